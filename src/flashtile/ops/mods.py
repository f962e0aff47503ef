"""Score transforms: softcap and ALiBi, each a device function with its host side beside it.

A score mod maps a row of raw products to scores in the log2 domain (ops.softmax); its derivative
sits next to it for the backward. `scores_log2` is where the Triton kernels apply them; the Hopper
kernels apply `capped_sm90` and `alibi_sm90` at their one scores step.
"""


from typing import NamedTuple

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from flashtile.ops.aggregates import VALUE, aggregate, keep_all
from flashtile.ops.softmax import LOG2E


class Mods(NamedTuple):
    """The score and mask mods a launch applies: the one constexpr record (MODS) that every kernel
    and helper takes, built once per plan on the host (Mods.of). Each field turns on a built-in mod,
    applied where each kernel computes its scores (scores_log2 in the Triton kernels, the Hopper
    kernels' scores steps) and masks them (ops.masks.visible and block_range):
      left, right  mask mods: key j is visible to row i iff i + sk - sq - left <= j (left) and
                   j <= i + sk - sq + right (right; causal is right = 0)
      softcap      score mod: s -> softcap * tanh(s / softcap), its derivative 1 - tanh^2 beside it
      alibi        score mod: s -> s - slope_h |i + sk - sq - j|
    A new mod is a field here and a device function applied at those points."""

    left: bool = False
    right: bool = False
    softcap: bool = False
    alibi: bool = False

    @classmethod
    def of(cls, window: tuple, softcap: float, alibi_slopes) -> "Mods":
        """The record of a call: window (left, right) with None for an unbounded side."""
        return cls(window[0] is not None, window[1] is not None, softcap > 0, alibi_slopes is not None)



