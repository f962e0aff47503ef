"""Hopper (sm_90) forward in Gluon: FA2's algorithm (ops.forward), with what Hopper adds made explicit.

Persistent (PERSISTENT; at d=256, whose single Q buffer leaves nothing to overlap, a program per
tile): one program per SM walks tiles of CONSUMERS x 64 query rows, taking each next tile from a
counter (tile_counter), so a tile's epilogue runs under the next tile's loads. A one-warp loader
partition brings each tile's Q (into one of Q_STAGES buffers) and its K/V blocks through a ring of
NUM_STAGES shared buffers with TMA (ready barriers per buffer and operand; empty barriers every
consumer releases, K's after its S = Q K^T, V's after its P V and Q's after the tile's output
rows, which leave through it (O_TMA), or else after the tile's last S).

The consumer warpgroups (the default partition and workers) each run the online softmax of their
64 rows on wgmma accumulators, independently, so the warp scheduler runs one's softmax under the
others' matrix products. With two consumers (d 128 and 256) S_j = Q K_j^T is issued
asynchronously before the P V product of block j - 1 of the same warpgroup, and the softmax of
block j runs while that product is in flight (FA3's intra-warpgroup overlap); at d <= 128 the two
consumers also issue each block's products by turns on hardware named barriers (FA3's
ping-pong). At d=64 three consumers of 160 registers each (FlashAttention-4's sm_90 tile,
192 x 128) take S, the softmax and P V in turn. Row sums l are taken by the tensor cores (P times
an [N, 8] tile of ones, beside P V), each block's product added to l in registers. A consumer's
output rows leave through its Q buffer and one TMA store (O_TMA).

Masks, block ranges, packed batches (IS_VARLEN) and sinks (HAS_SINK) are the Triton kernel's
helpers (ops.masks, ops.softmax); dropout draws ops.philox's bits; softcap and ALiBi are
ops.mods' Hopper forms. Why each of these choices: docs/tuning.md.
"""


from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashtile.ops import configs
from flashtile.ops._launch import Plan, cdiv, current_stream
from flashtile.ops.aggregates import VALUE, aggregate, keep_all
from flashtile.ops.host import box_descriptor, dropout_args, grid_lengths, seq_strides, tma_ok, tma_refusal, varlen_args
from flashtile.ops.masks import block_range, lse_row_base, seq_bounds, visible
from flashtile.ops.mods import (
    Mods,
    alibi_refusal,
    alibi_strides,
    alibi_unit_sm90,
    kernel_scale,
    score_mods_sm90,
    softcap_scales,
)
from flashtile.ops.philox import dropout_apply_sm90, dropout_keep_bits_sm90, dropout_seed, dropout_words_sm90
from flashtile.ops.schedule import chunked_order, q_block_of
from flashtile.ops.sm90 import (
    FIRST_FREE_BARRIER,
    HOPPER_CONSUMER_REGS,
    HOPPER_LOADER_REGS,
    HOPPER_MAXNREG,
    HOPPER_THREE_CONSUMER_REGS,
    HOPPER_THREE_MAXNREG,
    named_barrier_sm90,
)
from flashtile.ops.softmax import LN2, fold_sink


class ForwardFlags(NamedTuple):
    """_fwd_kernel_sm90's constexprs other than the mods (CFG), built once per plan (plan)."""

    HEAD_DIM: int  # the tensors' head dim (the boxes' may be wider: configs.hopper_head_dim)
    NUM_STAGES: int  # K/V ring slots
    Q_STAGES: int  # Q buffers (configs.hopper_forward_q_stages)
    CONSUMERS: int  # consumer warpgroups, 64 rows each (2, or 3 at d=64)
    PERSISTENT: bool  # a program per SM walking tiles, else a program per tile
    HEAD_CHUNKED: bool  # tiles in chunks of heads (configs.hopper_forward_chunked)
    IS_VARLEN: bool
    HAS_SEQUSED: bool
    HAS_DROPOUT: bool
    HAS_SINK: bool
    O_TMA: bool  # the output rows leave through the Q buffer and the copy engine
    # three consumers take the row sums l on the tensor cores (P times columns of ones), except with
    # dropout, whose l sums P before the mask; with two, the added registers spill
    ROWSUM_MMA: bool


@aggregate
class FwdRing:
    """The shared memory the forward's partitions hand each other: Q buffers (Q_STAGES sets of one
    per consumer), the K/V ring, the row sums' columns of ones (ROWSUM_MMA), the tile ids of a
    persistent program, and their barriers."""

    q_bufs: gl.shared_memory_descriptor
    k_bufs: gl.shared_memory_descriptor
    v_bufs: gl.shared_memory_descriptor
    ones: gl.shared_memory_descriptor
    tile_ids: gl.shared_memory_descriptor
    q_bar: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor
    tile_ready: gl.shared_memory_descriptor
    tile_free: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, q_bufs, k_bufs, v_bufs, ones, tile_ids, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                 tile_ready, tile_free):
        self.q_bufs, self.k_bufs, self.v_bufs, self.ones, self.tile_ids = q_bufs, k_bufs, v_bufs, ones, tile_ids
        self.q_bar, self.q_empty, self.k_ready, self.v_ready = q_bar, q_empty, k_ready, v_ready
        self.k_empty, self.v_empty, self.tile_ready, self.tile_free = k_empty, v_empty, tile_ready, tile_free


