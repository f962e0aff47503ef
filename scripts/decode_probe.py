"""Where a decoding kernel's time goes past the read floor: its loop's pieces on its own grid.

    PYTHONPATH=src python scripts/decode_probe.py [BATCHxCONTEXTxSPLITS,...] [--quick]
    PYTHONPATH=src python scripts/decode_probe.py --access [BATCHxCONTEXTxSPLITS,...]
    PYTHONPATH=src python scripts/decode_probe.py --pages [BATCHxCONTEXTxSPLITS,...]
    PYTHONPATH=src ncu ... python scripts/decode_probe.py --ncu [BATCHxCONTEXTxSPLITS]

Per shape (fp16, 2 KV heads of 128, 8 query rows a KV head), device time by CUDA-graph replay over
four rotating caches, all in one process:
- floor: bench decode's read floor (every byte once, many small programs);
- m0: programs on the split kernel's grid (splits, kv heads, batch) that stream their keys tile after
  tile (tl.load, pipelined by num_stages) and write one number;
- m1: the online softmax with tl.dot on 16 query rows (8 real), no masks, over the same keys; the 8
  rows' output in fp16 (2 KB a program);
- m2: m1 with the key range from a lengths tensor and masked loads, as the split kernel;
- m3: m1 with each warp on its own keys of a tile (a batched tl.dot), the warps' states merged once;
- g1: m3 in Gluon: each warp copies its own keys into shared memory (cp.async, STAGES deep, one
  barrier a tile), its P stays in registers for P V, and the warps' states merge once through a
  padded shared tile;
- g2: g1 with the products turned round (S^T = K Q^T, O^T = V^T P^T) on the 8 real rows: the form
  ops.decode_sm90._split_kernel_warps took (decode_probe_gluon.txt);
- g3: g2 in a persistent launch of 1 or 2 programs an SM, each taking g2's programs as items of one
  stream of tiles, q copied through the ring (probe_gluon_p; compiled for sm_90 on the CPU, not yet
  run on a GPU);
- flashtile: flash_attn_with_kvcache(cache_seqlens=..., num_splits=SPLITS), merge included.
Tiles are BLOCK_N x warps x stages; 64 x 4 x 2 is what the split kernel takes.
"""
import itertools
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

import flashtile
from flashtile.bench.decode import _read_floor

TILES = ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2))
MODES = (0, 1, 2, 3)
GLUON_TILES = ((16, 4, 2), (16, 4, 3), (16, 4, 4), (32, 4, 2), (16, 8, 2))  # keys a warp, warps, stages
# g3's: keys a warp, warps, stages, programs an SM (its grid: min(items, this x SMs)); shared memory
# 141 / 182 KB at 3 / 4 stages (a q ring of its own beside the keys'), 100 KB at 2: two fit an SM
PROBE_W_REGS = gl.constexpr(168)  # each of g4's and g5's compute warps (the default partition keeps the launch's)
PROBE_LOAD_REGS = gl.constexpr(80)  # g5's loader warp
G3_TILES = ((16, 4, 3, 1), (16, 4, 4, 1), (16, 4, 2, 2))


