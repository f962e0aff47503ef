"""The backward's preprocess (FA2's): delta = rowsum(dO * O) per query row, and for the Hopper
backward the rows' LSE in the log2 domain, padded per Q block, and its fp32 dQ sum zeroed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtile.ops.masks import head_dim_mask, lse_row_base, seq_bounds
from flashtile.ops.softmax import LOG2E


@triton.jit(do_not_specialize=["sq", "rows_out", "total_q"])
def _delta_kernel(Out, dOut, Delta, Lse, Lse2, DeltaOut, CuSeqQ, DqZero, stride_ob, stride_om, stride_oh, stride_od,
                  stride_dob, stride_dom, stride_doh, stride_dod, stride_zb, stride_zm, stride_zh, stride_zd, nheads,
                  sq, rows_out, total_q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  EVEN_D: tl.constexpr, WRITE_LSE2: tl.constexpr, IS_VARLEN: tl.constexpr):
    """delta = rowsum(dO * O) of rows [start_m, start_m + BLOCK_M) of head bh into Delta, which
    holds rows_out >= sq rows per head (rows past sq get 0). WRITE_LSE2: also the LSE in the log2
    domain into Lse2, laid out alike, +inf past sq and where a row saw no key (P = 0 there): what
    the Hopper backward's loader copies in without masks; and delta in the LSE's layout into
    DeltaOut when given. DqZero (given): the fp32 dQ sum laid out as dOut, whose rows this zeroes
    for the Hopper backward's additions (one launch fewer than a fill of its own). IS_VARLEN: b is
    a sequence of a packed batch (its rows from cu_seqlens, the LSE (h, total_q)), sq the longest."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)  # grid (row blocks, heads, batch)
    b = bh // nheads
    h = bh % nheads
    q_start, sq, _, _ = seq_bounds(b, CuSeqQ, CuSeqQ, None, sq, sq, total_q, total_q, IS_VARLEN, False, False)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (q_start + offs_m)[:, None].to(tl.int64)
    mask = (offs_m[:, None] < sq) & head_dim_mask(offs_d, HEAD_DIM, EVEN_D)
    o = tl.load(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows * stride_om
                + offs_d[None, :] * stride_od, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(dOut + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + rows * stride_dom
                 + offs_d[None, :] * stride_dod, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    tl.store(Delta + bh.to(tl.int64) * rows_out + offs_m, delta, mask=offs_m < rows_out)
    if DqZero is not None:
        tl.store(DqZero + b.to(tl.int64) * stride_zb + h.to(tl.int64) * stride_zh + rows * stride_zm
                 + offs_d[None, :] * stride_zd, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), mask=mask)
    if WRITE_LSE2:
        lse_rows = lse_row_base(b, h, nheads, sq, q_start, total_q, IS_VARLEN) + offs_m
        lse = tl.load(Lse + lse_rows, mask=offs_m < sq, other=float("-inf"))
        tl.store(Lse2 + bh.to(tl.int64) * rows_out + offs_m,
                 tl.where(lse == float("-inf"), float("inf"), lse * LOG2E), mask=offs_m < rows_out)
        if DeltaOut is not None:
            tl.store(DeltaOut + lse_rows, delta, mask=offs_m < sq)

