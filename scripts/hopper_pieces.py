"""What the Hopper building blocks reach on this GPU, before an sm90 attention kernel is built on them.

Written in Gluon (triton.experimental.gluon, triton 3.6), so that the schedule is ours, not the
compiler's pipeliner's.

GEMM, C = A @ B^T in bf16 (A (M, K), B (N, K) row-major, fp32 accumulate), TMA loads into a ring of
NUM_STAGES shared-memory stages and async wgmma waited with warpgroup_mma_wait(1), so that the load
of a stage overlaps the MMA still running on the one before; 8 warps, two consumer warpgroups on a
128-row tile; at M = N = K = 8192 and 4096, beside torch.matmul in the same run:
  pipelined  one partition issues the loads (NUM_STAGES - 1 steps ahead) and the wgmmas;
  ws         warp-specialised: a 1-warp loader partition fills the ring (ready / empty mbarrier per
             stage), the default partition issues the wgmmas.

S tile, the inner loop of attention without memory traffic: per CTA a Q tile (128 x 128 bf16), K and
V (128 x 128) resident in shared memory; N_ITERS times S = Q K^T (wgmma), the online-softmax update
on S in registers (rowmax, exp2, rowsum; the score scale grows with the iteration so that every
step rescales), O += P V (wgmma, P from registers); one CTA per SM:
  one_partition                   8 warps do the 128 rows, waiting for each wgmma;
  one_partition_overlap           the same, S_j issued before P_{j-1} V, whose wgmma then runs under
                                  the softmax of S_j (FlashAttention-3's intra-warpgroup overlap);
  two_partitions                  two 4-warp partitions (default + worker) of 64 rows each run the
                                  plain loop independently: any ping-pong comes from the warp scheduler;
  two_partitions_overlap          the same with the overlapped loop;
  two_partitions_pingpong         the overlapped loop with an mbarrier handshake: a partition issues
                                  its wgmmas only after the other issued its own (FA3's ping-pong).
TFLOP/s = 4 * 128 * 128 * 128 per iteration per CTA, against the ~990 TFLOP/s dense bf16 peak.

    PYTHONPATH=src python scripts/hopper_pieces.py --out DIR    # H100: check, then time; DIR/hopper_pieces.json
    python scripts/hopper_pieces.py --compile-only               # no GPU needed: sm_90a registers, spills, smem

Every kernel is checked in float32 before it is timed (GEMM: max |C - A.float() @ B.float().T|, next
to torch.matmul's; S tile: against stile_reference at N_ITERS = 3); a kernel that fails is not timed,
and the script exits with 1 after writing the rest.
"""

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import native_specialize_impl

from flashtile.bench import harness
from flashtile.ops._common import LOG2E

SM90 = GPUTarget("cuda", 90, 32)
PEAK_BF16_TFLOPS = 989.4  # H100 SXM dense bf16 (NVIDIA's datasheet: 1979 with 2:4 sparsity)
GEMM_SIZES = (8192, 4096)
GROUP_M = 8  # C tiles are walked 8 row-tiles at a time, so that their B tiles are reused from L2
STILE_ROWS, STILE_KEYS, STILE_D = 128, 128, 128  # Q rows per CTA, K/V rows, head dim
STILE_ITERS, STILE_CHECK_ITERS = 1024, 3  # 1024 x 132 CTAs: 1.1 TFLOP, 2-4 ms at 300-550 TFLOP/s
# stile_reference is 1.2e-3 from the fp64 closed form at N_ITERS = 3 (randn inputs; its P rounded to
# bf16); the kernel rounds the same P, up to ex2.approx against torch.exp2. A stale alpha errs by 0.12.
STILE_ATOL = 1e-2


# ---------------------------------------------------------------------------------------------------
# GEMM


