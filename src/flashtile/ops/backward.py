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
pair). That path was built in Triton and measured slower for the whole backward than the dQ
programs at every shape, so it was removed (docs/changelog.md, "Prefill: the Triton kernels").
The Hopper variant (ops.backward_sm90) does it in Gluon, with TMA reductions, and is faster there
(with deterministic=True in a fixed order). Both loops skip the blocks that the mask hides and run
the fully visible ones without mask work (ops.masks.block_range). dK/dQ are scaled by
softmax_scale once at the end.
The forward's flags carry over: IS_VARLEN (each program finds its sequence in cu_seqlens; programs
past their sequence's end run empty loops and store nothing) and HAS_DROPOUT (both kinds regenerate
the forward's keep-mask from the same Philox counters: dV = (P o Z)^T dO / (1 - p) and
dP = (dO V^T) o Z / (1 - p)). A paged K/V never reaches the backward (the API gathers the pages).
"""


import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from flashtile.ops import configs
from flashtile.ops._launch import Plan, cdiv
from flashtile.ops.aggregates import VALUE, aggregate, keep_all
from flashtile.ops.host import (
    DELTA,
    SLOPES,
    BackwardPlan,
    dot_precision,
    dropout_args,
    grid_lengths,
    seq_strides,
    tma_ok,
    varlen_args,
)
from flashtile.ops.masks import (
    block_range,
    head_dim_mask,
    in_window,
    load_tile_pair,
    lse_row_base,
    phase_blocks,
    seq_bounds,
    visible,
)
from flashtile.ops.mods import ModArgs, Mods, alibi_strides, kernel_scale, scores_log2
from flashtile.ops.philox import dropout_keep, dropout_seed
from flashtile.ops.preprocess import _delta_kernel
from flashtile.ops.schedule import head_chunked_order
from flashtile.ops.softmax import LOG2E


@aggregate
class BwdArgs:
    """_bwd_kernel's tensors, strides and scalars that its programs read, by name (its docstring and
    _dkdv_program's / _dq_program's say what each is)."""

    Q: VALUE
    K: VALUE
    V: VALUE
    dO: VALUE
    Out: VALUE
    Lse: VALUE
    Delta: VALUE
    dQ: VALUE
    dK: VALUE
    dV: VALUE
    Slopes: VALUE
    stride_qb: VALUE
    stride_qm: VALUE
    stride_qh: VALUE
    stride_qd: VALUE
    stride_kb: VALUE
    stride_kn: VALUE
    stride_kh: VALUE
    stride_kd: VALUE
    stride_vb: VALUE
    stride_vn: VALUE
    stride_vh: VALUE
    stride_vd: VALUE
    stride_dob: VALUE
    stride_dom: VALUE
    stride_doh: VALUE
    stride_dod: VALUE
    stride_ob: VALUE
    stride_om: VALUE
    stride_oh: VALUE
    stride_od: VALUE
    stride_dqb: VALUE
    stride_dqm: VALUE
    stride_dqh: VALUE
    stride_dqd: VALUE
    stride_dkb: VALUE
    stride_dkn: VALUE
    stride_dkh: VALUE
    stride_dkd: VALUE
    stride_dvb: VALUE
    stride_dvn: VALUE
    stride_dvh: VALUE
    stride_dvd: VALUE
    stride_slope_b: VALUE
    stride_slope_h: VALUE
    nheads: VALUE
    total_q: VALUE
    left: VALUE
    right: VALUE
    qk_scale: VALUE
    softcap: VALUE
    softmax_scale: VALUE
    threshold: VALUE
    dropout_scale: VALUE

    @triton.constexpr_function
    def __init__(self, Q, K, V, dO, Out, Lse, Delta, dQ, dK, dV, Slopes, stride_qb, stride_qm, stride_qh, stride_qd,
                 stride_kb, stride_kn, stride_kh, stride_kd, stride_vb, stride_vn, stride_vh, stride_vd, stride_dob,
                 stride_dom, stride_doh, stride_dod, stride_ob, stride_om, stride_oh, stride_od, stride_dqb,
                 stride_dqm, stride_dqh, stride_dqd, stride_dkb, stride_dkn, stride_dkh, stride_dkd, stride_dvb,
                 stride_dvn, stride_dvh, stride_dvd, stride_slope_b, stride_slope_h, nheads, total_q, left, right,
                 qk_scale, softcap, softmax_scale, threshold, dropout_scale):
        keep_all(self, dict(locals()))


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


@aggregate
class DkdvTile:
    """What each Q block step of a dK/dV program reads (_dkdv_program's names): its K/V block and keys,
    the head's Q, dO, LSE and delta, the sequence's lengths and mask bounds, the score mods' and dropout's
    scalars."""

    k: VALUE
    v: VALUE
    q_base: VALUE
    do_base: VALUE
    tma_b: VALUE
    tma_row0: VALUE
    h: VALUE
    lse_base: VALUE
    delta_base: VALUE
    start_n: VALUE
    offs_n: VALUE
    sq: VALUE
    mod_args: ModArgs  # the score and mask mods' scalars
    stride_qm: VALUE
    stride_dom: VALUE
    q_doffs: VALUE
    do_doffs: VALUE
    d_mask: VALUE
    bh: VALUE
    threshold: VALUE
    dropout_scale: VALUE

    @triton.constexpr_function
    def __init__(self, k, v, q_base, do_base, tma_b, tma_row0, h, lse_base, delta_base, start_n, offs_n, sq, mod_args,
                 stride_qm, stride_dom, q_doffs, do_doffs, d_mask, bh, threshold, dropout_scale):
        keep_all(self, dict(locals()))


@triton.jit
def _dkdv_step(dk, dv, start_m, tile, q_desc, do_desc, seed, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
               MODS: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """One Q block against the fixed K/V block, in the transposed (keys x rows) orientation."""
    mod_args = tile.mod_args
    k, v, q_base, do_base, tma_b, tma_row0 = tile.k, tile.v, tile.q_base, tile.do_base, tile.tma_b, tile.tma_row0
    h, lse_base, delta_base, start_n, offs_n = tile.h, tile.lse_base, tile.delta_base, tile.start_n, tile.offs_n
    sq, diag_offset, left, right = tile.sq, mod_args.diag_offset, mod_args.left, mod_args.right
    qk_scale, softcap, slope, stride_qm = mod_args.qk_scale, mod_args.softcap, mod_args.slope, tile.stride_qm
    stride_dom, q_doffs, do_doffs, d_mask, bh = tile.stride_dom, tile.q_doffs, tile.do_doffs, tile.d_mask, tile.bh
    threshold, dropout_scale = tile.threshold, tile.dropout_scale
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
                               diag_offset, MODS)
    p_t = tl.exp2(s2_t - lse2[None, :])
    # Bounds need no mask here: rows past sq load zeros with an LSE of +inf, so P = 0 there; keys
    # past sk only reach their own dK/dV rows, which are never stored.
    if MASKED and (MODS.left or MODS.right):
        ok = in_window(offs_m[None, :], offs_n[:, None], diag_offset, left, right, MODS)
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
def _dkdv_program(start_n, b, hk, q_start, k_start, group, sq, sk, seed, args, q_desc, do_desc,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  MODS: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  PDL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """dK, dV of keys [start_n, start_n + BLOCK_N) of K/V head hk, summed over its query heads.

    sq, sk: this sequence's rows and keys, which start at rows q_start / k_start of the tensors.
    PDL: launched as a programmatic dependent of the dQ launch that writes Delta; K and V are
    loaded while that launch drains, and gdc_wait holds the loop until its writes are visible."""
    diag_offset = sk - sq
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = head_dim_mask(offs_d, HEAD_DIM, EVEN_D)
    kv_mask = (offs_n[:, None] < sk) & d_mask
    k = tl.load(args.K + b.to(tl.int64) * args.stride_kb + hk.to(tl.int64) * args.stride_kh
                + (k_start + offs_n)[:, None].to(tl.int64) * args.stride_kn + offs_d[None, :] * args.stride_kd,
                mask=kv_mask, other=0.0)
    v = tl.load(args.V + b.to(tl.int64) * args.stride_vb + hk.to(tl.int64) * args.stride_vh
                + (k_start + offs_n)[:, None].to(tl.int64) * args.stride_vn + offs_d[None, :] * args.stride_vd,
                mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if PDL:
        gdc_wait()
    q_doffs = offs_d[None, :] * args.stride_qd
    do_doffs = offs_d[None, :] * args.stride_dod
    tma_b = b
    if IS_VARLEN:
        tma_b = 0

    # Rows that can see this key block: the block_range of keys-over-rows (offset and sides swap).
    lo, full_lo, full_hi, hi = block_range(start_n, BLOCK_N, BLOCK_M, sq, -diag_offset, args.right, args.left,
                                           MODS.right, MODS.left)
    n_heads = group
    if IS_VARLEN:  # a key block past its sequence's end (the grid covers the longest) does nothing
        n_heads = tl.where(start_n < sk, group, 0)
    for g in range(0, n_heads):
        h = hk * group + g
        bh = b * args.nheads + h
        slope = 0.0
        if MODS.alibi:
            slope = tl.load(args.Slopes + b * args.stride_slope_b + h * args.stride_slope_h)
        q_base = (args.Q + b.to(tl.int64) * args.stride_qb + h.to(tl.int64) * args.stride_qh
                  + tl.cast(q_start, tl.int64) * args.stride_qm)
        do_base = (args.dO + b.to(tl.int64) * args.stride_dob + h.to(tl.int64) * args.stride_doh
                   + tl.cast(q_start, tl.int64) * args.stride_dom)
        row_base = lse_row_base(b, h, args.nheads, sq, q_start, args.total_q, IS_VARLEN)
        lse_base = args.Lse + row_base
        delta_base = args.Delta + row_base
        tile = DkdvTile(k, v, q_base, do_base, tma_b, q_start, h, lse_base, delta_base, start_n, offs_n, sq,
                        ModArgs(sk, diag_offset, args.left, args.right, args.qk_scale, args.softcap, slope),
                        args.stride_qm, args.stride_dom, q_doffs, do_doffs, d_mask, bh, args.threshold,
                        args.dropout_scale)
        for phase in tl.static_range(3):  # masked blocks, those every row sees whole, masked blocks
            first, last = phase_blocks(phase, lo, full_lo, full_hi, hi)
            for start_m in range(first, last, BLOCK_M):
                dk, dv = _dkdv_step(dk, dv, start_m, tile, q_desc, do_desc, seed, BLOCK_M, BLOCK_N, BLOCK_D,
                                    phase != 1, EVEN_D, USE_TMA, MODS, DOT_PRECISION, HAS_DROPOUT)

    dk = dk * args.softmax_scale
    if HAS_DROPOUT:
        dv = dv * args.dropout_scale
    tl.store(args.dK + b.to(tl.int64) * args.stride_dkb + hk.to(tl.int64) * args.stride_dkh
             + (k_start + offs_n)[:, None].to(tl.int64) * args.stride_dkn + offs_d[None, :] * args.stride_dkd,
             dk.to(args.dK.dtype.element_ty), mask=kv_mask)
    tl.store(args.dV + b.to(tl.int64) * args.stride_dvb + hk.to(tl.int64) * args.stride_dvh
             + (k_start + offs_n)[:, None].to(tl.int64) * args.stride_dvn + offs_d[None, :] * args.stride_dvd,
             dv.to(args.dV.dtype.element_ty), mask=kv_mask)


@aggregate
class DqTile:
    """What each K/V block step of a dQ program reads (_dq_program's names): its Q, dO, LSE and delta
    rows, the head's K and V, the sequence's keys and mask bounds, the score mods' and dropout's scalars."""

    q: VALUE
    do: VALUE
    lse2: VALUE
    delta: VALUE
    k_base: VALUE
    v_base: VALUE
    tma_b: VALUE
    tma_row0: VALUE
    hk: VALUE
    start_m: VALUE
    offs_m: VALUE
    mod_args: ModArgs  # the score and mask mods' scalars
    stride_kn: VALUE
    stride_vn: VALUE
    k_doffs: VALUE
    v_doffs: VALUE
    d_mask: VALUE
    bh: VALUE
    threshold: VALUE
    dropout_scale: VALUE

    @triton.constexpr_function
    def __init__(self, q, do, lse2, delta, k_base, v_base, tma_b, tma_row0, hk, start_m, offs_m, mod_args, stride_kn,
                 stride_vn, k_doffs, v_doffs, d_mask, bh, threshold, dropout_scale):
        keep_all(self, dict(locals()))


@triton.jit
def _dq_step(dq, start_n, tile, k_desc, v_desc, seed, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             MASKED: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, MODS: tl.constexpr,
             DOT_PRECISION: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """One K/V block against the fixed Q block."""
    mod_args = tile.mod_args
    q, do, lse2, delta, k_base, v_base = tile.q, tile.do, tile.lse2, tile.delta, tile.k_base, tile.v_base
    tma_b, tma_row0, hk, start_m, offs_m = tile.tma_b, tile.tma_row0, tile.hk, tile.start_m, tile.offs_m
    sk, diag_offset, left, right = mod_args.sk, mod_args.diag_offset, mod_args.left, mod_args.right
    qk_scale, softcap, slope, stride_kn = mod_args.qk_scale, mod_args.softcap, mod_args.slope, tile.stride_kn
    stride_vn, k_doffs, v_doffs, d_mask, bh = tile.stride_vn, tile.k_doffs, tile.v_doffs, tile.d_mask, tile.bh
    threshold, dropout_scale = tile.threshold, tile.dropout_scale
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
                           diag_offset, MODS)
    p = tl.exp2(s2 - lse2[:, None])
    if MASKED:
        ok = visible(offs_m[:, None], offs_n[None, :], diag_offset, sk, left, right, MODS)
        p = tl.where(ok, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
    if HAS_DROPOUT:
        BLOCK_M: tl.constexpr = offs_m.shape[0]
        keep = dropout_keep(seed, bh, start_m, BLOCK_M, start_n, BLOCK_N, threshold, False)
        dp = tl.where(keep, dp * dropout_scale, 0.0)
    ds = p * (dp - delta[:, None]) * dcap
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)


@triton.jit
def _dq_program(start_m, b, h, hk, q_start, k_start, sq, sk, seed, args, k_desc, v_desc,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                MODS: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                WRITE_DELTA: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr, DQ_ADD: tl.constexpr):
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
    q = tl.load(args.Q + b.to(tl.int64) * args.stride_qb + h.to(tl.int64) * args.stride_qh
                + rows * args.stride_qm + offs_d[None, :] * args.stride_qd, mask=row_mask, other=0.0)
    do = tl.load(args.dO + b.to(tl.int64) * args.stride_dob + h.to(tl.int64) * args.stride_doh
                 + rows * args.stride_dom + offs_d[None, :] * args.stride_dod, mask=row_mask, other=0.0)
    row_base = lse_row_base(b, h, args.nheads, sq, q_start, args.total_q, IS_VARLEN)
    if WRITE_DELTA:
        o = tl.load(args.Out + b.to(tl.int64) * args.stride_ob + h.to(tl.int64) * args.stride_oh
                    + rows * args.stride_om + offs_d[None, :] * args.stride_od, mask=row_mask, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(args.Delta + row_base + offs_m, delta, mask=offs_m < sq)
        lse2 = _load_lse2(args.Lse + row_base, offs_m, sq, True)
    else:
        lse2, delta = _load_rows(args.Lse + row_base, args.Delta + row_base, offs_m, sq, True)
    slope = 0.0
    if MODS.alibi:
        slope = tl.load(args.Slopes + b * args.stride_slope_b + h * args.stride_slope_h)
    k_base = (args.K + b.to(tl.int64) * args.stride_kb + hk.to(tl.int64) * args.stride_kh
              + tl.cast(k_start, tl.int64) * args.stride_kn)
    v_base = (args.V + b.to(tl.int64) * args.stride_vb + hk.to(tl.int64) * args.stride_vh
              + tl.cast(k_start, tl.int64) * args.stride_vn)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_doffs = offs_d[None, :] * args.stride_kd
    v_doffs = offs_d[None, :] * args.stride_vd
    tma_b = b
    if IS_VARLEN:
        tma_b = 0
    bh = b * args.nheads + h

    lo, full_lo, full_hi, hi = block_range(start_m, BLOCK_M, BLOCK_N, sk, diag_offset, args.left, args.right,
                                           MODS.left, MODS.right)
    if IS_VARLEN:  # a row block past its sequence's end (the grid covers the longest) does nothing
        hi = tl.where(start_m < sq, hi, lo)
        full_lo = tl.minimum(full_lo, hi)
        full_hi = tl.minimum(full_hi, hi)
    tile = DqTile(q, do, lse2, delta, k_base, v_base, tma_b, k_start, hk, start_m, offs_m,
                  ModArgs(sk, diag_offset, args.left, args.right, args.qk_scale, args.softcap, slope), args.stride_kn,
                  args.stride_vn, k_doffs, v_doffs, d_mask, bh, args.threshold, args.dropout_scale)
    for phase in tl.static_range(3):  # masked blocks, those every row sees whole, masked blocks
        first, last = phase_blocks(phase, lo, full_lo, full_hi, hi)
        for start_n in range(first, last, BLOCK_N):
            dq = _dq_step(dq, start_n, tile, k_desc, v_desc, seed, BLOCK_N, BLOCK_D, phase != 1, EVEN_D, USE_TMA,
                          MODS, DOT_PRECISION, HAS_DROPOUT)

    dq_ptrs = args.dQ + b.to(tl.int64) * args.stride_dqb + h.to(tl.int64) * args.stride_dqh + rows * args.stride_dqm \
        + offs_d[None, :] * args.stride_dqd
    if DQ_ADD:  # unscaled, into the caller's sum; the program owns these rows: no other adds to them
        dq += tl.load(dq_ptrs, mask=row_mask, other=0.0)
    else:
        dq = dq * args.softmax_scale
    tl.store(dq_ptrs, dq.to(args.dQ.dtype.element_ty), mask=row_mask)


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
    PDL: tl.constexpr, MODS: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr, HAS_DROPOUT: tl.constexpr, DQ_ADD: tl.constexpr,
):
    """Grid of n_programs x (batch x kv heads) in the order of ops.schedule.head_chunked_order. With
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
    args = BwdArgs(Q, K, V, dO, Out, Lse, Delta, dQ, dK, dV, Slopes,
                   stride_qb, stride_qm, stride_qh, stride_qd, stride_kb, stride_kn, stride_kh, stride_kd,
                   stride_vb, stride_vn, stride_vh, stride_vd, stride_dob, stride_dom, stride_doh, stride_dod,
                   stride_ob, stride_om, stride_oh, stride_od, stride_dqb, stride_dqm, stride_dqh, stride_dqd,
                   stride_dkb, stride_dkn, stride_dkh, stride_dkd, stride_dvb, stride_dvn, stride_dvh, stride_dvd,
                   stride_slope_b, stride_slope_h, nheads, total_q, left, right, qk_scale, softcap,
                   softmax_scale, threshold, dropout_scale)
    if is_dkdv:
        _dkdv_program(pid * BLOCK_N1, b, hk, q_start, k_start, group, sq, sk, seed, args, Q_desc, dO_desc,
                      HEAD_DIM, BLOCK_D, BLOCK_M1, BLOCK_N1, MODS, EVEN_D, DKDV_TMA, DOT_PRECISION, PDL,
                      IS_VARLEN, HAS_DROPOUT)
    else:
        # Consecutive programs take the group's heads for one Q block. With a right-bounded mask
        # (causal) the last Q blocks see the most keys, so they go first and the short ones fill
        # the tail.
        if PDL:
            gdc_launch_dependents()
        j = pid - first_dq
        pid_m = j // group
        if MODS.right:
            pid_m = m_blocks - 1 - pid_m
        h = hk * group + j % group
        _dq_program(pid_m * BLOCK_M2, b, h, hk, q_start, k_start, sq, sk, seed, args, K_desc, V_desc,
                    HEAD_DIM, BLOCK_D, BLOCK_M2, BLOCK_N2, MODS, EVEN_D, DQ_TMA, DOT_PRECISION, WRITE_DELTA,
                    IS_VARLEN, HAS_DROPOUT, DQ_ADD)


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


def plan(env: list, softmax_scale: float, window: tuple, softcap: float, varlen, dropout, accumulate_dq: bool,
         zero_grads: bool) -> BackwardPlan:
    """The launches of _bwd_kernel (and of the delta preprocess where both kinds of programs share
    a grid) for the call whose tensors are env (ops.prefill.backward_tensors, as distinct() made
    it); varlen and dropout hold env's tensors. Buffers the launches share are made in env here as
    each call makes them (the plan records their sizes)."""
    dout, q, k, v, out, lse, dq, dk, dv, delta, alibi_slopes = env[:SLOPES + 1]
    h, d = q.shape[-2:]
    b, sq, sk = grid_lengths(q, k, varlen)
    qk_scale, _ = kernel_scale(softmax_scale, softcap)
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
                 BLOCK_M2=cfg.dq.block_m, BLOCK_N2=cfg.dq.block_n, MODS=Mods.of(window, softcap, alibi_slopes),
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