@triton.jit
def probe(Q, K, V, Out, Lens, s, num_splits, stride_b, stride_n, stride_h, D: tl.constexpr, BLOCK_N: tl.constexpr,
          MODE: tl.constexpr, W: tl.constexpr = 1):
    """One program: keys [split x per_split, ...) of (batch, kv head) as the split kernel cuts them;
    MODE 0 streams them, 1 adds the online softmax of 16 query rows, 2 the lengths and masks."""
    split = tl.program_id(0)
    kh = tl.program_id(1)
    b = tl.program_id(2)
    base = b.to(tl.int64) * stride_b + kh * stride_h
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    rows = tl.arange(0, 16)
    program = (b * tl.num_programs(1) + kh) * tl.num_programs(0) + split
    n = s
    if MODE == 2:
        n = tl.load(Lens + b)
    per_split = tl.cdiv(tl.cdiv(n, BLOCK_N), num_splits) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n)
    if MODE == 0:
        total = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            ptr = base + (start + offs_n)[:, None] * stride_n + offs_d[None, :]
            total += tl.load(K + ptr).to(tl.float32) * tl.load(V + ptr).to(tl.float32)
        tl.store(Out + program * 8 * D, tl.sum(total))  # one number: no output traffic
    elif MODE == 3:
        # m1 with each of the W warps on its own BLOCK_N / W keys of a tile: a batched dot puts one
        # warp on each batch, so the row max and sum stay inside a warp and P feeds the P V product
        # from registers; the W running states merge once, after the loop
        KW: tl.constexpr = BLOCK_N // W
        q = tl.load(Q + (b * tl.num_programs(1) + kh) * 16 * D + rows[:, None] * D + offs_d[None, :],
                    mask=rows[:, None] < 8, other=0.0)
        q3 = tl.broadcast_to(q[None, :, :], [W, 16, D])
        m_i = tl.full([W, 16], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([W, 16], dtype=tl.float32)
        acc = tl.zeros([W, 16, D], dtype=tl.float32)
        keys = tl.arange(0, W)[:, None] * KW + tl.arange(0, KW)[None, :]
        for start in range(lo, hi, BLOCK_N):
            rows_kv = base + (start + keys) * stride_n
            k_t = tl.load(K + rows_kv[:, None, :] + offs_d[None, :, None])  # K^T as loaded: (W, D, KW)
            v = tl.load(V + rows_kv[:, :, None] + offs_d[None, None, :])
            qk = tl.dot(q3, k_t) * 0.125
            m_new = tl.maximum(m_i, tl.max(qk, 2))
            p = tl.exp2(qk - m_new[:, :, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 2)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, :, None])
            m_i = m_new
        m = tl.max(m_i, 0)
        scale = tl.exp2(m_i - m[None, :])
        out = tl.sum(acc * scale[:, :, None], 0) / tl.sum(l_i * scale, 0)[:, None]
        tl.store(Out + program * 8 * D + rows[:, None] * D + offs_d[None, :], out.to(tl.float16),
                 mask=rows[:, None] < 8)
    else:
        q = tl.load(Q + (b * tl.num_programs(1) + kh) * 16 * D + rows[:, None] * D + offs_d[None, :],
                    mask=rows[:, None] < 8, other=0.0)
        m_i = tl.full([16], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([16], dtype=tl.float32)
        acc = tl.zeros([16, D], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n
            ptr = base + pos[:, None] * stride_n + offs_d[None, :]
            if MODE == 2:
                ok = pos < hi
                k = tl.load(K + ptr, mask=ok[:, None], other=0.0)
                v = tl.load(V + ptr, mask=ok[:, None], other=0.0)
            else:
                k = tl.load(K + ptr)
                v = tl.load(V + ptr)
            qk = tl.dot(q, tl.trans(k)) * 0.125
            if MODE == 2:
                qk = tl.where(ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        # the 8 real rows in fp16, as the split kernel's final output (no splits) or half its fp32 partial
        tl.store(Out + program * 8 * D + rows[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(tl.float16),
                 mask=rows[:, None] < 8)


@gluon.jit
def probe_gluon(Q, K, V, Out, s, num_splits, stride_b, stride_n, stride_h, qk_scale, D: gl.constexpr,
                KW: gl.constexpr, STAGES: gl.constexpr):
    """m1's keys and output with each of the program's warps on its own KW keys of a tile."""
    W: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(2, mma)  # (W, 16)
    copy_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 256 // D, D // 8], [W, 1, 1], [2, 1, 0])
    ring_l: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0])

    split = gl.program_id(0)
    kh = gl.program_id(1)
    b = gl.program_id(2)
    program = (b * gl.num_programs(1) + kh) * gl.num_programs(0) + split
    base = b.to(gl.int64) * stride_b + kh * stride_h
    TILE: gl.constexpr = W * KW
    per_split = gl.cdiv(gl.cdiv(s, TILE), num_splits) * TILE
    lo = split * per_split
    n_tiles = (gl.minimum(lo + per_split, s) - lo) // TILE

    # the 16 query rows (8 real), the same for every warp
    qw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, a_op)))
    qr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, a_op)))
    qd = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, a_op)))
    q_rows = qr[None, :, None] + 0 * qw[:, None, None]
    q = gl.load(Q + (b * gl.num_programs(1) + kh) * 16 * D + q_rows * D + qd[None, None, :], mask=q_rows < 8,
                other=0.0)

    # warp w copies keys [start + w KW, start + (w + 1) KW) of a tile
    cw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, copy_l)))
    ck = gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(2, copy_l)))
    cd = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, copy_l)))
    offs = base + (lo + cw[:, None, None] * KW + ck[None, :, None]).to(gl.int64) * stride_n + cd[None, None, :]
    k_ring = gl.allocate_shared_memory(gl.float16, [STAGES, W, KW, D], ring_l)
    v_ring = gl.allocate_shared_memory(gl.float16, [STAGES, W, KW, D], ring_l)
    for i in gl.static_range(STAGES - 1):
        ok = i < n_tiles
        async_copy.async_copy_global_to_shared(k_ring.index(i), K + offs + i * TILE * stride_n, mask=ok)
        async_copy.async_copy_global_to_shared(v_ring.index(i), V + offs + i * TILE * stride_n, mask=ok)
        async_copy.commit_group()

    m_i = gl.full([W, 16], float("-inf"), gl.float32, row_l)
    l_i = gl.zeros([W, 16], gl.float32, row_l)
    acc = gl.zeros([W, 16, D], gl.float32, mma)
    for t in range(n_tiles):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()  # tile t is in, and every warp is done with tile t - 1's slot
        nxt = t + STAGES - 1
        ok = nxt < n_tiles
        async_copy.async_copy_global_to_shared(k_ring.index(nxt % STAGES), K + offs + nxt * TILE * stride_n, mask=ok)
        async_copy.async_copy_global_to_shared(v_ring.index(nxt % STAGES), V + offs + nxt * TILE * stride_n, mask=ok)
        async_copy.commit_group()
        slot = t % STAGES
        k_t = k_ring.index(slot).permute((0, 2, 1)).load(b_op)
        qk = mma_v2(q, k_t, gl.zeros([W, 16, KW], gl.float32, mma)) * qk_scale
        m_new = gl.maximum(m_i, gl.max(qk, 2))
        p = gl.exp2(qk - gl.expand_dims(m_new, 2))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 2)
        v = v_ring.index(slot).load(b_op)
        acc = mma_v2(gl.convert_layout(p.to(gl.float16), a_op), v, acc * gl.expand_dims(alpha, 2))
        m_i = m_new
    async_copy.wait_group(0)

    # the warps' states, merged once: rescale to the common max, sum through a padded shared tile
    m = gl.max(m_i, 0)
    scale = gl.exp2(m_i - gl.expand_dims(m, 0))
    l = gl.sum(l_i * scale, 0)
    o_smem = gl.allocate_shared_memory(gl.float32, [W, 16, D],
                                       gl.PaddedSharedLayout.with_identity_for([[D, 8]], [W, 16, D], [2, 1, 0]))
    o_smem.store(acc * gl.expand_dims(scale, 2))
    gl.thread_barrier()
    red: gl.constexpr = gl.BlockedLayout([W, 1, 4], [1, 1, 32], [1, W, 1], [2, 1, 0])
    out_l: gl.constexpr = gl.SliceLayout(0, red)
    o = gl.sum(o_smem.load(red), 0)
    o = o / gl.expand_dims(gl.convert_layout(l, gl.SliceLayout(1, out_l)), 1)
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, out_l))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, out_l))
    gl.store(Out + program * 8 * D + r[:, None] * D + c[None, :], o.to(gl.float16), mask=r[:, None] < 8)


@gluon.jit
def probe_gluon_t(Q, K, V, Out, s, num_splits, stride_b, stride_n, stride_h, qk_scale, D: gl.constexpr,
                  KW: gl.constexpr, STAGES: gl.constexpr, COMPUTE: gl.constexpr = True, PARTS: gl.constexpr = 3):
    """probe_gluon with the products turned round, S^T = K Q^T and O^T = V^T P^T, on the 8 real rows
    (the MMA's N is 8): no padded rows, so half the multiplies and a 32-register accumulator.
    COMPUTE False (--access's c2): the ring of copies alone, every tile waited for and nothing done
    with it; the output is the zero state's (not checked). PARTS: _probe_t_step's pieces."""
    W: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    col_l: gl.constexpr = gl.SliceLayout(1, mma)  # (W, 8): a statistic per query row
    copy_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 256 // D, D // 8], [W, 1, 1], [2, 1, 0])
    ring_l: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0])

    split = gl.program_id(0)
    kh = gl.program_id(1)
    b = gl.program_id(2)
    program = (b * gl.num_programs(1) + kh) * gl.num_programs(0) + split
    base = b.to(gl.int64) * stride_b + kh * stride_h
    TILE: gl.constexpr = W * KW
    per_split = gl.cdiv(gl.cdiv(s, TILE), num_splits) * TILE
    lo = split * per_split
    n_tiles = (gl.minimum(lo + per_split, s) - lo) // TILE

    # Q^T (D, 8), the same for every warp
    qw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, b_op)))
    qd = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, b_op)))
    qr = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, b_op)))
    q_t = gl.load(Q + (b * gl.num_programs(1) + kh) * 16 * D + qr[None, None, :] * D + qd[None, :, None]
                  + 0 * qw[:, None, None])

    cw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, copy_l)))
    ck = gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(2, copy_l)))
    cd = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, copy_l)))
    offs = base + (lo + cw[:, None, None] * KW + ck[None, :, None]).to(gl.int64) * stride_n + cd[None, None, :]
    k_ring = gl.allocate_shared_memory(gl.float16, [STAGES, W, KW, D], ring_l)
    v_ring = gl.allocate_shared_memory(gl.float16, [STAGES, W, KW, D], ring_l)
    for i in gl.static_range(STAGES - 1):
        ok = i < n_tiles
        async_copy.async_copy_global_to_shared(k_ring.index(i), K + offs + i * TILE * stride_n, mask=ok)
        async_copy.async_copy_global_to_shared(v_ring.index(i), V + offs + i * TILE * stride_n, mask=ok)
        async_copy.commit_group()

    m_i = gl.full([W, 8], float("-inf"), gl.float32, col_l)
    l_i = gl.zeros([W, 8], gl.float32, col_l)
    acc = gl.zeros([W, D, 8], gl.float32, mma)
    for t in range(n_tiles):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        nxt = t + STAGES - 1
        ok = nxt < n_tiles
        async_copy.async_copy_global_to_shared(k_ring.index(nxt % STAGES), K + offs + nxt * TILE * stride_n, mask=ok)
        async_copy.async_copy_global_to_shared(v_ring.index(nxt % STAGES), V + offs + nxt * TILE * stride_n, mask=ok)
        async_copy.commit_group()
        if COMPUTE:
            slot = t % STAGES
            m_i, l_i, acc = _probe_t_step(k_ring.index(slot), v_ring.index(slot), q_t, m_i, l_i, acc, qk_scale, KW,
                                          PARTS)
    async_copy.wait_group(0)

    o_smem = gl.allocate_shared_memory(gl.float32, [W, D, 8],
                                       gl.PaddedSharedLayout.with_identity_for([[32, 4]], [W, D, 8], [2, 1, 0]))
    _probe_t_store(o_smem, m_i, l_i, acc, Out + program * 8 * D, D)