@gluon.constexpr_function
def wgmma_layout(num_warps, n):
    """Accumulator layout of a wgmma over num_warps warps stacked along M (16 rows each), one
    instruction spanning all n columns (n <= 256)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _gemm_tile(M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(off_m, off_n) of this program's C tile, walking GROUP_M row-tiles per column of tiles."""
    pid = gl.program_id(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_m = pid // pids_per_group * GROUP_M
    group_rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + pid % pids_per_group % group_rows
    pid_n = pid % pids_per_group // group_rows
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@gluon.jit
def _issue_load(a_desc, b_desc, a_bufs, b_bufs, ready, i, off_m, off_n, pred):
    """TMA loads of k-step i into stage i % NUM_STAGES, completing on that stage's ready barrier."""
    NUM_STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    s = i % NUM_STAGES
    bar = ready.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [off_m, i * BLOCK_K], bar, a_bufs.index(s), pred=pred)
    tma.async_copy_global_to_shared(b_desc, [off_n, i * BLOCK_K], bar, b_bufs.index(s), pred=pred)


@gluon.jit
def _mma_step(a_bufs, b_bufs, ready, i, acc):
    """Wait for k-step i's stage, issue its wgmma and return once at most it is in flight: the wgmma
    of step i - 1 has finished reading its stage."""
    NUM_STAGES: gl.constexpr = a_bufs.shape[0]
    s = i % NUM_STAGES
    mbarrier.wait(ready.index(s), i // NUM_STAGES & 1)
    acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))


