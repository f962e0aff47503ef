"""Flash-Decoding's split kernel in Gluon (_split_kernel_warps): ops.decode._split_kernel's launch
(same arguments, grid and outputs) with each warp on keys of its own, built from ops.decode's
helpers (the same append, key ranges and epilogue). ops.decoding picks it where
configs.decode_warp_tiles gives it tiles (sm_90, 16-bit, d=64/128).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.language.extra.cuda import gdc_launch_dependents

from flashtile.ops.decode import (
    _LENGTHS,
    Cache,
    NewRows,
    Outputs,
    Rope,
    Rows,
    _load_rope,
    _split_append,
    _split_epilogue,
    _split_keys,
)
from flashtile.ops.masks import visible
from flashtile.ops.mods import scores_log2


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
    CFG: gl.constexpr, MODS: gl.constexpr,
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
    gl.static_assert(CFG.EVEN_D, "whole 16-byte rows only")
    HEAD_DIM: gl.constexpr = CFG.HEAD_DIM
    BLOCK_M: gl.constexpr = CFG.BLOCK_M
    BLOCK_N: gl.constexpr = CFG.BLOCK_N
    GROUP: gl.constexpr = CFG.GROUP
    STAGES: gl.constexpr = CFG.STAGES
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

    if CFG.LAUNCH_COMBINE:
        gdc_launch_dependents()
    split = gl.program_id(0)
    kh = gl.program_id(1) // m_blocks
    start_m = (gl.program_id(1) % m_blocks) * BLOCK_M
    b = gl.program_id(2)

    keys = _split_keys(Rows(Seqlens, LeftPad, BatchIdx, stride_sl, stride_lp, stride_bi, seqlen_const, seqlen_q,
                            seqlen_new, capacity, cache_rows, num_splits, left, right), b, split, start_m, CFG, MODS)
    rope = Rope(Cos, Sin, stride_cr, stride_cc, stride_sr, stride_sc, rotary_len)
    lo, hi, pad, n_cache = keys.lo, keys.hi, keys.pad, keys.n_cache
    blk_start = keys.blk_start
    n_tiles = gl.maximum(keys.blk_end - blk_start, 0)

    table = BlockTable
    if CFG.PAGE_SIZE > 0:
        table = BlockTable + b.to(gl.int64) * stride_tb
    else:
        K = K + keys.cb.to(gl.int64) * stride_kb
        V = V + keys.cb.to(gl.int64) * stride_vb
    K = K + kh * stride_kh
    V = V + kh * stride_vh
    # a (rows or new keys, d) tile for the append and a rotated q: a row's 16-byte pieces across lanes
    rows_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 256 // HEAD_DIM, HEAD_DIM // 8], [1, W, 1], [2, 1, 0])
    cache = Cache(K, V, table, cache_rows, capacity, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd,
                  stride_tp)
    if CFG.APPEND:
        new = NewRows(Knew + b.to(gl.int64) * stride_nb + kh * stride_nh,
                      Vnew + b.to(gl.int64) * stride_wb + kh * stride_wh, stride_nt, stride_nd, stride_wt, stride_wd,
                      seqlen_new)
        _split_append(new, cache, rope, keys, split, start_m,
                      gl.arange(0, CFG.BLOCK_T, layout=gl.SliceLayout(1, gl.SliceLayout(0, rows_l))),
                      gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(0, rows_l))), CFG)
        gl.thread_barrier()  # this program's new rows are in the cache for all its threads

    # Q^T (W, d, rows), every warp's the same: row r is query r // GROUP of head kh GROUP + r % GROUP
    if CFG.ROTARY_DIM > 0:
        # rotated as _split_kernel rotates it, in (rows, d), then turned into the operand's layout
        r_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, gl.SliceLayout(0, rows_l)))
        r_i = r_rows // GROUP
        r_ptr = Q + b.to(gl.int64) * stride_qb + (r_i * stride_qm + (kh * GROUP + r_rows % GROUP) * stride_qh)[:, None]
        if CFG.ROTARY_BY_ROW:
            q_pos = n_cache + r_i
        else:
            q_pos = n_cache + r_i * 0
        q2 = _load_rope(r_ptr, gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(0, rows_l))),
                        stride_qd, (r_rows < seqlen_q * GROUP)[:, None], rope, q_pos, CFG)
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
    if MODS.alibi:
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
            _copy_tile(cache, k_ring.index(t), v_ring.index(t), (blk_start + t) * BLOCK_N, c_warp, c_keys, c_d,
                       k_cols, v_cols, lo, hi, CFG.PAGE_SIZE, BLOCK_N, KW)
        async_copy.commit_group()

    m_i = gl.full([W, BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
    l_i = gl.zeros([W, BLOCK_M], gl.float32, gl.SliceLayout(1, mma))
    acc = gl.zeros([W, HEAD_DIM, BLOCK_M], gl.float32, mma)
    for t in range(n_tiles):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()  # tile t is in, and every warp is done with the slot the copy below refills
        nxt = t + STAGES - 1
        if nxt < n_tiles:
            _copy_tile(cache, k_ring.index(nxt % STAGES), v_ring.index(nxt % STAGES), (blk_start + nxt) * BLOCK_N,
                       c_warp, c_keys, c_d, k_cols, v_cols, lo, hi, CFG.PAGE_SIZE, BLOCK_N, KW)
        async_copy.commit_group()
        slot = t % STAGES
        qk = mma_v2(k_ring.index(slot).load(a_op), q_t, gl.zeros([W, KW, BLOCK_M], gl.float32, mma))
        start = (blk_start + t) * BLOCK_N
        pos = start + s_keys
        s2, _ = scores_log2(qk, i, pos - pad, qk_scale, softcap, slope, keys.diag_offset, MODS)
        if MODS.left or MODS.right:
            ok = (pos >= lo) & (pos < hi) & visible(i, pos - pad, keys.diag_offset, keys.seqlen_k, left, right, MODS)
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
    outs = Outputs(Out, Lse, OutF, LseF, Arrivals, Sink, stride_os, stride_ob, stride_om, stride_oh, stride_od,
                   stride_ls, stride_lb, stride_lh, stride_lm, stride_fb, stride_fm, stride_fh, stride_fd, stride_gb,
                   stride_gh, stride_gm, num_splits)
    _split_epilogue(acc, l_sum, m, gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, out_l), outs, b, rows // GROUP,
                    kh * GROUP + rows % GROUP, offs_d, row_ok, row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], split,
                    CFG)


# cp.async copies the cache's rows in 16-byte pieces, so these strides must be known multiples of 16
# in every launch, the twin that for_strides picks for an unaligned q or output stride (sq = 2:
# the lse's head stride) too; decode_attention sends a cache without them to _split_kernel
_split_kernel_warps.aligned_strides = ("stride_kb", "stride_kn", "stride_kh", "stride_vb", "stride_vn", "stride_vh")


@gluon.jit
def _copy_tile(cache, k_slot, v_slot, start, warp0, key_ids, cols, k_cols, v_cols, lo, hi, PAGE_SIZE: gl.constexpr,
               BLOCK_N: gl.constexpr, KW: gl.constexpr):
    """Start the copies of the tile of keys [start, start + BLOCK_N) into a ring slot of
    _split_kernel_warps: warp w's keys start + warp0 + [0, KW) (key_ids (W, KW, 1), warp0 (W, 1, 1)),
    columns cols (1, 1, d); k_cols / v_cols: a contiguous cache's offsets of those keys and columns
    from the tile's first. Paged, a warp whose KW keys lie on one page (KW divides the page size)
    reads its page index once, else each key its own. Keys outside [lo, hi), or on a page outside
    k_cache, copy zeros and read nothing; only the tiles at a split's ends have keys outside [lo, hi)."""
    K, V, table = cache.K, cache.V, cache.table
    if PAGE_SIZE > 0:
        pos = start + key_ids
        # a table slot past hi may lie past the table's row (the last tile of a capacity that is not
        # a whole number of tiles): not read, and its keys copy nothing
        if PAGE_SIZE % KW == 0:
            page = gl.load(table + ((start + warp0) // PAGE_SIZE) * cache.stride_tp, mask=start + warp0 < hi, other=-1)
        else:
            page = gl.load(table + (pos // PAGE_SIZE) * cache.stride_tp, mask=pos < hi, other=-1)
        page_ok = (page >= 0) & (page < cache.cache_rows)
        k_ptrs = K + page.to(gl.int64) * cache.stride_kb + (pos % PAGE_SIZE) * cache.stride_kn + cols * cache.stride_kd
        v_ptrs = V + page.to(gl.int64) * cache.stride_vb + (pos % PAGE_SIZE) * cache.stride_vn + cols * cache.stride_vd
        if (start < lo) | (start + BLOCK_N > hi):
            ok = page_ok & (pos >= lo) & (pos < hi)
            async_copy.async_copy_global_to_shared(k_slot, k_ptrs, mask=ok)
            async_copy.async_copy_global_to_shared(v_slot, v_ptrs, mask=ok)
        else:
            async_copy.async_copy_global_to_shared(k_slot, k_ptrs, mask=page_ok)
            async_copy.async_copy_global_to_shared(v_slot, v_ptrs, mask=page_ok)
    else:
        k_ptrs = K + start.to(gl.int64) * cache.stride_kn + k_cols
        v_ptrs = V + start.to(gl.int64) * cache.stride_vn + v_cols
        if (start < lo) | (start + BLOCK_N > hi):
            pos = start + key_ids
            ok = (pos >= lo) & (pos < hi)
            async_copy.async_copy_global_to_shared(k_slot, k_ptrs, mask=ok)
            async_copy.async_copy_global_to_shared(v_slot, v_ptrs, mask=ok)
        else:
            async_copy.async_copy_global_to_shared(k_slot, k_ptrs)
            async_copy.async_copy_global_to_shared(v_slot, v_ptrs)