def kernel_scale(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, softcap) as the kernels take them: see scores_log2."""
    if softcap > 0:  # the cap comes before the log2(e) factor
        return softmax_scale / softcap, softcap
    return softmax_scale * LOG2E.value, 0.0


def softcap_scales(qk_scale: float, softcap: float) -> tuple[float, float]:
    """(cap_scale, softcap2) of capped_sm90 from kernel_scale's (qk_scale, softcap) of a capped
    call: the products' factor 2 log2(e) softmax_scale / softcap (one exp2 gives e^{2x}) and the
    cap in the log2 domain."""
    return 2.0 * LOG2E.value * qk_scale, softcap * LOG2E.value


def alibi_strides(alibi_slopes) -> tuple[int, int]:
    """(batch, head) strides of ALiBi slopes shaped (h,) or (b, h); (0, 0) when there are none."""
    if alibi_slopes is None:
        return 0, 0
    if alibi_slopes.dim() == 1:
        return 0, alibi_slopes.stride(0)
    return alibi_slopes.stride(0), alibi_slopes.stride(1)


@aggregate
class ModArgs:
    """The runtime arguments of the built-in score and mask mods (Mods says which apply): the
    sequence's keys sk and diag_offset = sk - sq, the window's left and right, qk_scale and softcap
    (kernel_scale's) and the head's ALiBi slope. A block step of the Triton kernels takes them as one
    value (forward.FwdTile, backward.DkdvTile and DqTile)."""

    sk: VALUE
    diag_offset: VALUE
    left: VALUE
    right: VALUE
    qk_scale: VALUE
    softcap: VALUE
    slope: VALUE

    @triton.constexpr_function
    def __init__(self, sk, diag_offset, left, right, qk_scale, softcap, slope):
        keep_all(self, dict(locals()))


@triton.jit
def tanh(x):
    """tanh from exp2 (no tanh in triton.language): 1 - 2 / (1 + e^{2x}); exact limits at +-inf."""
    return 1.0 - 2.0 / (1.0 + tl.exp2(x * (2.0 * LOG2E)))


@triton.jit
def scores_log2(qk, i, j, qk_scale, softcap, slope, diag_offset,
                MODS: tl.constexpr):
    """Raw q.k products -> scores in the log2 domain, and the softcap derivative factor.

    Without softcap, qk_scale = softmax_scale * log2(e) folds both multiplies into one. With
    softcap, qk_scale = softmax_scale / softcap and the cap is applied before the log2(e) factor.
    Returns (s2, dcap) where dcap = d(score)/d(scaled qk) = 1 - tanh^2 (1.0 without softcap).
    """
    if MODS.softcap:
        t = tanh(qk * qk_scale)
        s2 = t * (softcap * LOG2E)
        dcap = 1.0 - t * t
    else:
        s2 = qk * qk_scale
        dcap = 1.0
    if MODS.alibi:
        dist = tl.abs(i + diag_offset - j).to(tl.float32)
        s2 = s2 - (slope * LOG2E) * dist
    return s2, dcap


@gluon.jit
def capped_sm90(qk, cap_scale, softcap2):
    """The Hopper kernels' capped scores (log2 domain) of raw products qk, softcap * tanh(x) with
    x = qk * softmax_scale / softcap (scores_log2's, softcap_scales' arguments), and r: tanh(x) =
    1 - 2 r, r = 1 / (1 + e^{2x}) by one exp2 and an approximate reciprocal (two MUFU operations,
    where the IEEE division of tanh() costs a range check and more). The cap's derivative is
    1 - tanh^2 = 4 r (1 - r) (cap_derivative_sm90). Limits: r -> 0 (score -> +softcap) and r -> 1
    (-softcap)."""
    r = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + gl.exp2(qk * cap_scale)],
                                  dtype=gl.float32, is_pure=True, pack=1)
    return gl.fma(r, -2.0 * softcap2, softcap2), r


@gluon.jit
def cap_derivative_sm90(r):
    """1 - tanh^2 = 4 r - 4 r^2 of capped_sm90's r, in two instructions."""
    four_r = 4.0 * r
    return gl.fma(-four_r, r, four_r)


# Positions the Hopper kernels' ALiBi takes: |position| < 2^22, so that 1.5 * 2^23 + position is
# an exact float32 whose bits are those of 1.5 * 2^23 plus the integer (alibi_sm90)
ALIBI_MAX_POSITION = 1 << 22


ALIBI_MAGIC_BITS = gl.constexpr(0x4B400000)  # the bits of 12582912.0 = 1.5 * 2^23


@gluon.jit
def alibi_sm90(s, rows, cols, slope):
    """The Hopper kernels' ALiBi: s - slope * |rows - cols| on a block of scores s, in whatever
    units s has there (alibi_unit_sm90), rows and cols int32 positions along its two axes, one of
    them shifted by diag_offset (scores_log2's |i + diag_offset - j|), |position| <
    ALIBI_MAX_POSITION. A thread holds a few rows and many columns: the rows are converted, the
    columns made floats (both plus 1.5 * 2^23, which their difference drops) by an integer add
    to the bits of 1.5 * 2^23: int-to-float conversions issue on the unit the softmax's
    exponentials saturate. One per column made 138 of them in the d=128 forward's SASS (15 now)
    and slowed the d=64 causal backward by a fifth (docs/tuning.md)."""
    rows_f = rows.to(gl.float32) + 12582912.0
    cols_f = (cols + ALIBI_MAGIC_BITS).to(gl.float32, bitcast=True)
    return s - slope * gl.abs(rows_f[:, None] - cols_f[None, :])


@gluon.jit
def score_mods_sm90(s, rows, cols, slope, qk_scale, softcap, MODS: gl.constexpr):
    """The Hopper kernels' one point for the score mods (scores_log2 is the Triton kernels'): raw
    products s -> (scores, dcap). MODS.softcap: capped (capped_sm90; qk_scale and softcap are
    softcap_scales'), first: a cap is no scale; dcap is its derivative for dS (1.0 without one).
    MODS.alibi: then the bias -slope |rows - cols| (alibi_sm90; rows and cols the positions along
    s's two axes, one of them shifted by diag_offset; slope in alibi_unit_sm90's units). What a
    caller does not use (dcap in the forward, the positions without ALiBi) compiles to nothing."""
    dcap = 1.0
    if MODS.softcap:
        s, r = capped_sm90(s, qk_scale, softcap)
        dcap = cap_derivative_sm90(r)
    if MODS.alibi:
        s = alibi_sm90(s, rows, cols, slope)
    return s, dcap


def alibi_refusal(alibi_slopes, q, k, varlen) -> str | None:
    """Why the Hopper kernels cannot take this call's ALiBi, or None (also where it has none): every
    position of their blocks (up to a block past the longest sequence) must be below
    ALIBI_MAX_POSITION. q, k as the kernels take them; a packed batch (varlen) is bounded by its
    totals, which bound every sequence's length whatever max_seqlen says (not checked under
    CUDA-graph capture)."""
    if alibi_slopes is None:
        return None
    rows, keys = (q.shape[0], k.shape[0]) if varlen is not None else (q.shape[1], k.shape[1])
    if max(rows, keys) + 256 > ALIBI_MAX_POSITION:
        return f"takes ALiBi positions below {ALIBI_MAX_POSITION} only"
    return None


@gluon.jit
def alibi_unit_sm90(qk_scale, MODS: gl.constexpr):
    """What a slope is multiplied by to subtract it from the Hopper kernels' scores where ALiBi
    meets them: after the cap, scores are in the log2 domain (log2(e)); without one they are raw
    products, scaled by qk_scale = softmax_scale log2(e) only after the max (log2(e) / qk_scale)."""
    return LOG2E if MODS.softcap else LOG2E / qk_scale



# Integer helpers of the generated user mods (ops.mod_compiler): torch's semantics where Triton's
# operators differ (// and % truncate toward zero in Triton, floor in torch)
@triton.jit
def floor_div(a, b):
    q = a // b
    return tl.where((a % b != 0) & ((a < 0) != (b < 0)), q - 1, q)


@triton.jit
def py_remainder(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def sign(x):
    return tl.where(x > 0, 1, tl.where(x < 0, -1, 0)).to(x.dtype)


@triton.jit
def trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))