@gluon.jit
def _store_tile(c_desc, acc, off_m, off_n):
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _ring(a_desc, b_desc, NUM_STAGES: gl.constexpr):
    """The stages of A and B tiles and one initialised mbarrier per stage."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
    return a_bufs, b_bufs, ready


@gluon.jit
def gemm_pipelined_kernel(a_desc, b_desc, c_desc, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    off_m, off_n = _gemm_tile(c_desc.shape[0], c_desc.shape[1], BLOCK_M, BLOCK_N, GROUP_M)
    num_k = gl.cdiv(a_desc.shape[1], BLOCK_K)
    a_bufs, b_bufs, ready = _ring(a_desc, b_desc, NUM_STAGES)

    for i in gl.static_range(NUM_STAGES - 1):
        _issue_load(a_desc, b_desc, a_bufs, b_bufs, ready, i, off_m, off_n, i < num_k)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, wgmma_layout(gl.num_warps(), BLOCK_N))
    for i in range(num_k):
        acc = _mma_step(a_bufs, b_bufs, ready, i, acc)
        # step i - 1's stage is free (in both warpgroups: Triton's membar pass puts a bar.sync before
        # the TMA issue, see the PTX): it takes the load NUM_STAGES - 1 steps ahead of this one
        j = i + NUM_STAGES - 1
        _issue_load(a_desc, b_desc, a_bufs, b_bufs, ready, j, off_m, off_n, j < num_k)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    _store_tile(c_desc, acc, off_m, off_n)


@gluon.jit
def _gemm_load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, num_k):
    NUM_STAGES: gl.constexpr = a_bufs.shape[0]
    for i in range(num_k):
        # a fresh mbarrier passes a wait on the phase before its first: the first round does not wait
        mbarrier.wait(empty.index(i % NUM_STAGES), (i // NUM_STAGES & 1) ^ 1)
        _issue_load(a_desc, b_desc, a_bufs, b_bufs, ready, i, off_m, off_n, True)


@gluon.jit
def _gemm_mma_partition(a_bufs, b_bufs, ready, empty, c_desc, off_m, off_n, num_k):
    NUM_STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, wgmma_layout(gl.num_warps(), BLOCK_N))
    for i in range(num_k):
        acc = _mma_step(a_bufs, b_bufs, ready, i, acc)
        # one thread arrives (count=1); the bar.sync that Triton's membar pass puts before the arrive
        # (see the PTX) makes it wait for the other warpgroup's wgmma of step i - 1 too
        mbarrier.arrive(empty.index((i + NUM_STAGES - 1) % NUM_STAGES), pred=i > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    _store_tile(c_desc, acc, off_m, off_n)


@gluon.jit
def gemm_ws_kernel(a_desc, b_desc, c_desc, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                   LOADER_REGS: gl.constexpr):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    off_m, off_n = _gemm_tile(c_desc.shape[0], c_desc.shape[1], BLOCK_M, BLOCK_N, GROUP_M)
    num_k = gl.cdiv(a_desc.shape[1], BLOCK_K)
    a_bufs, b_bufs, ready = _ring(a_desc, b_desc, NUM_STAGES)
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_gemm_mma_partition, (a_bufs, b_bufs, ready, empty, c_desc, off_m, off_n, num_k)),
        (_gemm_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, num_k)),
    ], [1], [LOADER_REGS])


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    stages: int
    ws: bool
    loader_regs: int = 24  # setmaxnreg's floor: the loader holds a few scalars


# smem: 128x128x64 x 4 stages = 128 KiB + 32 KiB C tile; 128x256x64 x 3 = 144 KiB + 64 KiB (4 would not fit)
GEMMS = {
    "pipelined_128x128x64_s4": GemmConfig(128, 128, 64, 4, ws=False),
    "pipelined_128x256x64_s3": GemmConfig(128, 256, 64, 3, ws=False),
    "ws_128x128x64_s4": GemmConfig(128, 128, 64, 4, ws=True),
    "ws_128x256x64_s3": GemmConfig(128, 256, 64, 3, ws=True),
}
GEMM_WARPS = 8
# 8 warps + the loader's warpgroup = 384 threads; 65536 registers / 384 = 170, rounded down to a
# multiple of 8. setmaxnreg then moves the loader's share to the consumers (168 -> 24 frees 144 x 128).
GEMM_WS_MAXNREG = 168


def gemm_call(cfg: GemmConfig, a, b, c):
    """(kernel, grid, args, options) of C = A @ B^T with this config."""
    layout = lambda shape: gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)
    a_block, b_block, c_block = [cfg.block_m, cfg.block_k], [cfg.block_n, cfg.block_k], [cfg.block_m, cfg.block_n]
    descs = (TensorDescriptor.from_tensor(a, a_block, layout(a_block)),
             TensorDescriptor.from_tensor(b, b_block, layout(b_block)),
             TensorDescriptor.from_tensor(c, c_block, layout(c_block)))
    grid = (triton.cdiv(c.shape[0], cfg.block_m) * triton.cdiv(c.shape[1], cfg.block_n), )
    if cfg.ws:
        return gemm_ws_kernel, grid, descs + (cfg.stages, GROUP_M, cfg.loader_regs), dict(
            num_warps=GEMM_WARPS, maxnreg=GEMM_WS_MAXNREG)
    return gemm_pipelined_kernel, grid, descs + (cfg.stages, GROUP_M), dict(num_warps=GEMM_WARPS)


# ---------------------------------------------------------------------------------------------------
# S tile


@gluon.jit
def _softmax_step(s, m_i, l_i, scale):
    """Online softmax of one S tile in the log2 domain: (P, alpha, m_new, l_new)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale)
    p = gl.exp2(s * scale - gl.expand_dims(m_new, 1))  # P_tilde
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _stile_rows(q_smem, k_smem, v_smem, turns, out_ptr, row0, stride_om, stride_od, qk_scale, scale_step, n_iters,
                OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, ME: gl.constexpr):
    """n_iters online-softmax steps of the rows of q_smem against the one K/V tile; O / l to out."""
    ROWS: gl.constexpr = q_smem.shape[0]
    HEAD_D: gl.constexpr = q_smem.shape[1]
    KEYS: gl.constexpr = k_smem.shape[0]
    s_layout: gl.constexpr = wgmma_layout(gl.num_warps(), KEYS)
    o_layout: gl.constexpr = wgmma_layout(gl.num_warps(), HEAD_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    kT = k_smem.permute((1, 0))
    s_init = gl.zeros([ROWS, KEYS], gl.float32, s_layout)  # ignored (use_acc=False): gives the layout
    o = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    if OVERLAP:
        s = warpgroup_mma(q_smem, kT, s_init, use_acc=False)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        for j in range(1, n_iters):
            o = o * gl.expand_dims(alpha, 1)
            p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            if PINGPONG:  # turn j - 1 of this partition: partition 0 goes first
                mbarrier.wait(turns.index(ME), (j - 1 & 1) ^ (1 - ME))
            s = warpgroup_mma(q_smem, kT, s_init, use_acc=False, is_async=True)  # S_j
            o = warpgroup_mma(p_op, v_smem, o, is_async=True)  # O += P_{j-1} V
            if PINGPONG:
                mbarrier.arrive(turns.index(1 - ME))
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # P_{j-1} V may still run ...
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale + j * scale_step)  # ... under this
            o, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op))
        o = o * gl.expand_dims(alpha, 1)
        o = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_smem, o)
    else:
        for j in range(n_iters):
            s = warpgroup_mma(q_smem, kT, s_init, use_acc=False)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale + j * scale_step)
            o = o * gl.expand_dims(alpha, 1)
            o = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_smem, o)
    o = o / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols * stride_od, 0), o)


