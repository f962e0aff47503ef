"""Flash-Decoding: split-KV attention over a contiguous or paged KV cache, then an LSE merge.

Three kernels, each a plain stream over HBM:
  _split_kernel    one program per (split, kv head [x M block], batch): the query rows of every head
                   that shares the kv head are packed into one tile (GQA packing), so each KV byte
                   is read once; it writes a partial (out, lse) per split, in fp32 - or, with one
                   split, the final output directly. New k/v rows (rotary applied to k) are
                   written into the cache, through the page table, by the same launch (APPEND):
                   each program writes those it reads, before it reads them
  _split_kernel_warps  the same launch in Gluon, each warp on keys of its own (sm_90, 16-bit
                   d=64/128; a grid of at most one program an SM before it splits, or rows of
                   >= 8 tiles: configs.decode_warp_tiles); the same helpers, append and epilogue
  _combine_kernel  out = sum_s exp(lse_s - lse) out_s with lse = logsumexp_s lse_s (seed 004's
                   kernel 2); splits with lse = -inf (nothing seen) contribute nothing. Up to
                   configs.DECODE_FUSED_MAX_SPLITS splits the split kernel's last program of a row
                   merges instead (FUSED_COMBINE); above, on sm_90, the combine kernel is a
                   programmatic dependent launch of the split kernel (no launch gap between them)

An attention sink (HAS_SINK: a per-head logit with no value) joins each row once: in the split
kernel's epilogue with one split, else as the merge's starting state (out 0, lse = the sink) -
never once per split.

Positions: a batch row b attends logical keys j in [0, seqlen_k) with
seqlen_k = cache_seqlens[b] - leftpad[b] + seqlen_new (flash-attn 2.x); key j lives in cache row
leftpad[b] + j ("physical" position), in page block_table[b, pos // page_size] when paged. The KV
loop walks physical positions so tiles never straddle a page boundary when page_size % BLOCK_N == 0.

Host side: plan() packs everything that is the same for every layer of a decoding step (tiles,
split count, the index tensors and their strides, the partial buffers) into prepared launches once
(api.DecodePlan holds it); decode_attention adds one layer's q, k/v and cache.
Index values are checked by the API on the host; the kernels clamp them regardless (see
_split_kernel), so values the API cannot read (CUDA-graph capture) never reach outside a tensor.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashtile.ops import configs
from flashtile.ops._launch import Prepared, cdiv, current_stream, next_pow2
from flashtile.ops.host import dot_precision
from flashtile.ops.masks import visible
from flashtile.ops.mods import alibi_strides, kernel_scale, scores_log2
from flashtile.ops.softmax import LN2, LOG2E, exp_minus, fold_sink


@triton.jit
def _load_rope(rows, offs_d, stride_d, mask, Cos, Sin, stride_cr, stride_cc, stride_sr, stride_sc,
               pos, rotary_len, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Rows (R, BLOCK_D) as fp32, rotary embedding at positions pos (R,) on the first ROTARY_DIM dims.

    rows: (R, 1) pointers to each row's first element. Interleaved (GPT-J) rotates pairs
    (2i, 2i+1) by angle i; otherwise (GPT-NeoX) pairs (i, i + ROTARY_DIM/2). Each output element
    needs its partner element, loaded as a second gather of the same rows. A position outside the
    tables' rotary_len rows (possible only under CUDA-graph capture, where the API cannot check
    the lengths) is left unrotated rather than read out of bounds.
    """
    x = tl.load(rows + offs_d[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    if ROTARY_DIM > 0:
        HALF: tl.constexpr = ROTARY_DIM // 2
        if INTERLEAVED:
            first = offs_d % 2 == 0
            partner = offs_d ^ 1
            angle = offs_d // 2
        else:
            first = offs_d < HALF
            partner = tl.where(first, offs_d + HALF, offs_d - HALF)
            angle = tl.where(first, offs_d, offs_d - HALF)
        rot = mask & (offs_d[None, :] < ROTARY_DIM) & ((pos >= 0) & (pos < rotary_len))[:, None]
        xp = tl.load(rows + partner[None, :] * stride_d, mask=rot, other=0.0).to(tl.float32)
        # outside the rotary dims cos = 1, sin = 0 and xp = 0, so x passes through unchanged
        cos = tl.load(Cos + pos[:, None] * stride_cr + angle[None, :] * stride_cc, mask=rot, other=1.0)
        sin = tl.load(Sin + pos[:, None] * stride_sr + angle[None, :] * stride_sc, mask=rot, other=0.0)
        x = x * cos.to(tl.float32) + tl.where(first[None, :], -xp, xp) * sin.to(tl.float32)
    return x


# Cache lengths that are ints (an int cache_seqlens; the capacity of a cache that grows every step,
# as transformers' dynamic cache) and the cache's batch change from call to call: Triton would
# compile another variant whenever one becomes a multiple of 16 or 1. They never enter an address's
# alignment, so they are not specialised on.
_LENGTHS = ("seqlen_const", "capacity", "cache_rows")


@triton.jit
def _cache_rows(pos, first, ok, table, cache_rows, stride_kb, stride_kn, stride_vb, stride_vn, stride_tp,
                PAGE_SIZE: tl.constexpr, ONE_PAGE: tl.constexpr):
    """(ok, k_rows, v_rows) for cache positions pos (R,) of one sequence: the offsets of their rows
    in K and V, through the page table `table` when paged, where ok loses the positions on a page
    outside k_cache (cache_rows pages). ONE_PAGE: every position lies on the page of position
    `first`, whose index is read once."""
    if PAGE_SIZE > 0:
        if ONE_PAGE:
            page = tl.load(table + (first // PAGE_SIZE) * stride_tp)
        else:
            page = tl.load(table + (pos // PAGE_SIZE) * stride_tp, mask=ok, other=0)
        ok = ok & (page >= 0) & (page < cache_rows)
        k_rows = page.to(tl.int64) * stride_kb + (pos % PAGE_SIZE) * stride_kn
        v_rows = page.to(tl.int64) * stride_vb + (pos % PAGE_SIZE) * stride_vn
    else:
        k_rows = pos.to(tl.int64) * stride_kn
        v_rows = pos.to(tl.int64) * stride_vn
    return ok, k_rows, v_rows


@triton.jit
def _append_rows(KNew, VNew, K, V, table, n_cache, t_first, t_last, capacity, cache_rows, rows_ok,
                 stride_nt, stride_nd, stride_wt, stride_wd, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn,
                 stride_vd, stride_tp, Cos, Sin, stride_cr, stride_cc, stride_sr, stride_sc, rotary_len, offs_t0,
                 offs_d, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr, EVEN_D: tl.constexpr):
    """Write new rows of one (batch, kv head): KNew[t] -> cache position n_cache + t (rotary at that
    position), VNew[t] likewise, for t in [t_first, t_last), BLOCK_T at a time.

    K, V: the cache at this kv head (and, contiguous, at this sequence); table: this row's page
    table. rows_ok: False for a sequence outside k_cache. A row at a position outside
    [0, capacity) or on a page outside k_cache is not written (see _split_kernel). offs_t0 =
    arange(BLOCK_T) and offs_d = arange(BLOCK_D), in the layouts of the calling kernel's (BLOCK_T,
    BLOCK_D) tile (Triton's or a Gluon kernel's: everything here is shaped by them).
    """
    for t0 in tl.range(t_first, t_last, BLOCK_T, num_stages=1):  # not pipelined: no shared memory of its own
        offs_t = t0 + offs_t0
        pos = n_cache + offs_t
        ok = (offs_t < t_last) & (pos >= 0) & (pos < capacity) & rows_ok
        ok, k_rows, v_rows = _cache_rows(pos, n_cache + t0, ok, table, cache_rows, stride_kb, stride_kn, stride_vb,
                                         stride_vn, stride_tp, PAGE_SIZE, False)
        mask = ok[:, None]
        if not EVEN_D:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        k = _load_rope(KNew + offs_t[:, None] * stride_nt, offs_d, stride_nd, mask, Cos, Sin, stride_cr, stride_cc,
                       stride_sr, stride_sc, pos, rotary_len, ROTARY_DIM, ROTARY_INTERLEAVED)
        v = tl.load(VNew + offs_t[:, None] * stride_wt + offs_d[None, :] * stride_wd, mask=mask)
        tl.store(K + k_rows[:, None] + offs_d[None, :] * stride_kd, k.to(K.dtype.element_ty), mask=mask)
        tl.store(V + v_rows[:, None] + offs_d[None, :] * stride_vd, v, mask=mask)


@triton.jit
def _split_keys(Seqlens, LeftPad, BatchIdx, b, split, start_m, seqlen_const, seqlen_q, seqlen_new, capacity,
                cache_rows, num_splits, left, right, stride_sl, stride_lp, stride_bi, GROUP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr):
    """What a split program of (batch b, M block at start_m) reads, in either split kernel: (n_given,
    n_cache, pad, cb, cb_ok, seqlen_k, diag_offset, lo, hi, blk_start, blk_end). The keys any row of
    the M block can see are the logical [lo - pad, hi - pad), physical [lo, hi); this split's share is
    tiles [blk_start, blk_end) of BLOCK_N physical positions. Every index is clamped into the tensors
    it addresses (_split_kernel's docstring)."""
    if HAS_SEQLENS:
        n_given = tl.load(Seqlens + b * stride_sl)
        n_cache = tl.minimum(tl.maximum(n_given, 0), capacity)
    else:
        n_given = seqlen_const  # a host int: always checked
        n_cache = n_given
    pad = 0
    if HAS_LEFTPAD:
        pad = tl.minimum(tl.maximum(tl.load(LeftPad + b * stride_lp), 0), n_cache)
    cb = b
    cb_ok = True
    if HAS_BATCH_IDX:  # contiguous caches only (the API rejects it with a block_table)
        cb = tl.load(BatchIdx + b * stride_bi)
        cb_ok = (cb >= 0) & (cb < cache_rows)  # if not, the row gets no keys (below): nothing is read
    seqlen_k = n_cache - pad + seqlen_new
    diag_offset = seqlen_k - seqlen_q

    lo = 0
    hi = seqlen_k
    if HAS_LEFT:
        lo = tl.maximum(start_m // GROUP + diag_offset - left, 0)
    if HAS_RIGHT:
        last_i = tl.minimum((start_m + BLOCK_M - 1) // GROUP, seqlen_q - 1)
        hi = tl.minimum(hi, tl.maximum(last_i + diag_offset + right + 1, 0))
    hi = tl.minimum(hi + pad, capacity)
    if HAS_BATCH_IDX:
        hi = tl.where(cb_ok, hi, 0)  # a sequence outside k_cache: no keys
    lo = tl.minimum(lo + pad, hi)  # 0 <= lo <= hi <= capacity: every tile starts inside the cache
    first_blk = lo // BLOCK_N
    n_blk = tl.cdiv(hi, BLOCK_N) - first_blk
    per_split = tl.cdiv(n_blk, num_splits)
    blk_start = first_blk + split * per_split
    blk_end = tl.minimum(blk_start + per_split, first_blk + n_blk)
    return n_given, n_cache, pad, cb, cb_ok, seqlen_k, diag_offset, lo, hi, blk_start, blk_end


@triton.jit
def _split_append(Knew, Vnew, K, V, table, b, kh, split, start_m, n_given, n_cache, lo, hi, blk_start, blk_end,
                  seqlen_new, capacity, cache_rows, cb_ok, stride_nb, stride_nt, stride_nh, stride_nd, stride_wb,
                  stride_wt, stride_wh, stride_wd, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd,
                  stride_tp, Cos, Sin, stride_cr, stride_cc, stride_sr, stride_sc, rotary_len, offs_t0, offs_d,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr, EVEN_D: tl.constexpr):
    """APPEND, in either split kernel: before its loop a program writes the new rows its split reads
    into the cache, and the programs of split 0, M block 0 write every new row (one a window hides
    from every query is still appended); the caller's barrier then makes them visible to all its
    threads (_split_kernel's docstring). K, V: the cache at this kv head (contiguous: and sequence)."""
    t_first = tl.maximum(tl.maximum(blk_start * BLOCK_N, lo) - n_cache, 0)
    t_last = tl.minimum(tl.minimum(blk_end * BLOCK_N, hi) - n_cache, seqlen_new)
    if (split == 0) & (start_m == 0):
        t_first = 0
        t_last = seqlen_new
    _append_rows(Knew + b.to(tl.int64) * stride_nb + kh * stride_nh, Vnew + b.to(tl.int64) * stride_wb + kh * stride_wh,
                 K, V, table, n_given, t_first, t_last, capacity, cache_rows, cb_ok, stride_nt, stride_nd, stride_wt,
                 stride_wd, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_tp, Cos, Sin,
                 stride_cr, stride_cc, stride_sr, stride_sc, rotary_len, offs_t0, offs_d, HEAD_DIM, BLOCK_T,
                 PAGE_SIZE, ROTARY_DIM, ROTARY_INTERLEAVED, EVEN_D)


@triton.jit(do_not_specialize=_LENGTHS)
def _split_kernel(
    Q, K, V, Knew, Vnew, Out, Lse, OutF, LseF, Arrivals, Sink, Seqlens, BatchIdx, LeftPad, BlockTable, Slopes,
    Cos, Sin,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_nb, stride_nt, stride_nh, stride_nd,
    stride_wb, stride_wt, stride_wh, stride_wd,
    stride_os, stride_ob, stride_om, stride_oh, stride_od,
    stride_ls, stride_lb, stride_lh, stride_lm,
    stride_fb, stride_fm, stride_fh, stride_fd, stride_gb, stride_gh, stride_gm,
    stride_sl, stride_bi, stride_lp, stride_tb, stride_tp, stride_slope_b, stride_slope_h,
    stride_cr, stride_cc, stride_sr, stride_sc,
    seqlen_const, seqlen_q, seqlen_new, capacity, cache_rows, rotary_len, m_blocks, num_splits,
    left, right, qk_scale, softcap,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr,
    ROTARY_BY_ROW: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    HAS_ALIBI: tl.constexpr, FUSED_COMBINE: tl.constexpr, MERGE_UNROLL: tl.constexpr, HAS_SINK: tl.constexpr,
    APPEND: tl.constexpr, BLOCK_T: tl.constexpr, LAUNCH_COMBINE: tl.constexpr,
):
    """Attention of one (batch, kv head, M block) over one split of its keys, after appending
    Knew/Vnew (b, seqlen_new, hk, d) at cache positions cache_seqlens[b] + t (APPEND).

    Grid (num_splits, nheads_k * m_blocks, batch). Tile row r is query i = r // GROUP of head
    kv_head * GROUP + r % GROUP. Out/Lse are the partials (num_splits, b, sq, h, d) fp32 and
    (num_splits, b, h, sq), or with one split the final (b, sq, h, d) and (b, h, sq) (stride_os =
    stride_ls = 0): both get the normalised output and the natural-log LSE, -inf for empty rows.
    With FUSED_COMBINE the last program of a (batch, kv head, M block) to finish its split merges
    every split's partial into OutF (b, sq, h, d) and LseF (b, h, sq) (_merge_splits): Arrivals
    holds one zeroed int32 counter per (batch, kv head, M block), and is left zeroed. HAS_SINK:
    Sink (h,) is added to the final rows (one split's, or the fused merge's), not to partials.
    APPEND: before its loop, each program writes the new rows its split reads into the cache
    (_append_rows), and the programs of split 0, M block 0 write every new row (one a window hides
    from every query is still appended); after a barrier the loop reads them back like any key: a
    program's own writes are visible to all its threads, and programs that write one row write the
    same bytes. No program waits for another. A slot one batch row appends into and another row
    reads (a page shared that far: the API rejects it) would be read before or after the write.

    The API checks the index values whenever it can read them; under CUDA-graph capture it cannot,
    so every index is clamped into the tensors it addresses: cache_seqlens to [0, capacity],
    cache_leftpad to [0, cache_seqlens], key positions to [0, capacity); a key on a page outside
    k_cache (cache_rows pages) reads nothing and counts as a key of zeros, and a cache_batch_idx
    outside k_cache (cache_rows sequences) leaves its row with no keys. New rows at positions outside [0, capacity), on pages
    outside k_cache or of a sequence outside it are not written. Such rows get an output that
    means nothing, but nothing outside the cache, the page table or the rotary tables is read or
    written.
    LAUNCH_COMBINE: the combine kernel follows as a programmatic dependent launch (sm_90): once
    every program has started, its programs may too, and wait (gdc_wait) for this launch's writes.
    """
    if LAUNCH_COMBINE:
        gdc_launch_dependents()
    split = tl.program_id(0)
    kh = tl.program_id(1) // m_blocks
    start_m = (tl.program_id(1) % m_blocks) * BLOCK_M
    b = tl.program_id(2)

    n_given, n_cache, pad, cb, cb_ok, seqlen_k, diag_offset, lo, hi, blk_start, blk_end = _split_keys(
        Seqlens, LeftPad, BatchIdx, b, split, start_m, seqlen_const, seqlen_q, seqlen_new, capacity, cache_rows,
        num_splits, left, right, stride_sl, stride_lp, stride_bi, GROUP, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT,
        HAS_SEQLENS, HAS_BATCH_IDX, HAS_LEFTPAD)

    rows = start_m + tl.arange(0, BLOCK_M)
    i = rows // GROUP
    head = kh * GROUP + rows % GROUP
    row_ok = rows < seqlen_q * GROUP
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = row_ok[:, None]
    if not EVEN_D:
        row_mask = row_mask & (offs_d[None, :] < HEAD_DIM)

    q_rows = Q + b.to(tl.int64) * stride_qb + (i * stride_qm + head * stride_qh)[:, None]
    if ROTARY_DIM > 0:
        # flash-attn: with a causal or local mask query i sits at position cache_seqlens + i,
        # otherwise every query row takes position cache_seqlens
        if ROTARY_BY_ROW:
            q_pos = n_cache + i
        else:
            q_pos = n_cache + i * 0
        q = _load_rope(q_rows, offs_d, stride_qd, row_mask, Cos, Sin, stride_cr, stride_cc,
                       stride_sr, stride_sc, q_pos, rotary_len, ROTARY_DIM, ROTARY_INTERLEAVED)
        q = q.to(Q.dtype.element_ty)
    else:
        q = tl.load(q_rows + offs_d[None, :] * stride_qd, mask=row_mask, other=0.0)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + b * stride_slope_b + head * stride_slope_h)[:, None]

    table = BlockTable  # None for a contiguous cache
    if PAGE_SIZE > 0:
        table = BlockTable + b.to(tl.int64) * stride_tb
    else:
        K = K + cb.to(tl.int64) * stride_kb
        V = V + cb.to(tl.int64) * stride_vb
    K = K + kh * stride_kh
    V = V + kh * stride_vh
    if APPEND:
        _split_append(Knew, Vnew, K, V, table, b, kh, split, start_m, n_given, n_cache, lo, hi, blk_start, blk_end,
                      seqlen_new, capacity, cache_rows, cb_ok, stride_nb, stride_nt, stride_nh, stride_nd, stride_wb,
                      stride_wt, stride_wh, stride_wd, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn,
                      stride_vd, stride_tp, Cos, Sin, stride_cr, stride_cc, stride_sr, stride_sc, rotary_len,
                      tl.arange(0, BLOCK_T), offs_d, HEAD_DIM, BLOCK_N, BLOCK_T, PAGE_SIZE, ROTARY_DIM,
                      ROTARY_INTERLEAVED, EVEN_D)
        tl.debug_barrier()  # this program's new rows are in the cache for all its threads

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(blk_start * BLOCK_N, blk_end * BLOCK_N, BLOCK_N):
        pos = start_n + tl.arange(0, BLOCK_N)
        key_ok = (pos >= lo) & (pos < hi)
        # with pages a multiple of the tile, the tile lies inside one page: one page index per tile.
        # A key on a page outside k_cache reads zeros but stays in the scores, so the page indices
        # are needed only in the layout of the tile's addresses
        read_ok, k_rows, v_rows = _cache_rows(pos, start_n, key_ok, table, cache_rows, stride_kb, stride_kn,
                                              stride_vb, stride_vn, stride_tp, PAGE_SIZE, PAGE_SIZE % BLOCK_N == 0)
        kv_mask = read_ok[:, None]
        if not EVEN_D:
            kv_mask = kv_mask & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(K + k_rows[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(V + v_rows[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32
        j = pos - pad  # logical key index
        s2, _ = scores_log2(qk, i[:, None], j[None, :], qk_scale, softcap, slope, diag_offset,
                            HAS_SOFTCAP, HAS_ALIBI)
        ok = key_ok[None, :]
        if HAS_LEFT or HAS_RIGHT:
            ok = ok & visible(i[:, None], j[None, :], diag_offset, seqlen_k, left, right, HAS_LEFT,
                              HAS_RIGHT)
        s2 = tl.where(ok, s2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        # a row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s2 - m_sub[:, None])  # P_tilde, (BLOCK_M, BLOCK_N)
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    _split_epilogue(acc, l_i, m_i, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), Out, Lse, OutF, LseF, Arrivals,
                    Sink, b, i, head, offs_d, row_ok, row_mask, split,
                    num_splits, stride_os, stride_ob, stride_om, stride_oh, stride_od, stride_ls, stride_lb,
                    stride_lh, stride_lm, stride_fb, stride_fm, stride_fh, stride_fd, stride_gb, stride_gh, stride_gm,
                    FUSED_COMBINE, MERGE_UNROLL, HAS_SINK)


@gluon.jit(do_not_specialize=_LENGTHS)
def _split_kernel_warps(
    Q, K, V, Knew, Vnew, Out, Lse, OutF, LseF, Arrivals, Sink, Seqlens, BatchIdx, LeftPad, BlockTable, Slopes,
    Cos, Sin,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_nb, stride_nt, stride_nh, stride_nd,
    stride_wb, stride_wt, stride_wh, stride_wd,
    stride_os, stride_ob, stride_om, stride_oh, stride_od,
    stride_ls, stride_lb, stride_lh, stride_lm,
    stride_fb, stride_fm, stride_fh, stride_fd, stride_gb, stride_gh, stride_gm,
    stride_sl, stride_bi, stride_lp, stride_tb, stride_tp, stride_slope_b, stride_slope_h,
    stride_cr, stride_cc, stride_sr, stride_sc,
    seqlen_const, seqlen_q, seqlen_new, capacity, cache_rows, rotary_len, m_blocks, num_splits,
    left, right, qk_scale, softcap,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr, ROTARY_DIM: gl.constexpr, ROTARY_INTERLEAVED: gl.constexpr,
    ROTARY_BY_ROW: gl.constexpr, DOT_PRECISION: gl.constexpr, EVEN_D: gl.constexpr,
    HAS_SEQLENS: gl.constexpr, HAS_BATCH_IDX: gl.constexpr, HAS_LEFTPAD: gl.constexpr,
    HAS_ALIBI: gl.constexpr, FUSED_COMBINE: gl.constexpr, MERGE_UNROLL: gl.constexpr, HAS_SINK: gl.constexpr,
    APPEND: gl.constexpr, BLOCK_T: gl.constexpr, LAUNCH_COMBINE: gl.constexpr, STAGES: gl.constexpr,
):
    """_split_kernel (same arguments, grid and outputs) with each warp on keys of its own: the
    Gluon form that configs.decode_warp_tiles picks where it measured faster (sm_90, fp16/bf16, d=64
    or 128, at most 16 query rows a program).

    _split_kernel's tl.dot spreads a tile's keys over its warps, so every tile's row max, row sum
    and P go between warps through shared memory: 9 barriers a tile, and a warp's chain of ~300
    instructions a tile is what bounds the loop (decode_probe.txt). Here warp w copies keys
    [start + w KW, start + (w + 1) KW) of each BLOCK_N-key tile into shared memory itself
    (cp.async, STAGES tiles in flight) and keeps its own online softmax over them: two barriers a
    tile (the ring's, and one Triton adds after the copies: it cannot tell the ring's slots apart),
    and the warps' states merge once, after the loop. The products are turned round, S^T = K
    Q^T and O^T = V^T P^T, so the query rows are the MMA's N side, 8 at a time: no rows padded to
    16, and P^T goes from the first product's accumulator into the second's operand in registers.
    Key ranges, the append, rotary, masks, pages and the epilogue are _split_kernel's, through the
    same helpers."""
    gl.static_assert(EVEN_D, "whole 16-byte rows only")
    W: gl.constexpr = gl.num_warps()
    KW: gl.constexpr = BLOCK_N // W  # keys a warp takes of each tile
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    copy_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 256 // HEAD_DIM, HEAD_DIM // 8], [W, 1, 1], [2, 1, 0])
    ring_l: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0])
    # the warps' states (W, rows, d), summed over W: a thread takes 4 rows of a column of every warp
    red_l: gl.constexpr = gl.BlockedLayout([W, 4, 1], [1, BLOCK_M // 4, 128 // BLOCK_M], [1, 1, W], [1, 2, 0])
    out_l: gl.constexpr = gl.SliceLayout(0, red_l)  # (rows, d)
    dtype: gl.constexpr = K.dtype.element_ty

    if LAUNCH_COMBINE:
        gdc_launch_dependents()
    split = gl.program_id(0)
    kh = gl.program_id(1) // m_blocks
    start_m = (gl.program_id(1) % m_blocks) * BLOCK_M
    b = gl.program_id(2)

    n_given, n_cache, pad, cb, cb_ok, seqlen_k, diag_offset, lo, hi, blk_start, blk_end = _split_keys(
        Seqlens, LeftPad, BatchIdx, b, split, start_m, seqlen_const, seqlen_q, seqlen_new, capacity, cache_rows,
        num_splits, left, right, stride_sl, stride_lp, stride_bi, GROUP, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT,
        HAS_SEQLENS, HAS_BATCH_IDX, HAS_LEFTPAD)
    n_tiles = gl.maximum(blk_end - blk_start, 0)

    table = BlockTable
    if PAGE_SIZE > 0:
        table = BlockTable + b.to(gl.int64) * stride_tb
    else:
        K = K + cb.to(gl.int64) * stride_kb
        V = V + cb.to(gl.int64) * stride_vb
    K = K + kh * stride_kh
    V = V + kh * stride_vh
    # a (rows or new keys, d) tile for the append and a rotated q: a row's 16-byte pieces across lanes
    rows_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 256 // HEAD_DIM, HEAD_DIM // 8], [1, W, 1], [2, 1, 0])
    if APPEND:
        _split_append(Knew, Vnew, K, V, table, b, kh, split, start_m, n_given, n_cache, lo, hi, blk_start, blk_end,
                      seqlen_new, capacity, cache_rows, cb_ok, stride_nb, stride_nt, stride_nh, stride_nd, stride_wb,
                      stride_wt, stride_wh, stride_wd, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn,
                      stride_vd, stride_tp, Cos, Sin, stride_cr, stride_cc, stride_sr, stride_sc, rotary_len,
                      gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, gl.SliceLayout(0, rows_l))),
                      gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(0, rows_l))), HEAD_DIM, BLOCK_N,
                      BLOCK_T, PAGE_SIZE, ROTARY_DIM, ROTARY_INTERLEAVED, EVEN_D)
        gl.thread_barrier()  # this program's new rows are in the cache for all its threads

    # Q^T (W, d, rows), every warp's the same: row r is query r // GROUP of head kh GROUP + r % GROUP
    if ROTARY_DIM > 0:
        # rotated as _split_kernel rotates it, in (rows, d), then turned into the operand's layout
        r_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, gl.SliceLayout(0, rows_l)))
        r_i = r_rows // GROUP
        r_ptr = Q + b.to(gl.int64) * stride_qb + (r_i * stride_qm + (kh * GROUP + r_rows % GROUP) * stride_qh)[:, None]
        if ROTARY_BY_ROW:
            q_pos = n_cache + r_i
        else:
            q_pos = n_cache + r_i * 0
        q2 = _load_rope(r_ptr, gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(0, rows_l))),
                        stride_qd, (r_rows < seqlen_q * GROUP)[:, None], Cos, Sin, stride_cr, stride_cc, stride_sr,
                        stride_sc, q_pos, rotary_len, ROTARY_DIM, ROTARY_INTERLEAVED)
        q3 = gl.expand_dims(q2.to(dtype), 0) + gl.zeros([W, BLOCK_M, HEAD_DIM], dtype, rows_l)
        q_t = gl.convert_layout(gl.permute(q3, (0, 2, 1)), b_op)
    else:
        q_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(1, b_op)))
        q_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(2, b_op)))
        q_w = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, b_op)))
        q_ptr = (Q + b.to(gl.int64) * stride_qb + (q_rows // GROUP) * stride_qm
                 + (kh * GROUP + q_rows % GROUP) * stride_qh)
        q_ok = (q_rows < seqlen_q * GROUP)[None, None, :] & (q_w < W)[:, None, None]
        q_t = gl.load(q_ptr[None, None, :] + (q_d * stride_qd)[None, :, None] + 0 * q_w[:, None, None], mask=q_ok,
                      other=0.0)

    # the rows and keys of the scores (W, KW, rows), for the masks
    s_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
    i = (s_rows // GROUP)[None, None, :]
    s_keys = (gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, mma)))[:, None] * KW
              + gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(2, mma)))[None, :])[:, :, None]
    slope = 0.0
    if HAS_ALIBI:
        slope = gl.load(Slopes + b * stride_slope_b + (kh * GROUP + s_rows % GROUP) * stride_slope_h)[None, None, :]

    # each warp's copy of its keys: key k of warp w is key w KW + k of a tile, (W, KW, 1); columns (1, 1, d)
    c_warp = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, copy_l)))[:, None, None] * KW
    c_keys = c_warp + gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(2, copy_l)))[None, :, None]
    c_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(1, copy_l)))[None, None, :]
    k_cols = c_keys.to(gl.int64) * stride_kn + c_d * stride_kd  # a contiguous cache's rows from a tile's first
    v_cols = c_keys.to(gl.int64) * stride_vn + c_d * stride_vd
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, W, KW, HEAD_DIM], ring_l)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, W, KW, HEAD_DIM], ring_l)
    for t in gl.static_range(STAGES - 1):
        if t < n_tiles:
            _copy_tile(K, V, k_ring.index(t), v_ring.index(t), table, (blk_start + t) * BLOCK_N, c_warp, c_keys, c_d,
                       k_cols, v_cols, lo, hi, cache_rows, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn,
                       stride_vd, stride_tp, PAGE_SIZE, BLOCK_N, KW)
        async_copy.commit_group()

    m_i = gl.full([W, BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
    l_i = gl.zeros([W, BLOCK_M], gl.float32, gl.SliceLayout(1, mma))
    acc = gl.zeros([W, HEAD_DIM, BLOCK_M], gl.float32, mma)
    for t in range(n_tiles):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()  # tile t is in, and every warp is done with the slot the copy below refills
        nxt = t + STAGES - 1
        if nxt < n_tiles:
            _copy_tile(K, V, k_ring.index(nxt % STAGES), v_ring.index(nxt % STAGES), table,
                       (blk_start + nxt) * BLOCK_N, c_warp, c_keys, c_d, k_cols, v_cols, lo, hi, cache_rows, stride_kb,
                       stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_tp, PAGE_SIZE, BLOCK_N, KW)
        async_copy.commit_group()
        slot = t % STAGES
        qk = mma_v2(k_ring.index(slot).load(a_op), q_t, gl.zeros([W, KW, BLOCK_M], gl.float32, mma))
        start = (blk_start + t) * BLOCK_N
        pos = start + s_keys
        s2, _ = scores_log2(qk, i, pos - pad, qk_scale, softcap, slope, diag_offset, HAS_SOFTCAP, HAS_ALIBI)
        if HAS_LEFT or HAS_RIGHT:
            ok = (pos >= lo) & (pos < hi) & visible(i, pos - pad, diag_offset, seqlen_k, left, right, HAS_LEFT,
                                                    HAS_RIGHT)
            s2 = gl.where(ok, s2, float("-inf"))
        elif (start < lo) | (start + BLOCK_N > hi):  # a tile with keys outside [lo, hi): the split's ends
            s2 = gl.where((pos >= lo) & (pos < hi), s2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s2, 1))
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s2 - gl.expand_dims(m_sub, 1))
        alpha = gl.exp2(m_i - m_sub)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = mma_v2(v_ring.index(slot).permute((0, 2, 1)).load(a_op), gl.convert_layout(p.to(dtype), b_op),
                     acc * gl.expand_dims(alpha, 1))
        m_i = m_new
    async_copy.wait_group(0)

    # the warps' states onto their common max, then summed over the warps through shared memory
    m = gl.max(m_i, 0)
    m_sub = gl.where(m == float("-inf"), 0.0, m)
    scale = gl.exp2(m_i - gl.expand_dims(m_sub, 0))
    l_sum = gl.convert_layout(gl.sum(l_i * scale, 0), gl.SliceLayout(1, out_l))
    m = gl.convert_layout(m, gl.SliceLayout(1, out_l))
    states = gl.allocate_shared_memory(gl.float32, [W, HEAD_DIM, BLOCK_M],
                                       gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0]))
    states.store(acc * gl.expand_dims(scale, 1))
    gl.thread_barrier()
    acc = gl.sum(states.permute((0, 2, 1)).load(red_l), 0)  # (rows, d)

    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_l))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_l))
    row_ok = rows < seqlen_q * GROUP
    _split_epilogue(acc, l_sum, m, gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, out_l), Out, Lse, OutF, LseF, Arrivals,
                    Sink, b, rows // GROUP, kh * GROUP + rows % GROUP,
                    offs_d, row_ok, row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], split, num_splits, stride_os,
                    stride_ob, stride_om, stride_oh, stride_od, stride_ls, stride_lb, stride_lh, stride_lm, stride_fb,
                    stride_fm, stride_fh, stride_fd, stride_gb, stride_gh, stride_gm, FUSED_COMBINE, MERGE_UNROLL,
                    HAS_SINK)


