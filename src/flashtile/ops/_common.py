"""Shared Triton helpers and constants for every kernel file.

Masks follow flash-attn 2.x: aligned to the bottom-right corner, so query i sits at key position
i + sk - sq ("the diagonal"), and may see key j iff
    j >= i + (sk - sq) - left    (when HAS_LEFT)
    j <= i + (sk - sq) + right   (when HAS_RIGHT; causal is right = 0).
Scores live in the log2 domain inside the kernels: s2 = log2(e) * score, so exp2 replaces exp.
"""

import math

import torch
import triton
import triton.language as tl

# tl.constexpr so jit code can read them; launchers use .value
LOG2E = tl.constexpr(math.log2(math.e))  # exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(math.log(2.0))  # ln(x) = log2(x) * LN2


def kernel_scale(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, softcap) as the kernels take them: see scores_log2."""
    if softcap > 0:  # the cap comes before the log2(e) factor
        return softmax_scale / softcap, softcap
    return softmax_scale * LOG2E.value, 0.0


def alibi_strides(alibi_slopes) -> tuple[int, int]:
    """(batch, head) strides of ALiBi slopes shaped (h,) or (b, h); (0, 0) when there are none."""
    if alibi_slopes is None:
        return 0, 0
    if alibi_slopes.dim() == 1:
        return 0, alibi_slopes.stride(0)
    return alibi_slopes.stride(0), alibi_slopes.stride(1)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow torch's tf32 switch (DESIGN.md Numerics); half inputs use plain dots."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


@triton.jit
def in_window(i, j, diag_offset, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Is key j inside query row i's window (both sides given by HAS_LEFT / HAS_RIGHT)?"""
    diag = i + diag_offset
    if HAS_LEFT and HAS_RIGHT:
        return (j >= diag - left) & (j <= diag + right)
    if HAS_LEFT:
        return j >= diag - left
    return j <= diag + right


