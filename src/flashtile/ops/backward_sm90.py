"""Hopper (sm_90) backward in Gluon: FA2's backward with dQ added up by the copy engine (FA3's design).

A program owns 128 keys of one K/V head and loops over the Q blocks (64 rows at d=128, 128 at
d=64: configs.hopper_backward_tiles) of its GQA group's heads that can see them. A one-warp
loader brings K and V once and Q, dO and the rows' LSE (log2 domain) and delta through a ring
of NUM_STAGES buffers with TMA. Two consumer warpgroups take 64 keys each and work in the
transposed orientation, so P^T and dS^T are register operands of the dV and dK products (FA2's 4
matrix products per block pair, all wgmma). The fifth, dQ += dS K, needs every key of the block:
both warpgroups leave dS^T in shared memory and tell each other (an mbarrier; named barriers
where the dQ product waits until the next step, d=64 and d=128 without a right bound:
_bwd_sm90_ds_stored), each multiplies both by its half of K's columns and adds its half of the
dQ tile into an fp32 buffer by TMA's reduce-add (cp.reduce.async.bulk); ops.prefill scales and
casts it at the end. 5 products per block pair instead of the Triton path's 7. The additions
come in whatever order the programs reach a Q block, unless deterministic=True: then the
warpgroups hand their halves to a one-warp writer, and each (Q block, query head) has a counter
that admits the key blocks one by one in a fixed order (dq_order), FlashAttention-3's scheme;
only the writer waits for it.

Packed batches (IS_VARLEN, as the Triton programs): a program finds its sequence in cu_seqlens,
the copies address the packed tensors as one sequence of all the rows, and dK / dV leave through
masked pointer stores, since a TMA store of a block that runs into the next sequence would
overwrite that sequence's first keys.

At d=256 (SPLIT_D) a warpgroup's fp32 dK and dV of 64 keys would fill its registers, so a
program owns 64 keys and the warpgroups split the head dim instead: each computes S and dP for
32 of the keys (in the untransposed orientation), P and dS meet in shared memory, and each
takes the dV, dK and dQ products in its 128 columns (_bwd_sm90_step_split).
"""


from typing import NamedTuple

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashtile.ops import configs
from flashtile.ops._launch import Box, Plan, cdiv
from flashtile.ops.aggregates import VALUE, aggregate, keep_all
from flashtile.ops.host import (
    DELTA2,
    DQ_ACC,
    LSE2,
    SLOPES,
    TURNS,
    BackwardPlan,
    box_descriptor,
    dropout_args,
    grid_lengths,
    seq_strides,
    tma_refusal,
    varlen_args,
)
from flashtile.ops.masks import block_range, dq_order, dq_turn, seq_bounds, visible
from flashtile.ops.mods import (
    Mods,
    alibi_refusal,
    alibi_strides,
    alibi_unit_sm90,
    kernel_scale,
    score_mods_sm90,
    softcap_scales,
)
from flashtile.ops.philox import (
    dropout_keep_bits_sm90,
    dropout_keep_sm90,
    dropout_seed,
    dropout_sign_sm90,
    dropout_words_sm90,
    relu_to_sm90,
)
from flashtile.ops.preprocess import _delta_kernel
from flashtile.ops.schedule import key_block_program
from flashtile.ops.sm90 import (
    FIRST_FREE_BARRIER,
    HOPPER_CONSUMER_REGS,
    HOPPER_LOADER_REGS,
    HOPPER_MAXNREG,
    named_barrier_sm90,
)


class BackwardFlags(NamedTuple):
    """_bwd_kernel_sm90's constexprs other than the mods (CFG), built once per plan (plan)."""

    HEAD_DIM: int  # the tensors' head dim (the boxes' may be wider: configs.hopper_head_dim)
    NUM_STAGES: int  # Q / dO buffers
    DEFER_DQ: bool  # step i issues step i-1's dQ product (configs.hopper_backward_defer_dq)
    SPLIT_D: bool  # d=256: the warpgroups split the head dim (configs.hopper_backward_split_d)
    HEAD_CHUNKED: bool  # programs in chunks of (batch, K/V head) rows (configs.hopper_backward_chunked)
    IS_VARLEN: bool
    HAS_SEQUSED: bool
    HAS_DROPOUT: bool
    DETERMINISTIC: bool  # dQ's additions in a fixed order (the writer partition)


