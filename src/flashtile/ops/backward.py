"""FA2-style backward: recompute P from the saved LSE.

Two kinds of programs (_bwd_kernel), in two launches (configs.backward_config decides, from
measurements; each launch has its own tile, warps and stages):
  1. dQ: one program per (Q block, query head) looping over K/V blocks, recomputing P and dP
     (7 matmuls per block pair in all, no atomics, bitwise reproducible). On the way it computes
     its rows' delta = rowsum(dO * O) (the FA2 preprocess) from the dO tile it loads anyway.
  2. dK, dV: one program per (K/V block, batch x kv head), reading that delta; it loops over the
     query heads of its GQA group and over their Q blocks, so the group reduction happens in
     registers. On sm_90 it is a programmatic dependent launch: its programs load K and V while
     the dQ launch's last programs run, and wait for its writes (gdc_wait) only then.
Or both kinds in one grid after a delta launch (_delta_kernel): the dK/dV programs first (the
longest), then the dQ programs, all on the SMs at once with one tail at the end.
FA2 instead adds dS K into an fp32 dQ with atomics inside the dK/dV loop (5 matmuls per block
pair). That path was built in Triton and measured on the H100 (bf16, seqlen 512-16k, d 64/128/256):
6-20% slower for the whole backward than the dQ programs at every shape, so it was removed
(benchmarks/results/h100/NOTES.md). The Hopper variant at the end of this file does it in Gluon,
with TMA reductions, and is faster there (with deterministic=True in a fixed order). Both loops
skip the blocks that the mask hides and run the fully visible ones without mask work
(ops._common.block_range). dK/dQ are scaled by softmax_scale once at the end.
The forward's flags carry over: IS_VARLEN (each program finds its sequence in cu_seqlens; programs
past their sequence's end run empty loops and store nothing) and HAS_DROPOUT (both kinds regenerate
the forward's keep-mask from the same Philox counters: dV = (P o Z)^T dO / (1 - p) and
dP = (dO V^T) o Z / (1 - p)). A paged K/V never reaches the backward (the API gathers the pages).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from flashtile.ops import configs
from flashtile.ops._launch import Box, Plan, cdiv, new_plans, remember
from flashtile.ops._common import (FIRST_FREE_BARRIER, LOG2E, alibi_fits_sm90, alibi_sm90, alibi_strides,
                                   alibi_unit_sm90, block_range, cap_derivative_sm90, capped_sm90, dot_precision,
                                   dq_order, dq_turn, dropout_keep, dropout_keep_bits_sm90, dropout_keep_sm90,
                                   dropout_seed, dropout_sign_sm90, dropout_words_sm90, head_chunked_order,
                                   head_dim_mask, in_window, kernel_scale, key_block_program, load_tile_pair,
                                   lse_row_base, named_barrier_sm90, relu_to_sm90, scores_log2, seq_bounds,
                                   softcap_scales, visible)
from flashtile.ops.forward import (HOPPER_CONSUMER_REGS, HOPPER_LOADER_REGS, HOPPER_MAXNREG, box_descriptor,
                                   dropout_args, grid_lengths, plan_key, seq_strides, tensor_meta, tma_ok,
                                   varlen_args)


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


@triton.jit
def _load_lse2(Lse, offs, n, MASKED: tl.constexpr):
    """LSE of the rows offs in the log2 domain. Rows that saw no key (LSE -inf) get +inf so P = 0
    there; outside the masked phases every row is in bounds and saw this block's keys, so neither
    the bounds check nor the fix-up is needed."""
    if MASKED:
        lse = tl.load(Lse + offs, mask=offs < n, other=float("inf"))
        return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    return tl.load(Lse + offs) * LOG2E


@triton.jit
def _load_rows(Lse, Delta, offs, n, MASKED: tl.constexpr):
    """LSE (log2 domain, as _load_lse2) and delta of the rows offs."""
    lse2 = _load_lse2(Lse, offs, n, MASKED)
    if MASKED:
        delta = tl.load(Delta + offs, mask=offs < n, other=0.0)
    else:
        delta = tl.load(Delta + offs)
    return lse2, delta


@triton.jit
def _dkdv_step(dk, dv, k, v, q_base, do_base, q_desc, do_desc, tma_b, tma_row0, h, lse_base, delta_base,
               start_n, offs_n, start_m, sq, sk, diag_offset, left, right, qk_scale, softcap, slope,
               stride_qm, stride_dom, q_doffs, do_doffs, d_mask, seed, bh, threshold,
               dropout_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               MASKED: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """One Q block against the fixed K/V block, in the transposed (keys x rows) orientation."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    if USE_TMA:  # the copy engine zero-fills rows past the tensor and head dims past d; rows of the
        # next sequence of a packed batch get an LSE of +inf below, so P = 0 there as well
        q = q_desc.load([tma_b, tma_row0 + start_m, h, 0]).reshape(BLOCK_M, BLOCK_D)
        do = do_desc.load([tma_b, tma_row0 + start_m, h, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        q_ptrs = q_base + offs_m[:, None].to(tl.int64) * stride_qm + q_doffs
        do_ptrs = do_base + offs_m[:, None].to(tl.int64) * stride_dom + do_doffs
        q, do = load_tile_pair(q_ptrs, do_ptrs, offs_m[:, None] < sq, d_mask, MASKED, EVEN_D)
    lse2, delta = _load_rows(lse_base, delta_base, offs_m, sq, MASKED)
    if DOT_PRECISION == "ieee":
        # fp32: Q K^T in the forward's orientation, so every score rounds as it did there and P of a
        # row's largest score matches the forward's (K Q^T, summed in another order, failed the 2x
        # rule on dV at scores of 30-50)
        qk_t = tl.trans(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION))  # (BLOCK_N, BLOCK_M)
    else:
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
    s2_t, dcap_t = scores_log2(qk_t, offs_m[None, :], offs_n[:, None], qk_scale, softcap, slope,
                               diag_offset, HAS_SOFTCAP, HAS_ALIBI)
    p_t = tl.exp2(s2_t - lse2[None, :])
    # Bounds need no mask here: rows past sq load zeros with an LSE of +inf, so P = 0 there; keys
    # past sk only reach their own dK/dV rows, which are never stored.
    if MASKED and (HAS_LEFT or HAS_RIGHT):
        ok = in_window(offs_m[None, :], offs_n[:, None], diag_offset, left, right, HAS_LEFT, HAS_RIGHT)
        p_t = tl.where(ok, p_t, 0.0)
    if HAS_DROPOUT:  # the forward's mask in this orientation; dv is scaled by 1 / (1 - p) at the end
        keep_t = dropout_keep(seed, bh, start_m, BLOCK_M, start_n, BLOCK_N, threshold, True)
        dv = tl.dot(tl.where(keep_t, p_t, 0.0).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    else:
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
    if HAS_DROPOUT:
        dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
    ds_t = (p_t * (dp_t - delta[None, :]) * dcap_t).to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_program(
    start_n, b, hk, q_start, k_start, Q, K, V, dO, Lse, Delta, dK, dV, Slopes, q_desc, do_desc,
    stride_qb, stride_qm, stride_qh, stride_qd, stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd, stride_dob, stride_dom, stride_doh, stride_dod,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd, stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    stride_slope_b, stride_slope_h, nheads, group, sq, sk, total_q, left, right,
    qk_scale, softcap, softmax_scale, seed, threshold, dropout_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    """dK, dV of keys [start_n, start_n + BLOCK_N) of K/V head hk, summed over its query heads.

    sq, sk: this sequence's rows and keys, which start at rows q_start / k_start of the tensors.
    PDL: launched as a programmatic dependent of the dQ launch that writes Delta; K and V are
    loaded while that launch drains, and gdc_wait holds the loop until its writes are visible."""
    diag_offset = sk - sq
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = head_dim_mask(offs_d, HEAD_DIM, EVEN_D)
    kv_mask = (offs_n[:, None] < sk) & d_mask
    k = tl.load(K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
                + (k_start + offs_n)[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)
    v = tl.load(V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
                + (k_start + offs_n)[:, None].to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if PDL:
        gdc_wait()
    q_doffs = offs_d[None, :] * stride_qd
    do_doffs = offs_d[None, :] * stride_dod
    tma_b = b
    if IS_VARLEN:
        tma_b = 0

    # Rows that can see this key block: the block_range of keys-over-rows (offset and sides swap).
    lo, full_lo, full_hi, hi = block_range(start_n, BLOCK_N, BLOCK_M, sq, -diag_offset, right, left,
                                           HAS_RIGHT, HAS_LEFT)
    n_heads = group
    if IS_VARLEN:  # a key block past its sequence's end (the grid covers the longest) does nothing
        n_heads = tl.where(start_n < sk, group, 0)
    for g in range(0, n_heads):
        h = hk * group + g
        bh = b * nheads + h
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Slopes + b * stride_slope_b + h * stride_slope_h)
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + tl.cast(q_start, tl.int64) * stride_qm
        do_base = dO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + tl.cast(q_start, tl.int64) * stride_dom
        row_base = lse_row_base(b, h, nheads, sq, q_start, total_q, IS_VARLEN)
        lse_base = Lse + row_base
        delta_base = Delta + row_base
        for start_m in range(lo, full_lo, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, q_desc, do_desc, tma_b, q_start, h, lse_base,
                                delta_base, start_n, offs_n, start_m, sq, sk, diag_offset, left, right, qk_scale,
                                softcap, slope, stride_qm, stride_dom, q_doffs, do_doffs, d_mask, seed,
                                bh, threshold, dropout_scale, BLOCK_M, BLOCK_N, BLOCK_D, True,
                                EVEN_D, USE_TMA, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION,
                                HAS_DROPOUT)
        for start_m in range(full_lo, full_hi, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, q_desc, do_desc, tma_b, q_start, h, lse_base,
                                delta_base, start_n, offs_n, start_m, sq, sk, diag_offset, left, right, qk_scale,
                                softcap, slope, stride_qm, stride_dom, q_doffs, do_doffs, d_mask, seed,
                                bh, threshold, dropout_scale, BLOCK_M, BLOCK_N, BLOCK_D, False,
                                EVEN_D, USE_TMA, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION,
                                HAS_DROPOUT)
        for start_m in range(full_hi, hi, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, q_desc, do_desc, tma_b, q_start, h, lse_base,
                                delta_base, start_n, offs_n, start_m, sq, sk, diag_offset, left, right, qk_scale,
                                softcap, slope, stride_qm, stride_dom, q_doffs, do_doffs, d_mask, seed,
                                bh, threshold, dropout_scale, BLOCK_M, BLOCK_N, BLOCK_D, True,
                                EVEN_D, USE_TMA, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION,
                                HAS_DROPOUT)

    dk = dk * softmax_scale
    if HAS_DROPOUT:
        dv = dv * dropout_scale
    tl.store(dK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
             + (k_start + offs_n)[:, None].to(tl.int64) * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(dK.dtype.element_ty), mask=kv_mask)
    tl.store(dV + b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh
             + (k_start + offs_n)[:, None].to(tl.int64) * stride_dvn + offs_d[None, :] * stride_dvd,
             dv.to(dV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_step(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, tma_b, tma_row0, hk, start_m, offs_m, start_n,
             sk, diag_offset, left, right, qk_scale, softcap, slope, stride_kn, stride_vn, k_doffs, v_doffs,
             d_mask, seed, bh, threshold, dropout_scale,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
             EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
             HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
             HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """One K/V block against the fixed Q block."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if USE_TMA:  # zero-filled past the tensor and d; keys past sk (the next sequence's, or zeros)
        # still need the mask below (P there is not 0)
        k = k_desc.load([tma_b, tma_row0 + start_n, hk, 0]).reshape(BLOCK_N, BLOCK_D)
        v = v_desc.load([tma_b, tma_row0 + start_n, hk, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        k_ptrs = k_base + offs_n[:, None].to(tl.int64) * stride_kn + k_doffs
        v_ptrs = v_base + offs_n[:, None].to(tl.int64) * stride_vn + v_doffs
        k, v = load_tile_pair(k_ptrs, v_ptrs, offs_n[:, None] < sk, d_mask, MASKED, EVEN_D)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
    s2, dcap = scores_log2(qk, offs_m[:, None], offs_n[None, :], qk_scale, softcap, slope,
                           diag_offset, HAS_SOFTCAP, HAS_ALIBI)
    p = tl.exp2(s2 - lse2[:, None])
    if MASKED:
        ok = visible(offs_m[:, None], offs_n[None, :], diag_offset, sk, left, right, HAS_LEFT, HAS_RIGHT)
        p = tl.where(ok, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
    if HAS_DROPOUT:
        BLOCK_M: tl.constexpr = offs_m.shape[0]
        keep = dropout_keep(seed, bh, start_m, BLOCK_M, start_n, BLOCK_N, threshold, False)
        dp = tl.where(keep, dp * dropout_scale, 0.0)
    ds = p * (dp - delta[:, None]) * dcap
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)


@triton.jit
def _dq_program(
    start_m, b, h, hk, q_start, k_start, Q, K, V, dO, Out, Lse, Delta, dQ, Slopes, k_desc, v_desc,
    stride_qb, stride_qm, stride_qh, stride_qd, stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd, stride_dob, stride_dom, stride_doh, stride_dod,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_dqb, stride_dqm, stride_dqh, stride_dqd, stride_slope_b, stride_slope_h,
    nheads, sq, sk, total_q, left, right, qk_scale, softcap, softmax_scale, seed, threshold,
    dropout_scale, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WRITE_DELTA: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr, DQ_ADD: tl.constexpr,
):
    """dQ of rows [start_m, start_m + BLOCK_M) of query head h (K/V head hk); DQ_ADD: dQ /
    softmax_scale added into dQ (float32) instead.

    sq, sk: this sequence's rows and keys, which start at rows q_start / k_start of the tensors.
    WRITE_DELTA: these rows' delta = rowsum(dO * O) is computed here (from the dO tile the program
    loads anyway) and stored for the dK/dV launch that follows, instead of read from Delta."""
    diag_offset = sk - sq
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = head_dim_mask(offs_d, HEAD_DIM, EVEN_D)
    row_mask = (offs_m[:, None] < sq) & d_mask
    rows = (q_start + offs_m)[:, None].to(tl.int64)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
                + rows * stride_qm + offs_d[None, :] * stride_qd, mask=row_mask, other=0.0)
    do = tl.load(dO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
                 + rows * stride_dom + offs_d[None, :] * stride_dod, mask=row_mask, other=0.0)
    row_base = lse_row_base(b, h, nheads, sq, q_start, total_q, IS_VARLEN)
    if WRITE_DELTA:
        o = tl.load(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                    + rows * stride_om + offs_d[None, :] * stride_od, mask=row_mask, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(Delta + row_base + offs_m, delta, mask=offs_m < sq)
        lse2 = _load_lse2(Lse + row_base, offs_m, sq, True)
    else:
        lse2, delta = _load_rows(Lse + row_base, Delta + row_base, offs_m, sq, True)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + b * stride_slope_b + h * stride_slope_h)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + tl.cast(k_start, tl.int64) * stride_kn
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh + tl.cast(k_start, tl.int64) * stride_vn
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_doffs = offs_d[None, :] * stride_kd
    v_doffs = offs_d[None, :] * stride_vd
    tma_b = b
    if IS_VARLEN:
        tma_b = 0
    bh = b * nheads + h

    lo, full_lo, full_hi, hi = block_range(start_m, BLOCK_M, BLOCK_N, sk, diag_offset, left, right,
                                           HAS_LEFT, HAS_RIGHT)
    if IS_VARLEN:  # a row block past its sequence's end (the grid covers the longest) does nothing
        hi = tl.where(start_m < sq, hi, lo)
        full_lo = tl.minimum(full_lo, hi)
        full_hi = tl.minimum(full_hi, hi)
    for start_n in range(lo, full_lo, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, tma_b, k_start, hk, start_m, offs_m,
                      start_n, sk, diag_offset, left, right, qk_scale, softcap, slope, stride_kn, stride_vn,
                      k_doffs, v_doffs, d_mask, seed, bh, threshold, dropout_scale, BLOCK_N,
                      BLOCK_D, True, EVEN_D, USE_TMA, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                      DOT_PRECISION, HAS_DROPOUT)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, tma_b, k_start, hk, start_m, offs_m,
                      start_n, sk, diag_offset, left, right, qk_scale, softcap, slope, stride_kn, stride_vn,
                      k_doffs, v_doffs, d_mask, seed, bh, threshold, dropout_scale, BLOCK_N,
                      BLOCK_D, False, EVEN_D, USE_TMA, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                      DOT_PRECISION, HAS_DROPOUT)
    for start_n in range(full_hi, hi, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, tma_b, k_start, hk, start_m, offs_m,
                      start_n, sk, diag_offset, left, right, qk_scale, softcap, slope, stride_kn, stride_vn,
                      k_doffs, v_doffs, d_mask, seed, bh, threshold, dropout_scale, BLOCK_N,
                      BLOCK_D, True, EVEN_D, USE_TMA, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                      DOT_PRECISION, HAS_DROPOUT)

    dq_ptrs = dQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh + rows * stride_dqm \
        + offs_d[None, :] * stride_dqd
    if DQ_ADD:  # unscaled, into the caller's sum; the program owns these rows: no other adds to them
        dq += tl.load(dq_ptrs, mask=row_mask, other=0.0)
    else:
        dq = dq * softmax_scale
    tl.store(dq_ptrs, dq.to(dQ.dtype.element_ty), mask=row_mask)


@triton.jit(do_not_specialize=["batch", "sq", "sk", "total_q", "total_k", "left", "right", "threshold",
                               "n_programs"])
def _bwd_kernel(
    Q, K, V, dO, Out, Lse, Delta, dQ, dK, dV, Slopes, Q_desc, dO_desc, K_desc, V_desc,
    CuSeqQ, CuSeqK, SeqUsedK, Rng,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_dqb, stride_dqm, stride_dqh, stride_dqd,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    stride_slope_b, stride_slope_h,
    batch, nheads, nheads_k, sq, sk, total_q, total_k, left, right, qk_scale, softcap, softmax_scale,
    threshold, dropout_scale,
    n_programs, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
    BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, DKDV: tl.constexpr, DQ: tl.constexpr,
    DKDV_TMA: tl.constexpr, DQ_TMA: tl.constexpr, HEAD_CHUNK: tl.constexpr, WRITE_DELTA: tl.constexpr,
    PDL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr, HAS_DROPOUT: tl.constexpr, DQ_ADD: tl.constexpr,
):
    """Grid of n_programs x (batch x kv heads) in the order of ops._common.head_chunked_order. With
    DKDV the first cdiv(sk, BLOCK_N1) programs of a head are dK/dV programs (BLOCK_N1 keys,
    BLOCK_M1 rows per step); with DQ the next cdiv(sq, BLOCK_M2) x group are dQ programs (BLOCK_M2
    rows, BLOCK_N2 keys per step) of the group's query heads (sq, sk: the longest sequence's with
    IS_VARLEN). WRITE_DELTA (a dQ launch): the dQ programs compute delta and store it for the dK/dV
    launch after them. PDL: a dQ launch lets the next launch start as its last programs run; a
    dK/dV launch waits for the previous one's writes (gdc_wait) only after loading K and V.
    DQ_ADD: the dQ programs add dQ / softmax_scale into dQ (float32) instead of storing dQ."""
    pid, bhk = head_chunked_order(n_programs, batch * nheads_k, HEAD_CHUNK)
    b = bhk // nheads_k
    hk = bhk % nheads_k
    group = nheads // nheads_k
    if DKDV and DQ:
        first_dq = tl.cdiv(sk, BLOCK_N1)
        is_dkdv = pid < first_dq
    else:  # one kind per launch: decided at compile time, the other kind is not compiled in
        first_dq = 0
        is_dkdv = DKDV
    m_blocks = tl.cdiv(sq, BLOCK_M2)
    q_start, sq, k_start, sk = seq_bounds(b, CuSeqQ, CuSeqK, SeqUsedK, sq, sk, total_q, total_k,
                                          IS_VARLEN, HAS_SEQUSED, False)
    seed = (0, 0, 0)
    if HAS_DROPOUT:
        seed = dropout_seed(Rng)
    if is_dkdv:
        _dkdv_program(
            pid * BLOCK_N1, b, hk, q_start, k_start, Q, K, V, dO, Lse, Delta, dK, dV, Slopes, Q_desc, dO_desc,
            stride_qb, stride_qm, stride_qh, stride_qd, stride_kb, stride_kn, stride_kh, stride_kd,
            stride_vb, stride_vn, stride_vh, stride_vd, stride_dob, stride_dom, stride_doh, stride_dod,
            stride_dkb, stride_dkn, stride_dkh, stride_dkd, stride_dvb, stride_dvn, stride_dvh, stride_dvd,
            stride_slope_b, stride_slope_h, nheads, group, sq, sk, total_q, left, right,
            qk_scale, softcap, softmax_scale, seed, threshold, dropout_scale, HEAD_DIM,
            BLOCK_D, BLOCK_M1, BLOCK_N1, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, EVEN_D, DKDV_TMA,
            DOT_PRECISION, PDL, IS_VARLEN, HAS_DROPOUT)
    else:
        # Consecutive programs take the group's heads for one Q block. With a right-bounded mask
        # (causal) the last Q blocks see the most keys, so they go first and the short ones fill
        # the tail.
        if PDL:
            gdc_launch_dependents()
        j = pid - first_dq
        pid_m = j // group
        if HAS_RIGHT:
            pid_m = m_blocks - 1 - pid_m
        h = hk * group + j % group
        _dq_program(
            pid_m * BLOCK_M2, b, h, hk, q_start, k_start, Q, K, V, dO, Out, Lse, Delta, dQ, Slopes, K_desc,
            V_desc, stride_qb, stride_qm, stride_qh, stride_qd, stride_kb, stride_kn, stride_kh, stride_kd,
            stride_vb, stride_vn, stride_vh, stride_vd, stride_dob, stride_dom, stride_doh, stride_dod,
            stride_ob, stride_om, stride_oh, stride_od,
            stride_dqb, stride_dqm, stride_dqh, stride_dqd, stride_slope_b,
            stride_slope_h, nheads, sq, sk, total_q, left, right, qk_scale, softcap, softmax_scale, seed,
            threshold, dropout_scale, HEAD_DIM,
            BLOCK_D, BLOCK_M2, BLOCK_N2, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, EVEN_D,
            DQ_TMA, DOT_PRECISION, WRITE_DELTA, IS_VARLEN, HAS_DROPOUT, DQ_ADD)


def _descriptors(pair, block_rows: int, block_d: int, varlen: bool) -> tuple:
    """TMA descriptors of a (b, s, heads, d) pair with (1, block_rows, 1, block_d) boxes (a packed
    (total, heads, d) pair is read as a batch of one), or Nones when either layout does not allow
    TMA (then the programs load through pointers)."""
    if not all(tma_ok(t) for t in pair):
        return None, None
    block = [1, block_rows, 1, block_d]

    def view(t):  # a packed tensor read as t.unsqueeze(0), over t itself (a plan names the call's tensor)
        return ([1, *t.shape], [t.shape[0] * t.stride(0), *t.stride()]) if varlen else (list(t.shape), list(t.stride()))

    return tuple(TensorDescriptor(t, *view(t), block) for t in pair)


# The call's tensors, in the order of call_tensors, from which a plan's launches take their
# arguments; the last four are buffers between the launches, made per call as the plan says
(DOUT, Q, K, V, OUT, LSE, DQ, DK, DV, DELTA, SLOPES, CU_Q, CU_K, SEQUSED, RNG, LSE2, DELTA2, DQ_ACC,
 TURNS) = range(19)
_plans = new_plans()  # (forward.plan_key, the backward's own) -> BackwardPlan


class BackwardPlan(NamedTuple):
    """The backward's launches for one description of its call (attention_backward), and what it
    does around them per call."""

    launches: tuple  # Plans, launched in order
    zero_grads: bool  # dK and dV zeroed first (keys past seqused_k, or no query rows)
    delta: bool  # delta gets a buffer shaped like the LSE (none given)
    stats: int  # Hopper: rows of the fp32 log2-LSE and delta buffers the delta launch fills (0: none)
    dq_acc: bool  # Hopper: dQ sums in an fp32 buffer shaped like q, zeroed by the delta launch (else in dq)
    turns: int  # Hopper, deterministic: int32 counters, zeroed (0: none)
    dq_scale: float  # Hopper: dq = dQ sum * dq_scale, or with accumulate_dq dq += it (0: nothing to do)


def call_tensors(dout, q, k, v, out, lse, dq, dk, dv, delta, alibi_slopes, varlen, dropout) -> list:
    """A backward call's tensors in the plans' order (the buffers' slots empty)."""
    vl = (None,) * 3 if varlen is None else (varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_k)
    return [dout, q, k, v, out, lse, dq, dk, dv, delta, alibi_slopes, *vl, None if dropout is None else dropout[1],
            None, None, None, None]


def attention_backward(dout, q, k, v, out, lse, softmax_scale: float, window: tuple,
                       softcap: float = 0.0, alibi_slopes=None, dq=None, dk=None, dv=None, varlen=None,
                       dropout=None, delta=None, deterministic: bool = False, accumulate_dq: bool = False):
    """Launch the backward. Shapes and varlen / dropout as ops.forward.attention_forward (varlen
    without block_table); lse as it returned.

    Returns (dq, dk, dv) shaped like q, k, v (dk/dv summed over each GQA group), written into the
    given dq/dk/dv when passed (e.g. views of one packed gradient buffer). Keys past seqused_k get
    zero gradients. delta: where to leave delta = rowsum(dO * O), shaped like lse (the attention
    sink's gradient is made of it: autograd.sink_grad); by default a buffer of its own.
    deterministic: bitwise reproducible gradients. The Triton programs always are (dQ without
    atomics); the Hopper kernel (configs.hopper_backward_config, the calls it supports) then adds
    dQ's parts in a fixed order, else in the order the programs come (as flash-attn's), which
    varies from run to run. Deterministic calls keep the Triton programs where the Hopper kernel
    has no fixed order (configs.hopper_backward_ordered).
    accumulate_dq: dq is a float32 tensor shaped like q, and the call adds dQ / softmax_scale into
    it: the sum the Hopper kernel keeps anyway, left unscaled (ring attention sums the dQ of a
    shard's pieces so, without a buffer per piece, and scales the sum once; with dropout the
    Hopper kernel's dQ is in units of backward_ds_unit, and goes through a buffer of its own).
    As the forward, the launches are planned once per description of the call and replayed.
    """
    if accumulate_dq and (dq is None or dq.dtype != torch.float32 or dq.shape != q.shape):
        raise ValueError(f"accumulate_dq needs dq: a float32 tensor shaped like q {tuple(q.shape)}, got "
                         f"{None if dq is None else (dq.dtype, tuple(dq.shape))}")
    if varlen is not None and varlen.block_table is not None:
        raise ValueError("the backward reads contiguous k/v: gather the pages first (the API does)")
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if dq is None else dq
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if dk is None else dk
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if dv is None else dv
    key = (plan_key(q, k, v, out, softmax_scale, window, softcap, alibi_slopes, varlen, dropout, None),
           tensor_meta(dout), tensor_meta(lse), tensor_meta(dq), tensor_meta(dk), tensor_meta(dv), tensor_meta(delta),
           deterministic, accumulate_dq)
    plan = _plans.get(key)
    env = call_tensors(dout, q, k, v, out, lse, dq, dk, dv, delta, alibi_slopes, varlen, dropout)
    if plan is None:
        plan = remember(_plans, key, _plan(env, softmax_scale, window, softcap, varlen, dropout, deterministic,
                                           accumulate_dq))
    if plan.zero_grads:
        dk.zero_()
        dv.zero_()
    if plan.delta:
        env[DELTA] = torch.empty_like(lse)
    if plan.stats:
        env[LSE2], env[DELTA2] = torch.empty((2, plan.stats), dtype=torch.float32, device=q.device).unbind(0)
    if plan.dq_acc:  # zeroed by the plan's first launch
        env[DQ_ACC] = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if plan.turns:
        env[TURNS] = torch.zeros(plan.turns, dtype=torch.int32, device=q.device)
    for launch in plan.launches:
        launch.run(env)
    if plan.dq_scale:
        if not accumulate_dq:
            torch.mul(env[DQ_ACC], plan.dq_scale, out=dq)
        else:
            dq.add_(env[DQ_ACC], alpha=plan.dq_scale)
    return dq, dk, dv


def _plan(env: list, softmax_scale: float, window: tuple, softcap: float, varlen, dropout, deterministic: bool,
          accumulate_dq: bool) -> BackwardPlan:
    """The backward's launches for the call whose tensors are env (call_tensors, as distinct() made
    it: every tensor is taken from there): the Hopper kernel where configs.hopper_backward_config
    gives it tiles and it can address the tensors, else the Triton programs. Buffers the launches
    share are made in env here as each call makes them (the plan records their sizes)."""
    dout, q, k, v, out, lse, dq, dk, dv, delta, alibi_slopes, cu_q, cu_k, seqused_k, rng = env[:RNG + 1]
    if varlen is not None:
        varlen = varlen._replace(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused_k)
    if dropout is not None:
        dropout = (dropout[0], rng)
    h, d = q.shape[-2:]
    b, sq, sk = grid_lengths(q, k, varlen)
    zero_grads = varlen is not None and varlen.seqused_k is not None  # no program writes keys past seqused_k
    if b * h * sq == 0:  # no query rows: no key gets a gradient
        return BackwardPlan((), True, False, 0, False, 0, 0.0)
    _, _, _, has_dropout = dropout_args(dropout)
    qk_scale, _ = kernel_scale(softmax_scale, softcap)
    hopper = configs.hopper_backward_config(d, q.dtype, q.device, dropout=has_dropout, softcap=softcap > 0)
    if hopper is not None and _hopper_supports(q, k, v, dout, dk, dv, softmax_scale, varlen) \
            and (not accumulate_dq or tma_ok(dq)) and alibi_fits_sm90(alibi_slopes, q, k, varlen) \
            and (not deterministic or configs.hopper_backward_ordered(d)):
        return _launch_sm90(env, hopper, softmax_scale, window, accumulate_dq, dropout=dropout, varlen=varlen,
                            softcap=softcap, deterministic=deterministic, zero_grads=zero_grads)
    causal = window[1] is not None  # any right bound picks the causal tiles: one kernel for every seqlen_q - seqlen_k
    cfg = configs.backward_config(d, q.dtype, q.device, causal, dropout is not None)
    hk = k.shape[-2]
    packed = varlen is not None
    vl_tensors, (_, total_q, total_k, _, _), vl_flags = varlen_args(q, k, varlen)
    rng, threshold, dropout_scale, has_dropout = dropout_args(dropout)
    block_d = configs.padded_headdim(d)
    left, right = window
    _, softcap = kernel_scale(softmax_scale, softcap)
    new_delta = delta is None
    if new_delta:
        delta = env[DELTA] = torch.empty_like(lse)
    launches = []
    if cfg.fused:  # both kinds of programs read delta at once: computed first
        pre = configs.delta_config(d, q.device)
        # delta is per row, whatever sequence the row is in: a packed batch is one sequence of total_q rows
        rows, n = (q.shape[0], 1) if varlen is not None else (sq, b)
        launches.append(Plan.of(env, _delta_kernel, (cdiv(rows, pre.block_m), h, n),
                                (out, dout, delta, None, None, None, None, None),
                                (*seq_strides(out, packed), *seq_strides(dout, packed), 0, 0, 0, 0, h, rows, rows,
                                 0),
                                pre.num_warps, pre.num_stages, None,
                                dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=pre.block_m, EVEN_D=d == block_d,
                                     WRITE_LSE2=False, IS_VARLEN=False)))

    # TMA descriptors for what each kind of program streams, where the layout allows: dK/dV
    # programs stream Q and dO, dQ programs K and V
    dkdv_descs = _descriptors((q, dout), cfg.dkdv.block_m, block_d, packed) if cfg.dkdv_tma else (None, None)
    dq_descs = _descriptors((k, v), cfg.dq.block_n, block_d, packed) if cfg.dq_tma else (None, None)
    tensors = (q, k, v, dout, out, lse, delta, dq, dk, dv, alibi_slopes, *dkdv_descs, *dq_descs,
               *vl_tensors[:3], rng)
    strides = tuple(st for t in (q, k, v, dout, out, dq, dk, dv) for st in seq_strides(t, packed)) if packed else \
        (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *out.stride(), *dq.stride(), *dk.stride(), *dv.stride())
    scalars = (*strides, *alibi_strides(alibi_slopes), b, h, hk, sq, sk, total_q, total_k,
               left or 0, right or 0, qk_scale, softcap, softmax_scale, threshold, dropout_scale)
    flags = dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M1=cfg.dkdv.block_m, BLOCK_N1=cfg.dkdv.block_n,
                 BLOCK_M2=cfg.dq.block_m, BLOCK_N2=cfg.dq.block_n, HAS_LEFT=left is not None,
                 HAS_RIGHT=right is not None, HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None,
                 EVEN_D=d == block_d, DKDV_TMA=dkdv_descs[0] is not None, DQ_TMA=dq_descs[0] is not None,
                 DOT_PRECISION=dot_precision(q.dtype), IS_VARLEN=vl_flags["IS_VARLEN"],
                 HAS_SEQUSED=vl_flags["HAS_SEQUSED"], HAS_DROPOUT=has_dropout, DQ_ADD=accumulate_dq)
    kv_programs = cdiv(sk, cfg.dkdv.block_n)
    q_programs = cdiv(sq, cfg.dq.block_m) * (h // hk)

    def plan(n, chunk, block, pdl=False, **parts):
        if n == 0:
            return
        chunk = chunk if causal else 1  # equal-length programs need no reordering
        grid = (n, hk, b) if chunk == 1 else (n * b * hk,)
        launches.append(Plan.of(env, _bwd_kernel, grid, tensors, (*scalars, n), block.num_warps, block.num_stages,
                                None, dict(HEAD_CHUNK=chunk, PDL=pdl, **parts, **flags),
                                launch_pdl=pdl and parts["DKDV"]))

    if cfg.fused:
        plan(kv_programs + q_programs, cfg.head_chunk, cfg.dkdv, DKDV=True, DQ=True, WRITE_DELTA=False)
    else:  # the dQ programs compute delta on the way, for the dK/dV launch
        plan(q_programs, cfg.dq_head_chunk, cfg.dq, cfg.pdl, DKDV=False, DQ=True, WRITE_DELTA=True)
        plan(kv_programs, cfg.head_chunk, cfg.dkdv, cfg.pdl, DKDV=True, DQ=False, WRITE_DELTA=False)
    return BackwardPlan(tuple(launches), zero_grads, new_delta, 0, False, 0, 0.0)


# ----------------------------------------------------------------------------------------------
# Hopper (sm_90) variant in Gluon: FA2's backward with dQ added up by the copy engine (FA3's
# design).
#
# A program owns 128 keys of one K/V head and loops over the Q blocks (64 rows at d=128, 128 at
# d=64: configs.hopper_backward_tiles) of its GQA group's heads that can see them. A one-warp
# loader brings K and V once and Q, dO and the rows' LSE (log2 domain) and delta through a ring
# of NUM_STAGES buffers with TMA. Two consumer warpgroups take 64
# keys each and work in the transposed orientation, so P^T and dS^T are register operands of the
# dV and dK products (FA2's 4 matrix products per block pair, all wgmma). The fifth, dQ += dS K,
# needs every key of the block: both warpgroups leave dS^T in shared memory and tell each other
# (an mbarrier; named barriers where the dQ product waits until the next step, d=64 and d=128
# without a right bound: _bwd_sm90_ds_stored), each multiplies both by its half of K's columns and adds its half of the
# dQ tile into an fp32 buffer by TMA's reduce-add (cp.reduce.async.bulk); ops.backward scales
# and casts it at the end. 5 products per block pair instead of the Triton path's 7. The additions
# come in whatever order the programs reach a Q block, unless deterministic=True: then the
# warpgroups hand their halves to a one-warp writer, and each (Q block, query head) has a counter
# that admits the key blocks one by one in a fixed order (dq_order), FlashAttention-3's scheme;
# only the writer waits for it.
#
# Packed batches (IS_VARLEN, as the Triton programs): a program finds its sequence in cu_seqlens,
# the copies address the packed tensors as one sequence of all the rows, and dK / dV leave through
# masked pointer stores, since a TMA store of a block that runs into the next sequence would
# overwrite that sequence's first keys.
#
# At d=256 (SPLIT_D) a warpgroup's fp32 dK and dV of 64 keys would fill its registers, so a
# program owns 64 keys and the warpgroups split the head dim instead: each computes S and dP for
# 32 of the keys (in the untransposed orientation), P and dS meet in shared memory, and each
# takes the dV, dK and dQ products in its 128 columns (_bwd_sm90_step_split).
# ----------------------------------------------------------------------------------------------


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """dst[box at coord] += src, by the copy engine (Gluon 3.6 has the op in its builder only)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _dq_wait_turn(counter, turn):
    """Return once the Q block's counter shows `turn` earlier additions, each complete in L2: an
    acquire poll (the counts are releases, _dq_counted), then a proxy fence, so the reduction that
    follows (the async proxy) comes after what the poll saw. Every lane polls the same word."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 v;\n"
        "spin_${:uid}: ld.acquire.gpu.global.b32 v, [$1]; setp.lt.s32 p, v, $2; @p bra spin_${:uid};\n"
        "fence.proxy.async.global; mov.b32 $0, v; }", "=r,l,r", [counter, turn], dtype=gl.int32,
        is_pure=False, pack=1)


@gluon.jit
def _dq_counted(counter):
    """Count this program's addition into the Q block as done once its reductions are complete in
    L2 (`cp.async.bulk.wait_group 0`: tma.store_wait waits only until shared memory has been read):
    the issuing lane's wait, a proxy fence, the warp's barrier, then lane 0's release add. A relaxed
    count let the next program's reduction reach L2 first (NOTES.md, "Deterministic Hopper
    backward"); these fences stall only the writer warp."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 l;\n"
        "cp.async.bulk.wait_group 0; fence.proxy.async.global; bar.warp.sync -1;\n"
        "mov.u32 l, %laneid; setp.eq.u32 p, l, 0; @p red.release.gpu.global.add.s32 [$1], 1;\n"
        "mov.b32 $0, 0; }", "=r,l", [counter], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _bwd_sm90_write_dq(dq_desc, dq_bufs, dq_full, dq_empty, Turns, b, tb, q0, hk, group, nheads, rows_pad,
                       start_n, lo, n_m, sq, sk, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """dQ writer partition (DETERMINISTIC, not with SPLIT_D): step by step (the consumers' order) it
    waits for the step's Q block to have had every earlier addition (dq_turn, on its counter in
    Turns: one per Q block of rows_pad and query head, b the sequence or batch), then for both
    consumers' parts of the dQ tile, reduces them into the fp32 dQ at (tb, q0 + rows) by TMA (as
    _bwd_sm90_dq_out's), hands the buffers back once read and counts its addition once complete."""
    a, c = dq_order(start_n // BLOCK_N, gl.cdiv(sk, BLOCK_N), sq, sk, left, right, BLOCK_M, BLOCK_N, HAS_RIGHT)
    m_blocks = rows_pad // BLOCK_M
    for i in range(group * n_m):
        h = hk * group + i // n_m
        start_m = lo + (i % n_m) * BLOCK_M
        counter = Turns + (b * nheads + h).to(gl.int64) * m_blocks + start_m // BLOCK_M
        _dq_wait_turn(counter, dq_turn(start_m, a, c, BLOCK_N, HAS_LEFT, HAS_RIGHT))
        for half in gl.static_range(2):
            mbarrier.wait(dq_full.index(half), i & 1)
            _bwd_sm90_reduce_dq(dq_desc, dq_bufs.index(half), tb, q0 + start_m, h, half, BLOCK_M)
        tma.store_wait(0)
        mbarrier.arrive(dq_empty.index(0), count=1)
        mbarrier.arrive(dq_empty.index(1), count=1)
        _dq_counted(counter)


@gluon.jit
def _bwd_sm90_load(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs, k_bufs, v_bufs,
                   lse_bufs, delta_bufs, kv_bar, q_ready, do_ready, empty, b, tb, q0, k0, hk, group, nheads, rows_pad,
                   start_n, lo, n_m):
    """Loader partition: the program's K and V (one buffer per key half, or one for all with
    SPLIT_D), then for step i (head g = i // n_m of the group, Q block i % n_m) Q with its LSE and
    dO with its delta into buffer i % NUM_STAGES once both consumers have freed it. A program whose
    keys no row sees loads nothing. The copies address batch tb from row q0 (Q, dO) and k0 (K, V):
    b, 0, 0 for a dense batch, 0 and the sequence's first rows for a packed one."""
    NUM_STAGES: gl.constexpr = q_bufs.shape[0]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    KEY_ROWS: gl.constexpr = k_desc.block_type.shape[1]
    KEY_BUFS: gl.constexpr = k_bufs.shape[0]
    n_steps = group * n_m
    if n_steps > 0:
        mbarrier.expect(kv_bar, 2 * KEY_BUFS * k_desc.block_type.nbytes)
        for part in gl.static_range(KEY_BUFS):
            key = k0 + start_n + part * KEY_ROWS
            tma.async_copy_global_to_shared(k_desc, [tb, key, hk, 0], kv_bar, k_bufs.index(part))
            tma.async_copy_global_to_shared(v_desc, [tb, key, hk, 0], kv_bar, v_bufs.index(part))
    for i in range(n_steps):
        stage = i % NUM_STAGES
        h = hk * group + i // n_m
        row = lo + (i % n_m) * BLOCK_M
        stats_row = (b * nheads + h) * rows_pad + row
        mbarrier.wait(empty.index(stage), ((i // NUM_STAGES) & 1) ^ 1)  # the first round passes at once
        mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [tb, q0 + row, h, 0], q_ready.index(stage), q_bufs.index(stage))
        tma.async_copy_global_to_shared(lse_desc, [stats_row], q_ready.index(stage), lse_bufs.index(stage))
        mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [tb, q0 + row, h, 0], do_ready.index(stage), do_bufs.index(stage))
        tma.async_copy_global_to_shared(delta_desc, [stats_row], do_ready.index(stage), delta_bufs.index(stage))


@gluon.jit
def _bwd_sm90_consume(dk_desc, dv_desc, dq_desc, q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs, ds_bufs,
                      dq_bufs, handoff, kv_bar, q_ready, do_ready, empty, ds_ready, done, half, b, tb, q0, k0, hk,
                      group, start_n, lo, n_m, full_lo, full_hi, sk, diag_offset, left, right, qk_scale, softcap,
                      dk_scale, Rng, nheads, threshold, dropout_scale, DK, DV, stride_dkn, stride_dkh, stride_dvn,
                      stride_dvh, Slopes, stride_slope_b, stride_slope_h, HAS_LEFT: gl.constexpr,
                      HAS_RIGHT: gl.constexpr, DEFER_DQ: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                      HAS_DROPOUT: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_ALIBI: gl.constexpr,
                      HEAD_DIM: gl.constexpr, DETERMINISTIC: gl.constexpr):
    """A consumer warpgroup: dK, dV of keys start_n + half * HALF_N onwards, and its half of the
    columns of each Q block's dQ; with SPLIT_D (one K/V buffer) dK, dV of all the program's keys in
    its half of the head dim's columns (_bwd_sm90_step_split). DEFER_DQ: step i issues step i-1's
    dQ product ahead of its own S^T, so that product's trip out (shared memory, TMA reduce-add)
    runs under S^T; no product is left in flight from one step to the next (ptxas would serialise
    every wgmma), so the first step is peeled off. Otherwise each step ends with its own dQ.
    HAS_SOFTCAP: the scores are capped (capped_sm90; qk_scale and softcap are softcap_scales')
    and dS takes the cap's derivative, as in the Triton programs. HAS_ALIBI: P^T is recomputed with
    the forward's bias (alibi_sm90; each step reads its head's slope of Slopes, (h,) or (b, h));
    dS needs nothing more, the bias being constant in S. HAS_DROPOUT: P^T and dP^T see the
    forward's keep-mask (made while S^T is computed), dV is scaled by 1 / (1 - p) at the end, as
    in the Triton programs. IS_VARLEN: dK and dV leave through pointers, masked at the sequence's
    last key (a TMA store of the block would write its zeros over the next sequence's first keys)
    and at HEAD_DIM;
    tb, q0, k0 as _bwd_sm90_load's. dk_scale: dK's factor at the end, softmax_scale times
    backward_ds_unit."""
    BLOCK_M: gl.constexpr = q_bufs.shape[2]
    HALF_N: gl.constexpr = k_bufs.shape[2]  # this warpgroup's keys (with SPLIT_D, the program's)
    BLOCK_D: gl.constexpr = k_bufs.shape[4]
    HALF_D: gl.constexpr = BLOCK_D // 2
    SPLIT_D: gl.constexpr = k_bufs.shape[0] == 1
    OWN_D: gl.constexpr = HALF_D if SPLIT_D else BLOCK_D  # dK, dV columns of this warpgroup
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                        instr_shape=[16, OWN_D, 16])
    DQ_ROWS: gl.constexpr = dq_desc.block_type.shape[1]  # a dQ product's rows and columns (sm90_boxes)
    DQ_COLS: gl.constexpr = dq_desc.block_type.shape[3]
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    key0 = start_n if SPLIT_D else start_n + half * HALF_N
    offs_n = key0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    s_zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, s_layout)  # ignored (use_acc=False): the layouts
    dq_zero = gl.zeros([DQ_ROWS, DQ_COLS], gl.float32, dq_layout)
    dk = gl.zeros([HALF_N, OWN_D], gl.float32, kv_layout)
    dv = gl.zeros([HALF_N, OWN_D], gl.float32, kv_layout)
    n_steps = group * n_m
    if HAS_DROPOUT:
        seed = dropout_seed(Rng)
        delta_unit = 2.0 / dropout_scale  # D / u of _bwd_sm90_step's dS
    else:
        seed = (0, 0, 0)
        delta_unit = 1.0
    drop = (seed, b * nheads + hk * group, threshold, dropout_scale, delta_unit)  # bh of step i: drop[1] + i // n_m
    if HAS_ALIBI:  # step i's slope: alibi[0] + (i // n_m) * alibi[1], times alibi[2]
        alibi = (Slopes + b * stride_slope_b + hk * group * stride_slope_h, stride_slope_h,
                 alibi_unit_sm90(qk_scale, HAS_SOFTCAP))
    else:
        alibi = (0, 0, 0.0)
    if SPLIT_D:
        if n_steps > 0:
            mbarrier.wait(kv_bar, 0)
        for i in range(n_steps):
            dk, dv = _bwd_sm90_step_split(i, dk, dv, q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs, ds_bufs,
                                          q_ready, do_ready, empty, ds_ready, dq_desc, half, tb, q0, hk, group, lo,
                                          n_m,
                                          full_lo, full_hi, sk, diag_offset, left, right, qk_scale, softcap, start_n,
                                          dq_zero, drop, alibi, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_DROPOUT,
                                          HAS_ALIBI)
    elif n_steps > 0:
        mbarrier.wait(kv_bar, 0)
        if DEFER_DQ:
            dk, dv = _bwd_sm90_step(0, dk, dv, q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs, ds_bufs,
                                    dq_bufs, handoff, q_ready, do_ready, empty, ds_ready, dq_desc, half, tb, q0, hk,
                                    group, lo,
                                    n_m,
                                    full_lo, full_hi, sk, diag_offset, left, right, qk_scale, softcap, key0, offs_n,
                                    s_zero, dq_zero, drop, alibi, HAS_LEFT, HAS_RIGHT, True, False, HAS_SOFTCAP,
                                    HAS_DROPOUT, HAS_ALIBI, DETERMINISTIC)
        for i in range(1 if DEFER_DQ else 0, n_steps):
            dk, dv = _bwd_sm90_step(i, dk, dv, q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs, ds_bufs,
                                    dq_bufs, handoff, q_ready, do_ready, empty, ds_ready, dq_desc, half, tb, q0, hk,
                                    group, lo,
                                    n_m,
                                    full_lo, full_hi, sk, diag_offset, left, right, qk_scale, softcap, key0, offs_n,
                                    s_zero, dq_zero, drop, alibi, HAS_LEFT, HAS_RIGHT, DEFER_DQ, DEFER_DQ, HAS_SOFTCAP,
                                    HAS_DROPOUT, HAS_ALIBI, DETERMINISTIC)
        if DEFER_DQ:
            last = n_steps - 1
            NAMED_DS: gl.constexpr = not HAS_ALIBI  # _bwd_sm90_step's, DEFER_DQ being set here
            dq = warpgroup_mma_wait(0, deps=(_bwd_sm90_dq_product(ds_bufs, k_bufs, ds_ready, last, half, dq_zero,
                                                                  NAMED_DS), ))
            _bwd_sm90_dq_out(dq_desc, dq_bufs, handoff, dq, last, tb, q0 + lo + (last % n_m) * BLOCK_M,
                             hk * group + last // n_m, half, BLOCK_M, DETERMINISTIC)
    tma.store_wait(0)
    # both warpgroups read all of K: wait for the other's last dQ product, then the K and V buffers
    # take dK and dV on their way out (rows past sk are clipped): this warpgroup's key half of them,
    # or with SPLIT_D its columns, through half of the buffer's bytes
    mbarrier.arrive(done, count=1)
    mbarrier.wait(done, 0)
    if SPLIT_D:
        out_shape: gl.constexpr = [2] + dk_desc.block_type.shape
        dk_smem = k_bufs.index(0)._reinterpret(q_bufs.dtype, out_shape, dk_desc.layout).index(half)
        dv_smem = v_bufs.index(0)._reinterpret(q_bufs.dtype, out_shape, dv_desc.layout).index(half)
        col = half * HALF_D
    else:
        dk_smem = k_bufs.index(half)
        dv_smem = v_bufs.index(half)
        col = 0
    if HAS_DROPOUT:
        dv = dv * dropout_scale
    if IS_VARLEN:
        keys = key0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, kv_layout))
        cols = col + gl.arange(0, OWN_D, layout=gl.SliceLayout(0, kv_layout))
        rows = (k0 + keys)[:, None].to(gl.int64)
        ok = (keys < sk)[:, None]
        if HEAD_DIM < BLOCK_D:
            ok = ok & (cols < HEAD_DIM)[None, :]
        gl.store(DK + hk.to(gl.int64) * stride_dkh + rows * stride_dkn + cols[None, :],
                 (dk * dk_scale).to(DK.dtype.element_ty), mask=ok)
        gl.store(DV + hk.to(gl.int64) * stride_dvh + rows * stride_dvn + cols[None, :], dv.to(DV.dtype.element_ty),
                 mask=ok)
    else:
        dk_smem.reshape([HALF_N, OWN_D]).store((dk * dk_scale).to(q_bufs.dtype))
        dv_smem.reshape([HALF_N, OWN_D]).store(dv.to(q_bufs.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [b, key0, hk, col], dk_smem)
        tma.async_copy_shared_to_global(dv_desc, [b, key0, hk, col], dv_smem)
        tma.store_wait(0)


@gluon.jit
def _bwd_sm90_step(i, dk, dv, q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs, ds_bufs, dq_bufs, handoff,
                   q_ready, do_ready, empty, ds_ready, dq_desc, half, tb, q0, hk, group, lo, n_m, full_lo, full_hi, sk,
                   diag_offset, left, right, qk_scale, softcap, key0, offs_n, s_zero, dq_zero, drop, alibi,
                   HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, DEFER_DQ: gl.constexpr, HAS_PREV: gl.constexpr,
                   HAS_SOFTCAP: gl.constexpr, HAS_DROPOUT: gl.constexpr, HAS_ALIBI: gl.constexpr,
                   DETERMINISTIC: gl.constexpr):
    """Step i of a consumer warpgroup (head hk * group + i // n_m, Q block i % n_m): dV += P^T dO
    and dK += dS^T Q for its 64 keys, its dS^T into shared memory; then its dQ, or with DEFER_DQ
    step i-1's dQ first (HAS_PREV); dQ goes to batch tb, rows from q0 (_bwd_sm90_load's). With
    HAS_DROPOUT, dS is in units of backward_ds_unit (so are dK and the dQ it adds). Returns dK,
    dV."""
    NUM_STAGES: gl.constexpr = q_bufs.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.shape[2]
    HALF_N: gl.constexpr = k_bufs.shape[2]
    BLOCK_D: gl.constexpr = k_bufs.shape[4]
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    s_layout: gl.constexpr = s_zero.type.layout
    row_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per query row, along S^T's columns
    dtype: gl.constexpr = q_bufs.dtype
    stage = i % NUM_STAGES
    phase = (i // NUM_STAGES) & 1
    start_m = lo + (i % n_m) * BLOCK_M
    NAMED_DS: gl.constexpr = DEFER_DQ and not HAS_ALIBI  # dS^T handed over on named barriers (_bwd_sm90_ds_stored)
    if HAS_PREV:
        dq_tok = _bwd_sm90_dq_product(ds_bufs, k_bufs, ds_ready, i - 1, half, dq_zero, NAMED_DS)
    mbarrier.wait(q_ready.index(stage), phase)
    q = q_bufs.index(stage).reshape([BLOCK_M, BLOCK_D])
    k = k_bufs.index(half).reshape([HALF_N, BLOCK_D])
    s_tok = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)  # S^T = K Q^T
    if HAS_PREV:  # step i-1's dQ leaves while S^T runs
        dq = warpgroup_mma_wait(1, deps=(dq_tok, ))
        _bwd_sm90_dq_out(dq_desc, dq_bufs, handoff, dq, i - 1, tb, q0 + lo + ((i - 1) % n_m) * BLOCK_M,
                         hk * group + (i - 1) // n_m, half, BLOCK_M, DETERMINISTIC)
    mbarrier.wait(do_ready.index(stage), phase)
    do = do_bufs.index(stage).reshape([BLOCK_M, BLOCK_D])
    v = v_bufs.index(half).reshape([HALF_N, BLOCK_D])
    dp_tok = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)  # dP^T = V dO^T
    if HAS_DROPOUT:
        seed, bh0, threshold, _, delta_unit = drop
        w0, w1 = dropout_words_sm90(seed, bh0 + i // n_m, start_m, key0, BLOCK_M, HALF_N, True)
        keep_words = (dropout_keep_bits_sm90(w0, threshold), dropout_keep_bits_sm90(w1, threshold))
    if HAS_ALIBI:
        slopes, stride_slope_h, unit = alibi
        slope = gl.load(slopes + (i // n_m) * stride_slope_h) * unit
    s_t = warpgroup_mma_wait(1, deps=(s_tok, ))
    if HAS_SOFTCAP:  # the forward's capped scores; dS takes the cap's derivative 1 - tanh^2 = 4 r (1 - r)
        s_t, r = capped_sm90(s_t, qk_scale, softcap)
        dcap = cap_derivative_sm90(r)
    if HAS_ALIBI:  # the forward's bias: queries along S^T's columns, keys along its rows
        queries = start_m + diag_offset + gl.arange(0, BLOCK_M, layout=row_layout)
        s_t = alibi_sm90(s_t, offs_n, queries, slope)
    # rows past sq (zeros from TMA) and rows that saw no key have an LSE of +inf: P = 0 there
    p_t = gl.exp2(s_t * (1.0 if HAS_SOFTCAP else qk_scale) - lse_bufs.index(stage).load(row_layout)[None, :])
    if (start_m < full_lo) | (start_m >= full_hi):
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
        ok = visible(offs_m[None, :], offs_n[:, None], diag_offset, sk, left, right, HAS_LEFT, HAS_RIGHT)
        p_t = gl.where(ok, p_t, 0.0)
    if HAS_DROPOUT:  # P >= 0, so its sign can carry the keep-mask to dP^T: P' = P kept, -P dropped
        p_t = dropout_sign_sm90(p_t, keep_words, BLOCK_M, HALF_N, True)
        p_op = gl.convert_layout(relu_to_sm90(p_t, dtype), op_layout)
    else:
        p_op = gl.convert_layout(p_t.to(dtype), op_layout)
    dv_tok = warpgroup_mma(p_op, do, dv, is_async=True)
    if HAS_SOFTCAP:  # from here on P only makes dS: P times the cap's derivative (>= 0, P's sign stays)
        p_t = p_t * dcap
    dp_t = warpgroup_mma_wait(1, deps=(dp_tok, ))
    delta = delta_bufs.index(stage).load(row_layout)[None, :]
    if HAS_DROPOUT:  # dS = P (keep dP / (1 - p) - D) = u (P' dP + |P'| (dP - D / u)), u = 1 / (2 (1 - p)): the
        # step leaves dS / u (three instructions a score where four were), dK and dQ take u at the end
        ds_t = (p_t * dp_t + gl.abs(p_t) * (dp_t - delta * delta_unit)).to(dtype)
    else:
        ds_t = (p_t * (dp_t - delta)).to(dtype)
    ds_op = gl.convert_layout(ds_t, op_layout)
    dk_tok = warpgroup_mma(ds_op, q, dk, is_async=True)
    # dS^T buffers alternate: a step's are overwritten two steps later, once both warpgroups have
    # passed the next step's exchange (ds_ready), i.e. waited for this step's dQ product
    ds_bufs.index(2 * (i & 1) + half).store(ds_t)
    fence_async_shared()
    _bwd_sm90_ds_stored(ds_ready, i, half, NAMED_DS)
    dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
    mbarrier.arrive(empty.index(stage), count=1)  # Q, dO and the row stats of this step are read
    if not DEFER_DQ:
        dq = warpgroup_mma_wait(0, deps=(_bwd_sm90_dq_product(ds_bufs, k_bufs, ds_ready, i, half, dq_zero, False), ))
        _bwd_sm90_dq_out(dq_desc, dq_bufs, handoff, dq, i, tb, q0 + start_m, hk * group + i // n_m, half,
                         BLOCK_M, DETERMINISTIC)
    return dk, dv


# named barriers of _bwd_sm90_ds_stored: DS_BARRIER + 2 x step parity + warpgroup
DS_BARRIER = FIRST_FREE_BARRIER


@gluon.jit
def _bwd_sm90_ds_stored(ds_ready, i, half, NAMED: gl.constexpr):
    """A consumer's dS^T of step i is in shared memory (fenced): tell the other warpgroup, whose dQ
    product reads it (_bwd_sm90_dq_product waits). By ds_ready's mbarrier of the step's parity, or
    with NAMED by passing hardware named barrier DS_BARRIER + 2 x parity + half (bar.arrive), at
    which the other waits (bar.sync): one barrier per parity and warpgroup, so a warpgroup's next
    pass on one comes after the other's wait there (it needs the other's pass of the step between).
    Both consumers take the same n_steps, so each pass has its wait. NAMED where the dQ product
    waits until the next step (DEFER_DQ): backward TFLOP/s at d=64 2k / 8k 411 / 411 -> 415 / 420,
    455 / 451 -> 473 / 472, causal 8k level; at d=128 where each step ends with its dQ product
    (configs.hopper_backward_defer_dq), 3% slower (H200 NOTES.md, thirty-ninth session). Not with
    ALiBi, whose d=64 steps spill 32-36 bytes more with it (528 causal) and were not timed so."""
    if NAMED:
        named_barrier_sm90(DS_BARRIER + 2 * (i & 1) + half, True)
    else:
        mbarrier.arrive(ds_ready.index(i & 1), count=1)


@gluon.jit
def _bwd_sm90_dq_product(ds_bufs, k_bufs, ds_ready, i, half, dq_zero, NAMED: gl.constexpr):
    """This warpgroup's part of step i's dQ: dS (both warpgroups' keys, once the other's dS^T is
    in shared memory: _bwd_sm90_ds_stored) times K; asynchronous. With 128-row Q blocks its 64
    rows (half) in every column, an m64n64 product a key half where the columns' halves take two
    m64n32 (FA3's split of dQ at d=64); else every row in its half of the columns."""
    HALF_N: gl.constexpr = k_bufs.shape[2]
    BLOCK_D: gl.constexpr = k_bufs.shape[4]
    BLOCK_M: gl.constexpr = ds_bufs.shape[2]
    DQ_ROWS: gl.constexpr = dq_zero.shape[0]
    DQ_COLS: gl.constexpr = dq_zero.shape[1]
    par = i & 1
    if NAMED:
        named_barrier_sm90(DS_BARRIER + 2 * par + 1 - half, False)
    else:
        mbarrier.wait(ds_ready.index(par), (i >> 1) & 1)
    ds0 = ds_bufs.index(2 * par).permute((1, 0))
    ds1 = ds_bufs.index(2 * par + 1).permute((1, 0))
    k0 = k_bufs.index(0).reshape([HALF_N, BLOCK_D])
    k1 = k_bufs.index(1).reshape([HALF_N, BLOCK_D])
    if DQ_ROWS < BLOCK_M:
        ds0 = ds0.slice(half * DQ_ROWS, DQ_ROWS, dim=0)
        ds1 = ds1.slice(half * DQ_ROWS, DQ_ROWS, dim=0)
    else:
        k0 = k0.slice(half * DQ_COLS, DQ_COLS, dim=1)
        k1 = k1.slice(half * DQ_COLS, DQ_COLS, dim=1)
    tok = warpgroup_mma(ds0, k0, dq_zero, use_acc=False, is_async=True)
    return warpgroup_mma(ds1, k1, tok, is_async=True)


@gluon.jit
def _bwd_sm90_step_split(i, dk, dv, q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs, ds_bufs, q_ready,
                         do_ready, empty, ds_ready, dq_desc, half, tb, q0, hk, group, lo, n_m, full_lo, full_hi, sk,
                         diag_offset, left, right, qk_scale, softcap, start_n, dq_zero, drop, alibi,
                         HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                         HAS_DROPOUT: gl.constexpr, HAS_ALIBI: gl.constexpr):
    """Step i with SPLIT_D (FA3's schedule at d=256). The warpgroups split S = Q K^T and dP = dO V^T
    by keys, 32 each, and leave their columns of P and dS in shared memory; once both have, each
    takes dV += P^T dO, dK += dS^T Q and dQ = dS K in its half of the head dim, all operands from
    shared memory. dQ leaves by TMA reduce-add in two products of a quarter, staged in this
    warpgroup's columns of the step's Q (first quarter) and dO (second) buffers: by then every
    other reader of those bytes is done (the S and dP products of both warpgroups come before the
    exchange, dK and dV read only this warpgroup's columns). Returns dK, dV."""
    NUM_STAGES: gl.constexpr = q_bufs.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.shape[2]
    BLOCK_N: gl.constexpr = k_bufs.shape[2]
    BLOCK_D: gl.constexpr = k_bufs.shape[4]
    OWN_N: gl.constexpr = BLOCK_N // 2  # keys of this warpgroup's S and dP
    OWN_D: gl.constexpr = dk.shape[1]  # columns of its dK, dV and dQ
    QUARTER: gl.constexpr = dq_zero.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                       instr_shape=[16, OWN_N, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_bufs.dtype
    stage = i % NUM_STAGES
    phase = (i // NUM_STAGES) & 1
    start_m = lo + (i % n_m) * BLOCK_M
    s_zero = gl.zeros([BLOCK_M, OWN_N], gl.float32, s_layout)  # ignored (use_acc=False): the layout
    k = k_bufs.index(0).reshape([BLOCK_N, BLOCK_D])
    mbarrier.wait(q_ready.index(stage), phase)
    q = q_bufs.index(stage).reshape([BLOCK_M, BLOCK_D])
    s_tok = warpgroup_mma(q, k.slice(half * OWN_N, OWN_N, dim=0).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    mbarrier.wait(do_ready.index(stage), phase)
    do = do_bufs.index(stage).reshape([BLOCK_M, BLOCK_D])
    v = v_bufs.index(0).reshape([BLOCK_N, BLOCK_D])
    dp_tok = warpgroup_mma(do, v.slice(half * OWN_N, OWN_N, dim=0).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)
    if HAS_DROPOUT:
        seed, bh0, threshold, dropout_scale, _ = drop
        words = dropout_words_sm90(seed, bh0 + i // n_m, start_m, start_n + half * OWN_N, BLOCK_M, OWN_N, False)
    if HAS_ALIBI:
        slopes, stride_slope_h, unit = alibi
        slope = gl.load(slopes + (i // n_m) * stride_slope_h) * unit
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    if HAS_SOFTCAP:  # the forward's capped scores; dS takes the cap's derivative 1 - tanh^2 = 4 r (1 - r)
        s, r = capped_sm90(s, qk_scale, softcap)
        dcap = cap_derivative_sm90(r)
    if HAS_ALIBI:  # the forward's bias
        queries = start_m + diag_offset + gl.arange(0, BLOCK_M, layout=row_layout)
        keys = start_n + half * OWN_N + gl.arange(0, OWN_N, layout=gl.SliceLayout(0, s_layout))
        s = alibi_sm90(s, queries, keys, slope)
    # rows past sq (zeros from TMA) and rows that saw no key have an LSE of +inf: P = 0 there
    p = gl.exp2(s * (1.0 if HAS_SOFTCAP else qk_scale) - lse_bufs.index(stage).load(row_layout)[:, None])
    if (start_m < full_lo) | (start_m >= full_hi):
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
        offs_n = start_n + half * OWN_N + gl.arange(0, OWN_N, layout=gl.SliceLayout(0, s_layout))
        ok = visible(offs_m[:, None], offs_n[None, :], diag_offset, sk, left, right, HAS_LEFT, HAS_RIGHT)
        p = gl.where(ok, p, 0.0)
    dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
    if HAS_DROPOUT:
        keep = dropout_keep_sm90(words, threshold, s_layout, BLOCK_M, OWN_N, False)
        dp = gl.where(keep, dp * dropout_scale, 0.0)
    ds = p * (dp - delta_bufs.index(stage).load(row_layout)[:, None])
    if HAS_SOFTCAP:
        ds = ds * dcap
    if HAS_DROPOUT:  # dV's operand
        p = gl.where(keep, p, 0.0)
    # P and dS buffers alternate: a step's are overwritten two steps later, once both warpgroups
    # have passed the next step's ds_ready, i.e. finished this step's products
    par = i & 1
    p_smem = ds_bufs.index(2 + par)
    ds_smem = ds_bufs.index(par)
    p_smem.slice(half * OWN_N, OWN_N, dim=1).store(p.to(dtype))
    ds_smem.slice(half * OWN_N, OWN_N, dim=1).store(ds.to(dtype))
    fence_async_shared()
    mbarrier.arrive(ds_ready.index(par), count=1)
    mbarrier.wait(ds_ready.index(par), (i >> 1) & 1)
    col: gl.constexpr = half * OWN_D
    dv_tok = warpgroup_mma(p_smem.permute((1, 0)), do.slice(col, OWN_D, dim=1), dv, is_async=True)
    dk_tok = warpgroup_mma(ds_smem.permute((1, 0)), q.slice(col, OWN_D, dim=1), dk, is_async=True)
    first_tok = warpgroup_mma(ds_smem, k.slice(col, QUARTER, dim=1), dq_zero, use_acc=False, is_async=True)
    second_tok = warpgroup_mma(ds_smem, k.slice(col + QUARTER, QUARTER, dim=1), dq_zero, use_acc=False,
                               is_async=True)
    quarters: gl.constexpr = [2] + dq_desc.block_type.shape  # a stage's Q (or dO) buffer: 2 fp32 dQ boxes
    first_smem = q_bufs.index(stage)._reinterpret(gl.float32, quarters, dq_desc.layout).index(half)
    second_smem = do_bufs.index(stage)._reinterpret(gl.float32, quarters, dq_desc.layout).index(half)
    dv, dk, first = warpgroup_mma_wait(1, deps=(dv_tok, dk_tok, first_tok))
    first_smem.reshape(first.shape).store(first)
    second = warpgroup_mma_wait(0, deps=(second_tok, ))
    second_smem.reshape(second.shape).store(second)
    fence_async_shared()
    h = hk * group + i // n_m
    _tma_reduce_add(dq_desc, [tb, q0 + start_m, h, col], first_smem)
    _tma_reduce_add(dq_desc, [tb, q0 + start_m, h, col + QUARTER], second_smem)
    tma.store_wait(0)
    mbarrier.arrive(empty.index(stage), count=1)  # Q, dO and the row stats of this step are read
    return dk, dv


@gluon.jit
def _bwd_sm90_dq_out(dq_desc, dq_bufs, handoff, dq, i, tb, row, h, half, BLOCK_M: gl.constexpr,
                     DETERMINISTIC: gl.constexpr):
    """A consumer's part of step i's dQ (_bwd_sm90_dq_product's; over softmax_scale, and with
    dropout in backward_ds_unit's units) into the fp32 dQ buffer at (tb, row) by TMA
    reduce-add (rows past the tensor are clipped; in a packed batch the
    rows past the sequence's end, whose P is 0, add zeros to the next one's), through its shared
    buffer once the previous reduction has read it. DETERMINISTIC: into its shared buffer once the
    writer partition (_bwd_sm90_write_dq) has had the previous step's read, and handed to it
    (handoff's barriers: dq_full, dq_empty), which adds it in its turn. (A writer for the
    any-order additions too measured 2-5% slower at d=64 and at d=128 16k: NOTES.md.)"""
    if DETERMINISTIC:
        dq_full, dq_empty = handoff
        mbarrier.wait(dq_empty.index(half), (i & 1) ^ 1)  # the first step passes at once
        dq_bufs.index(half).reshape(dq.shape).store(dq)
        fence_async_shared()
        mbarrier.arrive(dq_full.index(half), count=1)
    else:
        tma.store_wait(0)
        dq_bufs.index(half).reshape(dq.shape).store(dq)
        fence_async_shared()
        _bwd_sm90_reduce_dq(dq_desc, dq_bufs.index(half), tb, row, h, half, BLOCK_M)


@gluon.jit
def _bwd_sm90_reduce_dq(dq_desc, buf, tb, row, h, half, BLOCK_M: gl.constexpr):
    """Adds a warpgroup's part of a step's dQ tile (buf, shared) into the fp32 dQ whose block
    starts at (tb, row) by TMA reduce-add: rows half * 64 onwards in every column where dQ's box
    (sm90_boxes) is half the block's rows, else every row in columns half * box width onwards."""
    DQ_ROWS: gl.constexpr = dq_desc.block_type.shape[1]
    DQ_COLS: gl.constexpr = dq_desc.block_type.shape[3]
    if DQ_ROWS < BLOCK_M:
        _tma_reduce_add(dq_desc, [tb, row + half * DQ_ROWS, h, 0], buf)
    else:
        _tma_reduce_add(dq_desc, [tb, row, h, half * DQ_COLS], buf)


@gluon.jit(do_not_specialize=["sq", "sk", "left", "right", "rows_pad", "head_chunk", "total_q", "total_k",
                               "threshold"])
def _bwd_kernel_sm90(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dk_desc, dv_desc, dq_desc, Rng,
                     CuSeqQ, CuSeqK, SeqUsedK, DK, DV, Slopes, Turns, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
                     nheads, nheads_k, sq, sk, left, right, rows_pad, head_chunk, qk_scale, dk_scale, threshold,
                     dropout_scale, total_q, total_k, softcap, stride_slope_b, stride_slope_h,
                     HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, NUM_STAGES: gl.constexpr,
                     DEFER_DQ: gl.constexpr, SPLIT_D: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                     HAS_DROPOUT: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_SEQUSED: gl.constexpr,
                     HAS_ALIBI: gl.constexpr, HEAD_CHUNKED: gl.constexpr, HEAD_DIM: gl.constexpr,
                     DETERMINISTIC: gl.constexpr):
    """Grid: (key blocks, K/V heads, batch), key block 0 first, the longest with a causal mask (with
    DETERMINISTIC under a right bound, the last key block first: see below); or
    with HEAD_CHUNKED (configs.hopper_backward_chunked) a 1D grid of the same programs in
    chunked_order, key block 0 of head_chunk (batch, K/V head) rows first
    (configs.hopper_backward_head_chunk).
    A key block is two boxes of k_desc, one per consumer warpgroup, or with SPLIT_D one that both
    share (configs.hopper_backward_split_d). rows_pad: rows per head of the LSE and delta buffers
    (a multiple of the Q block). IS_VARLEN: a packed batch (the descriptors over (1, total, heads,
    d) views; DK, DV its gradients, (total_k, hk, d)) whose `batch` counts sequences, sq / sk the
    longest: a program finds its sequence in cu_seqlens (seq_bounds); a key block past its end
    does nothing, and one that runs into the next sequence masks every step (those keys' rows of
    P^T are zero, so nothing of them reaches dQ). HAS_SOFTCAP: capped scores (capped_sm90; qk_scale
    and softcap are softcap_scales'). dk_scale: dK's factor, softmax_scale times backward_ds_unit.
    HAS_ALIBI: Slopes, ALiBi slopes (h,) or (b, h), fp32, with their strides. HEAD_DIM: the
    tensors' head dim; the boxes may be wider (configs.hopper_head_dim), their columns past it read
    as zeros and clipped on the way out. DETERMINISTIC (not with SPLIT_D): dQ's additions into a
    Q block come in a fixed order, the one in which the programs reach it (dq_order), counted in
    Turns (int32, one per Q block of rows_pad and query head, zeroed) by a writer partition
    (_bwd_sm90_write_dq) that the consumers hand their dQ tiles to; under a right bound the key
    blocks are launched last first, so a program only waits for programs launched before it (this
    relies on the GPU starting programs in launch order, as FlashAttention-3's deterministic
    backward does; a program waiting on one not yet started would wait forever).
    Pointers and descriptors come before the scalars, as ops._launch.Prepared passes them."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    WG_KEYS: gl.constexpr = k_desc.block_type.shape[1]  # a consumer warpgroup's keys
    KEY_BUFS: gl.constexpr = 1 if SPLIT_D else 2
    BLOCK_N: gl.constexpr = KEY_BUFS * WG_KEYS
    n_kb = gl.cdiv(sk, BLOCK_N)  # the longest sequence's key blocks (before seq_bounds)
    gl.static_assert(not (DETERMINISTIC and SPLIT_D), "SPLIT_D's dQ has no writer partition")
    pid, bhk = key_block_program(n_kb, gl.num_programs(0) // n_kb, head_chunk, HEAD_CHUNKED, DETERMINISTIC,
                                 HAS_RIGHT)
    start_n = pid * BLOCK_N
    # b and hk by div / mod of one index, as when the grid was (key blocks, batch x kv heads):
    # reading them off the z and y axes measured 407 against 414 TFLOP/s at d=64 causal 16k
    # (benchmarks/results/h100/NOTES.md, "Batch x heads past 65535")
    b = bhk // nheads_k
    hk = bhk % nheads_k
    group = nheads // nheads_k
    q0, sq, k0, sk = seq_bounds(b, CuSeqQ, CuSeqK, SeqUsedK, sq, sk, total_q, total_k, IS_VARLEN, HAS_SEQUSED, False)
    tb = 0 if IS_VARLEN else b
    diag_offset = sk - sq
    # rows that can see this key block: the block_range of keys-over-rows (offset and sides swap)
    lo, full_lo, full_hi, hi = block_range(start_n, BLOCK_N, BLOCK_M, sq, -diag_offset, right, left,
                                           HAS_RIGHT, HAS_LEFT)
    n_m = gl.cdiv(hi - lo, BLOCK_M)
    if IS_VARLEN:
        n_m = gl.where(start_n < sk, n_m, 0)
        full_hi = gl.where(start_n + BLOCK_N > sk, full_lo, full_hi)

    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [KEY_BUFS] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [KEY_BUFS] + v_desc.block_type.shape, v_desc.layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], delta_desc.layout)
    if SPLIT_D:  # dS and P [step parity] of BLOCK_M rows by the program's keys, written in column
        # halves (32 keys, one 64-byte swizzle atom wide); dQ leaves through the Q and dO buffers
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
        ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [4, BLOCK_M, WG_KEYS], ds_layout)  # dS, dS, P, P
        dq_bufs = q_bufs
    else:
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_KEYS, BLOCK_M], q_desc.dtype)
        ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [4, WG_KEYS, BLOCK_M], ds_layout)  # [step parity, half]
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # DETERMINISTIC: dq_bufs[half]
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # to the writer and back
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(done, count=2)  # one arrival per consumer warpgroup
    mbarrier.init(ds_ready.index(0), count=2)
    mbarrier.init(ds_ready.index(1), count=2)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    if DETERMINISTIC:
        for half in gl.static_range(2):
            mbarrier.init(dq_full.index(half), count=1)
            mbarrier.init(dq_empty.index(half), count=1)

    # arguments spelled out per partition (see _fwd_kernel_sm90), in full in both branches: Gluon
    # turns the constexprs of a list built by + or if-else into plain values, which a partition's
    # arguments cannot take. DETERMINISTIC adds the dQ writer, whose warp shares the loader's
    # warpgroup of registers.
    if DETERMINISTIC:
        gl.warp_specialize([
            (_bwd_sm90_consume, (dk_desc, dv_desc, dq_desc, q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs,
                                 ds_bufs, dq_bufs, (dq_full, dq_empty), kv_bar, q_ready, do_ready, empty,
                                 ds_ready, done, 0, b, tb, q0, k0, hk, group, start_n, lo, n_m, full_lo, full_hi,
                                 sk, diag_offset, left, right, qk_scale, softcap, dk_scale, Rng, nheads, threshold,
                                 dropout_scale, DK, DV, stride_dkn, stride_dkh, stride_dvn, stride_dvh, Slopes,
                                 stride_slope_b, stride_slope_h, HAS_LEFT, HAS_RIGHT, DEFER_DQ, HAS_SOFTCAP,
                                 HAS_DROPOUT, IS_VARLEN, HAS_ALIBI, HEAD_DIM, DETERMINISTIC)),
            (_bwd_sm90_consume, (dk_desc, dv_desc, dq_desc, q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs,
                                 ds_bufs, dq_bufs, (dq_full, dq_empty), kv_bar, q_ready, do_ready, empty,
                                 ds_ready, done, 1, b, tb, q0, k0, hk, group, start_n, lo, n_m, full_lo, full_hi,
                                 sk, diag_offset, left, right, qk_scale, softcap, dk_scale, Rng, nheads, threshold,
                                 dropout_scale, DK, DV, stride_dkn, stride_dkh, stride_dvn, stride_dvh, Slopes,
                                 stride_slope_b, stride_slope_h, HAS_LEFT, HAS_RIGHT, DEFER_DQ, HAS_SOFTCAP,
                                 HAS_DROPOUT, IS_VARLEN, HAS_ALIBI, HEAD_DIM, DETERMINISTIC)),
            (_bwd_sm90_load, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs, k_bufs, v_bufs,
                              lse_bufs, delta_bufs, kv_bar, q_ready, do_ready, empty, b, tb, q0, k0, hk, group, nheads,
                              rows_pad, start_n, lo, n_m)),
            (_bwd_sm90_write_dq, (dq_desc, dq_bufs, dq_full, dq_empty, Turns, b, tb, q0, hk, group, nheads,
                                  rows_pad, start_n, lo, n_m, sq, sk, left, right, BLOCK_M, BLOCK_N, HAS_LEFT,
                                  HAS_RIGHT)),
        ], [4, 1, 1], [HOPPER_CONSUMER_REGS, HOPPER_LOADER_REGS, HOPPER_LOADER_REGS])
    else:
        gl.warp_specialize([
            (_bwd_sm90_consume, (dk_desc, dv_desc, dq_desc, q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs,
                                 ds_bufs, dq_bufs, (dq_full, dq_empty), kv_bar, q_ready, do_ready, empty,
                                 ds_ready, done, 0, b, tb, q0, k0, hk, group, start_n, lo, n_m, full_lo, full_hi,
                                 sk, diag_offset, left, right, qk_scale, softcap, dk_scale, Rng, nheads, threshold,
                                 dropout_scale, DK, DV, stride_dkn, stride_dkh, stride_dvn, stride_dvh, Slopes,
                                 stride_slope_b, stride_slope_h, HAS_LEFT, HAS_RIGHT, DEFER_DQ, HAS_SOFTCAP,
                                 HAS_DROPOUT, IS_VARLEN, HAS_ALIBI, HEAD_DIM, DETERMINISTIC)),
            (_bwd_sm90_consume, (dk_desc, dv_desc, dq_desc, q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs,
                                 ds_bufs, dq_bufs, (dq_full, dq_empty), kv_bar, q_ready, do_ready, empty,
                                 ds_ready, done, 1, b, tb, q0, k0, hk, group, start_n, lo, n_m, full_lo, full_hi,
                                 sk, diag_offset, left, right, qk_scale, softcap, dk_scale, Rng, nheads, threshold,
                                 dropout_scale, DK, DV, stride_dkn, stride_dkh, stride_dvn, stride_dvh, Slopes,
                                 stride_slope_b, stride_slope_h, HAS_LEFT, HAS_RIGHT, DEFER_DQ, HAS_SOFTCAP,
                                 HAS_DROPOUT, IS_VARLEN, HAS_ALIBI, HEAD_DIM, DETERMINISTIC)),
            (_bwd_sm90_load, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs, k_bufs, v_bufs,
                              lse_bufs, delta_bufs, kv_bar, q_ready, do_ready, empty, b, tb, q0, k0, hk, group, nheads,
                              rows_pad, start_n, lo, n_m)),
        ], [4, 1], [HOPPER_CONSUMER_REGS, HOPPER_LOADER_REGS])


ROW_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def _hopper_supports(q, k, v, dout, dk, dv, softmax_scale, varlen) -> bool:
    """Can _bwd_kernel_sm90 take this call? As the Hopper forward (ops.forward._hopper_supports):
    BSHD and packed batches (dropout, softcap and ALiBi included) with a positive scale, whose
    inputs and dK/dV TMA can address."""
    if softmax_scale <= 0:
        return False
    if varlen is not None and varlen.block_table is not None:
        return False
    return all(map(tma_ok, (q, k, v, dout, dk, dv)))


def sm90_boxes(cfg, d: int, dq_by_rows: bool = False) -> dict:
    """(rows, columns) of the TMA boxes of _bwd_kernel_sm90's BSHD descriptors, by parameter name,
    for tiles cfg at the kernel's head dim d (configs.hopper_head_dim): K and V in a box per
    consumer warpgroup (half the program's keys), or with SPLIT_D one box that both share, and
    dK / dV in a box per warpgroup's columns; dQ in a box per warpgroup's part of a step's tile
    (_bwd_sm90_dq_product): half its rows where dq_by_rows (configs.hopper_backward_dq_by_rows),
    else half its columns (with SPLIT_D a quarter)."""
    split = configs.hopper_backward_split_d(d)
    keys = cfg.block_n if split else cfg.block_n // 2
    kv_cols = d // 2 if split else d
    dq = (cfg.block_m // 2, d) if dq_by_rows else (cfg.block_m, d // 4) if split else (cfg.block_m, d // 2)
    return dict(q_desc=(cfg.block_m, d), do_desc=(cfg.block_m, d), k_desc=(keys, d), v_desc=(keys, d),
                dk_desc=(keys, kv_cols), dv_desc=(keys, kv_cols), dq_desc=dq)


def backward_ds_unit(dropout_scale: float, has_dropout: bool, split_d: bool) -> float:
    """The true dS over what a step of _bwd_kernel_sm90 computes, 1 / (2 (1 - p)) with dropout
    (_bwd_sm90_step; not with SPLIT_D): dK takes it in the kernel's epilogue and dQ on the host,
    which saves the step a multiply a score."""
    return 0.5 * dropout_scale if has_dropout and not split_d else 1.0


def _launch_sm90(env: list, cfg, softmax_scale, window, accumulate_dq, dropout=None, varlen=None, softcap=0.0,
                 deterministic=False, zero_grads=False) -> BackwardPlan:
    """The Hopper backward's plan for the call whose tensors are env (attention_backward's
    _plan): the delta/LSE launch, the kernel into an fp32 dQ, dQ scaled into dq; accumulate_dq:
    dq (float32) gets dQ / softmax_scale added, by the kernel or (where its dS is scaled,
    backward_ds_unit) through a buffer of its own; dropout, varlen (a packed batch) and softcap as
    attention_backward's; delta (shaped like lse) gets delta when given; deterministic: dQ's
    additions in a fixed order (not with SPLIT_D), counted in a zeroed int32 per Q block and query
    head. cfg: hopper_backward_tiles (Q block rows, keys per program, warps per consumer, stages)."""
    dout, q, k, v, out, lse, dq, dk, dv, delta, alibi_slopes = env[:SLOPES + 1]
    left, right = window
    h, d = q.shape[-2:]
    dp = configs.hopper_head_dim(d)  # the boxes' columns: those past d read as zeros and are clipped
    hk = k.shape[-2]
    b, sq, sk = grid_lengths(q, k, varlen)
    packed = varlen is not None  # one sequence of all the rows for the copy engine; the kernel finds each
    vl_tensors, (_, total_q, total_k, _, _), vl_flags = varlen_args(q, k, varlen)
    rows_pad = cdiv(sq, cfg.block_m) * cfg.block_m  # per sequence of a packed batch, its longest
    env[LSE2], env[DELTA2] = lse2, delta2 = torch.empty((2, b * h * rows_pad), dtype=torch.float32,
                                                        device=q.device).unbind(0)
    rng, threshold, dropout_scale, has_dropout = dropout_args(dropout)
    split = configs.hopper_backward_split_d(dp)
    assert not (deterministic and split), "SPLIT_D adds dQ in no fixed order"
    ds_unit = backward_ds_unit(dropout_scale, has_dropout, split)
    # the kernel adds dQ / (softmax_scale ds_unit): a buffer of its own where dq must get dQ / softmax_scale,
    # zeroed by the delta launch
    own_dq = not (accumulate_dq and ds_unit == 1)
    env[DQ_ACC] = dq_acc = torch.empty(q.shape, dtype=torch.float32, device=q.device) if own_dq else dq
    pre = configs.delta_config(d, q.device)
    delta_launch = Plan.of(env, _delta_kernel, (cdiv(rows_pad, pre.block_m), h, b),
                           (out, dout, delta2, lse, lse2, delta, vl_tensors[0], dq_acc if own_dq else None),
                           (*seq_strides(out, packed), *seq_strides(dout, packed),
                            *(seq_strides(dq_acc, packed) if own_dq else (0,) * 4), h, sq, rows_pad, total_q),
                           pre.num_warps, pre.num_stages, None,
                           dict(HEAD_DIM=d, BLOCK_D=configs.padded_headdim(d), BLOCK_M=pre.block_m,
                                EVEN_D=d == configs.padded_headdim(d), WRITE_LSE2=True, IS_VARLEN=packed))
    # a packed batch's dK / dV leave through pointers (the kernel's IS_VARLEN epilogue)
    grad_ptrs, grad_strides = ((dk, dv), (*dk.stride()[:2], *dv.stride()[:2])) if packed else ((None, None), (0,) * 4)
    rows = [Box(t, (t.numel(),), (1,), (cfg.block_m,), ROW_LAYOUT) for t in (lse2, delta2)]
    boxes = sm90_boxes(cfg, dp, configs.hopper_backward_dq_by_rows(cfg.block_m, right is not None, deterministic))

    def box(t, name):
        return box_descriptor(t, *boxes[name], packed)

    qk_scale, softcap2 = kernel_scale(softmax_scale, softcap)
    if softcap > 0:
        qk_scale, softcap2 = softcap_scales(qk_scale, softcap2)
    n_turns = b * h * rows_pad // cfg.block_m if deterministic else 0
    env[TURNS] = turns = torch.zeros(n_turns, dtype=torch.int32, device=q.device) if deterministic else None
    chunked = configs.hopper_backward_chunked(dp, right is not None, deterministic)
    chunk = configs.hopper_backward_head_chunk(dp, sq, h // hk, right is not None, q.device, deterministic)
    n_kb = cdiv(sk, cfg.block_n)
    kernel_launch = Plan.of(
        env, _bwd_kernel_sm90, (n_kb * hk * b, 1, 1) if chunked else (n_kb, hk, b),
        (box(q, "q_desc"), box(dout, "do_desc"), box(k, "k_desc"), box(v, "v_desc"), *rows, box(dk, "dk_desc"),
         box(dv, "dv_desc"), box(dq_acc, "dq_desc"), rng, *vl_tensors[:3], *grad_ptrs, alibi_slopes, turns),
        (*grad_strides, h, hk, sq, sk, left or 0, right or 0, rows_pad, chunk, qk_scale, softmax_scale * ds_unit,
         threshold, dropout_scale, total_q, total_k, softcap2, *alibi_strides(alibi_slopes)),
        cfg.num_warps, None, HOPPER_MAXNREG,
        dict(HAS_LEFT=left is not None, HAS_RIGHT=right is not None, NUM_STAGES=cfg.num_stages,
             DEFER_DQ=configs.hopper_backward_defer_dq(dp, right is not None, deterministic), SPLIT_D=split,
             HAS_SOFTCAP=softcap > 0, HAS_DROPOUT=has_dropout, IS_VARLEN=packed, HAS_SEQUSED=vl_flags["HAS_SEQUSED"],
             HAS_ALIBI=alibi_slopes is not None, HEAD_CHUNKED=chunked, HEAD_DIM=d, DETERMINISTIC=deterministic))
    # then dq = the sum scaled, or (accumulate_dq) dq += it from a buffer of its own, at ds_unit
    dq_scale = softmax_scale * ds_unit if not accumulate_dq else ds_unit if own_dq else 0.0
    return BackwardPlan((delta_launch, kernel_launch), zero_grads, False, b * h * rows_pad, own_dq, n_turns,
                        dq_scale)