@gluon.jit
def _probe_w_loop(Q, K, V, k_ring, v_ring, states, ms, ls, base, lo, n_tiles, q_off, stride_n, qk_scale,
                  w: gl.constexpr, W: gl.constexpr, D: gl.constexpr, KW: gl.constexpr, STAGES: gl.constexpr):
    """g4's warp w, a partition of one warp: keys lo + t W KW + w KW + [0, KW) of tile t through its
    own slots of the ring (STAGES deep: slot t % STAGES of warp w is k_ring[(t % STAGES) W + w]),
    g2's products turned round. Its barrier a tile is its own warp's (bar.warp.sync), so no warp
    waits for another in the loop. Its state goes to rows [w D, (w + 1) D) of states (acc (D, 8)),
    and m, l (8,) to ms[8 w, 8 w + 8), ls[8 w, 8 w + 8)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)  # (8,): a statistic per query row
    copy_l: gl.constexpr = gl.BlockedLayout([1, 8], [256 // D, D // 8], [1, 1], [1, 0])
    TILE: gl.constexpr = W * KW

    qd = gl.arange(0, D, layout=gl.SliceLayout(1, b_op))
    qr = gl.arange(0, 8, layout=gl.SliceLayout(0, b_op))
    q_t = gl.load(Q + q_off + qr[None, :] * D + qd[:, None])  # Q^T (D, 8)
    ck = gl.arange(0, KW, layout=gl.SliceLayout(1, copy_l))
    cd = gl.arange(0, D, layout=gl.SliceLayout(0, copy_l))
    offs = base + (lo + w * KW + ck[:, None]).to(gl.int64) * stride_n + cd[None, :]
    for i in gl.static_range(STAGES - 1):
        ok = i < n_tiles
        async_copy.async_copy_global_to_shared(k_ring.index(i * W + w), K + offs + i * TILE * stride_n, mask=ok)
        async_copy.async_copy_global_to_shared(v_ring.index(i * W + w), V + offs + i * TILE * stride_n, mask=ok)
        async_copy.commit_group()

    m_i = gl.full([8], float("-inf"), gl.float32, col_l)
    l_i = gl.zeros([8], gl.float32, col_l)
    acc = gl.zeros([D, 8], gl.float32, mma)
    for t in range(n_tiles):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()  # this warp's
        nxt = t + STAGES - 1
        ok = nxt < n_tiles
        async_copy.async_copy_global_to_shared(k_ring.index(nxt % STAGES * W + w), K + offs + nxt * TILE * stride_n,
                                               mask=ok)
        async_copy.async_copy_global_to_shared(v_ring.index(nxt % STAGES * W + w), V + offs + nxt * TILE * stride_n,
                                               mask=ok)
        async_copy.commit_group()
        slot = t % STAGES
        s_t = mma_v2(k_ring.index(slot * W + w).load(a_op), q_t, gl.zeros([KW, 8], gl.float32, mma)) * qk_scale
        m_new = gl.maximum(m_i, gl.max(s_t, 0))
        p_t = gl.exp2(s_t - gl.expand_dims(m_new, 0))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p_t, 0)
        acc = mma_v2(v_ring.index(slot * W + w).permute((1, 0)).load(a_op), gl.convert_layout(p_t.to(gl.float16), b_op),
                     acc * gl.expand_dims(alpha, 0))
        m_i = m_new
    async_copy.wait_group(0)
    states.slice(w * D, D).store(acc)
    ms.slice(w * 8, 8).store(m_i)
    ls.slice(w * 8, 8).store(l_i)


@gluon.jit
def _probe_w_merge(states, ms, ls, Out, W: gl.constexpr, D: gl.constexpr):
    """g4's and g5's end, on the launch's four warps: the compute warps' states (states (W D, 8),
    ms and ls (W 8,)) onto their common max and summed, the 8 rows' output stored at Out (8, D)."""
    red: gl.constexpr = gl.BlockedLayout([W, 1, 8], [1, 32, 1], [1, 4, 1], [2, 1, 0])  # (W, D, 8)
    st_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # (W 8,)
    m_w = gl.reshape(ms.load(st_l), [W, 8])
    l_w = gl.reshape(ls.load(st_l), [W, 8])
    m = gl.max(m_w, 0)
    scale = gl.exp2(m_w - gl.expand_dims(m, 0))
    l = gl.sum(l_w * scale, 0)
    scale = gl.convert_layout(scale, gl.SliceLayout(1, red))
    acc = gl.convert_layout(gl.reshape(states.load(gl.BlockedLayout([1, 8], [32, 1], [4, 1], [1, 0])), [W, D, 8]), red)
    o = gl.sum(acc * gl.expand_dims(scale, 1), 0)  # (D, 8)
    o = o / gl.expand_dims(gl.convert_layout(l, gl.SliceLayout(0, gl.SliceLayout(0, red))), 0)
    c = gl.arange(0, D, layout=gl.SliceLayout(1, gl.SliceLayout(0, red)))
    r = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, red)))
    gl.store(Out + r[None, :] * D + c[:, None], o.to(gl.float16))


@gluon.jit
def _probe_w_idle():
    pass