@aggregate
class BwdRing:
    """The shared memory the backward's partitions hand each other: the Q / dO ring with the rows'
    LSE and delta, the program's K and V, dS (and with SPLIT_D P), the dQ staging buffers and
    their barriers."""

    q_bufs: gl.shared_memory_descriptor
    do_bufs: gl.shared_memory_descriptor
    k_bufs: gl.shared_memory_descriptor
    v_bufs: gl.shared_memory_descriptor
    lse_bufs: gl.shared_memory_descriptor
    delta_bufs: gl.shared_memory_descriptor
    ds_bufs: gl.shared_memory_descriptor
    dq_bufs: gl.shared_memory_descriptor
    dq_full: gl.shared_memory_descriptor
    dq_empty: gl.shared_memory_descriptor
    kv_bar: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    do_ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    ds_ready: gl.shared_memory_descriptor
    done: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs, ds_bufs, dq_bufs, dq_full, dq_empty,
                 kv_bar, q_ready, do_ready, empty, ds_ready, done):
        for name, value in dict(locals()).items():
            if name != "self":
                setattr(self, name, value)


@aggregate
class BwdCall:
    """_bwd_kernel_sm90's runtime arguments that the partitions read, by name (its docstring says
    what each is)."""

    Rng: VALUE
    DK: VALUE
    DV: VALUE
    Slopes: VALUE
    Turns: VALUE
    stride_dkn: VALUE
    stride_dkh: VALUE
    stride_dvn: VALUE
    stride_dvh: VALUE
    nheads: VALUE
    left: VALUE
    right: VALUE
    rows_pad: VALUE
    qk_scale: VALUE
    dk_scale: VALUE
    threshold: VALUE
    dropout_scale: VALUE
    softcap: VALUE
    stride_slope_b: VALUE
    stride_slope_h: VALUE

    @gluon.constexpr_function
    def __init__(self, Rng, DK, DV, Slopes, Turns, stride_dkn, stride_dkh, stride_dvn, stride_dvh, nheads, left, right,
                 rows_pad, qk_scale, dk_scale, threshold, dropout_scale, softcap, stride_slope_b, stride_slope_h):
        keep_all(self, dict(locals()))


