"""Flash-Decoding: split-KV attention over a contiguous or paged KV cache, then an LSE merge.

Three kernels, each a plain stream over HBM:
  _split_kernel    one program per (split, kv head [x M block], batch): the query rows of every head
                   that shares the kv head are packed into one tile (GQA packing), so each KV byte
                   is read once; it writes a partial (out, lse) per split, in fp32 - or, with one
                   split, the final output directly. New k/v rows (rotary applied to k) are
                   written into the cache, through the page table, by the same launch (APPEND):
                   each program writes those it reads, before it reads them
  _split_kernel_warps  (ops.decode_sm90) the same launch in Gluon, each warp on keys of its own (sm_90, 16-bit
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

Host side: ops.decoding plans and launches these (and ops.decode_sm90's Gluon form of the split
kernel).
Index values are checked by the API on the host; the kernels clamp them regardless (see
_split_kernel), so values the API cannot read (CUDA-graph capture) never reach outside a tensor.
"""

from typing import NamedTuple

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashtile.ops.aggregates import VALUE, aggregate, keep_all
from flashtile.ops.masks import visible
from flashtile.ops.mods import scores_log2
from flashtile.ops.softmax import LN2, LOG2E, exp_minus, fold_sink


class DecodeFlags(NamedTuple):
    """The split kernels' constexprs other than the mods (CFG), built once per plan (ops.decoding)."""

    GROUP: int  # query heads per kv head: tile row r is query r // GROUP of head kh GROUP + r % GROUP
    HEAD_DIM: int
    BLOCK_D: int  # HEAD_DIM padded to a power of two
    BLOCK_M: int  # tile rows (query rows x GROUP)
    BLOCK_N: int  # keys a tile
    PAGE_SIZE: int  # 0: a contiguous cache
    ROTARY_DIM: int  # 0: no rotary
    ROTARY_INTERLEAVED: bool  # GPT-J pairs (2i, 2i+1), else GPT-NeoX (i, i + ROTARY_DIM / 2)
    ROTARY_BY_ROW: bool  # query i at position cache_seqlens + i (causal or local), else all at cache_seqlens
    DOT_PRECISION: str
    EVEN_D: bool  # HEAD_DIM == BLOCK_D
    HAS_SEQLENS: bool  # cache_seqlens is a tensor (else the int seqlen_const)
    HAS_BATCH_IDX: bool
    HAS_LEFTPAD: bool
    FUSED_COMBINE: bool  # the last split program of a row merges the splits
    MERGE_UNROLL: int  # splits a step of that merge
    HAS_SINK: bool
    APPEND: bool  # new k/v rows are written into the cache first
    BLOCK_T: int  # new rows a step of the append
    LAUNCH_COMBINE: bool  # the combine kernel follows as a programmatic dependent launch
    STAGES: int  # _split_kernel_warps' cp.async ring (_split_kernel pipelines through num_stages)


@aggregate
class Rope:
    """The rotary tables Cos and Sin (rotary_len positions x ROTARY_DIM / 2) and their strides."""

    Cos: VALUE
    Sin: VALUE
    stride_cr: VALUE
    stride_cc: VALUE
    stride_sr: VALUE
    stride_sc: VALUE
    rotary_len: VALUE

    @triton.constexpr_function
    def __init__(self, Cos, Sin, stride_cr, stride_cc, stride_sr, stride_sc, rotary_len):
        keep_all(self, dict(locals()))


@aggregate
class Cache:
    """A program's view of the KV cache: K and V at its kv head (contiguous: and its sequence), its
    page table row `table` (paged), cache_rows (k_cache's first dim: sequences or pages), capacity
    (positions a sequence has) and the strides."""

    K: VALUE
    V: VALUE
    table: VALUE
    cache_rows: VALUE
    capacity: VALUE
    stride_kb: VALUE
    stride_kn: VALUE
    stride_kd: VALUE
    stride_vb: VALUE
    stride_vn: VALUE
    stride_vd: VALUE
    stride_tp: VALUE

    @triton.constexpr_function
    def __init__(self, K, V, table, cache_rows, capacity, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn,
                 stride_vd, stride_tp):
        keep_all(self, dict(locals()))