@gluon.jit
def probe_gluon_w(Q, K, V, Out, s, num_splits, stride_b, stride_n, stride_h, qk_scale, D: gl.constexpr,
                  KW: gl.constexpr, STAGES: gl.constexpr):
    """g4: g2 with each of its four warps a partition of its own (gl.warp_specialize), so a tile's
    barrier is a warp's and not the program's; the launch's four warps (the default partition, a
    multiple of four warps) wait meanwhile and merge the states after the partitions join."""
    W: gl.constexpr = 4
    # layouts of one buffer: the leading dimension of each allocation picks the buffer
    ring_l: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    flat2: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    flat1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    split = gl.program_id(0)
    kh = gl.program_id(1)
    b = gl.program_id(2)
    program = (b * gl.num_programs(1) + kh) * gl.num_programs(0) + split
    base = b.to(gl.int64) * stride_b + kh * stride_h
    TILE: gl.constexpr = W * KW
    per_split = gl.cdiv(gl.cdiv(s, TILE), num_splits) * TILE
    lo = split * per_split
    n_tiles = (gl.minimum(lo + per_split, s) - lo) // TILE
    q_off = (b * gl.num_programs(1) + kh) * 16 * D
    k_ring = gl.allocate_shared_memory(gl.float16, [STAGES * W, KW, D], ring_l)  # slot, warp
    v_ring = gl.allocate_shared_memory(gl.float16, [STAGES * W, KW, D], ring_l)  # slot, warp
    states = gl.allocate_shared_memory(gl.float32, [W * D, 8], flat2)
    ms = gl.allocate_shared_memory(gl.float32, [W * 8], flat1)
    ls = gl.allocate_shared_memory(gl.float32, [W * 8], flat1)
    gl.warp_specialize([
        (_probe_w_idle, ()),
        (_probe_w_loop, (Q, K, V, k_ring, v_ring, states, ms, ls, base, lo, n_tiles, q_off, stride_n, qk_scale, 0, W,
                         D, KW, STAGES)),
        (_probe_w_loop, (Q, K, V, k_ring, v_ring, states, ms, ls, base, lo, n_tiles, q_off, stride_n, qk_scale, 1, W,
                         D, KW, STAGES)),
        (_probe_w_loop, (Q, K, V, k_ring, v_ring, states, ms, ls, base, lo, n_tiles, q_off, stride_n, qk_scale, 2, W,
                         D, KW, STAGES)),
        (_probe_w_loop, (Q, K, V, k_ring, v_ring, states, ms, ls, base, lo, n_tiles, q_off, stride_n, qk_scale, 3, W,
                         D, KW, STAGES)),
    ], [1, 1, 1, 1], [PROBE_W_REGS, PROBE_W_REGS, PROBE_W_REGS, PROBE_W_REGS])
    gl.thread_barrier()
    _probe_w_merge(states, ms, ls, Out + program * 8 * D, W, D)