@aggregate
class BwdProgram:
    """What a program works on, found before the partitions start: batch (or sequence) b, the
    copies' batch coordinate tb and first rows q0 / keys k0, K/V head hk and its group of query
    heads, its keys from start_n, the rows lo .. in n_m Q blocks that see them (full_lo .. full_hi
    without a mask), the sequence's lengths sq / sk and diag_offset = sk - sq."""

    b: VALUE
    tb: VALUE
    q0: VALUE
    k0: VALUE
    hk: VALUE
    group: VALUE
    start_n: VALUE
    lo: VALUE
    n_m: VALUE
    full_lo: VALUE
    full_hi: VALUE
    sq: VALUE
    sk: VALUE
    diag_offset: VALUE

    @gluon.constexpr_function
    def __init__(self, b, tb, q0, k0, hk, group, start_n, lo, n_m, full_lo, full_hi, sq, sk, diag_offset):
        keep_all(self, dict(locals()))


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
    count let the next program's reduction reach L2 first (docs/changelog.md, "Deterministic
    backward"); these fences stall only the writer warp."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 l;\n"
        "cp.async.bulk.wait_group 0; fence.proxy.async.global; bar.warp.sync -1;\n"
        "mov.u32 l, %laneid; setp.eq.u32 p, l, 0; @p red.release.gpu.global.add.s32 [$1], 1;\n"
        "mov.b32 $0, 0; }", "=r,l", [counter], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _bwd_sm90_write_dq(dq_desc, ring, call, prog, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MODS: gl.constexpr):
    """dQ writer partition (DETERMINISTIC, not with SPLIT_D): step by step (the consumers' order) it
    waits for the step's Q block to have had every earlier addition (dq_turn, on its counter in
    Turns: one per Q block of rows_pad and query head, b the sequence or batch), then for both
    consumers' parts of the dQ tile, reduces them into the fp32 dQ at (tb, q0 + rows) by TMA (as
    _bwd_sm90_dq_out's), hands the buffers back once read and counts its addition once complete."""
    dq_bufs, dq_full, dq_empty, Turns, nheads = ring.dq_bufs, ring.dq_full, ring.dq_empty, call.Turns, call.nheads
    rows_pad = call.rows_pad
    b, tb, q0, hk, group = prog.b, prog.tb, prog.q0, prog.hk, prog.group
    start_n, lo, n_m, sq = prog.start_n, prog.lo, prog.n_m, prog.sq
    sk = prog.sk
    left, right = call.left, call.right
    a, c = dq_order(start_n // BLOCK_N, gl.cdiv(sk, BLOCK_N), sq, sk, left, right, BLOCK_M, BLOCK_N, MODS)
    m_blocks = rows_pad // BLOCK_M
    for i in range(group * n_m):
        h = hk * group + i // n_m
        start_m = lo + (i % n_m) * BLOCK_M
        counter = Turns + (b * nheads + h).to(gl.int64) * m_blocks + start_m // BLOCK_M
        _dq_wait_turn(counter, dq_turn(start_m, a, c, BLOCK_N, MODS))
        for half in gl.static_range(2):
            mbarrier.wait(dq_full.index(half), i & 1)
            _bwd_sm90_reduce_dq(dq_desc, dq_bufs.index(half), tb, q0 + start_m, h, half, BLOCK_M)
        tma.store_wait(0)
        mbarrier.arrive(dq_empty.index(0), count=1)
        mbarrier.arrive(dq_empty.index(1), count=1)
        _dq_counted(counter)


@gluon.jit
def _bwd_sm90_load(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, ring, call, prog):
    """Loader partition: the program's K and V (one buffer per key half, or one for all with
    SPLIT_D), then for step i (head g = i // n_m of the group, Q block i % n_m) Q with its LSE and
    dO with its delta into buffer i % NUM_STAGES once both consumers have freed it. A program whose
    keys no row sees loads nothing. The copies address batch tb from row q0 (Q, dO) and k0 (K, V):
    b, 0, 0 for a dense batch, 0 and the sequence's first rows for a packed one."""
    q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs = ring.q_bufs, ring.do_bufs, ring.k_bufs, ring.v_bufs, ring.lse_bufs
    delta_bufs, kv_bar, q_ready, do_ready, empty = ring.delta_bufs, ring.kv_bar, ring.q_ready, ring.do_ready, ring.empty
    b, tb, q0, k0, hk = prog.b, prog.tb, prog.q0, prog.k0, prog.hk
    group, start_n, lo, n_m = prog.group, prog.start_n, prog.lo, prog.n_m
    nheads, rows_pad = call.nheads, call.rows_pad
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
def _bwd_sm90_consume(dk_desc, dv_desc, dq_desc, ring, call, prog, half, MODS: gl.constexpr, CFG: gl.constexpr):
    """A consumer warpgroup: dK, dV of keys start_n + half * HALF_N onwards, and its half of the
    columns of each Q block's dQ; with SPLIT_D (one K/V buffer) dK, dV of all the program's keys in
    its half of the head dim's columns (_bwd_sm90_step_split). DEFER_DQ: step i issues step i-1's
    dQ product ahead of its own S^T, so that product's trip out (shared memory, TMA reduce-add)
    runs under S^T; no product is left in flight from one step to the next (ptxas would serialise
    every wgmma), so the first step is peeled off. Otherwise each step ends with its own dQ.
    MODS.softcap: the scores are capped (capped_sm90; qk_scale and softcap are softcap_scales')
    and dS takes the cap's derivative, as in the Triton programs. MODS.alibi: P^T is recomputed with
    the forward's bias (alibi_sm90; each step reads its head's slope of Slopes, (h,) or (b, h));
    dS needs nothing more, the bias being constant in S. HAS_DROPOUT: P^T and dP^T see the
    forward's keep-mask (made while S^T is computed), dV is scaled by 1 / (1 - p) at the end, as
    in the Triton programs. IS_VARLEN: dK and dV leave through pointers, masked at the sequence's
    last key (a TMA store of the block would write its zeros over the next sequence's first keys)
    and at HEAD_DIM;
    tb, q0, k0 as _bwd_sm90_load's. dk_scale: dK's factor at the end, softmax_scale times
    backward_ds_unit."""
    q_bufs, k_bufs, v_bufs, ds_bufs, dq_bufs = ring.q_bufs, ring.k_bufs, ring.v_bufs, ring.ds_bufs, ring.dq_bufs
    kv_bar, ds_ready, done = ring.kv_bar, ring.ds_ready, ring.done
    handoff = (ring.dq_full, ring.dq_empty)
    b, q0, k0, hk, group = prog.b, prog.q0, prog.k0, prog.hk, prog.group
    start_n, lo, n_m, sk = prog.start_n, prog.lo, prog.n_m, prog.sk
    Rng, DK, DV, Slopes, stride_dkn, stride_dkh = call.Rng, call.DK, call.DV, call.Slopes, call.stride_dkn, call.stride_dkh
    stride_dvn, stride_dvh, nheads = call.stride_dvn, call.stride_dvh, call.nheads
    qk_scale, dk_scale, threshold, dropout_scale = call.qk_scale, call.dk_scale, call.threshold, call.dropout_scale
    stride_slope_b, stride_slope_h = call.stride_slope_b, call.stride_slope_h
    tb = prog.tb
    DEFER_DQ: gl.constexpr = CFG.DEFER_DQ
    HAS_DROPOUT: gl.constexpr = CFG.HAS_DROPOUT
    IS_VARLEN: gl.constexpr = CFG.IS_VARLEN
    HEAD_DIM: gl.constexpr = CFG.HEAD_DIM
    DETERMINISTIC: gl.constexpr = CFG.DETERMINISTIC
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
    if MODS.alibi:  # step i's slope: alibi[0] + (i // n_m) * alibi[1], times alibi[2]
        alibi = (Slopes + b * stride_slope_b + hk * group * stride_slope_h, stride_slope_h,
                 alibi_unit_sm90(qk_scale, MODS))
    else:
        alibi = (0, 0, 0.0)
    if SPLIT_D:
        if n_steps > 0:
            mbarrier.wait(kv_bar, 0)
        for i in range(n_steps):
            dk, dv = _bwd_sm90_step_split(i, dk, dv, ring, call, prog, dq_desc, half, dq_zero, drop, alibi, MODS, HAS_DROPOUT)
    elif n_steps > 0:
        mbarrier.wait(kv_bar, 0)
        if DEFER_DQ:
            dk, dv = _bwd_sm90_step(0, dk, dv, ring, call, prog, dq_desc, half, key0, offs_n, s_zero, dq_zero, drop,
                                    alibi, MODS, True, False, HAS_DROPOUT, DETERMINISTIC)
        for i in range(1 if DEFER_DQ else 0, n_steps):
            dk, dv = _bwd_sm90_step(i, dk, dv, ring, call, prog, dq_desc, half, key0, offs_n, s_zero, dq_zero, drop,
                                    alibi, MODS, DEFER_DQ, DEFER_DQ, HAS_DROPOUT, DETERMINISTIC)
        if DEFER_DQ:
            last = n_steps - 1
            NAMED_DS: gl.constexpr = not MODS.alibi  # _bwd_sm90_step's, DEFER_DQ being set here
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
def _head_slope(alibi, head, MODS: gl.constexpr):
    """The ALiBi slope of query head `head` in the scores' units (alibi: the slopes, their head
    stride and alibi_unit_sm90's factor), or 0.0 without ALiBi."""
    slope = 0.0
    if MODS.alibi:
        slopes, stride_slope_h, unit = alibi
        slope = gl.load(slopes + head * stride_slope_h) * unit
    return slope


@gluon.jit
def _bwd_sm90_step(i, dk, dv, ring, call, prog, dq_desc, half, key0, offs_n, s_zero, dq_zero, drop, alibi,
                   MODS: gl.constexpr, DEFER_DQ: gl.constexpr, HAS_PREV: gl.constexpr, HAS_DROPOUT: gl.constexpr,
                   DETERMINISTIC: gl.constexpr):
    """Step i of a consumer warpgroup (head hk * group + i // n_m, Q block i % n_m): dV += P^T dO
    and dK += dS^T Q for its 64 keys, its dS^T into shared memory; then its dQ, or with DEFER_DQ
    step i-1's dQ first (HAS_PREV); dQ goes to batch tb, rows from q0 (_bwd_sm90_load's). With
    HAS_DROPOUT, dS is in units of backward_ds_unit (so are dK and the dQ it adds). Returns dK,
    dV."""
    q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs = ring.q_bufs, ring.do_bufs, ring.k_bufs, ring.v_bufs, ring.lse_bufs
    delta_bufs, ds_bufs, dq_bufs, q_ready, do_ready = ring.delta_bufs, ring.ds_bufs, ring.dq_bufs, ring.q_ready, ring.do_ready
    empty, ds_ready = ring.empty, ring.ds_ready
    handoff = (ring.dq_full, ring.dq_empty)
    tb, q0, hk, group, lo = prog.tb, prog.q0, prog.hk, prog.group, prog.lo
    n_m, full_lo, full_hi = prog.n_m, prog.full_lo, prog.full_hi
    sk, diag_offset = prog.sk, prog.diag_offset
    left, right, qk_scale, softcap = call.left, call.right, call.qk_scale, call.softcap
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
    NAMED_DS: gl.constexpr = DEFER_DQ and not MODS.alibi  # dS^T handed over on named barriers (_bwd_sm90_ds_stored)
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
    slope = _head_slope(alibi, i // n_m, MODS)
    s_t = warpgroup_mma_wait(1, deps=(s_tok, ))
    # the forward's scores; dS takes the cap's derivative 1 - tanh^2 = 4 r (1 - r). S^T: keys along
    # its rows, queries along its columns
    queries = start_m + diag_offset + gl.arange(0, BLOCK_M, layout=row_layout)
    s_t, dcap = score_mods_sm90(s_t, offs_n, queries, slope, qk_scale, softcap, MODS)
    # rows past sq (zeros from TMA) and rows that saw no key have an LSE of +inf: P = 0 there
    p_t = gl.exp2(s_t * (1.0 if MODS.softcap else qk_scale) - lse_bufs.index(stage).load(row_layout)[None, :])
    if (start_m < full_lo) | (start_m >= full_hi):
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
        ok = visible(offs_m[None, :], offs_n[:, None], diag_offset, sk, left, right, MODS)
        p_t = gl.where(ok, p_t, 0.0)
    if HAS_DROPOUT:  # P >= 0, so its sign can carry the keep-mask to dP^T: P' = P kept, -P dropped
        p_t = dropout_sign_sm90(p_t, keep_words, BLOCK_M, HALF_N, True)
        p_op = gl.convert_layout(relu_to_sm90(p_t, dtype), op_layout)
    else:
        p_op = gl.convert_layout(p_t.to(dtype), op_layout)
    dv_tok = warpgroup_mma(p_op, do, dv, is_async=True)
    if MODS.softcap:  # from here on P only makes dS: P times the cap's derivative (>= 0, P's sign stays)
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
    waits until the next step (DEFER_DQ), where it measured faster; where each step ends with its
    dQ product (configs.hopper_backward_defer_dq) it measured slower (docs/tuning.md). Not with
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
def _bwd_sm90_step_split(i, dk, dv, ring, call, prog, dq_desc, half, dq_zero, drop, alibi, MODS: gl.constexpr,
                         HAS_DROPOUT: gl.constexpr):
    """Step i with SPLIT_D (FA3's schedule at d=256). The warpgroups split S = Q K^T and dP = dO V^T
    by keys, 32 each, and leave their columns of P and dS in shared memory; once both have, each
    takes dV += P^T dO, dK += dS^T Q and dQ = dS K in its half of the head dim, all operands from
    shared memory. dQ leaves by TMA reduce-add in two products of a quarter, staged in this
    warpgroup's columns of the step's Q (first quarter) and dO (second) buffers: by then every
    other reader of those bytes is done (the S and dP products of both warpgroups come before the
    exchange, dK and dV read only this warpgroup's columns). Returns dK, dV."""
    q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs = ring.q_bufs, ring.do_bufs, ring.k_bufs, ring.v_bufs, ring.lse_bufs
    delta_bufs, ds_bufs, q_ready, do_ready, empty = ring.delta_bufs, ring.ds_bufs, ring.q_ready, ring.do_ready, ring.empty
    ds_ready = ring.ds_ready
    tb, q0, hk, group, lo = prog.tb, prog.q0, prog.hk, prog.group, prog.lo
    n_m, full_lo, full_hi = prog.n_m, prog.full_lo, prog.full_hi
    sk, diag_offset, start_n = prog.sk, prog.diag_offset, prog.start_n
    left, right, qk_scale, softcap = call.left, call.right, call.qk_scale, call.softcap
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
    slope = _head_slope(alibi, i // n_m, MODS)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    # the forward's scores; dS takes the cap's derivative
    queries = start_m + diag_offset + gl.arange(0, BLOCK_M, layout=row_layout)
    keys = start_n + half * OWN_N + gl.arange(0, OWN_N, layout=gl.SliceLayout(0, s_layout))
    s, dcap = score_mods_sm90(s, queries, keys, slope, qk_scale, softcap, MODS)
    # rows past sq (zeros from TMA) and rows that saw no key have an LSE of +inf: P = 0 there
    p = gl.exp2(s * (1.0 if MODS.softcap else qk_scale) - lse_bufs.index(stage).load(row_layout)[:, None])
    if (start_m < full_lo) | (start_m >= full_hi):
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
        offs_n = start_n + half * OWN_N + gl.arange(0, OWN_N, layout=gl.SliceLayout(0, s_layout))
        ok = visible(offs_m[:, None], offs_n[None, :], diag_offset, sk, left, right, MODS)
        p = gl.where(ok, p, 0.0)
    dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
    if HAS_DROPOUT:
        keep = dropout_keep_sm90(words, threshold, s_layout, BLOCK_M, OWN_N, False)
        dp = gl.where(keep, dp * dropout_scale, 0.0)
    ds = p * (dp - delta_bufs.index(stage).load(row_layout)[:, None])
    if MODS.softcap:
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
    any-order additions too measured slower: docs/tuning.md.)"""
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
                     MODS: gl.constexpr, CFG: gl.constexpr):
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
    P^T are zero, so nothing of them reaches dQ). MODS.softcap: capped scores (capped_sm90; qk_scale
    and softcap are softcap_scales'). dk_scale: dK's factor, softmax_scale times backward_ds_unit.
    MODS.alibi: Slopes, ALiBi slopes (h,) or (b, h), fp32, with their strides. HEAD_DIM: the
    tensors' head dim; the boxes may be wider (configs.hopper_head_dim), their columns past it read
    as zeros and clipped on the way out. DETERMINISTIC (not with SPLIT_D): dQ's additions into a
    Q block come in a fixed order, the one in which the programs reach it (dq_order), counted in
    Turns (int32, one per Q block of rows_pad and query head, zeroed) by a writer partition
    (_bwd_sm90_write_dq) that the consumers hand their dQ tiles to; under a right bound the key
    blocks are launched last first, so a program only waits for programs launched before it (this
    relies on the GPU starting programs in launch order, as FlashAttention-3's deterministic
    backward does; a program waiting on one not yet started would wait forever).
    Pointers and descriptors come before the scalars, as ops._launch.Prepared passes them.
    MODS: the score and mask mods (ops.mods.Mods); CFG: the kernel's other constexprs (BackwardFlags)."""
    NUM_STAGES: gl.constexpr = CFG.NUM_STAGES
    SPLIT_D: gl.constexpr = CFG.SPLIT_D
    IS_VARLEN: gl.constexpr = CFG.IS_VARLEN
    DETERMINISTIC: gl.constexpr = CFG.DETERMINISTIC
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    WG_KEYS: gl.constexpr = k_desc.block_type.shape[1]  # a consumer warpgroup's keys
    KEY_BUFS: gl.constexpr = 1 if SPLIT_D else 2
    BLOCK_N: gl.constexpr = KEY_BUFS * WG_KEYS
    n_kb = gl.cdiv(sk, BLOCK_N)  # the longest sequence's key blocks (before seq_bounds)
    gl.static_assert(not (DETERMINISTIC and SPLIT_D), "SPLIT_D's dQ has no writer partition")
    pid, bhk = key_block_program(n_kb, gl.num_programs(0) // n_kb, head_chunk, CFG.HEAD_CHUNKED, DETERMINISTIC,
                                 MODS)
    start_n = pid * BLOCK_N
    # b and hk by div / mod of one index, as when the grid was (key blocks, batch x kv heads):
    # reading them off the z and y axes measured slower (docs/tuning.md)
    b = bhk // nheads_k
    hk = bhk % nheads_k
    group = nheads // nheads_k
    q0, sq, k0, sk = seq_bounds(b, CuSeqQ, CuSeqK, SeqUsedK, sq, sk, total_q, total_k, IS_VARLEN, CFG.HAS_SEQUSED,
                                False)
    tb = 0 if IS_VARLEN else b
    diag_offset = sk - sq
    # rows that can see this key block: the block_range of keys-over-rows (offset and sides swap)
    lo, full_lo, full_hi, hi = block_range(start_n, BLOCK_N, BLOCK_M, sq, -diag_offset, right, left,
                                           MODS.right, MODS.left)
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

    ring = BwdRing(q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs, ds_bufs, dq_bufs, dq_full, dq_empty, kv_bar,
                   q_ready, do_ready, empty, ds_ready, done)
    call = BwdCall(Rng, DK, DV, Slopes, Turns, stride_dkn, stride_dkh, stride_dvn, stride_dvh, nheads, left, right,
                   rows_pad, qk_scale, dk_scale, threshold, dropout_scale, softcap, stride_slope_b, stride_slope_h)
    prog = BwdProgram(b, tb, q0, k0, hk, group, start_n, lo, n_m, full_lo, full_hi, sq, sk, diag_offset)
    # a partition's arguments are written in place (see _fwd_kernel_sm90). DETERMINISTIC adds the dQ
    # writer, whose warp shares the loader's warpgroup of registers
    if DETERMINISTIC:
        gl.warp_specialize([(_bwd_sm90_consume, (dk_desc, dv_desc, dq_desc, ring, call, prog, 0, MODS, CFG)),
                            (_bwd_sm90_consume, (dk_desc, dv_desc, dq_desc, ring, call, prog, 1, MODS, CFG)),
                            (_bwd_sm90_load, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, ring, call, prog)),
                            (_bwd_sm90_write_dq, (dq_desc, ring, call, prog, BLOCK_M, BLOCK_N, MODS))],
                           [4, 1, 1], [HOPPER_CONSUMER_REGS, HOPPER_LOADER_REGS, HOPPER_LOADER_REGS])
    else:
        gl.warp_specialize([(_bwd_sm90_consume, (dk_desc, dv_desc, dq_desc, ring, call, prog, 0, MODS, CFG)),
                            (_bwd_sm90_consume, (dk_desc, dv_desc, dq_desc, ring, call, prog, 1, MODS, CFG)),
                            (_bwd_sm90_load, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, ring, call, prog))],
                           [4, 1], [HOPPER_CONSUMER_REGS, HOPPER_LOADER_REGS])


