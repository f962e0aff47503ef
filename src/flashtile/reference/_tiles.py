"""What the blockwise references (fa1, fa2, decoding) share: one tile of scores and the mask geometry.

`Problem` checks the arguments once, lays q, k, v out as (b, h, s, d) in the compute dtype and then
hands out tiles: `scores` is one (Br, Bc) tile of S with scale, softcap, ALiBi and the bottom-right
aligned mask applied exactly as `naive` does. `Mask` is the mask's geometry in integers: which K/V
blocks a block of queries sees (and back), so the loops skip fully masked blocks, and the IO model
(`analysis.io_model`) counts the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtile import _checks

NEG_INF = float("-inf")
POS_INF = float("inf")


class NoCounter:
    """Stands in for an `analysis.IOCounter` when nobody is counting HBM traffic."""

    def read(self, *tiles: torch.Tensor) -> None:
        pass

    def write(self, *tiles: torch.Tensor) -> None:
        pass


NO_COUNTER = NoCounter()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (the oracle's precision); every other dtype accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """A row max of -inf (the row has seen no visible key yet) replaced by 0 where it is subtracted.

    exp(-inf - (-inf)) would be NaN; with 0 in its place exp(s - m) is exp(-inf) = 0, so an empty row
    keeps l = 0 and O = 0. The papers' loops never meet this: their Algorithm 1 has no masks.
    """
    return m.masked_fill(m == NEG_INF, 0.0)


def exp_minus(x: torch.Tensor, m) -> torch.Tensor:
    """exp(x - m) for a term x of a log-sum-exp whose max (or total) is m, with exp(inf - inf) = 1:
    a term of logit +inf (an attention sink of +inf, a piece whose LSE is +inf) takes all the
    weight, shared equally with any other +inf term, where x - m would be NaN."""
    return torch.exp(torch.where(x == POS_INF, 0.0, x - m))


def nonzero(l: torch.Tensor) -> torch.Tensor:
    """The row sum l with 0 (a row that sees no key) replaced by 1, so O = 0 / 1 = 0 there."""
    return l.masked_fill(l == 0, 1.0)


def check_block(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class Mask:
    """The bottom-right aligned causal / sliding-window mask of an (n_q, n_k) score matrix, in ints.

    Query i sits at key position i + n_k - n_q and sees keys j with
    i + offset - left <= j <= i + offset + right (a side of -1 is unbounded). Over consecutive rows
    these windows overlap, so the keys a block of rows sees form one interval, and so do the rows
    that see a block of keys: that is what lets the loops skip fully masked blocks exactly.
    """

    n_q: int
    n_k: int
    left: int = -1
    right: int = -1

    @property
    def offset(self) -> int:
        return self.n_k - self.n_q

    def allowed(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Bool (Br, Bc) from query positions i (Br, 1) and key positions j (1, Bc)."""
        diag = i + self.offset
        ok = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool, device=i.device)
        if self.left >= 0:
            ok &= j >= diag - self.left
        if self.right >= 0:
            ok &= j <= diag + self.right
        return ok

    def key_range(self, r0: int, r1: int, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        """Keys [lo', hi') within [lo, hi) that some query of rows [r0, r1) sees; empty if lo' >= hi'."""
        hi = self.n_k if hi is None else hi
        if self.left >= 0:
            lo = max(lo, r0 + self.offset - self.left)
        if self.right >= 0:
            hi = min(hi, r1 + self.offset + self.right)  # the last row's last key, + 1
        return lo, hi

    def query_range(self, c0: int, c1: int) -> tuple[int, int]:
        """Queries [lo, hi) that see some key of [c0, c1); empty if lo >= hi."""
        lo, hi = 0, self.n_q
        if self.right >= 0:
            lo = max(lo, c0 - self.offset - self.right)
        if self.left >= 0:
            hi = min(hi, c1 - self.offset + self.left)  # the last key's last row, + 1
        return lo, hi

    def key_blocks(self, r0: int, r1: int, block_n: int, lo: int = 0, hi: int | None = None) -> range:
        """Starts of the blocks of the block_n grid laid from lo over keys [lo, hi) that rows [r0, r1)
        see at least partly; the other blocks are fully masked and skipped (FA2's causal skip)."""
        hi = self.n_k if hi is None else hi
        first, last = self.key_range(r0, r1, lo, hi)
        if first >= last:
            return range(0)
        return range(lo + (first - lo) // block_n * block_n, last, block_n)

    def query_blocks(self, c0: int, c1: int, block_m: int) -> range:
        """Starts of the blocks of the block_m query grid that see some key of [c0, c1)."""
        first, last = self.query_range(c0, c1)
        if first >= last:
            return range(0)
        return range(first // block_m * block_m, last, block_m)


class Problem:
    """One attention call, checked, with its inputs in (b, h, s, d) layout and the compute dtype.

    q (b, sq, h, d), k and v (b, sk, hk, d) in BSHD, as flash-attn; h % hk == 0.
    Attributes: qh (b, h, sq, d); kh, vh (b, hk, sk, d), all in `dtype` (float32, or float64 for
    float64 inputs); scale; softcap; mask (a `Mask`); slopes (b, h, 1, 1) in `dtype`, or None.
    """

    def __init__(self, q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None):
        self.b, self.sq, self.sk, self.h, self.hk, self.d = _checks.check_qkv(q, k, v)
        self.scale = _checks.default_scale(softmax_scale, self.d)
        self.mask = Mask(self.sq, self.sk, *_checks.check_window(window_size, causal))
        self.softcap = _checks.check_softcap(softcap)
        _checks.check_alibi(alibi_slopes, self.b, self.h, q.device)
        self.in_dtype = q.dtype
        self.dtype = compute_dtype(q.dtype)
        self.group = self.h // self.hk
        self.qh = q.transpose(1, 2).to(self.dtype)  # (b, h, sq, d)
        self.kh = k.transpose(1, 2).to(self.dtype)  # (b, hk, sk, d)
        self.vh = v.transpose(1, 2).to(self.dtype)  # (b, hk, sk, d)
        self.slopes = None
        if alibi_slopes is not None:
            self.slopes = alibi_slopes.to(self.dtype).reshape(-1, self.h).expand(self.b, self.h)[
                :, :, None, None]  # (b, h, 1, 1)

    def kv_tile(self, t: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
        """Rows c0:c1 of kh or vh, each kv head repeated over its query group: (b, h, c1 - c0, d)."""
        return t[:, :, c0:c1].repeat_interleave(self.group, dim=1)

    def group_sum(self, t: torch.Tensor) -> torch.Tensor:
        """(b, h, n, d) per query head -> (b, hk, n, d), summed over each kv head's group (GQA/MQA)."""
        return t.unflatten(1, (self.hk, self.group)).sum(2)

    def scores(self, q_i: torch.Tensor, k_j: torch.Tensor, r0: int, c0: int):
        """S_ij for q_i (b, h, Br, d) = queries r0.., k_j (b, h, Bc, d) = keys c0...

        Returns (s, tanh): s (b, h, Br, Bc) scaled, softcapped, ALiBi-biased and -inf where masked,
        in the order `naive` applies them; tanh (b, h, Br, Bc) = tanh(scale * q.k / softcap), kept
        for the backward, or None without softcap.
        """
        br, bc = q_i.shape[2], k_j.shape[2]
        s = (q_i @ k_j.transpose(-1, -2)) * self.scale  # (b, h, Br, Bc)
        tanh = None
        if self.softcap > 0:
            tanh = torch.tanh(s / self.softcap)
            s = self.softcap * tanh
        i = torch.arange(r0, r0 + br, device=s.device).view(br, 1)
        j = torch.arange(c0, c0 + bc, device=s.device).view(1, bc)
        if self.slopes is not None:
            s = s - self.slopes * (i + self.mask.offset - j).abs().to(s.dtype)
        return s.masked_fill(~self.mask.allowed(i, j), NEG_INF), tanh

    def through_softcap(self, ds: torch.Tensor, tanh: torch.Tensor | None) -> torch.Tensor:
        """dS with respect to the uncapped scores: d(c * tanh(x / c)) / dx = 1 - tanh^2."""
        return ds if tanh is None else ds * (1.0 - tanh * tanh)

    def like_q(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Check t (b, sq, h, d) with q's dtype and device (out, dout); return (b, h, sq, d) in dtype."""
        _checks.check_tensor(name, t, 4)
        if tuple(t.shape) != (self.b, self.sq, self.h, self.d):
            raise ValueError(f"{name} must have shape {(self.b, self.sq, self.h, self.d)} (as q), "
                             f"got {tuple(t.shape)}")
        if t.dtype != self.in_dtype:
            raise TypeError(f"{name} must have the dtype of q ({self.in_dtype}), got {t.dtype}")
        return t.transpose(1, 2).to(self.dtype)

    def row_stat(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Check a per-row statistic (lse, l, m) of shape (b, h, sq); return it in dtype."""
        _checks.check_tensor(name, t, 3)
        if tuple(t.shape) != (self.b, self.h, self.sq):
            raise ValueError(f"{name} must have shape {(self.b, self.h, self.sq)}, got {tuple(t.shape)}")
        return t.to(self.dtype)

    def bshd(self, t: torch.Tensor) -> torch.Tensor:
        """(b, h, s, d) -> (b, s, h, d) in the input dtype."""
        return t.transpose(1, 2).to(self.in_dtype)