@gluon.jit
def _probe_ws_load(K, V, k_ring, v_ring, full, empty, base, lo, n_tiles, stride_n, W: gl.constexpr, D: gl.constexpr,
                   KW: gl.constexpr, STAGES: gl.constexpr):
    """g5's loader, a partition of one warp: tile t's keys into slot t % STAGES (warp w's KW of them
    at k_ring[(t % STAGES) W + w]) once the four compute warps have handed the slot back (empty),
    each lane's copies counted on full[slot] as they land (cp.async's mbarrier arrive)."""
    copy_l: gl.constexpr = gl.BlockedLayout([1, 8], [256 // D, D // 8], [1, 1], [1, 0])
    TILE: gl.constexpr = W * KW
    ck = gl.arange(0, KW, layout=gl.SliceLayout(1, copy_l))
    cd = gl.arange(0, D, layout=gl.SliceLayout(0, copy_l))
    offs = base + (lo + ck[:, None]).to(gl.int64) * stride_n + cd[None, :]
    for t in range(n_tiles):
        slot = t % STAGES
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
        for w in gl.static_range(W):
            rows = (t * TILE + w * KW) * stride_n
            async_copy.async_copy_global_to_shared(k_ring.index(slot * W + w), K + offs + rows)
            async_copy.async_copy_global_to_shared(v_ring.index(slot * W + w), V + offs + rows)
        async_copy.mbarrier_arrive(full.index(slot), increment_count=False)  # the arrival of this lane


@gluon.jit
def _probe_ws_compute(Q, k_ring, v_ring, full, empty, states, ms, ls, n_tiles, q_off, qk_scale, w: gl.constexpr,
                      W: gl.constexpr, D: gl.constexpr, KW: gl.constexpr, STAGES: gl.constexpr,
                      TMA: gl.constexpr = False, COMPUTE: gl.constexpr = True):
    """g5's compute warp w, a partition of one warp: g4's online softmax over its KW keys of each
    tile, waiting for the slot's copies (full) and handing the slot back after its P V (empty).
    TMA (g6): a slot is one TMA box of the tile's W KW keys (1, W KW, 1, D), warp w's the rows
    [w KW, (w + 1) KW) of it. COMPUTE False (c6): each slot waited for and handed back, nothing
    computed."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    qd = gl.arange(0, D, layout=gl.SliceLayout(1, b_op))
    qr = gl.arange(0, 8, layout=gl.SliceLayout(0, b_op))
    q_t = gl.load(Q + q_off + qr[None, :] * D + qd[:, None])
    m_i = gl.full([8], float("-inf"), gl.float32, col_l)
    l_i = gl.zeros([8], gl.float32, col_l)
    acc = gl.zeros([D, 8], gl.float32, mma)
    for t in range(n_tiles):
        slot = t % STAGES
        mbarrier.wait(full.index(slot), (t // STAGES) & 1)
        if COMPUTE:
            if TMA:
                k_slot = k_ring.index(slot).reshape([W * KW, D]).slice(w * KW, KW)
                v_slot = v_ring.index(slot).reshape([W * KW, D]).slice(w * KW, KW)
            else:
                k_slot = k_ring.index(slot * W + w)
                v_slot = v_ring.index(slot * W + w)
            s_t = mma_v2(k_slot.load(a_op), q_t, gl.zeros([KW, 8], gl.float32, mma)) * qk_scale
            m_new = gl.maximum(m_i, gl.max(s_t, 0))
            p_t = gl.exp2(s_t - gl.expand_dims(m_new, 0))
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p_t, 0)
            acc = mma_v2(v_slot.permute((1, 0)).load(a_op), gl.convert_layout(p_t.to(gl.float16), b_op),
                         acc * gl.expand_dims(alpha, 0))
            m_i = m_new
        mbarrier.arrive(empty.index(slot), count=1)
    states.slice(w * D, D).store(acc)
    ms.slice(w * 8, 8).store(m_i)
    ls.slice(w * 8, 8).store(l_i)


@gluon.jit
def probe_gluon_ws(Q, K, V, Out, s, num_splits, stride_b, stride_n, stride_h, qk_scale, D: gl.constexpr,
                   KW: gl.constexpr, STAGES: gl.constexpr):
    """g5: g4's four compute warps fed by a loader warp of their own through per-slot mbarriers, so
    a slot is refilled as soon as the four have read it and no compute warp issues a copy; the
    launch's four warps wait meanwhile and merge the states as g4's."""
    W: gl.constexpr = 4
    ring_l: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    flat2: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    flat1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    split = gl.program_id(0)
    kh = gl.program_id(1)
    b = gl.program_id(2)
    program = (b * gl.num_programs(1) + kh) * gl.num_programs(0) + split
    base = b.to(gl.int64) * stride_b + kh * stride_h
    TILE: gl.constexpr = W * KW
    per_split = gl.cdiv(gl.cdiv(s, TILE), num_splits) * TILE
    lo = split * per_split
    n_tiles = (gl.minimum(lo + per_split, s) - lo) // TILE
    q_off = (b * gl.num_programs(1) + kh) * 16 * D
    k_ring = gl.allocate_shared_memory(gl.float16, [STAGES * W, KW, D], ring_l)
    v_ring = gl.allocate_shared_memory(gl.float16, [STAGES * W, KW, D], ring_l)
    states = gl.allocate_shared_memory(gl.float32, [W * D, 8], flat2)
    ms = gl.allocate_shared_memory(gl.float32, [W * 8], flat1)
    ls = gl.allocate_shared_memory(gl.float32, [W * 8], flat1)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=32)  # the loader's lanes, each when its copies land
        mbarrier.init(empty.index(i), count=W)
    gl.warp_specialize([
        (_probe_w_idle, ()),
        (_probe_ws_load, (K, V, k_ring, v_ring, full, empty, base, lo, n_tiles, stride_n, W, D, KW, STAGES)),
        (_probe_ws_compute, (Q, k_ring, v_ring, full, empty, states, ms, ls, n_tiles, q_off, qk_scale, 0, W, D, KW,
                             STAGES)),
        (_probe_ws_compute, (Q, k_ring, v_ring, full, empty, states, ms, ls, n_tiles, q_off, qk_scale, 1, W, D, KW,
                             STAGES)),
        (_probe_ws_compute, (Q, k_ring, v_ring, full, empty, states, ms, ls, n_tiles, q_off, qk_scale, 2, W, D, KW,
                             STAGES)),
        (_probe_ws_compute, (Q, k_ring, v_ring, full, empty, states, ms, ls, n_tiles, q_off, qk_scale, 3, W, D, KW,
                             STAGES)),
    ], [1, 1, 1, 1, 1], [PROBE_LOAD_REGS, PROBE_W_REGS, PROBE_W_REGS, PROBE_W_REGS, PROBE_W_REGS])
    gl.thread_barrier()
    _probe_w_merge(states, ms, ls, Out + program * 8 * D, W, D)


@gluon.jit
def _probe_tma_load(k_desc, v_desc, k_ring, v_ring, full, empty, b, kh, lo, n_tiles, TILE: gl.constexpr,
                    STAGES: gl.constexpr):
    """g6's loader, a partition of one warp: tile t's K and V as one TMA box each into slot
    t % STAGES once the compute warps have handed it back (empty); full[slot] counts the bytes."""
    for t in range(n_tiles):
        slot = t % STAGES
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(full.index(slot), 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, lo + t * TILE, kh, 0], full.index(slot), k_ring.index(slot))
        tma.async_copy_global_to_shared(v_desc, [b, lo + t * TILE, kh, 0], full.index(slot), v_ring.index(slot))


@gluon.jit
def probe_gluon_tma(Q, k_desc, v_desc, Out, s, num_splits, qk_scale, D: gl.constexpr, KW: gl.constexpr,
                    STAGES: gl.constexpr, COMPUTE: gl.constexpr = True):
    """g6: g5 with each tile's K and V copied by the TMA engine, one box of the tile's keys
    (1, 4 KW, 1, D) each, issued by the loader warp (k_desc / v_desc over the (b, s, hk, d) cache)."""
    W: gl.constexpr = 4
    flat2: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    flat1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    split = gl.program_id(0)
    kh = gl.program_id(1)
    b = gl.program_id(2)
    program = (b * gl.num_programs(1) + kh) * gl.num_programs(0) + split
    TILE: gl.constexpr = W * KW
    per_split = gl.cdiv(gl.cdiv(s, TILE), num_splits) * TILE
    lo = split * per_split
    n_tiles = (gl.minimum(lo + per_split, s) - lo) // TILE
    q_off = (b * gl.num_programs(1) + kh) * 16 * D
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    states = gl.allocate_shared_memory(gl.float32, [W * D, 8], flat2)
    ms = gl.allocate_shared_memory(gl.float32, [W * 8], flat1)
    ls = gl.allocate_shared_memory(gl.float32, [W * 8], flat1)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=W)
    gl.warp_specialize([
        (_probe_w_idle, ()),
        (_probe_tma_load, (k_desc, v_desc, k_ring, v_ring, full, empty, b, kh, lo, n_tiles, TILE, STAGES)),
        (_probe_ws_compute, (Q, k_ring, v_ring, full, empty, states, ms, ls, n_tiles, q_off, qk_scale, 0, W, D, KW,
                             STAGES, True, COMPUTE)),
        (_probe_ws_compute, (Q, k_ring, v_ring, full, empty, states, ms, ls, n_tiles, q_off, qk_scale, 1, W, D, KW,
                             STAGES, True, COMPUTE)),
        (_probe_ws_compute, (Q, k_ring, v_ring, full, empty, states, ms, ls, n_tiles, q_off, qk_scale, 2, W, D, KW,
                             STAGES, True, COMPUTE)),
        (_probe_ws_compute, (Q, k_ring, v_ring, full, empty, states, ms, ls, n_tiles, q_off, qk_scale, 3, W, D, KW,
                             STAGES, True, COMPUTE)),
    ], [1, 1, 1, 1, 1], [PROBE_LOAD_REGS, PROBE_W_REGS, PROBE_W_REGS, PROBE_W_REGS, PROBE_W_REGS])
    gl.thread_barrier()
    _probe_w_merge(states, ms, ls, Out + program * 8 * D, W, D)


@gluon.jit
def _probe_t_step(k_slot, v_slot, q_t, m_i, l_i, acc, qk_scale, KW: gl.constexpr, PARTS: gl.constexpr = 3):
    """g2's and g3's online softmax over one tile (k_slot, v_slot (W, KW, D) in shared memory),
    the products turned round: S^T = K Q^T, O^T = V^T P^T on the 8 real rows -> (m_i, l_i, acc).
    PARTS (--access's pieces): 1 S^T and its row max only, 2 the softmax too (l summed, no P V),
    3 all of it."""
    mma: gl.constexpr = acc.type.layout
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    s_t = mma_v2(k_slot.load(a_op), q_t, gl.zeros([gl.num_warps(), KW, 8], gl.float32, mma)) * qk_scale
    m_new = gl.maximum(m_i, gl.max(s_t, 1))
    if PARTS == 1:
        return m_new, l_i, acc
    p_t = gl.exp2(s_t - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p_t, 1)
    if PARTS == 2:
        return m_new, l_i, acc
    acc = mma_v2(v_slot.permute((0, 2, 1)).load(a_op), gl.convert_layout(p_t.to(gl.float16), b_op),
                 acc * gl.expand_dims(alpha, 1))
    return m_new, l_i, acc


@gluon.jit
def _probe_t_store(o_smem, m_i, l_i, acc, Out, D: gl.constexpr):
    """The warps' states (m_i, l_i (W, 8), acc (W, D, 8)) of g2 / g3 merged once through o_smem
    (the caller's barriers keep it free), the 8 rows' output stored at Out (8, D) in fp16."""
    W: gl.constexpr = gl.num_warps()
    m = gl.max(m_i, 0)
    scale = gl.exp2(m_i - gl.expand_dims(m, 0))
    l = gl.sum(l_i * scale, 0)
    o_smem.store(acc * gl.expand_dims(scale, 1))
    gl.thread_barrier()
    red: gl.constexpr = gl.BlockedLayout([W, 4, 1], [1, 4, 8], [1, W, 1], [1, 2, 0])
    out_l: gl.constexpr = gl.SliceLayout(0, red)  # (D, 8)
    o = gl.sum(o_smem.load(red), 0)
    o = o / gl.expand_dims(gl.convert_layout(l, gl.SliceLayout(0, out_l)), 0)
    c = gl.arange(0, D, layout=gl.SliceLayout(1, out_l))
    r = gl.arange(0, 8, layout=gl.SliceLayout(0, out_l))
    gl.store(Out + r[None, :] * D + c[:, None], o.to(gl.float16))


@gluon.jit
def _probe_item(item, s, num_splits, hk, stride_b, stride_n, stride_h, D: gl.constexpr, TILE: gl.constexpr):
    """g3's item `item`, g2's program (split, kv head, batch) = (item % num_splits, row % hk, row //
    hk) with row = item // num_splits: (offset of its first key, its tiles, offset of its q rows)."""
    row = item // num_splits
    per_split = gl.cdiv(gl.cdiv(s, TILE), num_splits) * TILE
    lo = (item % num_splits) * per_split
    n_tiles = gl.maximum(gl.minimum(lo + per_split, s) - lo, 0) // TILE
    base = (row // hk).to(gl.int64) * stride_b + (row % hk) * stride_h + lo.to(gl.int64) * stride_n
    return base, n_tiles, row * 16 * D


@gluon.jit
def _probe_copy(cur, k_slot, v_slot, q_ring, K, V, Q, offs, q_offs, n_items, step, s, num_splits, hk, stride_b,
                stride_n, stride_h, D: gl.constexpr, TILE: gl.constexpr, STAGES: gl.constexpr):
    """g3's producer: copy the next tile of the program's stream, moving on to its next item (and
    copying that item's q into q ring slot `items copied % STAGES`, in the same commit group as its
    first tile) when this one's tiles are all copied. cur = (item, next tile, tiles, key offset,
    items entered - 1)."""
    item, t, n, base, seq = cur
    while (t >= n) & (item + step < n_items):
        item += step
        seq += 1
        t = 0
        base, n, q_base = _probe_item(item, s, num_splits, hk, stride_b, stride_n, stride_h, D, TILE)
        async_copy.async_copy_global_to_shared(q_ring.index(seq % STAGES), Q + q_base + q_offs)
    if t < n:
        async_copy.async_copy_global_to_shared(k_slot, K + base + offs + t * TILE * stride_n)
        async_copy.async_copy_global_to_shared(v_slot, V + base + offs + t * TILE * stride_n)
        t += 1
    async_copy.commit_group()
    return item, t, n, base, seq


@gluon.jit
def probe_gluon_p(Q, K, V, Out, s, num_splits, hk, n_items, stride_b, stride_n, stride_h, qk_scale, D: gl.constexpr,
                  KW: gl.constexpr, STAGES: gl.constexpr):
    """g2 in a persistent launch: program p takes g2's programs p, p + G, ... (items) as one stream of
    tiles, the ring running on from one item into the next; an item's q comes through the ring too
    (cp.async into a slot of its own, with the item's first tile), so an item's start waits for no
    load and its end (the warps' merge, the store) happens with STAGES - 1 tiles in flight. Measures
    whether such a kernel reads short rows (256 x 256: 4 tiles an item) at the one-program-an-SM
    stream's rate. (The thirty-second session's persistent forms of _split_kernel_warps loaded the
    lengths and q into registers and lost to their waits: ab_decode_warp_rounds.txt.)"""
    W: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    col_l: gl.constexpr = gl.SliceLayout(1, mma)
    copy_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 256 // D, D // 8], [W, 1, 1], [2, 1, 0])
    ring_l: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0])
    TILE: gl.constexpr = W * KW
    first = gl.program_id(0)
    step = gl.num_programs(0)

    cw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, copy_l)))
    ck = gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(2, copy_l)))
    cd = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, copy_l)))
    offs = (cw[:, None, None] * KW + ck[None, :, None]).to(gl.int64) * stride_n + cd[None, None, :]
    cr = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, copy_l)))
    q_offs = cr[None, :, None] * D + cd[None, None, :] + 0 * cw[:, None, None]  # every warp its own copy
    k_ring = gl.allocate_shared_memory(gl.float16, [STAGES, W, KW, D], ring_l)
    v_ring = gl.allocate_shared_memory(gl.float16, [STAGES, W, KW, D], ring_l)
    q_ring = gl.allocate_shared_memory(gl.float16, [STAGES, W, 8, D], ring_l)
    o_smem = gl.allocate_shared_memory(gl.float32, [W, D, 8],
                                       gl.PaddedSharedLayout.with_identity_for([[32, 4]], [W, D, 8], [2, 1, 0]))
    zero = first * 0
    cur = (first - step, zero, zero, zero.to(gl.int64), zero - 1)
    for pre in gl.static_range(STAGES - 1):
        cur = _probe_copy(cur, k_ring.index(pre), v_ring.index(pre), q_ring, K, V, Q, offs, q_offs, n_items, step, s,
                          num_splits, hk, stride_b, stride_n, stride_h, D, TILE, STAGES)

    q_t = gl.zeros([W, D, 8], gl.float16, b_op)
    c = 0  # tiles consumed: tile c sits in slot c % STAGES
    j = 0  # items consumed: item j's q in q ring slot j % STAGES
    for item in range(first, n_items, step):
        _base, n_tiles, _q = _probe_item(item, s, num_splits, hk, stride_b, stride_n, stride_h, D, TILE)
        m_i = gl.full([W, 8], float("-inf"), gl.float32, col_l)
        l_i = gl.zeros([W, 8], gl.float32, col_l)
        acc = gl.zeros([W, D, 8], gl.float32, mma)
        for t in range(n_tiles):
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            cur = _probe_copy(cur, k_ring.index((c + STAGES - 1) % STAGES), v_ring.index((c + STAGES - 1) % STAGES),
                              q_ring, K, V, Q, offs, q_offs, n_items, step, s, num_splits, hk, stride_b, stride_n,
                              stride_h, D, TILE, STAGES)
            if t == 0:
                q_t = q_ring.index(j % STAGES).permute((0, 2, 1)).load(b_op)
            slot = c % STAGES
            m_i, l_i, acc = _probe_t_step(k_ring.index(slot), v_ring.index(slot), q_t, m_i, l_i, acc, qk_scale, KW)
            c += 1
        gl.thread_barrier()  # every warp has read the item before's states
        _probe_t_store(o_smem, m_i, l_i, acc, Out + item * 8 * D, D)
        j += 1
    async_copy.wait_group(0)