ROW_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def refusal(q, k, v, dout, dq, dk, dv, softmax_scale, varlen, alibi_slopes, accumulate_dq) -> str | None:
    """Why _bwd_kernel_sm90 cannot take this call, or None: as the Hopper forward
    (ops.forward_sm90.refusal), BSHD and packed batches (dropout, softcap and ALiBi included) with
    a positive scale, whose inputs and dK/dV (and with accumulate_dq dQ) TMA can address."""
    if softmax_scale <= 0:
        return "needs a positive softmax_scale"
    if varlen is not None and varlen.block_table is not None:
        return "reads no page table (paged K/V)"
    return (tma_refusal(q=q, k=k, v=v, dout=dout, dk=dk, dv=dv, **({"dq": dq} if accumulate_dq else {}))
            or alibi_refusal(alibi_slopes, q, k, varlen))


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


def plan(env: list, cfg, softmax_scale, window, softcap, varlen, dropout, accumulate_dq, deterministic,
         zero_grads) -> BackwardPlan:
    """The Hopper backward's plan for the call whose tensors are env (ops.prefill.backward_tensors):
    the delta/LSE launch, the kernel into an fp32 dQ, dQ scaled into dq; accumulate_dq:
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
    dq_acc = dq  # the kernel adds into the caller's dq, which the launches then take from its slot
    if own_dq:
        env[DQ_ACC] = dq_acc = torch.empty(q.shape, dtype=torch.float32, device=q.device)
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
        dict(MODS=Mods.of(window, softcap, alibi_slopes),
             CFG=BackwardFlags(HEAD_DIM=d, NUM_STAGES=cfg.num_stages,
                               DEFER_DQ=configs.hopper_backward_defer_dq(dp, right is not None, deterministic),
                               SPLIT_D=split, HEAD_CHUNKED=chunked, IS_VARLEN=packed,
                               HAS_SEQUSED=vl_flags["HAS_SEQUSED"], HAS_DROPOUT=has_dropout,
                               DETERMINISTIC=deterministic)))
    # then dq = the sum scaled, or (accumulate_dq) dq += it from a buffer of its own, at ds_unit
    dq_scale = softmax_scale * ds_unit if not accumulate_dq else ds_unit if own_dq else 0.0
    return BackwardPlan((delta_launch, kernel_launch), zero_grads, False, b * h * rows_pad, own_dq, n_turns,
                        dq_scale)