@gluon.jit
def _copy_tile(K, V, k_slot, v_slot, table, start, warp0, keys, cols, k_cols, v_cols, lo, hi, cache_rows, stride_kb,
               stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_tp, PAGE_SIZE: gl.constexpr,
               BLOCK_N: gl.constexpr, KW: gl.constexpr):
    """Start the copies of the tile of keys [start, start + BLOCK_N) into a ring slot of
    _split_kernel_warps: warp w's keys start + warp0 + [0, KW) (keys (W, KW, 1), warp0 (W, 1, 1)),
    columns cols (1, 1, d); k_cols / v_cols: a contiguous cache's offsets of those keys and columns
    from the tile's first. Paged, a warp whose KW keys lie on one page (KW divides the page size)
    reads its page index once, else each key its own. Keys outside [lo, hi), or on a page outside
    k_cache, copy zeros and read nothing; only the tiles at a split's ends have keys outside [lo, hi)."""
    if PAGE_SIZE > 0:
        pos = start + keys
        # a table slot past hi may lie past the table's row (the last tile of a capacity that is not
        # a whole number of tiles): not read, and its keys copy nothing
        if PAGE_SIZE % KW == 0:
            page = gl.load(table + ((start + warp0) // PAGE_SIZE) * stride_tp, mask=start + warp0 < hi, other=-1)
        else:
            page = gl.load(table + (pos // PAGE_SIZE) * stride_tp, mask=pos < hi, other=-1)
        page_ok = (page >= 0) & (page < cache_rows)
        k_ptrs = K + page.to(gl.int64) * stride_kb + (pos % PAGE_SIZE) * stride_kn + cols * stride_kd
        v_ptrs = V + page.to(gl.int64) * stride_vb + (pos % PAGE_SIZE) * stride_vn + cols * stride_vd
        if (start < lo) | (start + BLOCK_N > hi):
            ok = page_ok & (pos >= lo) & (pos < hi)
            async_copy.async_copy_global_to_shared(k_slot, k_ptrs, mask=ok)
            async_copy.async_copy_global_to_shared(v_slot, v_ptrs, mask=ok)
        else:
            async_copy.async_copy_global_to_shared(k_slot, k_ptrs, mask=page_ok)
            async_copy.async_copy_global_to_shared(v_slot, v_ptrs, mask=page_ok)
    else:
        k_ptrs = K + start.to(gl.int64) * stride_kn + k_cols
        v_ptrs = V + start.to(gl.int64) * stride_vn + v_cols
        if (start < lo) | (start + BLOCK_N > hi):
            pos = start + keys
            ok = (pos >= lo) & (pos < hi)
            async_copy.async_copy_global_to_shared(k_slot, k_ptrs, mask=ok)
            async_copy.async_copy_global_to_shared(v_slot, v_ptrs, mask=ok)
        else:
            async_copy.async_copy_global_to_shared(k_slot, k_ptrs)
            async_copy.async_copy_global_to_shared(v_slot, v_ptrs)


@triton.jit
def _split_epilogue(acc, l_i, m_i, zeros, Out, Lse, OutF, LseF, Arrivals, Sink, b, i, head, offs_d, row_ok, row_mask,
                    split,
                    num_splits, stride_os, stride_ob, stride_om, stride_oh, stride_od, stride_ls, stride_lb,
                    stride_lh, stride_lm, stride_fb, stride_fm, stride_fh, stride_fd, stride_gb, stride_gh, stride_gm,
                    FUSED_COMBINE: tl.constexpr, MERGE_UNROLL: tl.constexpr, HAS_SINK: tl.constexpr):
    """A split program's end, in either split kernel: its rows' (acc (rows, d), l_i, m_i), query i
    and head per row, normalised into its partial (or, with one split, the output) with their LSE;
    zeros: (rows, d) fp32 zeros in acc's layout, where the fused merge starts;
    with FUSED_COMBINE the last program of its row of splits then merges them (the kernel's
    docstring). Shaped by the caller's tensors, so a Gluon kernel passes its own layouts."""
    if HAS_SINK:
        if num_splits == 1:  # these rows are final; partials get the sink in the merge
            acc, l_i, m_i = fold_sink(acc, l_i, m_i, Sink, head)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    # this tile's rows in split 0's partials (or in the outputs, with one split)
    out_tile = Out + b.to(tl.int64) * stride_ob + (i * stride_om + head * stride_oh)[:, None] + offs_d[None, :] * stride_od
    lse_tile = Lse + b.to(tl.int64) * stride_lb + head * stride_lh + i * stride_lm
    tl.store(out_tile + split.to(tl.int64) * stride_os, out.to(Out.dtype.element_ty), mask=row_mask)
    tl.store(lse_tile + split.to(tl.int64) * stride_ls, lse, mask=row_ok)

    if FUSED_COMBINE:
        # Arrival counting (a split-K semaphore): every thread's partial stores are issued before
        # the barrier, and the counter's add releases them at GPU scope; the program that sees
        # num_splits - 1 arrivals before its own acquires every other program's partials.
        tl.debug_barrier()
        arrivals = Arrivals + b * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(arrivals, 0)  # zero again for the next launch
            out, lse = _merge_splits(out_tile, lse_tile, stride_os, stride_ls, num_splits, row_ok, row_mask,
                                     Sink, head, zeros, MERGE_UNROLL, HAS_SINK)
            OutF = OutF + b.to(tl.int64) * stride_fb
            tl.store(OutF + (i * stride_fm + head * stride_fh)[:, None] + offs_d[None, :] * stride_fd,
                     out.to(OutF.dtype.element_ty), mask=row_mask)
            tl.store(LseF + b.to(tl.int64) * stride_gb + head * stride_gh + i * stride_gm, lse, mask=row_ok)


@triton.jit
def _merge_splits(OutP, LseP, stride_s, stride_ls, num_splits, row_ok, row_mask, Sink, heads, acc,
                  UNROLL: tl.constexpr, HAS_SINK: tl.constexpr):
    """(out (rows, d), lse (rows,)) of split 0's partial tile at OutP / LseP merged with the
    num_splits - 1 after it (strides stride_s / stride_ls): the combine's online merge on one
    program's tile of rows. acc: zeros (rows, d) fp32 in the caller's layout (a Triton or a Gluon
    kernel: everything else here is shaped by heads, one per row). UNROLL splits per step, so their
    loads are in flight together. The partials were written by other programs of this launch:
    loads bypass L1 (.cg), which is not coherent across SMs. HAS_SINK: the merge starts from the
    sink Sink[heads] (out 0, lse = sink)."""
    l = (heads * 0).to(tl.float32)
    if HAS_SINK:
        m = tl.load(Sink + heads).to(tl.float32)
        l = l + 1.0
    else:
        m = l - float("inf")
    for s0 in range(0, num_splits, UNROLL):
        for t in tl.static_range(UNROLL):
            s = s0 + t
            lse = tl.load(LseP + s.to(tl.int64) * stride_ls, mask=row_ok & (s < num_splits), other=float("-inf"),
                          cache_modifier=".cg")
            # issued beside the LSE load, not after it: an empty split's tile (anything, NaN included)
            # is loaded too, and dropped by the select below
            o = tl.load(OutP + s.to(tl.int64) * stride_s, mask=row_mask & (s < num_splits), other=0.0,
                        cache_modifier=".cg")
            live = lse > float("-inf")
            m_new = tl.maximum(m, lse)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            w = exp_minus(lse, m_sub, LOG2E)
            alpha = exp_minus(m, m_sub, LOG2E)
            acc = acc * alpha[:, None] + tl.where(live[:, None], w[:, None] * o, 0.0)
            l = l * alpha + w
            m = m_new
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    return acc / l_safe[:, None], tl.where(empty, float("-inf"), m + tl.log(l_safe))


@triton.jit
def _combine_kernel(
    OutP, LseP, Out, Lse, Sink, num_splits, n1, n2,
    stride_ps, stride_p0, stride_p1, stride_p2, stride_pd,
    stride_qs, stride_q0, stride_q1, stride_q2,
    stride_o0, stride_o1, stride_o2, stride_od,
    stride_l0, stride_l1, stride_l2, stride_k0, stride_k1, stride_k2,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge the splits of one row (r0, r1, r2) over one BLOCK_D slice of its columns.

    Grid (rows, cdiv(d, BLOCK_D)) with rows = n0 * n1 * n2. Partials OutP (S, n0, n1, n2, d) and
    LseP (S, n0, n1, n2), any strides (the decode partials are (S, b, sq, h, d) and (S, b, h, sq),
    read through strides). An online merge over BLOCK_S splits at a time (usually one step).
    HAS_SINK: the merge starts from the row's sink (out 0, lse = Sink at strides stride_k*).
    PDL: launched as a programmatic dependent of the launch that writes the partials (the decoding
    split kernel): the programs start while that launch runs and wait for its writes before loading.
    """
    row = tl.program_id(0)
    r0 = row // (n1 * n2)
    r1 = (row // n2) % n1
    r2 = row % n2
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    LseP = LseP + r0.to(tl.int64) * stride_q0 + r1 * stride_q1 + r2 * stride_q2
    OutP = OutP + r0.to(tl.int64) * stride_p0 + r1 * stride_p1 + r2 * stride_p2

    if HAS_SINK:
        m = tl.load(Sink + r0.to(tl.int64) * stride_k0 + r1 * stride_k1 + r2 * stride_k2).to(tl.float32)
        l = tl.full([], 1.0, dtype=tl.float32)
    else:
        m = tl.full([], float("-inf"), dtype=tl.float32)
        l = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if PDL:
        gdc_wait()
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(LseP + offs_s.to(tl.int64) * stride_qs, mask=offs_s < num_splits,
                      other=float("-inf")).to(tl.float32)
        live = lse > float("-inf")
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = exp_minus(lse, m_sub, LOG2E)  # (BLOCK_S,), 0 for empty splits, 1 for +inf
        alpha = exp_minus(m, m_sub, LOG2E)
        # issued beside the LSE load, not after it: an empty split's row (anything, NaN included)
        # is loaded too, and dropped by the select below
        o = tl.load(OutP + offs_s.to(tl.int64)[:, None] * stride_ps + offs_d[None, :] * stride_pd,
                    mask=(offs_s < num_splits)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(tl.where(live[:, None], w[:, None] * o, 0.0), 0)
        l = l * alpha + tl.sum(w, 0)
        m = m_new

    empty = l == 0.0
    out = acc / tl.where(empty, 1.0, l)
    tl.store(Out + r0.to(tl.int64) * stride_o0 + r1 * stride_o1 + r2 * stride_o2 + offs_d * stride_od,
             out.to(Out.dtype.element_ty), mask=d_ok)
    lse_out = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l)))
    tl.store(Lse + r0.to(tl.int64) * stride_l0 + r1 * stride_l1 + r2 * stride_l2, lse_out,
             mask=tl.program_id(1) == 0)


# --------------------------------------------------------------------------------------------
# Launchers: a plan packs every argument that does not change between layers once; the per-call
# launchers add the layer's tensors
# --------------------------------------------------------------------------------------------

def prepare_combine(num_splits: int, d: int, rows: tuple, strides: tuple, has_sink: bool = False,
                    pdl: bool = False) -> Prepared:
    """The merge of partials (S, n0, n1, n2, d) / (S, n0, n1, n2) into out (n0, n1, n2, d) / lse
    (n0, n1, n2), rows = (n0, n1, n2); strides = the four tensors' strides in those dim orders, and
    the sink's over the rows (given apart from the tensors, so that a permuted or broadcast layout
    needs no view). The call passes the tensors (out_partial, lse_partial, out, lse, sink or None)
    and no scalars. pdl: a programmatic dependent launch of the kernel before it in the stream
    (_combine_kernel's PDL)."""
    n0, n1, n2 = rows
    cfg = configs.combine_config(num_splits, d)
    return Prepared(_combine_kernel, (n0 * n1 * n2, cdiv(d, cfg.block_d)), (), (num_splits, n1, n2, *strides),
                    cfg.num_warps, 3, pdl, HEAD_DIM=d, BLOCK_S=cfg.block_s, BLOCK_D=cfg.block_d, HAS_SINK=has_sink,
                    PDL=pdl)


def merge_states(out_partial: torch.Tensor, lse_partial: torch.Tensor, sink=None):
    """out_partial (S, *, d) fp16/bf16/fp32, lse_partial (S, *) fp32 -> out (*, d) in out_partial's
    dtype, lse (*) fp32 (the public merge_attention_states, checked by the API); sink: None or a
    float tensor broadcastable to (*), added once."""
    num_splits, d = out_partial.shape[0], out_partial.shape[-1]
    lead = tuple(out_partial.shape[1:-1])
    out = torch.empty(lead + (d,), dtype=out_partial.dtype, device=out_partial.device)
    lse = torch.empty(lead, dtype=torch.float32, device=out_partial.device)
    n = out.numel() // max(d, 1)
    if n == 0:
        return out, lse
    # flatten * into one row axis; reshape copies only when * cannot be viewed as one axis
    o_part, l_part = out_partial.reshape(num_splits, n, d), lse_partial.reshape(num_splits, n)
    (ps, pn, pd), (qs, qn) = o_part.stride(), l_part.stride()
    if sink is not None:
        sink = torch.broadcast_to(sink, lead).reshape(n)
    merge = prepare_combine(num_splits, d, (n, 1, 1), (ps, pn, 0, 0, pd, qs, qn, 0, 0, d, 0, 0, 1, 1, 0, 0,
                                                       0 if sink is None else sink.stride(0), 0, 0), sink is not None)
    merge((o_part, l_part, out, lse, sink), ())
    return out, lse


class DecodeLaunch(NamedTuple):
    """A planned decoding call (plan): its launches less the per-layer tensors, and the buffers."""

    out_shape: tuple  # (b, sq, h, d), q's dtype
    lse_shape: tuple  # (b, h, sq), fp32
    num_splits: int
    seqlen_new: int  # new keys each call appends (its k and v); 0: none
    split: Optional[Prepared]  # called with (q, k_cache, v_cache, k, v, out, lse, ...) and the first five's strides
    split_any: Optional[Callable[[], Prepared]]  # with _split_kernel_warps: _split_kernel for caches it cannot copy
    combine: Optional[Prepared]  # None with one split, or with the combine fused into the split kernel
    fused: bool  # the split kernel's last program per row merges the splits (arrival counters)
    partial_sizes: tuple  # (elements of the fp32 buffer, offset of the lse partials in it)
    scratch: dict  # CUDA stream (None on CPU) -> (out_partial, lse_partial, arrivals or None) of its calls
    unread: dict  # "lse" -> where calls that do not return the LSE let the kernels write it
    has_sink: bool  # the calls pass an attention sink (h,)


def _seqlens_args(cache_seqlens):
    """(tensor or None, int): a tensor of lengths goes to the kernel; an int travels by value."""
    if isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens, 0
    return None, int(cache_seqlens)


def _stride0(t) -> int:
    return 0 if t is None else t.stride(0)


def plan(b, sq, h, hk, d, dtype, device, *, page_size, capacity, cache_rows, seqlen_new, cache_seqlens,
         cache_batch_idx, cache_leftpad, block_table, alibi_slopes, rotary_cos, rotary_sin, rotary_interleaved,
         softmax_scale, window, softcap, num_splits, max_keys, has_sink=False) -> DecodeLaunch:
    """The launches of a checked decoding call: split-KV attention of q over the cache, which the
    same launch extends by the new k/v, then the merge of the splits (unless fused).

    q (b, sq, h, d); k_cache/v_cache (cache_rows, capacity, hk, d), or pages (cache_rows, page_size,
    hk, d) with block_table (b, max_blocks) int32 (capacity = max_blocks * page_size);
    cache_seqlens int or (b,) int32 (lengths before the seqlen_new appended keys);
    cache_batch_idx / cache_leftpad (b,) int32; rotary_cos/sin (seqlen_ro, rotary_dim / 2) rotate
    k and q; window = (left, right), -1 unbounded. Index tensors are read through their strides.
    num_splits = 0 asks configs.decode_tiles (the tiles and the split count), given max_keys (the
    longest key range known on the host, else None: the capacity). has_sink: every call passes an
    attention sink.
    With splits, the calls of a plan on one CUDA stream share the split partials (and the fused
    merge's counters), allocated at its first call there: a stream runs its calls in order.
    """
    group = h // hk
    left, right = window
    if sq == 1:
        right = -1  # one query row sits at the last key: nothing is to its right
    keys = capacity if max_keys is None else max_keys
    warps = configs.decode_warp_tiles(sq * group, d, dtype, device, b * hk, keys, num_splits)
    if warps is not None:
        cfg, num_splits = warps
    else:
        cfg, num_splits = configs.decode_tiles(sq * group, d, dtype, page_size, device, b * hk, keys, num_splits)
    m_blocks = cdiv(sq * group, cfg.block_m)
    seqlens, seqlen_const = _seqlens_args(cache_seqlens)
    if rotary_cos is None:
        rotary_dim, rotary_len, rotary_strides = 0, 0, (0, 0, 0, 0)
    else:
        rotary_dim, rotary_len = 2 * rotary_cos.shape[1], rotary_cos.shape[0]
        rotary_strides = (*rotary_cos.stride(), *rotary_sin.stride())
    table_strides = (0, 0) if block_table is None else tuple(block_table.stride())
    block_d = configs.padded_headdim(d)
    flags = dict(HEAD_DIM=d, BLOCK_D=block_d, PAGE_SIZE=page_size, ROTARY_DIM=rotary_dim,
                 ROTARY_INTERLEAVED=bool(rotary_interleaved), EVEN_D=d == block_d,
                 HAS_SEQLENS=seqlens is not None, HAS_BATCH_IDX=cache_batch_idx is not None)

    # out (b, sq, h, d) and lse (b, h, sq) are allocated contiguous by each call; the partials
    # (S, b, sq, h, d) and (S, b, h, sq) share one fp32 buffer, the lse part 16-byte aligned
    out_strides, lse_strides = (sq * h * d, h * d, d, 1), (h * sq, sq, 1)
    o_numel = num_splits * b * sq * h * d
    lse_offset = cdiv(o_numel, 4) * 4
    sizes = (lse_offset + num_splits * b * h * sq, lse_offset)
    combine = None
    fused = num_splits > 1 and configs.decode_fuse_combine(num_splits)
    pdl = num_splits > 1 and not fused and configs.supports_pdl(device)
    if num_splits == 1:  # the split kernel writes out and lse directly: split stride 0
        o_strides, l_strides = (0, *out_strides), (0, *lse_strides)
    else:
        o_strides = (b * sq * h * d, *out_strides)
        l_strides = (b * h * sq, *lse_strides)
        # rows (b, sq, h); the lse partials are (S, b, h, sq) and lse is (b, h, sq): their row
        # strides are given in (b, sq, h) order
        (ps, pb, pm, ph, pd), (qs, qb, qh, qm) = o_strides, l_strides
        (ob, om, oh, od), (lb, lh, lm) = out_strides, lse_strides
        if not fused:
            combine = prepare_combine(num_splits, d, (b, sq, h), (ps, pb, pm, ph, pd, qs, qb, qm, qh, ob, om, oh, od,
                                                                   lb, lm, lh, 0, 0, 1), has_sink, pdl)
    qk_scale, softcap = kernel_scale(softmax_scale, softcap)
    split = split_any = None
    if b > 0:
        flags.update(GROUP=group, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, HAS_SOFTCAP=softcap > 0,
                     ROTARY_BY_ROW=left >= 0 or window[1] >= 0, DOT_PRECISION=dot_precision(dtype),
                     HAS_LEFTPAD=cache_leftpad is not None, HAS_ALIBI=alibi_slopes is not None, FUSED_COMBINE=fused,
                     MERGE_UNROLL=configs.DECODE_MERGE_UNROLL, HAS_SINK=has_sink, APPEND=seqlen_new > 0,
                     BLOCK_T=min(16, next_pow2(seqlen_new)), LAUNCH_COMBINE=pdl)
        fixed = ((seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes, rotary_cos, rotary_sin),
                 (*o_strides, *l_strides, *out_strides, *lse_strides, _stride0(seqlens), _stride0(cache_batch_idx),
                  _stride0(cache_leftpad), *table_strides, *alibi_strides(alibi_slopes), *rotary_strides,
                  seqlen_const, sq, seqlen_new, capacity, cache_rows, rotary_len, m_blocks, num_splits,
                  max(left, 0), max(right, 0), qk_scale, softcap))

        def prepare(kernel, tiles, stages, **more):
            return Prepared(kernel, (num_splits, hk * m_blocks, b), *fixed, tiles.num_warps, stages, pdl,
                            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, **flags, **more)

        if warps is None:
            split = prepare(_split_kernel, cfg, cfg.num_stages)
        else:
            split = prepare(_split_kernel_warps, cfg, None, STAGES=cfg.num_stages)

            @functools.cache
            def split_any():
                """_split_kernel_warps copies rows of 16-byte pieces: a cache that is not
                (decode_attention) takes _split_kernel with the same splits (and one M block, as
                either's tiles hold the <= 16 rows), prepared at its first such call."""
                tiles, _ = configs.decode_tiles(sq * group, d, dtype, page_size, device, b * hk, keys, num_splits)
                return prepare(_split_kernel, tiles, tiles.num_stages)
    return DecodeLaunch((b, sq, h, d), (b, h, sq), num_splits, seqlen_new, split, split_any, combine, fused, sizes,
                        {}, {}, has_sink)


def _scratch(p: DecodeLaunch, device, stream) -> tuple:
    """(out_partial, lse_partial, arrivals) of the calls on `stream`: one fp32 buffer for the
    partials, and for the fused merge int32 arrival counters, zeroed once and left zeroed by every
    launch (else None). Calls on one stream run in order, so they may share these; calls on
    different streams never do."""
    scratch = p.scratch.get(stream)
    if scratch is None:
        buf = torch.empty(p.partial_sizes[0], dtype=torch.float32, device=device)
        arrivals = torch.zeros(p.out_shape[0] * p.split.grid[1], dtype=torch.int32, device=device) if p.fused else None
        scratch = p.scratch[stream] = (buf, buf[p.partial_sizes[1]:], arrivals)
    return scratch


def _whole_rows(cache: torch.Tensor) -> bool:
    """Whether _split_kernel_warps can copy this cache's head rows in 16-byte pieces: the last
    dimension contiguous, every other stride and the address multiples of 16 elements / bytes (what
    Triton's specialisation tells the kernel)."""
    s0, s1, s2, s3 = cache.stride()
    return s3 == 1 and s0 % 16 == 0 and s1 % 16 == 0 and s2 % 16 == 0 and cache.data_ptr() % 16 == 0


def decode_attention(p: DecodeLaunch, q, k_cache, v_cache, k=None, v=None, want_lse: bool = True, sink=None):
    """Append k/v (b, seqlen_new, hk, d) to the cache at cache_seqlens[b] (in place, k rotated; given
    exactly when the plan has seqlen_new > 0) and attend q over the cache -> out (b, sq, h, d) in
    q's dtype, and lse (b, h, sq) fp32, or None when not want_lse: the kernels then write the LSE
    into a buffer the plan keeps for that and nobody reads (one allocation less per call). sink:
    the attention sink (h,) contiguous, given exactly when the plan was made with has_sink."""
    if (sink is not None) != p.has_sink:
        raise ValueError(f"this decoding launch was planned {'with' if p.has_sink else 'without'} an attention sink")
    device = q.device
    # q's shape is out_shape (checked by the plan's run); empty_like parses less than torch.empty
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if want_lse:
        lse = torch.empty(p.lse_shape, dtype=torch.float32, device=device)
    else:
        lse = p.unread.get("lse")
        if lse is None:
            lse = p.unread["lse"] = torch.empty(p.lse_shape, dtype=torch.float32, device=device)
    if p.split is None:
        return out, lse if want_lse else None
    stream = current_stream(q.get_device()) if q.is_cuda else None
    if p.num_splits == 1:
        o_buf, l_buf, arrivals = out, lse, None
    else:
        o_buf, l_buf, arrivals = _scratch(p, device, stream)
    finals = (out, lse, arrivals) if p.fused else (None, None, None)
    # the launch key of the call's tensors: q, k_cache, v_cache, k and v share q's dtype (checked
    # by DecodePlan.run); the outputs and buffers are allocated here, 16-byte aligned
    key = (q.dtype, q.data_ptr() % 16 == 0, k_cache.data_ptr() % 16 == 0, v_cache.data_ptr() % 16 == 0,
           None if sink is None else (sink.dtype, sink.data_ptr() % 16 == 0))
    if k is None:
        new_strides = (0,) * 8
    else:
        key += (k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0)
        new_strides = (*k.stride(), *v.stride())
    split = p.split
    if p.split_any is not None and not (_whole_rows(k_cache) and _whole_rows(v_cache)):
        split = p.split_any()
    split((q, k_cache, v_cache, k, v, o_buf, l_buf, *finals, sink),
          (*q.stride(), *k_cache.stride(), *v_cache.stride(), *new_strides), stream, key)
    if p.combine is not None:  # its tensors' key: the partials and lse are fp32, out q's dtype, all allocated here
        p.combine((o_buf, l_buf, out, lse, sink), (), stream, (key[0], key[4]))
    return out, lse if want_lse else None
