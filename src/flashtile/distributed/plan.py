"""Which kernel calls one ring step makes: sequence layouts, and the mask of every block pair.

Rank r of a ring of `world` ranks holds some chunks of the global sequence (its *segments*, in
order, end to end in its shard):

    contiguous: world chunks, rank r holds chunk r
    zigzag:     2 * world chunks, rank r holds chunks r and 2 * world - 1 - r

Under a causal mask, chunk c sees c + 1/2 chunks of keys, so with contiguous shards the last rank
does 2 * world - 1 times the first rank's work; zigzag pairs an early chunk with a late one and
every rank does the same work (Brandon et al., "Striped Attention", and the zigzag variant of
ring-flash-attention).

At step t of the ring, rank r holds the K/V shard of rank src = (r - t) mod world. A global window
(query at position qpos sees key kpos iff -left <= kpos - qpos <= right; causal is right = 0) is,
for one (query segment, key segment) pair, a diagonal *band* in rank-local coordinates
(il = the query's row in the rank's shard, jl = the key's row in the held K/V shard):

    lo <= jl - il <= hi,    lo = -left - delta,  hi = right - delta,
    delta = (key segment's global start - its local start) - (query segment's global start - its local start)

Every pair is cropped to the rows and keys that see something (pairs that see nothing are
dropped), and pairs whose union is itself one band over their bounding box are fused into one
call: zigzag's first step is three pairs (two diagonal chunks and one full one) and one causal call
over the whole shard. Fusion is checked by counting cells: the band spanning both pairs, over
their bounding box, must hold exactly as many visible cells as the two pairs (it holds both).

A piece becomes one call of the kernels, whose masks are bottom-right aligned: with q rows
[q0, q1) and keys [k0, k1), row i may see key j iff j - i >= (k1 - q1) - left_k and
j - i <= (k1 - q1) + right_k (in local rows), so

    right_k = hi - (k1 - q1),    left_k = (k1 - q1) - lo,

None where the band does not bind inside the piece. Both are >= 0: the bounding box of a band is
tight, so its bottom-right cell (q1 - 1, k1 - 1) is visible, which puts k1 - q1 inside [lo, hi].
(The reference path reads -1 as unbounded and refuses other negative windows, so this matters.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def num_chunks(world: int, layout: str) -> int:
    """How many equal chunks the global sequence is cut into."""
    return 2 * world if layout == "zigzag" else world


def chunks_of(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The global chunks rank holds, in the order its shard lays them out."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


@dataclass(frozen=True)
class Piece:
    """One kernel call of a ring step: queries q0:q1 of the rank's shard against keys k0:k1 of the
    K/V shard it holds, with the kernels' bottom-right window (None = unbounded side). cells is
    the number of visible (query, key) pairs, the piece's share of the FLOPs."""

    q0: int
    q1: int
    k0: int
    k1: int
    left: Optional[int]
    right: Optional[int]
    cells: int


@dataclass(frozen=True)
class _Band:
    """Cells (il, jl) of the box [q0, q1) x [k0, k1) with lo <= jl - il <= hi."""

    q0: int
    q1: int
    k0: int
    k1: int
    lo: int
    hi: int


def _tighten(q0, q1, k0, k1, lo, hi) -> Optional[_Band]:
    """The band cropped to the rows and keys that see something, and its bounds clipped to the
    j - i the box spans; None if no cell is visible. lo/hi may be +-inf on entry."""
    if q0 >= q1 or k0 >= k1:
        return None
    lo, hi = max(lo, k0 - (q1 - 1)), min(hi, (k1 - 1) - q0)
    if lo > hi:
        return None
    # row i sees keys [max(k0, i + lo), min(k1 - 1, i + hi)]: non-empty iff k0 - hi <= i <= k1 - 1 - lo
    r0, r1 = max(q0, k0 - hi), min(q1, k1 - lo)
    c0, c1 = max(k0, r0 + lo), min(k1, r1 - 1 + hi + 1)
    if r0 >= r1 or c0 >= c1:
        return None
    return _Band(int(r0), int(r1), int(c0), int(c1), int(max(lo, c0 - (r1 - 1))), int(min(hi, (c1 - 1) - r0)))


def _cells(band: _Band) -> int:
    """Visible cells of a band: the sum over its rows of the keys each row sees."""
    i = np.arange(band.q0, band.q1, dtype=np.int64)
    first = np.maximum(band.k0, i + band.lo)
    last = np.minimum(band.k1 - 1, i + band.hi)
    return int(np.clip(last - first + 1, 0, None).sum())


def _fuse(a: _Band, b: _Band, cells_a: int, cells_b: int) -> Optional[_Band]:
    """One band over the bounding box of a and b holding exactly their cells, or None."""
    box = (min(a.q0, b.q0), max(a.q1, b.q1), min(a.k0, b.k0), max(a.k1, b.k1))
    hull = _tighten(*box, min(a.lo, b.lo), max(a.hi, b.hi))
    # the hull holds every cell of a and b (their j - i lie in [lo, hi]); a and b are disjoint, so
    # equal counts mean it holds nothing else
    if hull is None or _cells(hull) != cells_a + cells_b:
        return None
    return hull


def _piece(band: _Band, cells: int) -> Piece:
    diag = band.k1 - band.q1  # j - i along the bottom-right diagonal
    assert band.lo <= diag <= band.hi, f"bottom-right cell of {band} not visible"
    right = None if band.hi >= (band.k1 - 1) - band.q0 else band.hi - diag
    left = None if band.lo <= band.k0 - (band.q1 - 1) else diag - band.lo
    return Piece(band.q0, band.q1, band.k0, band.k1, left, right, cells)


@functools.lru_cache(maxsize=4096)
def pieces(rank: int, src: int, world: int, layout: str, chunk: int, left: int = -1,
           right: int = -1) -> tuple[Piece, ...]:
    """The kernel calls of rank's queries against src's keys, chunk tokens per chunk, under the
    global window (left, right) (-1 = unbounded; causal is right = 0). Sorted by (q0, k0): a
    piece's index in the tuple names its dropout stream (ring.piece_rngs)."""
    inf = float("inf")
    lo_g = -inf if left < 0 else -left
    hi_g = inf if right < 0 else right
    blocks = []
    for a, cq in enumerate(chunks_of(rank, world, layout)):
        for b, ck in enumerate(chunks_of(src, world, layout)):
            delta = (ck - b) * chunk - (cq - a) * chunk
            band = _tighten(a * chunk, (a + 1) * chunk, b * chunk, (b + 1) * chunk, lo_g - delta, hi_g - delta)
            if band is not None:
                blocks.append((band, _cells(band)))
    fused = True
    while fused:  # at most four pairs per step: greedy pairwise fusion until nothing fuses
        fused = False
        for i in range(len(blocks)):
            for j in range(i + 1, len(blocks)):
                union = _fuse(blocks[i][0], blocks[j][0], blocks[i][1], blocks[j][1])
                if union is not None:
                    blocks[i] = (union, blocks[i][1] + blocks[j][1])
                    del blocks[j]
                    fused = True
                    break
            if fused:
                break
    return tuple(sorted((_piece(b, n) for b, n in blocks), key=lambda p: (p.q0, p.k0)))


def max_pieces(layout: str) -> int:
    """An upper bound on the pieces of one step: every (query, key) segment pair."""
    return len(chunks_of(0, 1, layout)) ** 2


def positions(seqlen: int, rank: int, world: int, layout: str) -> np.ndarray:
    """The global position of each row of rank's shard of a seqlen-token sequence."""
    chunk = seqlen // num_chunks(world, layout)
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks_of(rank, world, layout)])