@aggregate
class FwdCall:
    """_fwd_kernel_sm90's runtime arguments but its descriptors, by name (its docstring says what
    each is): the partitions read what they need of them."""

    Out: VALUE
    Lse: VALUE
    TileCounter: VALUE
    Rng: VALUE
    CuSeqQ: VALUE
    CuSeqK: VALUE
    SeqUsedK: VALUE
    Sink: VALUE
    Slopes: VALUE
    stride_ob: VALUE
    stride_om: VALUE
    stride_oh: VALUE
    n_tiles: VALUE
    head_chunk: VALUE
    n_m: VALUE
    nheads: VALUE
    group: VALUE
    sq: VALUE
    sk: VALUE
    left: VALUE
    right: VALUE
    qk_scale: VALUE
    softcap: VALUE
    threshold: VALUE
    dropout_scale: VALUE
    total_q: VALUE
    total_k: VALUE
    stride_slope_b: VALUE
    stride_slope_h: VALUE

    @gluon.constexpr_function
    def __init__(self, Out, Lse, TileCounter, Rng, CuSeqQ, CuSeqK, SeqUsedK, Sink, Slopes, stride_ob, stride_om,
                 stride_oh, n_tiles, head_chunk, n_m, nheads, group, sq, sk, left, right, qk_scale, softcap, threshold,
                 dropout_scale, total_q, total_k, stride_slope_b, stride_slope_h):
        keep_all(self, dict(locals()))


def hopper_forward_maxnreg(consumers: int) -> int:
    """The Hopper forward's register cap per thread at launch, with 2 or 3 consumer warpgroups."""
    return HOPPER_MAXNREG if consumers == 2 else HOPPER_THREE_MAXNREG