@triton.jit
def floor_heads(K, V, Out, stride_b, stride_n, stride_h, D: tl.constexpr, BLOCK_N: tl.constexpr,
                KH_FIRST: tl.constexpr):
    """The read floor over one KV head's rows at a time (--access): a program reads BLOCK_N keys x
    D of one (batch, KV head) of K and of V, as the split kernels do, and writes one number.
    KH_FIRST: grid (KV heads, key chunks, batch), the heads of a chunk next to each other in launch
    order; else (key chunks, KV heads, batch), the split kernels' order."""
    if KH_FIRST:
        kh = tl.program_id(0)
        chunk = tl.program_id(1)
    else:
        chunk = tl.program_id(0)
        kh = tl.program_id(1)
    b = tl.program_id(2)
    rows = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = (b.to(tl.int64) * stride_b + kh * stride_h + rows[:, None].to(tl.int64) * stride_n
            + tl.arange(0, D)[None, :])
    x = tl.load(K + offs).to(tl.float32) + tl.load(V + offs).to(tl.float32)
    program = (b * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)
    tl.store(Out + program, tl.sum(tl.sum(x, 1), 0))


def access(spec: str) -> None:
    """--access: the cache's access pattern against the read floor, per shape BATCHxCONTEXTxSPLITS
    (2 KV heads of 128, fp16, rows (batch, key, KV head, d)):
    - floor: bench decode's read floor (the bytes in address order);
    - floor-h / floor-h-kh: the same bytes a KV head at a time, 64 keys x 128 a program (a head's
      256 bytes of each 512-byte key row), in the split kernels' grid order / heads side by side;
    - c2 KWxWxSTAGES: g2's ring of cp.async copies, one program per (split, KV head, batch) as the
      Gluon split kernel, waiting for each tile and computing nothing;
    - c2w: that ring over both heads' 512-byte rows (the cache viewed as one KV head of 256), twice
      the splits, so as many programs of as many bytes;
    - g2 16x4x3 (the ring with the online softmax) and flashtile, as the other rows; g2-s: its loop
      with S^T = K Q^T and the row max only, g2-softmax: with the softmax but no P V;
    - g4 16x4xSTAGES: g2 with each warp a partition of its own (no barrier across warps in the loop);
      g5: g4's warps fed by a loader warp through per-slot mbarriers; g6: g5 with TMA copies, c6: g6's
      ring alone (each slot waited for and handed back);
      err: its output against g2's where g2's is finite (the output poisoned with NaN first; inf
      where the two are not finite at the same places)."""
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for item in spec.split(","):
        b, s, splits = (int(x) for x in item.split("x"))
        hk, d = 2, 128
        bufs = [(torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16),
                 torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16)) for _ in range(4)]
        q = torch.randn(b * hk * 16 * d, device="cuda", dtype=torch.float16)
        q_api = torch.randn(b, 1, 8 * hk, d, device="cuda", dtype=torch.float16)
        lens = torch.full((b,), s, device="cuda", dtype=torch.int32)
        out = torch.empty(2 * b * hk * splits * 8 * d, device="cuda", dtype=torch.float32)
        res = {"floor": graph_us(lambda k, v: _read_floor(None, k, v), bufs)}
        for name, kh_first in (("floor-h", False), ("floor-h-kh", True)):
            grid = (hk, s // 64, b) if kh_first else (s // 64, hk, b)
            res[name] = graph_us(lambda k, v, grid=grid, kh_first=kh_first: floor_heads[grid](
                k, v, out, k.stride(0), k.stride(1), k.stride(2), D=d, BLOCK_N=64, KH_FIRST=kh_first, num_warps=8),
                bufs)
        for stages in (3, 4, 5):
            res[f"c2 16x4x{stages}"] = graph_us(lambda k, v, stages=stages: probe_gluon_t[(splits, hk, b)](
                q, k, v, out, s, splits, k.stride(0), k.stride(1), k.stride(2), 0.125, D=d, KW=16, STAGES=stages,
                COMPUTE=False, num_warps=4), bufs)
            res[f"c2w 8x4x{stages}"] = graph_us(lambda k, v, stages=stages: probe_gluon_t[(2 * splits, 1, b)](
                q, k, v, out, s, 2 * splits, k.stride(0), k.stride(1), k.stride(1), 0.125, D=2 * d, KW=8,
                STAGES=stages, COMPUTE=False, num_warps=4), bufs)
        def run_g2(k, v):
            probe_gluon_t[(splits, hk, b)](q, k, v, out, s, splits, k.stride(0), k.stride(1), k.stride(2), 0.125, D=d,
                                           KW=16, STAGES=3, num_warps=4)
        res["g2 16x4x3"] = graph_us(run_g2, bufs)
        for parts, name in ((1, "g2-s"), (2, "g2-softmax")):
            res[f"{name} 16x4x3"] = graph_us(lambda k, v, parts=parts: probe_gluon_t[(splits, hk, b)](
                q, k, v, out, s, splits, k.stride(0), k.stride(1), k.stride(2), 0.125, D=d, KW=16, STAGES=3,
                PARTS=parts, num_warps=4), bufs)
        out.fill_(float("nan"))
        run_g2(*bufs[0])
        want = out.clone()
        for (name, kernel), stages in itertools.product((("g4", probe_gluon_w), ("g5", probe_gluon_ws)), (3, 4)):
            def run_g(k, v, kernel=kernel, stages=stages):
                kernel[(splits, hk, b)](q, k, v, out, s, splits, k.stride(0), k.stride(1), k.stride(2), 0.125, D=d,
                                        KW=16, STAGES=stages, num_warps=4)
            out.fill_(float("nan"))
            run_g(*bufs[0])
            # an empty split (66 splits of 1024 tiles: the last two) leaves NaN in both
            live = want.isfinite()
            res[f"{name} 16x4x{stages} err"] = ((out - want).abs()[live].max().item()
                                                if bool((out.isfinite() == live).all()) else float("inf"))
            res[f"{name} 16x4x{stages}"] = graph_us(run_g, bufs)
        box_l = gl.NVMMASharedLayout.get_default_for([1, 64, 1, d], gl.float16)
        descs = {x.data_ptr(): TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 64, 1, d], box_l)
                 for pair in bufs for x in pair}
        for stages in (3, 4):
            def run_g6(k, v, stages=stages):
                probe_gluon_tma[(splits, hk, b)](q, descs[k.data_ptr()], descs[v.data_ptr()], out, s, splits, 0.125,
                                                 D=d, KW=16, STAGES=stages, num_warps=4)
            out.fill_(float("nan"))
            run_g6(*bufs[0])
            live = want.isfinite()
            res[f"g6 16x4x{stages} err"] = ((out - want).abs()[live].max().item()
                                            if bool((out.isfinite() == live).all()) else float("inf"))
            res[f"g6 16x4x{stages}"] = graph_us(run_g6, bufs)
            res[f"c6 16x4x{stages}"] = graph_us(lambda k, v, stages=stages: probe_gluon_tma[(splits, hk, b)](
                q, descs[k.data_ptr()], descs[v.data_ptr()], out, s, splits, 0.125, D=d, KW=16, STAGES=stages,
                COMPUTE=False, num_warps=4), bufs)
        res["flashtile"] = graph_us(lambda k, v: flashtile.flash_attn_with_kvcache(
            q_api, k, v, cache_seqlens=lens, num_splits=splits), bufs)
        print(item, " ".join(f"{k}={v:.2f}" if "err" not in k else f"{k}={v:.1e}" for k, v in res.items()), flush=True)
        del bufs