@gluon.jit(do_not_specialize=["n_iters"])  # one compiled kernel for the check's 3 and the timing's 1024
def stile_kernel(q_desc, k_desc, v_desc, out_ptr, stride_om, stride_od, qk_scale, scale_step, n_iters,
                 SPLIT: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, WORKER_REGS: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    row0 = gl.program_id(0) * ROWS
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, q_desc.block_type.nbytes + k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0, 0], bar, q_smem)
    tma.async_copy_global_to_shared(k_desc, [0, 0], bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [0, 0], bar, v_smem)
    mbarrier.wait(bar, 0)
    mbarrier.invalidate(bar)
    # the ping-pong handshake (allocated for every variant: a partition's arguments cannot be None)
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    if SPLIT:
        HALF: gl.constexpr = ROWS // 2
        gl.warp_specialize([
            (_stile_rows, (q_smem.slice(0, HALF), k_smem, v_smem, turns, out_ptr, row0, stride_om, stride_od,
                           qk_scale, scale_step, n_iters, OVERLAP, PINGPONG, 0)),
            (_stile_rows, (q_smem.slice(HALF, HALF), k_smem, v_smem, turns, out_ptr, row0 + HALF, stride_om,
                           stride_od, qk_scale, scale_step, n_iters, OVERLAP, PINGPONG, 1)),
        ], [4], [WORKER_REGS])
    else:
        _stile_rows(q_smem, k_smem, v_smem, turns, out_ptr, row0, stride_om, stride_od, qk_scale, scale_step,
                    n_iters, OVERLAP, PINGPONG, 0)


@dataclasses.dataclass(frozen=True)
class StileConfig:
    split: bool  # two 4-warp partitions of 64 rows, else one 8-warp partition of 128
    overlap: bool
    pingpong: bool = False


STILES = {
    "one_partition": StileConfig(split=False, overlap=False),
    "one_partition_overlap": StileConfig(split=False, overlap=True),
    "two_partitions": StileConfig(split=True, overlap=False),
    "two_partitions_overlap": StileConfig(split=True, overlap=True),
    "two_partitions_pingpong": StileConfig(split=True, overlap=True, pingpong=True),
}
# 4 + 4 warps at one CTA per SM: 65536 / 256 threads = 256 registers each, but ptxas takes at most
# 255 (Triton's default .maxnreg 256 for warp-specialised kernels draws "Too many maxnreg ... ignored").
# 248 for both partitions: no spills (240: 16 bytes of spill stores in the overlapped loop; 232: 60).
STILE_SPLIT_REGS = 248