@aggregate
class NewRows:
    """The new k and v rows of a program's (batch, kv head), (seqlen_new, d) at strides (t, d) each."""

    K: VALUE
    V: VALUE
    stride_kt: VALUE
    stride_kd: VALUE
    stride_vt: VALUE
    stride_vd: VALUE
    seqlen_new: VALUE

    @triton.constexpr_function
    def __init__(self, K, V, stride_kt, stride_kd, stride_vt, stride_vd, seqlen_new):
        keep_all(self, dict(locals()))


@aggregate
class Rows:
    """What says which keys a batch row has: the cache_seqlens tensor (or the int seqlen_const),
    cache_leftpad and cache_batch_idx with their strides, seqlen_q, seqlen_new, capacity,
    cache_rows, the splits and the window's left and right."""

    Seqlens: VALUE
    LeftPad: VALUE
    BatchIdx: VALUE
    stride_sl: VALUE
    stride_lp: VALUE
    stride_bi: VALUE
    seqlen_const: VALUE
    seqlen_q: VALUE
    seqlen_new: VALUE
    capacity: VALUE
    cache_rows: VALUE
    num_splits: VALUE
    left: VALUE
    right: VALUE

    @triton.constexpr_function
    def __init__(self, Seqlens, LeftPad, BatchIdx, stride_sl, stride_lp, stride_bi, seqlen_const, seqlen_q, seqlen_new,
                 capacity, cache_rows, num_splits, left, right):
        keep_all(self, dict(locals()))


@aggregate
class Keys:
    """The keys of a split program (_split_keys): n_given (cache_seqlens[b] as given), n_cache (it
    clamped into the cache), pad (the left padding), the cache's sequence cb and whether it lies in
    k_cache (cb_ok), seqlen_k, diag_offset = seqlen_k - seqlen_q, the physical positions [lo, hi)
    any of its rows can see, and its split's tiles [blk_start, blk_end) of BLOCK_N positions."""

    n_given: VALUE
    n_cache: VALUE
    pad: VALUE
    cb: VALUE
    cb_ok: VALUE
    seqlen_k: VALUE
    diag_offset: VALUE
    lo: VALUE
    hi: VALUE
    blk_start: VALUE
    blk_end: VALUE

    @triton.constexpr_function
    def __init__(self, n_given, n_cache, pad, cb, cb_ok, seqlen_k, diag_offset, lo, hi, blk_start, blk_end):
        keep_all(self, dict(locals()))


@aggregate
class Outputs:
    """Where a split program's rows go: Out / Lse (the partials (S, b, sq, h, d) and (S, b, h, sq),
    or with one split the outputs, split stride 0), and with FUSED_COMBINE the merged OutF / LseF
    and the arrival counters; the sink; the strides and the splits."""

    Out: VALUE
    Lse: VALUE
    OutF: VALUE
    LseF: VALUE
    Arrivals: VALUE
    Sink: VALUE
    stride_os: VALUE
    stride_ob: VALUE
    stride_om: VALUE
    stride_oh: VALUE
    stride_od: VALUE
    stride_ls: VALUE
    stride_lb: VALUE
    stride_lh: VALUE
    stride_lm: VALUE
    stride_fb: VALUE
    stride_fm: VALUE
    stride_fh: VALUE
    stride_fd: VALUE
    stride_gb: VALUE
    stride_gh: VALUE
    stride_gm: VALUE
    num_splits: VALUE

    @triton.constexpr_function
    def __init__(self, Out, Lse, OutF, LseF, Arrivals, Sink, stride_os, stride_ob, stride_om, stride_oh, stride_od,
                 stride_ls, stride_lb, stride_lh, stride_lm, stride_fb, stride_fm, stride_fh, stride_fd, stride_gb,
                 stride_gh, stride_gm, num_splits):
        keep_all(self, dict(locals()))