@triton.jit
def visible(i, j, diag_offset, n_keys, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """May query row i see key j? i and j broadcast against each other (either may be rows)."""
    ok = j < n_keys
    if HAS_LEFT or HAS_RIGHT:
        ok = ok & in_window(i, j, diag_offset, left, right, HAS_LEFT, HAS_RIGHT)
    return ok


@triton.jit
def block_range(start, BLOCK_OUTER: tl.constexpr, BLOCK_INNER: tl.constexpr, n_inner, offset,
                left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Which inner blocks an outer block [start, start + BLOCK_OUTER) meets, in three phases.

    Outer index o sees inner index x iff o + offset - left <= x <= o + offset + right (each side
    only when bounded). Returns (lo, full_lo, full_hi, hi): blocks in [lo, full_lo) and
    [full_hi, hi) need the mask; [full_lo, full_hi) are visible to every outer row and fully inside
    n_inner, so they run without one. Blocks outside [lo, hi) are never touched (causal skipping).
    The forward and dQ loops call this with (rows over keys, offset = sk - sq); the dK/dV loop
    with (keys over rows, offset = sq - sk, left and right swapped).
    """
    last = start + BLOCK_OUTER - 1
    lo = 0
    hi = n_inner
    full_lo = 0
    full_hi = (n_inner // BLOCK_INNER) * BLOCK_INNER
    if HAS_LEFT:
        lo = tl.maximum(start + offset - left, 0) // BLOCK_INNER * BLOCK_INNER
        full_lo = tl.maximum(last + offset - left, 0)
        full_lo = (full_lo + BLOCK_INNER - 1) // BLOCK_INNER * BLOCK_INNER
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(last + offset + right + 1, 0), n_inner)
        full_hi = tl.minimum(full_hi, tl.maximum(start + offset + right + 1, 0) // BLOCK_INNER * BLOCK_INNER)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def q_block_program(nheads, group, BLOCK_M: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """(start_m, bh, b, h, hk) of a program of a (Q block, batch x head) grid.

    With HEAVY_LAST (a right-bounded mask, e.g. causal) the last Q blocks see the most keys, so
    program 0 takes the last block: the long programs start first and the short ones fill the tail.
    """
    pid_m = tl.program_id(0)
    if HEAVY_LAST:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    h = bh % nheads
    return pid_m * BLOCK_M, bh, bh // nheads, h, h // group  # hk: the K/V head of query head h


@triton.jit
def head_chunked_order(n_programs, n_heads, HEAD_CHUNK: tl.constexpr):
    """(program, head) of this program of a grid of n_programs x n_heads programs.

    HEAD_CHUNK = 1: grid (n_programs, n_heads), launched one head after the other. Otherwise a 1D
    grid launched in chunks of HEAD_CHUNK heads: program 0 of each head of the chunk, then
    program 1 of each, and so on. Under a causal mask program 0 is the longest (callers order them
    so), so a chunk runs its long programs first, where one head at a time would start the long
    programs of the last heads last and leave SMs idle at the end; the chunk bounds how many heads'
    rows stream through L2 at once. (The index arithmetic costs registers: 126 -> 136 in the dQ
    program at d=64, which halved its occupancy at 8 warps; hence the plain 2D grid for 1.)
    """
    if HEAD_CHUNK == 1:
        return tl.program_id(0), tl.program_id(1)
    lin = tl.program_id(0)
    per_chunk = HEAD_CHUNK * n_programs
    chunk = lin // per_chunk
    r = lin - chunk * per_chunk
    heads_here = tl.minimum(HEAD_CHUNK, n_heads - chunk * HEAD_CHUNK)
    return r // heads_here, chunk * HEAD_CHUNK + r % heads_here


@triton.jit
def head_dim_mask(offs_d, head_dim, EVEN_D: tl.constexpr):
    """(1, BLOCK_D) mask of the real head dims. With d a power of two it is a constant, so a mask
    made of it and a row mask stays constant along each row and the loads/stores it guards are
    vectorised; compared against the runtime head_dim it would make them per-element (ptxas:
    192 16-bit loads and 128 16-bit stores in the dK/dV kernel at d=128)."""
    if EVEN_D:
        return tl.full([1, offs_d.shape[0]], 1, tl.int1)
    return offs_d[None, :] < head_dim


@triton.jit
def load_tile_pair(a_ptrs, b_ptrs, row_ok, d_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """Two (rows, BLOCK_D) tiles that share row and head-dim bounds (K and V, or Q and dO).

    Tiles of the masked loop phases check rows (row_ok); the unmasked phase's rows are all in
    bounds, so only an uneven head dim (padded to BLOCK_D) needs a mask there.
    """
    if MASKED:
        mask = row_ok & d_mask
        a = tl.load(a_ptrs, mask=mask, other=0.0)
        b = tl.load(b_ptrs, mask=mask, other=0.0)
    elif EVEN_D:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        a = tl.load(a_ptrs, mask=d_mask, other=0.0)
        b = tl.load(b_ptrs, mask=d_mask, other=0.0)
    return a, b


@triton.jit
def tanh(x):
    """tanh from exp2 (no tanh in triton.language): 1 - 2 / (1 + e^{2x}); exact limits at +-inf."""
    return 1.0 - 2.0 / (1.0 + tl.exp2(x * (2.0 * LOG2E)))


@triton.jit
def scores_log2(qk, i, j, qk_scale, softcap, slope, diag_offset,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Raw q.k products -> scores in the log2 domain, and the softcap derivative factor.

    Without softcap, qk_scale = softmax_scale * log2(e) folds both multiplies into one. With
    softcap, qk_scale = softmax_scale / softcap and the cap is applied before the log2(e) factor.
    Returns (s2, dcap) where dcap = d(score)/d(scaled qk) = 1 - tanh^2 (1.0 without softcap).
    """
    if HAS_SOFTCAP:
        t = tanh(qk * qk_scale)
        s2 = t * (softcap * LOG2E)
        dcap = 1.0 - t * t
    else:
        s2 = qk * qk_scale
        dcap = 1.0
    if HAS_ALIBI:
        dist = tl.abs(i + diag_offset - j).to(tl.float32)
        s2 = s2 - (slope * LOG2E) * dist
    return s2, dcap