def stile_call(cfg: StileConfig, q, k, v, out, qk_scale: float, n_iters: int):
    """(kernel, grid, args, options): q (ctas * 128, 128), k and v (128, 128) bf16; out (ctas * 128, 128)
    fp32. The score scale of iteration j is qk_scale * (1 + j / n_iters)."""
    layout = gl.NVMMASharedLayout.get_default_for([STILE_ROWS, STILE_D], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([STILE_KEYS, STILE_D], gl.bfloat16)
    args = (TensorDescriptor.from_tensor(q, [STILE_ROWS, STILE_D], layout),
            TensorDescriptor.from_tensor(k, [STILE_KEYS, STILE_D], kv_layout),
            TensorDescriptor.from_tensor(v, [STILE_KEYS, STILE_D], kv_layout), out, out.stride(0), out.stride(1),
            qk_scale, qk_scale / n_iters, n_iters, cfg.split, cfg.overlap, cfg.pingpong, STILE_SPLIT_REGS)
    options = dict(num_warps=4, maxnreg=STILE_SPLIT_REGS) if cfg.split else dict(num_warps=8)
    return stile_kernel, (q.shape[0] // STILE_ROWS, ), args, options


def stile_reference(q, k, v, qk_scale: float, n_iters: int):
    """The kernel's recurrence in float32 (P rounded to bf16 before P V, as the wgmma takes it)."""
    s = q.float() @ k.float().T  # (rows, keys)
    m_i = torch.full((q.shape[0], ), float("-inf"), device=q.device)
    l_i = torch.zeros(q.shape[0], device=q.device)
    o = torch.zeros(q.shape[0], v.shape[1], device=q.device)
    for j in range(n_iters):
        scale = qk_scale * (1 + j / n_iters)
        m_new = torch.maximum(m_i, s.amax(-1) * scale)
        p = torch.exp2(s * scale - m_new[:, None])  # P_tilde
        alpha = torch.exp2(m_i - m_new)
        l_i = l_i * alpha + p.sum(-1)
        o = o * alpha[:, None] + p.bfloat16().float() @ v.float()
        m_i = m_new
    return o / l_i[:, None]


# ---------------------------------------------------------------------------------------------------
# compile-only: sm_90a code without a GPU


def compile_sm90(kernel, args, options):
    """Compile kernel for sm_90a as a launch with these arguments would: each argument is specialised
    by triton.runtime.jit's own rule (tensordesc<...> with its layout, *bf16 + divisibility, ints)."""
    backend = make_backend(SM90)
    signature, constexprs, attrs = {}, {}, {}
    for i, (param, arg) in enumerate(zip(kernel.params, args, strict=True)):
        if param.is_constexpr:
            ty, spec = "constexpr", arg
        else:
            ty, spec = native_specialize_impl(backend, arg, param.is_const, not param.do_not_specialize,
                                              not param.do_not_specialize_on_alignment)
        signature[param.name] = ty
        if ty == "constexpr":
            constexprs[(i, )] = spec
        elif isinstance(spec, str) and spec:
            attrs[(i, )] = backend.parse_attr(spec)
    return triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=SM90, options=options)


def ptxas_report(compiled) -> dict:
    """Registers and spill bytes per thread from ptxas -v (the most over the partitions of a
    warp-specialised kernel), its warnings, shared memory bytes, and the setmaxnreg values in the PTX."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        log = subprocess.run([ptxas, "-v", "-arch=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"regs": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2)),
            "smem": compiled.metadata.shared,
            "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)",
                                                compiled.asm["ptx"]))),
            "warnings": re.findall(r"ptxas warning : (.*)", log)}


def compile_only() -> None:
    """Compile every variant for sm_90a and print what ptxas says; a warp-specialised kernel's regs are
    its .maxnreg, the partitions' budgets are the setmaxnreg values."""
    a = torch.empty(512, 512, dtype=torch.bfloat16)
    q = torch.empty(2 * STILE_ROWS, STILE_D, dtype=torch.bfloat16)
    kv = torch.empty(STILE_KEYS, STILE_D, dtype=torch.bfloat16)
    out = torch.empty(2 * STILE_ROWS, STILE_D)
    calls = {f"gemm {name}": gemm_call(cfg, a, a, torch.empty_like(a)) for name, cfg in GEMMS.items()}
    calls.update({f"stile {name}": stile_call(cfg, q, kv, kv, out, 1.0, STILE_ITERS) for name, cfg in STILES.items()})
    for name, (kernel, _, args, options) in calls.items():
        r = ptxas_report(compile_sm90(kernel, args, options))
        setmaxnreg = ", ".join(f"{op} {n}" for op, n in r["setmaxnreg"]) or "-"
        print(f"{name:<36} regs {r['regs']:>3}  spill stores {r['spill_stores']:>3} loads {r['spill_loads']:>3}  "
              f"smem {r['smem']:>6}  setmaxnreg {setmaxnreg}  {'; '.join(r['warnings'])}", flush=True)


# ---------------------------------------------------------------------------------------------------
# GPU: check, then time


def run_gemms(rec) -> None:
    for size in GEMM_SIZES:
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ b.float().T  # (M, N)
        shape, flops = [size] * 3, 2 * size**3
        torch_err = (torch.matmul(a, b.T).float() - ref).abs().max().item()
        rec("gemm torch.matmul", shape, flops, torch_err, None, None, lambda: torch.matmul(a, b.T))
        for name, cfg in GEMMS.items():
            c = torch.empty(size, size, device="cuda", dtype=torch.bfloat16)
            kernel, grid, args, options = gemm_call(cfg, a, b, c)
            launch = lambda: kernel[grid](*args, **options)
            compiled = launch()
            # the same fp32 sums rounded to bf16 as cuBLAS's, summed in another order
            rec(f"gemm {name}", shape, flops, (c.float() - ref).abs().max().item(), 2 * torch_err, compiled, launch)
        del a, b, ref


def run_stiles(rec) -> None:
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    q = torch.randn(ctas * STILE_ROWS, STILE_D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(STILE_KEYS, STILE_D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(STILE_KEYS, STILE_D, device="cuda", dtype=torch.bfloat16)
    qk_scale = STILE_D**-0.5 * LOG2E.value
    ref = stile_reference(q, k, v, qk_scale, STILE_CHECK_ITERS)
    out = torch.empty(q.shape, device="cuda")
    shape = [ctas, STILE_ROWS, STILE_KEYS, STILE_D, STILE_ITERS]
    flops = 4 * STILE_ROWS * STILE_KEYS * STILE_D * STILE_ITERS * ctas
    for name, cfg in STILES.items():
        kernel, grid, args, options = stile_call(cfg, q, k, v, out, qk_scale, STILE_CHECK_ITERS)
        compiled = kernel[grid](*args, **options)
        err = (out - ref).abs().max().item()
        kernel, grid, args, options = stile_call(cfg, q, k, v, out, qk_scale, STILE_ITERS)
        rec(f"stile {name}", shape, flops, err, STILE_ATOL, compiled, lambda: kernel[grid](*args, **options))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--compile-only", action="store_true", help="compile every variant for sm_90a, print ptxas -v")
    mode.add_argument("--out", help="folder for hopper_pieces.json (needs an H100)")
    opts = parser.parse_args()
    if opts.compile_only:
        return compile_only()
    path = os.path.join(opts.out, "hopper_pieces.json")
    rows = []

    def rec(name, shape, flops, err, tol, compiled, launch):
        """Time launch unless its check failed (tol None: the peer, not checked), print the row and
        rewrite the result file (a kernel that hangs leaves the rows before it)."""
        ok = tol is None or err <= tol
        ms = harness.bench_ms(launch) if ok else None
        rows.append(dict(name=name, shape=shape, ms=ms, tflops=ms and flops / ms * 1e-9, err=err, tol=tol, ok=ok,
                         ptxas=compiled and ptxas_report(compiled)))
        r = rows[-1]
        timing = (f"{ms:9.3f} ms {r['tflops']:7.1f} TFLOP/s {r['tflops'] / PEAK_BF16_TFLOPS:6.1%}" if ok else
                  f"not timed: error above {tol:.2e}")
        print(f"{name:<36} {'x'.join(map(str, shape)):<22} err {err:.2e}  {timing}", flush=True)
        harness.write_result(path, dict(environment=harness.environment(), peak_bf16_tflops=PEAK_BF16_TFLOPS,
                                        rows=rows), quiet=True)

    print(f"{'variant':<36} {'shape':<22} {'max abs error':<17} {'median':>9} {'':>15} of {PEAK_BF16_TFLOPS}")
    run_gemms(rec)
    run_stiles(rec)
    print(f"wrote {path}")
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