@gluon.jit
def _fwd_sm90_tile(tile, call, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MODS: gl.constexpr,
                   CFG: gl.constexpr):
    """Tile `tile` of the persistent grid: (start_m, b, h, hk, lo, full_lo, full_hi, n_blocks, q_start,
    sq_b, k_start, sk_b). Tiles go in the Triton kernel's launch order (row blocks, then heads, then
    batch), so the programs working at once share a few heads' K/V in L2, or with HEAD_CHUNKED in
    chunks of head_chunk heads (b * nheads + h; configs.hopper_forward_head_chunk), row block after
    row block (chunked_order); under a right-bounded mask a head's last row block, which sees
    the most keys, comes first (q_block_program's HEAVY_LAST).
    IS_VARLEN: b is a sequence of the packed batch, its rows q_start .. q_start + sq_b - 1 of q and
    keys k_start .. of k (seq_bounds); n_m covers the longest, and a tile past its sequence's end has
    no block. A tile's last rows and keys may run into the next sequence's: the keys are masked
    (block_range puts the block past sk_b among the masked ones), the rows are never stored."""
    n_tiles, head_chunk, n_m, left, right = call.n_tiles, call.head_chunk, call.n_m, call.left, call.right
    if CFG.HEAD_CHUNKED:
        pid_m, bh = chunked_order(tile, n_m, n_tiles // n_m, head_chunk)
    else:
        pid_m, bh = tile % n_m, tile // n_m
    start_m, bh, b, h, hk = q_block_of(pid_m, n_m, bh, call.nheads, call.group, BLOCK_M, MODS.right)
    q_start, sq_b, k_start, sk_b = seq_bounds(b, call.CuSeqQ, call.CuSeqK, call.SeqUsedK, call.sq, call.sk,
                                              call.total_q, call.total_k, CFG.IS_VARLEN, CFG.HAS_SEQUSED, False)
    lo, full_lo, full_hi, hi = block_range(start_m, BLOCK_M, BLOCK_N, sk_b, sk_b - sq_b, left, right, MODS.left, MODS.right)
    n_blocks = gl.cdiv(hi - lo, BLOCK_N)
    if CFG.IS_VARLEN:
        n_blocks = gl.where(start_m < sq_b, n_blocks, 0)
    return start_m, b, h, hk, lo, full_lo, full_hi, n_blocks, q_start, sq_b, k_start, sk_b


@gluon.jit
def _fwd_sm90_fetch(TileCounter, tile_ids, tile_ready, tile_free, n, n_tiles):
    """Loader: this program's next tile, handed to the consumers through slot n % 2 of tile_ids.
    Programs start on tile program_id and then take grid + (the launch's counter, post-
    incremented): the GPU balances the tiles of a causal mask, whose lengths a static order
    would deal out unevenly. A launch adds to its counter n_tiles times in all (n_tiles - grid
    tiles, then one past the end per program), so the add that reads n_tiles - 1 is its last and
    puts the counter back to 0 for the next launch on this stream."""
    old = gl.atomic_add(TileCounter, 1)
    if old == n_tiles - 1:
        gl.store(TileCounter, 0)
    slot = n % 2
    mbarrier.wait(tile_free.index(slot), ((n // 2) & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    tile_ids.index(slot).store(gl.full([1], gl.num_programs(0) + old, gl.int32, layout))
    mbarrier.arrive(tile_ready.index(slot), count=1)
    return gl.num_programs(0) + old


@gluon.jit
def _fwd_sm90_next(tile_ids, tile_ready, tile_free, n):
    """Consumer: the next tile, from slot n % 2 of tile_ids (_fwd_sm90_fetch)."""
    slot = n % 2
    mbarrier.wait(tile_ready.index(slot), (n // 2) & 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    tile = gl.max(tile_ids.index(slot).load(layout), 0)
    gl.thread_barrier()  # every warp of the partition has read the slot before it is freed
    mbarrier.arrive(tile_free.index(slot), count=1)
    return tile


@gluon.jit
def _fwd_sm90_load(q_desc, k_desc, v_desc, ring, call, MODS: gl.constexpr, CFG: gl.constexpr):
    """Loader partition, tile after tile: the Q halves into a Q buffer once every consumer is done
    with it (its output rows have left through it, or without O_TMA its last S is computed), then
    K_j and V_j into ring slot it % NUM_STAGES once both consumers have freed it (`it` counts K/V
    blocks across tiles). A tile whose rows see no key loads nothing: nobody would wait for it,
    and the program must not end with copies into its shared memory in flight. A packed batch
    (IS_VARLEN) is read as one sequence of total rows: batch coordinate 0, rows from the tile's
    sequence start."""
    q_bufs, k_bufs, v_bufs, q_bar, q_empty = ring.q_bufs, ring.k_bufs, ring.v_bufs, ring.q_bar, ring.q_empty
    k_ready, v_ready, k_empty, v_empty = ring.k_ready, ring.v_ready, ring.k_empty, ring.v_empty
    tile_ids, tile_ready, tile_free = ring.tile_ids, ring.tile_ready, ring.tile_free
    n_tiles = call.n_tiles
    PERSISTENT: gl.constexpr = CFG.PERSISTENT
    IS_VARLEN: gl.constexpr = CFG.IS_VARLEN
    NUM_STAGES: gl.constexpr = k_bufs.shape[0]
    Q_STAGES: gl.constexpr = q_bar.shape[0]
    CONSUMERS: gl.constexpr = q_bufs.shape[0] // Q_STAGES
    HALF_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    it = 0
    q_loads = 0
    n = 0
    tile = gl.program_id(0)
    while tile < n_tiles:
        start_m, b, h, hk, lo, full_lo, full_hi, n_blocks, q_start, sq_b, k_start, sk_b = _fwd_sm90_tile(
            tile, call, CONSUMERS * HALF_M, BLOCK_N, MODS, CFG)
        tb = 0 if IS_VARLEN else b
        if n_blocks > 0:
            # the empty barriers start in phase 0: the first round of waits (parity 1) passes at once
            qs = q_loads % Q_STAGES
            mbarrier.wait(q_empty.index(qs), ((q_loads // Q_STAGES) & 1) ^ 1)
            mbarrier.expect(q_bar.index(qs), CONSUMERS * q_desc.block_type.nbytes)
            for c in gl.static_range(CONSUMERS):
                tma.async_copy_global_to_shared(q_desc, [tb, q_start + start_m + c * HALF_M, h, 0], q_bar.index(qs),
                                                q_bufs.index(CONSUMERS * qs + c))
            q_loads += 1
        for j in range(n_blocks):
            stage = it % NUM_STAGES
            free = ((it // NUM_STAGES) & 1) ^ 1
            row = k_start + lo + j * BLOCK_N
            mbarrier.wait(k_empty.index(stage), free)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [tb, row, hk, 0], k_ready.index(stage), k_bufs.index(stage))
            mbarrier.wait(v_empty.index(stage), free)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [tb, row, hk, 0], v_ready.index(stage), v_bufs.index(stage))
            it += 1
        if PERSISTENT:
            tile = _fwd_sm90_fetch(call.TileCounter, tile_ids, tile_ready, tile_free, n, call.n_tiles)
        else:
            tile = n_tiles  # a program per tile: done
        n += 1


@gluon.jit
def _fwd_sm90_scores(s_tok, m_i, l_i, start_m, start_n, full_lo, full_hi, sk, diag_offset, slope, seed, bh, call,
                     MODS: gl.constexpr, IN_FLIGHT: gl.constexpr, HAS_DROPOUT: gl.constexpr,
                     ROWSUM_MMA: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, dtype: gl.constexpr):
    """Wait for S = Q K_j^T (IN_FLIGHT = 1: the P V product of block j - 1, issued after it, may
    still run), mask it if block j needs a mask, and update the online softmax in the log2
    domain: (p, alpha, m_new, l_new). ROWSUM_MMA: l_i is the tensor cores' row sums, which the
    caller rescales and adds to, and comes back as it is. MODS.softcap: the scores are capped
    (capped_sm90; qk_scale and softcap are softcap_scales'). MODS.alibi: after the cap, the bias
    -slope |i + diag_offset - j| (slope in alibi_unit_sm90's units). HAS_DROPOUT: the block's Philox calls
    (head bh) are made and their bytes compared four at a time (dropout_keep_bits_sm90) before the
    wait, while S is computed; l sums P before dropout, and the returned p (P V's operand) is P in
    the inputs' dtype with the dropped scores zeroed, applied to converted pairs
    (dropout_apply_sm90): 1.75 instructions a score where a compare and a select of each fp32
    score took 3."""
    left, right, qk_scale, softcap, threshold = call.left, call.right, call.qk_scale, call.softcap, call.threshold
    if HAS_DROPOUT:
        w0, w1 = dropout_words_sm90(seed, bh, start_m, start_n, HALF_M, BLOCK_N, False)
        m0 = dropout_keep_bits_sm90(w0, threshold)
        m1 = dropout_keep_bits_sm90(w1, threshold)
    qk = warpgroup_mma_wait(IN_FLIGHT, deps=(s_tok, ))
    s_layout: gl.constexpr = qk.type.layout
    rows = start_m + diag_offset + gl.arange(0, qk.shape[0], layout=gl.SliceLayout(1, s_layout))
    cols = start_n + gl.arange(0, qk.shape[1], layout=gl.SliceLayout(0, s_layout))
    qk, _ = score_mods_sm90(qk, rows, cols, slope, qk_scale, softcap, MODS)
    if (start_n < full_lo) | (start_n >= full_hi):
        offs_m = start_m + gl.arange(0, qk.shape[0], layout=gl.SliceLayout(1, s_layout))
        offs_n = start_n + gl.arange(0, qk.shape[1], layout=gl.SliceLayout(0, s_layout))
        ok = visible(offs_m[:, None], offs_n[None, :], diag_offset, sk, left, right, MODS)
        qk = gl.where(ok, qk, float("-inf"))
    # without a cap the max is taken on raw products and scaled after (qk_scale > 0), so exp2's
    # argument is one FMA
    scale = 1.0 if MODS.softcap else qk_scale
    m_new = gl.maximum(m_i, gl.max(qk, 1) * scale)
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2 gives 0, not NaN
    p = gl.exp2(qk * scale - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    l_new = l_i if ROWSUM_MMA else l_i * alpha + gl.sum(p, 1)
    if HAS_DROPOUT:
        p = dropout_apply_sm90(p, m0, m1, HALF_M, BLOCK_N, dtype)
    return p, alpha, m_new, l_new


@gluon.jit
def _fwd_sm90_epilogue(acc, m_i, l_i, b, h, row0, q_start, sq_b, o_desc, o_smem, by_tma, call, CFG: gl.constexpr,
                       O_TMA: gl.constexpr):
    """A consumer's rows row0 .. of a finished tile (batch b, head h): acc / l into Out and the LSE
    (natural log) into Lse, the Triton kernel's epilogue. m_i, l_i: the online softmax's row max
    (log2 domain) and sum, in the scores' row layout. With O_TMA and by_tma (a runtime flag) the rows
    go through o_smem (this consumer's Q buffer of the tile, which the caller hands back after) to
    the copy engine, which writes whole 16-byte pieces and clips rows past the sequence and columns
    past HEAD_DIM (o_desc, BSHD, a box of these rows); this waits until the copy has read them.
    Otherwise each thread stores its own pairs of columns, 4 bytes apiece: 64 rows of d=128 in 32
    stores a thread, whose traffic costs the forward most at short lengths (docs/tuning.md)."""
    Out, Lse, Sink, nheads, total_q = call.Out, call.Lse, call.Sink, call.nheads, call.total_q
    stride_ob, stride_om, stride_oh, dropout_scale = call.stride_ob, call.stride_om, call.stride_oh, call.dropout_scale
    HAS_SINK: gl.constexpr = CFG.HAS_SINK
    HAS_DROPOUT: gl.constexpr = CFG.HAS_DROPOUT
    IS_VARLEN: gl.constexpr = CFG.IS_VARLEN
    HEAD_DIM: gl.constexpr = CFG.HEAD_DIM
    o_layout: gl.constexpr = acc.type.layout
    HALF_M: gl.constexpr = acc.shape[0]
    BLOCK_D: gl.constexpr = acc.shape[1]
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    if HAS_SINK:
        acc, l_o, m_o = fold_sink(acc, l_o, m_o, Sink, h)
    # Rows that saw no key (nor a sink): l = 0 -> output 0 and LSE = -inf, as in the Triton kernel.
    empty = l_o == 0.0
    l_safe = gl.where(empty, 1.0, l_o)
    if HAS_DROPOUT:  # the kept products scaled by 1 / (1 - p)
        l_safe = l_safe / dropout_scale
    out = acc / l_safe[:, None]
    lse = gl.where(empty, float("-inf"), (m_o + gl.log2(gl.where(empty, 1.0, l_o))) * LN2)
    offs_m = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))
    if O_TMA:
        if by_tma:
            o_smem.reshape([HALF_M, BLOCK_D]).store(out.to(o_smem.dtype))
            fence_async_shared()  # the stores, before the copy engine reads them
            tma.async_copy_shared_to_global(o_desc, [0 if IS_VARLEN else b, q_start + row0, h, 0], o_smem)
            tma.store_wait(0)  # read out of shared memory: the caller may hand the buffer back
        else:
            _fwd_sm90_store_rows(out, Out, b, h, offs_m, q_start, sq_b, stride_ob, stride_om, stride_oh, HEAD_DIM)
    else:
        _fwd_sm90_store_rows(out, Out, b, h, offs_m, q_start, sq_b, stride_ob, stride_om, stride_oh, HEAD_DIM)
    gl.store(Lse + lse_row_base(b, h, nheads, sq_b, q_start, total_q, IS_VARLEN) + offs_m, lse, mask=offs_m < sq_b)


@gluon.jit
def _fwd_sm90_store_rows(out, Out, b, h, offs_m, q_start, sq_b, stride_ob, stride_om, stride_oh,
                         HEAD_DIM: gl.constexpr):
    """out's rows offs_m (those below sq_b) into Out from registers, the columns below HEAD_DIM."""
    o_layout: gl.constexpr = out.type.layout
    BLOCK_D: gl.constexpr = out.shape[1]
    offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = (Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
              + (q_start + offs_m)[:, None].to(gl.int64) * stride_om + offs_d[None, :])
    o_mask = offs_m[:, None] < sq_b
    if HEAD_DIM < BLOCK_D:  # the boxes' columns past the head dim (zeros): not stored
        o_mask = o_mask & (offs_d[None, :] < HEAD_DIM)
    gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)


@gluon.jit
def _fwd_sm90_consume(o_desc, ring, call, half, MODS: gl.constexpr, CFG: gl.constexpr):
    """A consumer warpgroup, tile after tile: rows start_m + half * HALF_M onwards over key blocks
    lo, lo + BLOCK_N, ..., then its part of the output and the LSE (the Triton kernel's epilogue)
    while the loader brings the next tile's Q and first K/V blocks. MODS.softcap: the scores are
    capped (_fwd_sm90_scores; softcap in the log2 domain). MODS.alibi: the tile's slope, of
    Slopes (h,) or (b, h), is read once and biases every block's scores. HAS_DROPOUT: as the Triton
    kernel, P V sees the keep-mask and l does not; a block's Philox calls are made while its S
    is computed. ROWSUM_MMA (three consumers): l is an [HALF_M, 8] register tile whose 8 columns
    are equal, to which each block adds P times `ones`, a product beside P V instead of an
    addition per score. The product starts from zero every block: accumulated across blocks by
    the tensor cores, whose additions keep fewer bits than fp32 and drop the rest, the sums of
    4M keys came out 2.4% low (LSE 0.024 below the Triton kernel's; docs/changelog.md, "Prefill
    forward: the Hopper kernel"), against 1e-5 with 128 keys a product. IS_VARLEN:
    the output's and the LSE's rows are the sequence's (Out's batch stride is 0, the LSE is (h,
    total_q)), and only its sq_b rows are stored. HAS_SINK: the attention sink joins each row's
    sum once, before the epilogue (the Triton kernel's fold_sink). O_TMA: the output rows leave
    through the tile's Q buffer and the copy engine (_fwd_sm90_epilogue; o_desc, over Out), so that
    buffer goes back to the loader after them rather than after the tile's last S; a packed batch's
    rows that end inside the 64 (the copy would write the next sequence's) and rows without keys
    (no Q buffer) are stored from registers."""
    q_bufs, k_bufs, v_bufs, ones, q_bar, q_empty = ring.q_bufs, ring.k_bufs, ring.v_bufs, ring.ones, ring.q_bar, ring.q_empty
    k_ready, v_ready, k_empty, v_empty = ring.k_ready, ring.v_ready, ring.k_empty, ring.v_empty
    tile_ids, tile_ready, tile_free = ring.tile_ids, ring.tile_ready, ring.tile_free
    n_tiles, nheads, qk_scale, Rng = call.n_tiles, call.nheads, call.qk_scale, call.Rng
    Slopes, stride_slope_b, stride_slope_h = call.Slopes, call.stride_slope_b, call.stride_slope_h
    left, right = call.left, call.right
    PERSISTENT: gl.constexpr = CFG.PERSISTENT
    HAS_DROPOUT: gl.constexpr = CFG.HAS_DROPOUT
    ROWSUM_MMA: gl.constexpr = CFG.ROWSUM_MMA
    IS_VARLEN: gl.constexpr = CFG.IS_VARLEN
    O_TMA: gl.constexpr = CFG.O_TMA
    NUM_STAGES: gl.constexpr = k_bufs.shape[0]
    Q_STAGES: gl.constexpr = q_bar.shape[0]
    CONSUMERS: gl.constexpr = q_bufs.shape[0] // Q_STAGES
    HALF_M: gl.constexpr = q_bufs.shape[2]
    BLOCK_N: gl.constexpr = k_bufs.shape[2]
    BLOCK_D: gl.constexpr = k_bufs.shape[4]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                       instr_shape=[16, BLOCK_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                       instr_shape=[16, 8, 16])
    dtype: gl.constexpr = q_bufs.dtype
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)  # ignored (use_acc=False): S's layout
    l_zero = gl.zeros([HALF_M, 8], gl.float32, l_layout)  # likewise, the row sums' layout
    seed = dropout_seed(Rng) if HAS_DROPOUT else 0
    it = 0
    q_loads = 0
    n = 0
    tile = gl.program_id(0)
    # TURNS: the two consumers issue a block's S and P V products by turns (FA3's warp-scheduler
    # barriers), each waiting at named barrier TURN_BARRIER + half for the other's pass; the first turn
    # is the first consumer's. The waits and passes pair up because both consumers walk the same
    # tiles with the same n_blocks (one turn each a block past the first). Not at d=256, where FA3
    # and FA4 leave them out too
    TURNS: gl.constexpr = CONSUMERS == 2 and BLOCK_D <= 128
    TURN_BARRIER: gl.constexpr = FIRST_FREE_BARRIER
    if TURNS:
        if half == 1:
            named_barrier_sm90(TURN_BARRIER, True)
    # DEFER_PV (two consumers, persistent, dropout): a tile's last P V is issued beside the next
    # tile's first S, whose softmax and Philox calls run under it, and the tile's rows are stored
    # after; pending while `it` > 0, with its operands, output rows and softmax state. Without
    # dropout the deferral measured slower (docs/tuning.md), so there a tile ends with its last
    # P V and its output; with a cap or ALiBi beside dropout it spills 368 / 460 bytes and was
    # not measured, so neither takes it.
    DEFER_PV: gl.constexpr = CONSUMERS == 2 and PERSISTENT and HAS_DROPOUT and not (MODS.softcap or MODS.alibi)
    # the tile's Q buffer holds its output rows on their way out, and is handed back after them. Not
    # with DEFER_PV, whose rows leave during the next tile, after this buffer went back; not with three
    # consumers and dropout either, whose 160 registers then spill into the block loop (a reload every
    # block at d=64, causal; none before), so those store from registers as they did
    Q_AFTER_OUT: gl.constexpr = O_TMA and not DEFER_PV and not (CONSUMERS == 3 and HAS_DROPOUT)
    p_last = gl.zeros([HALF_M, BLOCK_N], dtype, p_layout)
    acc_last = gl.zeros([HALF_M, BLOCK_D], gl.float32, o_layout)
    m_last = gl.full([HALF_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_last = gl.zeros([HALF_M], gl.float32, gl.SliceLayout(1, s_layout))
    b_last = 0
    h_last = 0
    row0_last = 0
    q_start_last = 0
    sq_b_last = 0
    while tile < n_tiles:
        start_m, b, h, hk, lo, full_lo, full_hi, n_blocks, q_start, sq_b, k_start, sk_b = _fwd_sm90_tile(
            tile, call, CONSUMERS * HALF_M, BLOCK_N, MODS, CFG)
        diag_offset = sk_b - sq_b
        row0 = start_m + half * HALF_M
        if MODS.alibi:
            slope = gl.load(Slopes + b * stride_slope_b + h * stride_slope_h) * alibi_unit_sm90(qk_scale, MODS)
        else:
            slope = 0.0
        acc = gl.zeros([HALF_M, BLOCK_D], gl.float32, o_layout)
        m_i = gl.full([HALF_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        if ROWSUM_MMA:
            l_i = gl.zeros([HALF_M, 8], gl.float32, l_layout)
        else:
            l_i = gl.zeros([HALF_M], gl.float32, gl.SliceLayout(1, s_layout))
        qs = q_loads % Q_STAGES
        if n_blocks > 0:
            mbarrier.wait(q_bar.index(qs), (q_loads // Q_STAGES) & 1)
            q = q_bufs.index(CONSUMERS * qs + half).reshape([HALF_M, BLOCK_D])
            if CONSUMERS == 2:
                stage = it % NUM_STAGES
                mbarrier.wait(k_ready.index(stage), (it // NUM_STAGES) & 1)
                k = k_bufs.index(stage).reshape([BLOCK_N, BLOCK_D]).permute((1, 0))
                s_tok = warpgroup_mma(q, k, s_zero, use_acc=False, is_async=True)
                if DEFER_PV:
                    if it > 0:  # the last tile's last P V runs under this S's softmax, then its rows are stored
                        last = (it - 1) % NUM_STAGES
                        mbarrier.wait(v_ready.index(last), ((it - 1) // NUM_STAGES) & 1)
                        o_tok = warpgroup_mma(p_last, v_bufs.index(last).reshape([BLOCK_N, BLOCK_D]), acc_last,
                                              is_async=True)
                        p, alpha, m_i, l_i = _fwd_sm90_scores(s_tok, m_i, l_i, row0, lo, full_lo, full_hi, sk_b,
                                                              diag_offset, slope, seed, b * nheads + h, call, MODS, 1,
                                                              HAS_DROPOUT, False, HALF_M, BLOCK_N, dtype)
                        acc_last, p_last = warpgroup_mma_wait(0, deps=(o_tok, p_last))
                        mbarrier.arrive(v_empty.index(last), count=1)
                        _fwd_sm90_epilogue(acc_last, m_last, l_last, b_last, h_last, row0_last, q_start_last,
                                           sq_b_last, o_desc, q_bufs, False, call, CFG, False)
                    else:
                        p, alpha, m_i, l_i = _fwd_sm90_scores(s_tok, m_i, l_i, row0, lo, full_lo, full_hi, sk_b,
                                                              diag_offset, slope, seed, b * nheads + h, call, MODS, 0,
                                                              HAS_DROPOUT, False, HALF_M, BLOCK_N, dtype)
                else:
                    p, alpha, m_i, l_i = _fwd_sm90_scores(s_tok, m_i, l_i, row0, lo, full_lo, full_hi, sk_b,
                                                          diag_offset, slope, seed, b * nheads + h, call, MODS, 0,
                                                          HAS_DROPOUT, False, HALF_M, BLOCK_N, dtype)
                mbarrier.arrive(k_empty.index(stage), count=1)
                for j in range(1, n_blocks):
                    prev = (it + j - 1) % NUM_STAGES
                    stage = (it + j) % NUM_STAGES
                    mbarrier.wait(k_ready.index(stage), ((it + j) // NUM_STAGES) & 1)
                    mbarrier.wait(v_ready.index(prev), ((it + j - 1) // NUM_STAGES) & 1)
                    p_op = gl.convert_layout(p.to(dtype), p_layout)
                    k = k_bufs.index(stage).reshape([BLOCK_N, BLOCK_D]).permute((1, 0))
                    if TURNS:  # this warpgroup's turn on the tensor cores
                        named_barrier_sm90(TURN_BARRIER + half, False)
                    s_tok = warpgroup_mma(q, k, s_zero, use_acc=False, is_async=True)
                    v = v_bufs.index(prev).reshape([BLOCK_N, BLOCK_D])
                    o_tok = warpgroup_mma(p_op, v, acc, is_async=True)
                    if TURNS:  # then the other's
                        named_barrier_sm90(TURN_BARRIER + 1 - half, True)
                    p, alpha, m_i, l_i = _fwd_sm90_scores(s_tok, m_i, l_i, row0, lo + j * BLOCK_N, full_lo, full_hi,
                                                          sk_b, diag_offset, slope, seed, b * nheads + h, call, MODS,
                                                          1, HAS_DROPOUT, False, HALF_M, BLOCK_N, dtype)
                    mbarrier.arrive(k_empty.index(stage), count=1)
                    # P_{j-1} is a register operand of the product in flight: it stays untouched until the
                    # product is done
                    acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
                    mbarrier.arrive(v_empty.index(prev), count=1)
                    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                if not Q_AFTER_OUT:
                    mbarrier.arrive(q_empty.index(qs), count=1)  # every S of the tile is done: its Q buffer is free
                if DEFER_PV:  # the last P V waits for the next tile's first S (or the end of the program)
                    p_last = gl.convert_layout(p.to(dtype), p_layout)
                    acc_last = acc
                    m_last = m_i
                    l_last = l_i
                    b_last = b
                    h_last = h
                    row0_last = row0
                    q_start_last = q_start
                    sq_b_last = sq_b
                else:
                    last = (it + n_blocks - 1) % NUM_STAGES
                    mbarrier.wait(v_ready.index(last), ((it + n_blocks - 1) // NUM_STAGES) & 1)
                    p_op = gl.convert_layout(p.to(dtype), p_layout)
                    o_tok = warpgroup_mma(p_op, v_bufs.index(last).reshape([BLOCK_N, BLOCK_D]), acc, is_async=True)
                    acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
                    mbarrier.arrive(v_empty.index(last), count=1)
            else:  # three consumers: each block's S, softmax and P V in turn (see the comment above)
                # this warpgroup's own rows' blocks: of the tile's blocks those its rows see none of
                # (under a causal mask the last one for the first two warpgroups) it only lets pass,
                # and those its rows see whole need no mask
                own_lo, own_full_lo, own_full_hi, own_hi = block_range(row0, HALF_M, BLOCK_N, sk_b, diag_offset,
                                                                       left, right, MODS.left, MODS.right)
                for j in range(n_blocks):
                    stage = (it + j) % NUM_STAGES
                    start_n = lo + j * BLOCK_N
                    mbarrier.wait(k_ready.index(stage), ((it + j) // NUM_STAGES) & 1)
                    if (start_n >= own_lo) & (start_n < own_hi):
                        k = k_bufs.index(stage).reshape([BLOCK_N, BLOCK_D]).permute((1, 0))
                        s_tok = warpgroup_mma(q, k, s_zero, use_acc=False, is_async=True)
                        p, alpha, m_i, l_i = _fwd_sm90_scores(s_tok, m_i, l_i, row0, start_n, own_full_lo, own_full_hi,
                                                              sk_b, diag_offset, slope, seed, b * nheads + h, call,
                                                              MODS, 0, HAS_DROPOUT, ROWSUM_MMA, HALF_M, BLOCK_N, dtype)
                        mbarrier.arrive(k_empty.index(stage), count=1)
                        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                        if ROWSUM_MMA:
                            l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, l_layout))[:, None]
                        p_op = gl.convert_layout(p.to(dtype), p_layout)
                        mbarrier.wait(v_ready.index(stage), ((it + j) // NUM_STAGES) & 1)
                        o_tok = warpgroup_mma(p_op, v_bufs.index(stage).reshape([BLOCK_N, BLOCK_D]), acc,
                                              is_async=True)
                        if ROWSUM_MMA:  # l += P times the columns of ones, P the register operand of both products
                            p_l = gl.convert_layout(p_op, gl.DotOperandLayout(operand_index=0, parent=l_layout,
                                                                              k_width=2))
                            l_tok = warpgroup_mma(p_l, ones.permute((1, 0)), l_zero, use_acc=False, is_async=True)
                            acc, l_block, p_op = warpgroup_mma_wait(0, deps=(o_tok, l_tok, p_op))
                            l_i = l_i + l_block
                        else:
                            acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
                    else:
                        mbarrier.arrive(k_empty.index(stage), count=1)
                        mbarrier.wait(v_ready.index(stage), ((it + j) // NUM_STAGES) & 1)
                    mbarrier.arrive(v_empty.index(stage), count=1)
                if not Q_AFTER_OUT:
                    mbarrier.arrive(q_empty.index(qs), count=1)
            it += n_blocks
            q_loads += 1
        if DEFER_PV:
            if n_blocks == 0:  # rows that see no key: stored at once
                _fwd_sm90_epilogue(acc, m_i, l_i, b, h, row0, q_start, sq_b, o_desc, q_bufs, False, call, CFG, False)
        else:
            if ROWSUM_MMA:
                l_i = gl.max(l_i, 1)
            by_tma = n_blocks > 0
            if IS_VARLEN:
                by_tma = by_tma & (row0 + HALF_M <= sq_b)
            _fwd_sm90_epilogue(acc, m_i, l_i, b, h, row0, q_start, sq_b, o_desc, q_bufs.index(CONSUMERS * qs + half),
                               by_tma, call, CFG, Q_AFTER_OUT)
            if Q_AFTER_OUT:
                if n_blocks > 0:
                    mbarrier.arrive(q_empty.index(qs), count=1)  # its rows are out: the Q buffer is free
        if PERSISTENT:
            tile = _fwd_sm90_next(tile_ids, tile_ready, tile_free, n)
        else:
            tile = n_tiles
        n += 1
    if DEFER_PV:
        if it > 0:  # the program's last tile
            last = (it - 1) % NUM_STAGES
            mbarrier.wait(v_ready.index(last), ((it - 1) // NUM_STAGES) & 1)
            o_tok = warpgroup_mma(p_last, v_bufs.index(last).reshape([BLOCK_N, BLOCK_D]), acc_last, is_async=True)
            acc_last, p_last = warpgroup_mma_wait(0, deps=(o_tok, p_last))
            mbarrier.arrive(v_empty.index(last), count=1)
            _fwd_sm90_epilogue(acc_last, m_last, l_last, b_last, h_last, row0_last, q_start_last, sq_b_last, o_desc,
                               q_bufs, False, call, CFG, False)


@gluon.jit(do_not_specialize=["n_tiles", "head_chunk", "n_m", "sq", "sk", "left", "right", "total_q", "total_k",
                              "threshold"])
def _fwd_kernel_sm90(Out, Lse, TileCounter, q_desc, k_desc, v_desc, o_desc, Rng, CuSeqQ, CuSeqK, SeqUsedK, Sink,
                     Slopes, stride_ob, stride_om, stride_oh, n_tiles, head_chunk, n_m, nheads, group, sq, sk,
                     left, right, qk_scale, softcap, threshold, dropout_scale, total_q, total_k, stride_slope_b,
                     stride_slope_h, MODS: gl.constexpr, CFG: gl.constexpr):
    """Persistent: a program per SM works through the n_m x heads x batch row blocks
    (_fwd_sm90_tile; with HEAD_CHUNKED in chunks of head_chunk heads), taking the next from a
    counter (_fwd_sm90_fetch), so one tile's output leaves while the next one's Q and K/V come in.
    IS_VARLEN: the batch is packed (q_desc, k_desc and v_desc over (1, total, heads, d) views), `batch`
    counts its sequences and sq / sk are the longest ones (the Triton kernel's flag). HAS_SINK: Sink,
    the (h,) attention sink, as there. MODS.softcap: capped scores (capped_sm90; qk_scale and softcap are
    softcap_scales'). MODS.alibi: Slopes, ALiBi slopes (h,) or (b, h), fp32, with their strides.
    HEAD_DIM: the tensors' head dim; the descriptors' boxes may be wider (configs.hopper_head_dim),
    their columns past it read as zeros, and the output's are not stored. O_TMA: o_desc, a box of a
    consumer's rows of Out (BSHD; packed: (1, total, heads, d)), takes the output rows
    (_fwd_sm90_epilogue); without it o_desc is q_desc and not read (a partition's argument cannot
    be None). Pointers and descriptors come before the scalars, as ops._launch.Prepared passes them.
    MODS: the score and mask mods (ops.mods.Mods); CFG: the kernel's other constexprs (ForwardFlags)."""
    CONSUMERS: gl.constexpr = CFG.CONSUMERS
    Q_STAGES: gl.constexpr = CFG.Q_STAGES
    NUM_STAGES: gl.constexpr = CFG.NUM_STAGES
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS * Q_STAGES] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_bar = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if CFG.ROWSUM_MMA:
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
        ones = gl.allocate_shared_memory(k_desc.dtype, [8, BLOCK_N], gl.NVMMASharedLayout(128, 16),
                                         gl.full([8, BLOCK_N], 1.0, k_desc.dtype,
                                                 gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])))
        fence_async_shared()  # the stores, before the tensor cores read them
    else:
        ones = tile_ids  # not read (a partition's argument cannot be None)
    for i in gl.static_range(Q_STAGES):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(tile_ready.index(i), count=1)
        mbarrier.init(tile_free.index(i), count=CONSUMERS)

    ring = FwdRing(q_bufs, k_bufs, v_bufs, ones, tile_ids, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                   tile_ready, tile_free)
    call = FwdCall(Out, Lse, TileCounter, Rng, CuSeqQ, CuSeqK, SeqUsedK, Sink, Slopes, stride_ob, stride_om, stride_oh,
                   n_tiles, head_chunk, n_m, nheads, group, sq, sk, left, right, qk_scale, softcap, threshold,
                   dropout_scale, total_q, total_k, stride_slope_b, stride_slope_h)
    # a partition's arguments are written in place (a tuple held in a variable cannot carry its function)
    if CONSUMERS == 3:
        gl.warp_specialize([(_fwd_sm90_consume, (o_desc, ring, call, 0, MODS, CFG)),
                            (_fwd_sm90_consume, (o_desc, ring, call, 1, MODS, CFG)),
                            (_fwd_sm90_consume, (o_desc, ring, call, 2, MODS, CFG)),
                            (_fwd_sm90_load, (q_desc, k_desc, v_desc, ring, call, MODS, CFG))],
                           [4, 4, 1], [HOPPER_THREE_CONSUMER_REGS, HOPPER_THREE_CONSUMER_REGS, HOPPER_LOADER_REGS])
    else:
        gl.warp_specialize([(_fwd_sm90_consume, (o_desc, ring, call, 0, MODS, CFG)),
                            (_fwd_sm90_consume, (o_desc, ring, call, 1, MODS, CFG)),
                            (_fwd_sm90_load, (q_desc, k_desc, v_desc, ring, call, MODS, CFG))],
                           [4, 1], [HOPPER_CONSUMER_REGS, HOPPER_LOADER_REGS])


def refusal(q, k, v, out, qk_scale, varlen, alibi_slopes) -> str | None:
    """Why _fwd_kernel_sm90 cannot take this call, or None: it takes BSHD batches and packed ones
    without a page table (dropout, softcap, ALiBi and sinks included) with a positive scale (its
    row max is taken on raw products, or with softcap on scores that rise with them), whose inputs
    TMA can address and whose output has a contiguous head dim."""
    if qk_scale <= 0:
        return "needs a positive softmax_scale"
    if varlen is not None and varlen.block_table is not None:
        return "reads no page table (paged K/V)"
    if out.stride(-1) != 1:
        return "writes an output with a contiguous head dim only"
    return tma_refusal(q=q, k=k, v=v) or alibi_refusal(alibi_slopes, q, k, varlen)


_TILE_COUNTERS = {}  # (device, CUDA stream) -> the int32 tile counter of _fwd_kernel_sm90's launches there


def tile_counter(device: torch.device) -> torch.Tensor:
    """The tile counter of a Hopper forward launch on the current stream. Eager launches on one
    stream run one after the other, so they share one, zeroed once and back to 0 at the end of
    every launch (_fwd_sm90_fetch); launches on different streams never share. Under CUDA-graph
    capture each launch gets its own, zeroed inside the graph, so graphs replayed side by side
    (or after a replay that was cut short) never meet a counter another launch is using."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=device)
    index = torch.cuda.current_device() if device.index is None else device.index
    key = (index, current_stream(index))
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        counter = _TILE_COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def plan(env: list, cfg, softmax_scale: float, window: tuple, softcap: float, varlen, dropout) -> Plan:
    """The launch of _fwd_kernel_sm90 for the call whose tensors are env (ops.prefill.forward_tensors,
    its COUNTER slot filled): tiles of cfg.block_m rows, 64 per consumer warpgroup
    (configs.hopper_forward_consumers; cfg.num_warps = 4 each); cfg.num_stages K/V buffers; a
    program per SM walking tiles where configs.hopper_forward_persistent says so, else a program
    per tile. varlen (a packed batch without a page table) and dropout hold env's tensors."""
    qk_scale, softcap = kernel_scale(softmax_scale, softcap)
    left, right = window
    q, k, v, out, lse, alibi_slopes, *_, sink, counter = env
    if softcap > 0:
        qk_scale, softcap = softcap_scales(qk_scale, softcap)
    h, d = q.shape[-2:]
    dp = configs.hopper_head_dim(d)  # the boxes' columns: those past d read as zeros and are not stored
    hk = k.shape[-2]
    b, sq, sk = grid_lengths(q, k, varlen)
    packed = varlen is not None  # one sequence of all the rows for the copy engine; the kernel finds each
    vl_tensors, (_, total_q, total_k, _, _), vl_flags = varlen_args(q, k, varlen)
    out_strides = seq_strides(out, packed)
    o_tma = tma_ok(out) and out.dtype == q.dtype  # the output rows leave through a Q buffer
    n_m = cdiv(sq, cfg.block_m)
    n_tiles = n_m * h * b
    persistent = configs.hopper_forward_persistent(dp)
    grid = (min(n_tiles, configs.num_sms(q.device)) if persistent else n_tiles, )
    rng, threshold, dropout_scale, has_dropout = dropout_args(dropout)
    consumers = cfg.block_m // 64  # 64 rows a consumer warpgroup (configs.hopper_forward_tiles)
    if consumers not in (2, 3):
        raise ValueError(f"the Hopper forward runs 128- or 192-row tiles, got block_m={cfg.block_m}")
    chunk = configs.hopper_forward_head_chunk(dp, sk, h // hk, right is not None, q.device)
    q_box = box_descriptor(q, cfg.block_m // consumers, dp, packed)
    return Plan.of(env, _fwd_kernel_sm90, grid,
            (out, lse, counter, q_box, box_descriptor(k, cfg.block_n, dp, packed),
             box_descriptor(v, cfg.block_n, dp, packed),
             box_descriptor(out, cfg.block_m // consumers, dp, packed) if o_tma else q_box,
             rng, *vl_tensors[:3], sink, alibi_slopes),
            (*out_strides[:3], n_tiles, chunk, n_m, h, h // hk, sq, sk, left or 0, right or 0, qk_scale, softcap,
             threshold, dropout_scale, total_q, total_k, *alibi_strides(alibi_slopes)),
            cfg.num_warps, None, hopper_forward_maxnreg(consumers),
            dict(MODS=Mods.of(window, softcap, alibi_slopes),
                 CFG=ForwardFlags(HEAD_DIM=d, NUM_STAGES=cfg.num_stages, Q_STAGES=configs.hopper_forward_q_stages(dp),
                                  CONSUMERS=consumers, PERSISTENT=persistent,
                                  HEAD_CHUNKED=configs.hopper_forward_chunked(dp, right is not None),
                                  IS_VARLEN=vl_flags["IS_VARLEN"], HAS_SEQUSED=vl_flags["HAS_SEQUSED"],
                                  HAS_DROPOUT=has_dropout, HAS_SINK=sink is not None, O_TMA=o_tma,
                                  ROWSUM_MMA=not has_dropout and consumers == 3)))