@triton.jit
def floor_pages(K, V, Table, Out, n_keys, num_splits, stride_tb, stride_p, stride_n, stride_h, D: tl.constexpr,
                BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """The read floor through a page table (--pages): a program reads its split of one (batch, KV
    head)'s keys, BLOCK_N at a time, each key's row through its page's index (a gather when PAGE <
    BLOCK_N), as _split_kernel's loop does without its products; it writes one number. Grid
    (splits, KV heads, batch)."""
    split = tl.program_id(0)
    kh = tl.program_id(1)
    b = tl.program_id(2)
    per_split = n_keys // num_splits
    acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    for start in range(split * per_split, (split + 1) * per_split, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        page = tl.load(Table + b * stride_tb + pos // PAGE)
        rows = page.to(tl.int64) * stride_p + (pos % PAGE) * stride_n + kh * stride_h
        offs = rows[:, None] + tl.arange(0, D)[None, :]
        acc += tl.load(K + offs).to(tl.float32) + tl.load(V + offs).to(tl.float32)
    program = (b * tl.num_programs(1) + kh) * tl.num_programs(0) + split
    tl.store(Out + program, tl.sum(tl.sum(acc, 1), 0))


def pages(spec: str) -> None:
    """--pages: what a paged cache costs by where its pages lie, per shape BATCHxCONTEXTxSPLITS (2 KV
    heads of 128, 16 query heads, fp16): the pages of 16 and 64 tokens in order (page p of sequence
    b at b x pages + p: the contiguous cache's bytes in its order) or in a random order (bench
    decode's tables: a permutation of all pages), read by floor_pages (64-key tiles, 2 / 3 stages)
    and by flashtile (num_splits=SPLITS); floor and flashtile contiguous beside them."""
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for item in spec.split(","):
        b, s, splits = (int(x) for x in item.split("x"))
        hk, d = 2, 128
        bufs = [(torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16),
                 torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16)) for _ in range(4)]
        q_api = torch.randn(b, 1, 8 * hk, d, device="cuda", dtype=torch.float16)
        lens = torch.full((b,), s, device="cuda", dtype=torch.int32)
        out = torch.empty(b * hk * splits, device="cuda", dtype=torch.float32)
        res = {"floor": graph_us(lambda k, v: _read_floor(None, k, v), bufs),
               "flashtile": graph_us(lambda k, v: flashtile.flash_attn_with_kvcache(
                   q_api, k, v, cache_seqlens=lens, num_splits=splits), bufs)}
        for page in (16, 64):
            n = s // page
            for order, table in (("in-order", torch.arange(b * n, device="cuda")),
                                 ("random", torch.randperm(b * n, device="cuda"))):
                table = table.view(b, n).int()
                views = {k.data_ptr(): (k.view(-1, page, hk, d), v.view(-1, page, hk, d)) for k, v in bufs}
                for stages in (2, 3):
                    res[f"floor-p{page}-{order} 64x4x{stages}"] = graph_us(
                        lambda k, v, table=table, stages=stages, page=page: floor_pages[(splits, hk, b)](
                            k, v, table, out, s, splits, table.stride(0), page * hk * d, hk * d, d, D=d, BLOCK_N=64,
                            PAGE=page, num_warps=4, num_stages=stages), bufs)
                res[f"flashtile-p{page}-{order}"] = graph_us(
                    lambda k, v, table=table, views=views: flashtile.flash_attn_with_kvcache(
                        q_api, *views[k.data_ptr()], cache_seqlens=lens, block_table=table, num_splits=splits), bufs)
        print(item, " ".join(f"{k}={v:.2f}" for k, v in res.items()), flush=True)
        del bufs


def graph_us(fn, bufs, rep=40):
    for i in range(3):
        fn(*bufs[i % 4])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(rep):
            fn(*bufs[i % 4])
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / rep)
    return min(times)