@triton.jit
def _load_rope(rows, offs_d, stride_d, mask, rope, pos, CFG: tl.constexpr):
    """Rows (R, BLOCK_D) as fp32, rotary embedding at positions pos (R,) on the first ROTARY_DIM dims.

    rows: (R, 1) pointers to each row's first element. Interleaved (GPT-J) rotates pairs
    (2i, 2i+1) by angle i; otherwise (GPT-NeoX) pairs (i, i + ROTARY_DIM/2). Each output element
    needs its partner element, loaded as a second gather of the same rows. A position outside the
    tables' rotary_len rows (possible only under CUDA-graph capture, where the API cannot check
    the lengths) is left unrotated rather than read out of bounds.
    """
    x = tl.load(rows + offs_d[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    if CFG.ROTARY_DIM > 0:
        HALF: tl.constexpr = CFG.ROTARY_DIM // 2
        if CFG.ROTARY_INTERLEAVED:
            first = offs_d % 2 == 0
            partner = offs_d ^ 1
            angle = offs_d // 2
        else:
            first = offs_d < HALF
            partner = tl.where(first, offs_d + HALF, offs_d - HALF)
            angle = tl.where(first, offs_d, offs_d - HALF)
        rot = mask & (offs_d[None, :] < CFG.ROTARY_DIM) & ((pos >= 0) & (pos < rope.rotary_len))[:, None]
        xp = tl.load(rows + partner[None, :] * stride_d, mask=rot, other=0.0).to(tl.float32)
        # outside the rotary dims cos = 1, sin = 0 and xp = 0, so x passes through unchanged
        cos = tl.load(rope.Cos + pos[:, None] * rope.stride_cr + angle[None, :] * rope.stride_cc, mask=rot, other=1.0)
        sin = tl.load(rope.Sin + pos[:, None] * rope.stride_sr + angle[None, :] * rope.stride_sc, mask=rot, other=0.0)
        x = x * cos.to(tl.float32) + tl.where(first[None, :], -xp, xp) * sin.to(tl.float32)
    return x


# Cache lengths that are ints (an int cache_seqlens; the capacity of a cache that grows every step,
# as transformers' dynamic cache) and the cache's batch change from call to call: Triton would
# compile another variant whenever one becomes a multiple of 16 or 1. They never enter an address's
# alignment, so they are not specialised on.
_LENGTHS = ("seqlen_const", "capacity", "cache_rows")


@triton.jit
def _cache_rows(pos, first, ok, cache, PAGE_SIZE: tl.constexpr, ONE_PAGE: tl.constexpr):
    """(ok, k_rows, v_rows) for cache positions pos (R,) of one sequence: the offsets of their rows
    in cache.K and cache.V, through the page table when paged, where ok loses the positions on a page
    outside k_cache (cache_rows pages). ONE_PAGE: every position lies on the page of position
    `first`, whose index is read once."""
    if PAGE_SIZE > 0:
        if ONE_PAGE:
            page = tl.load(cache.table + (first // PAGE_SIZE) * cache.stride_tp)
        else:
            page = tl.load(cache.table + (pos // PAGE_SIZE) * cache.stride_tp, mask=ok, other=0)
        ok = ok & (page >= 0) & (page < cache.cache_rows)
        k_rows = page.to(tl.int64) * cache.stride_kb + (pos % PAGE_SIZE) * cache.stride_kn
        v_rows = page.to(tl.int64) * cache.stride_vb + (pos % PAGE_SIZE) * cache.stride_vn
    else:
        k_rows = pos.to(tl.int64) * cache.stride_kn
        v_rows = pos.to(tl.int64) * cache.stride_vn
    return ok, k_rows, v_rows


@triton.jit
def _append_rows(new, cache, rope, n_cache, t_first, t_last, rows_ok, offs_t0, offs_d, CFG: tl.constexpr):
    """Write new rows of one (batch, kv head): new.K[t] -> cache position n_cache + t (rotary at that
    position), new.V[t] likewise, for t in [t_first, t_last), BLOCK_T at a time.

    rows_ok: False for a sequence outside k_cache. A row at a position outside [0, capacity) or on
    a page outside k_cache is not written (see _split_kernel). offs_t0 = arange(BLOCK_T) and offs_d
    = arange(BLOCK_D), in the layouts of the calling kernel's (BLOCK_T, BLOCK_D) tile (Triton's or a
    Gluon kernel's: everything here is shaped by them).
    """
    for t0 in tl.range(t_first, t_last, CFG.BLOCK_T, num_stages=1):  # not pipelined: no shared memory of its own
        offs_t = t0 + offs_t0
        pos = n_cache + offs_t
        ok = (offs_t < t_last) & (pos >= 0) & (pos < cache.capacity) & rows_ok
        ok, k_rows, v_rows = _cache_rows(pos, n_cache + t0, ok, cache, CFG.PAGE_SIZE, False)
        mask = ok[:, None]
        if not CFG.EVEN_D:
            mask = mask & (offs_d[None, :] < CFG.HEAD_DIM)
        k = _load_rope(new.K + offs_t[:, None] * new.stride_kt, offs_d, new.stride_kd, mask, rope, pos, CFG)
        v = tl.load(new.V + offs_t[:, None] * new.stride_vt + offs_d[None, :] * new.stride_vd, mask=mask)
        tl.store(cache.K + k_rows[:, None] + offs_d[None, :] * cache.stride_kd, k.to(cache.K.dtype.element_ty),
                 mask=mask)
        tl.store(cache.V + v_rows[:, None] + offs_d[None, :] * cache.stride_vd, v, mask=mask)


@triton.jit
def _split_keys(rows, b, split, start_m, CFG: tl.constexpr, MODS: tl.constexpr):
    """What a split program of (batch b, M block at start_m) reads, in either split kernel (Keys).
    The keys any row of the M block can see are the logical [lo - pad, hi - pad), physical [lo, hi);
    this split's share is tiles [blk_start, blk_end) of BLOCK_N physical positions. Every index is
    clamped into the tensors it addresses (_split_kernel's docstring)."""
    if CFG.HAS_SEQLENS:
        n_given = tl.load(rows.Seqlens + b * rows.stride_sl)
        n_cache = tl.minimum(tl.maximum(n_given, 0), rows.capacity)
    else:
        n_given = rows.seqlen_const  # a host int: always checked
        n_cache = n_given
    pad = 0
    if CFG.HAS_LEFTPAD:
        pad = tl.minimum(tl.maximum(tl.load(rows.LeftPad + b * rows.stride_lp), 0), n_cache)
    cb = b
    cb_ok = True
    if CFG.HAS_BATCH_IDX:  # contiguous caches only (the API rejects it with a block_table)
        cb = tl.load(rows.BatchIdx + b * rows.stride_bi)
        cb_ok = (cb >= 0) & (cb < rows.cache_rows)  # if not, the row gets no keys (below): nothing is read
    seqlen_k = n_cache - pad + rows.seqlen_new
    diag_offset = seqlen_k - rows.seqlen_q

    lo = 0
    hi = seqlen_k
    if MODS.left:
        lo = tl.maximum(start_m // CFG.GROUP + diag_offset - rows.left, 0)
    if MODS.right:
        last_i = tl.minimum((start_m + CFG.BLOCK_M - 1) // CFG.GROUP, rows.seqlen_q - 1)
        hi = tl.minimum(hi, tl.maximum(last_i + diag_offset + rows.right + 1, 0))
    hi = tl.minimum(hi + pad, rows.capacity)
    if CFG.HAS_BATCH_IDX:
        hi = tl.where(cb_ok, hi, 0)  # a sequence outside k_cache: no keys
    lo = tl.minimum(lo + pad, hi)  # 0 <= lo <= hi <= capacity: every tile starts inside the cache
    first_blk = lo // CFG.BLOCK_N
    n_blk = tl.cdiv(hi, CFG.BLOCK_N) - first_blk
    per_split = tl.cdiv(n_blk, rows.num_splits)
    blk_start = first_blk + split * per_split
    blk_end = tl.minimum(blk_start + per_split, first_blk + n_blk)
    return Keys(n_given, n_cache, pad, cb, cb_ok, seqlen_k, diag_offset, lo, hi, blk_start, blk_end)


@triton.jit
def _split_append(new, cache, rope, keys, split, start_m, offs_t0, offs_d, CFG: tl.constexpr):
    """APPEND, in either split kernel: before its loop a program writes the new rows its split reads
    into the cache, and the programs of split 0, M block 0 write every new row (one a window hides
    from every query is still appended); the caller's barrier then makes them visible to all its
    threads (_split_kernel's docstring)."""
    t_first = tl.maximum(tl.maximum(keys.blk_start * CFG.BLOCK_N, keys.lo) - keys.n_cache, 0)
    t_last = tl.minimum(tl.minimum(keys.blk_end * CFG.BLOCK_N, keys.hi) - keys.n_cache, new.seqlen_new)
    if (split == 0) & (start_m == 0):
        t_first = 0
        t_last = new.seqlen_new
    _append_rows(new, cache, rope, keys.n_given, t_first, t_last, keys.cb_ok, offs_t0, offs_d, CFG)


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
    CFG: tl.constexpr, MODS: tl.constexpr,
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
    if CFG.LAUNCH_COMBINE:
        gdc_launch_dependents()
    BLOCK_M: tl.constexpr = CFG.BLOCK_M
    BLOCK_N: tl.constexpr = CFG.BLOCK_N
    BLOCK_D: tl.constexpr = CFG.BLOCK_D
    GROUP: tl.constexpr = CFG.GROUP
    split = tl.program_id(0)
    kh = tl.program_id(1) // m_blocks
    start_m = (tl.program_id(1) % m_blocks) * BLOCK_M
    b = tl.program_id(2)

    keys = _split_keys(Rows(Seqlens, LeftPad, BatchIdx, stride_sl, stride_lp, stride_bi, seqlen_const, seqlen_q,
                            seqlen_new, capacity, cache_rows, num_splits, left, right), b, split, start_m, CFG, MODS)
    rope = Rope(Cos, Sin, stride_cr, stride_cc, stride_sr, stride_sc, rotary_len)

    rows = start_m + tl.arange(0, BLOCK_M)
    i = rows // GROUP
    head = kh * GROUP + rows % GROUP
    row_ok = rows < seqlen_q * GROUP
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = row_ok[:, None]
    if not CFG.EVEN_D:
        row_mask = row_mask & (offs_d[None, :] < CFG.HEAD_DIM)

    q_rows = Q + b.to(tl.int64) * stride_qb + (i * stride_qm + head * stride_qh)[:, None]
    if CFG.ROTARY_DIM > 0:
        # flash-attn: with a causal or local mask query i sits at position cache_seqlens + i,
        # otherwise every query row takes position cache_seqlens
        if CFG.ROTARY_BY_ROW:
            q_pos = keys.n_cache + i
        else:
            q_pos = keys.n_cache + i * 0
        q = _load_rope(q_rows, offs_d, stride_qd, row_mask, rope, q_pos, CFG).to(Q.dtype.element_ty)
    else:
        q = tl.load(q_rows + offs_d[None, :] * stride_qd, mask=row_mask, other=0.0)
    slope = 0.0
    if MODS.alibi:
        slope = tl.load(Slopes + b * stride_slope_b + head * stride_slope_h)[:, None]

    table = BlockTable  # None for a contiguous cache
    if CFG.PAGE_SIZE > 0:
        table = BlockTable + b.to(tl.int64) * stride_tb
    else:
        K = K + keys.cb.to(tl.int64) * stride_kb
        V = V + keys.cb.to(tl.int64) * stride_vb
    cache = Cache(K + kh * stride_kh, V + kh * stride_vh, table, cache_rows, capacity, stride_kb, stride_kn, stride_kd,
                  stride_vb, stride_vn, stride_vd, stride_tp)
    if CFG.APPEND:
        new = NewRows(Knew + b.to(tl.int64) * stride_nb + kh * stride_nh,
                      Vnew + b.to(tl.int64) * stride_wb + kh * stride_wh, stride_nt, stride_nd, stride_wt, stride_wd,
                      seqlen_new)
        _split_append(new, cache, rope, keys, split, start_m, tl.arange(0, CFG.BLOCK_T), offs_d, CFG)
        tl.debug_barrier()  # this program's new rows are in the cache for all its threads

    lo, hi, pad, diag_offset = keys.lo, keys.hi, keys.pad, keys.diag_offset
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(keys.blk_start * BLOCK_N, keys.blk_end * BLOCK_N, BLOCK_N):
        pos = start_n + tl.arange(0, BLOCK_N)
        key_ok = (pos >= lo) & (pos < hi)
        # with pages a multiple of the tile, the tile lies inside one page: one page index per tile.
        # A key on a page outside k_cache reads zeros but stays in the scores, so the page indices
        # are needed only in the layout of the tile's addresses
        read_ok, k_rows, v_rows = _cache_rows(pos, start_n, key_ok, cache, CFG.PAGE_SIZE,
                                              CFG.PAGE_SIZE % BLOCK_N == 0)
        kv_mask = read_ok[:, None]
        if not CFG.EVEN_D:
            kv_mask = kv_mask & (offs_d[None, :] < CFG.HEAD_DIM)
        k = tl.load(cache.K + k_rows[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(cache.V + v_rows[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)

        qk = tl.dot(q, tl.trans(k), input_precision=CFG.DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32
        j = pos - pad  # logical key index
        s2, _ = scores_log2(qk, i[:, None], j[None, :], qk_scale, softcap, slope, diag_offset,
                            MODS)
        ok = key_ok[None, :]
        if MODS.left or MODS.right:
            ok = ok & visible(i[:, None], j[None, :], diag_offset, keys.seqlen_k, left, right, MODS)
        s2 = tl.where(ok, s2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        # a row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s2 - m_sub[:, None])  # P_tilde, (BLOCK_M, BLOCK_N)
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=CFG.DOT_PRECISION)
        m_i = m_new

    outs = Outputs(Out, Lse, OutF, LseF, Arrivals, Sink, stride_os, stride_ob, stride_om, stride_oh, stride_od,
                   stride_ls, stride_lb, stride_lh, stride_lm, stride_fb, stride_fm, stride_fh, stride_fd, stride_gb,
                   stride_gh, stride_gm, num_splits)
    _split_epilogue(acc, l_i, m_i, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), outs, b, i, head, offs_d, row_ok,
                    row_mask, split, CFG)


@triton.jit
def _split_epilogue(acc, l_i, m_i, zeros, outs, b, i, head, offs_d, row_ok, row_mask, split, CFG: tl.constexpr):
    """A split program's end, in either split kernel: its rows' (acc (rows, d), l_i, m_i), query i
    and head per row, normalised into its partial (or, with one split, the output) with their LSE;
    zeros: (rows, d) fp32 zeros in acc's layout, where the fused merge starts;
    with FUSED_COMBINE the last program of its row of splits then merges them (the kernel's
    docstring). Shaped by the caller's tensors, so a Gluon kernel passes its own layouts."""
    if CFG.HAS_SINK:
        if outs.num_splits == 1:  # these rows are final; partials get the sink in the merge
            acc, l_i, m_i = fold_sink(acc, l_i, m_i, outs.Sink, head)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    # this tile's rows in split 0's partials (or in the outputs, with one split)
    out_tile = (outs.Out + b.to(tl.int64) * outs.stride_ob + (i * outs.stride_om + head * outs.stride_oh)[:, None]
                + offs_d[None, :] * outs.stride_od)
    lse_tile = outs.Lse + b.to(tl.int64) * outs.stride_lb + head * outs.stride_lh + i * outs.stride_lm
    tl.store(out_tile + split.to(tl.int64) * outs.stride_os, out.to(outs.Out.dtype.element_ty), mask=row_mask)
    tl.store(lse_tile + split.to(tl.int64) * outs.stride_ls, lse, mask=row_ok)

    if CFG.FUSED_COMBINE:
        # Arrival counting (a split-K semaphore): every thread's partial stores are issued before
        # the barrier, and the counter's add releases them at GPU scope; the program that sees
        # num_splits - 1 arrivals before its own acquires every other program's partials.
        tl.debug_barrier()
        arrivals = outs.Arrivals + b * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == outs.num_splits - 1:
            tl.store(arrivals, 0)  # zero again for the next launch
            out, lse = _merge_splits(out_tile, lse_tile, outs.stride_os, outs.stride_ls, outs.num_splits, row_ok,
                                     row_mask, outs.Sink, head, zeros, CFG.MERGE_UNROLL, CFG.HAS_SINK)
            OutF = outs.OutF + b.to(tl.int64) * outs.stride_fb
            tl.store(OutF + (i * outs.stride_fm + head * outs.stride_fh)[:, None] + offs_d[None, :] * outs.stride_fd,
                     out.to(OutF.dtype.element_ty), mask=row_mask)
            tl.store(outs.LseF + b.to(tl.int64) * outs.stride_gb + head * outs.stride_gh + i * outs.stride_gm, lse,
                     mask=row_ok)


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