def ncu_targets(spec: str) -> None:
    """--ncu: the read floor, c2, g2-s and g2 of --access launched eagerly, three times each, on the
    first shape of spec (for a profiler: ncu -k regex:'read_floor|probe_gluon_t')."""
    b, s, splits = (int(x) for x in spec.split(",")[0].split("x"))
    hk, d = 2, 128
    k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16) for _ in range(2))
    q = torch.randn(b * hk * 16 * d, device="cuda", dtype=torch.float16)
    out = torch.empty(b * hk * splits * 8 * d, device="cuda", dtype=torch.float32)
    for _ in range(3):
        _read_floor(None, k, v)
    for compute, parts in ((False, 3), (True, 1), (True, 3)):
        for _ in range(3):
            probe_gluon_t[(splits, hk, b)](q, k, v, out, s, splits, k.stride(0), k.stride(1), k.stride(2), 0.125,
                                           D=d, KW=16, STAGES=3, COMPUTE=compute, PARTS=parts, num_warps=4)
    torch.cuda.synchronize()


def main() -> None:
    if "--ncu" in sys.argv:
        return ncu_targets(next((a for a in sys.argv[1:] if a != "--ncu"), "64x1024x1"))
    if "--pages" in sys.argv:
        return pages(next((a for a in sys.argv[1:] if a != "--pages"), "256x256x1,128x256x1,64x1024x1,16x4096x4"))
    if "--access" in sys.argv:
        return access(next((a for a in sys.argv[1:] if a != "--access"), "64x1024x1,16x4096x4,1x65536x66"))
    quick = "--quick" in sys.argv  # m0 and m1 on the split kernel's tiles only, beside the Gluon probes
    args = [a for a in sys.argv[1:] if a != "--quick"]
    spec = args[0] if args else "256x256x1,16x4096x8,8x8192x16,1x65536x128,1x131072x132"
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for item in spec.split(","):
        b, s, splits = (int(x) for x in item.split("x"))
        hk, d = 2, 128
        bufs = [(torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16),
                 torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16)) for _ in range(4)]
        q = torch.randn(b * hk * 16 * d, device="cuda", dtype=torch.float16)
        q_api = torch.randn(b, 1, 8 * hk, d, device="cuda", dtype=torch.float16)
        lens = torch.full((b,), s, device="cuda", dtype=torch.int32)
        out = torch.empty(b * hk * splits * 8 * d, device="cuda", dtype=torch.float16)
        res = {"floor": graph_us(lambda k, v: _read_floor(None, k, v), bufs),
               "flashtile": graph_us(lambda k, v: flashtile.flash_attn_with_kvcache(
                   q_api, k, v, cache_seqlens=lens, num_splits=splits), bufs)}
        for mode in (0, 1) if quick else MODES:
            for bn, warps, stages in TILES[:1] if quick else TILES:
                def run(k, v, mode=mode, bn=bn, warps=warps, stages=stages):
                    probe[(splits, hk, b)](q, k, v, out, lens, s, splits, k.stride(0), k.stride(1), k.stride(2), D=d,
                                           BLOCK_N=bn, MODE=mode, W=warps, num_warps=warps, num_stages=stages)
                res[f"m{mode} {bn}x{warps}x{stages}"] = graph_us(run, bufs)
        run(*bufs[0], mode=1, bn=64, warps=4, stages=2)
        want = out.clone()
        for name, kernel in (("g1", probe_gluon), ("g2", probe_gluon_t)):
            for kw, warps, stages in GLUON_TILES:
                def run_gluon(k, v, kernel=kernel, kw=kw, warps=warps, stages=stages):
                    kernel[(splits, hk, b)](q, k, v, out, s, splits, k.stride(0), k.stride(1), k.stride(2), 0.125, D=d,
                                            KW=kw, STAGES=stages, num_warps=warps)
                out.fill_(float("nan"))
                run_gluon(*bufs[0])
                err = (out.float() - want.float()).abs().max().item()
                res[f"{name} {kw}x{warps}x{stages}"] = graph_us(run_gluon, bufs)
                res[f"{name} {kw}x{warps}x{stages} err"] = err
        items = splits * hk * b
        for kw, warps, stages, per_sm in G3_TILES:
            def run_persistent(k, v, kw=kw, warps=warps, stages=stages, per_sm=per_sm):
                probe_gluon_p[(min(items, per_sm * sms),)](q, k, v, out, s, splits, hk, items, k.stride(0),
                                                           k.stride(1), k.stride(2), 0.125, D=d, KW=kw,
                                                           STAGES=stages, num_warps=warps)
            out.fill_(float("nan"))
            run_persistent(*bufs[0])
            err = (out.float() - want.float()).abs().max().item()
            res[f"g3 {kw}x{warps}x{stages} {per_sm}/SM"] = graph_us(run_persistent, bufs)
            res[f"g3 {kw}x{warps}x{stages} {per_sm}/SM err"] = err
        print(item, " ".join(f"{k}={v:.1f}" if "err" not in k else f"{k}={v:.1e}" for k, v in res.items()), flush=True)
        del bufs


if __name__ == "__main__":
    main()
