"""Dropout's keep-mask in plain PyTorch, bit for bit the one the kernels draw.

Dropout on attention probabilities needs a random bit per score, (b, h, sq, sk) of them, which no
kernel may store: the backward must regenerate the forward's mask. Both use a counter-based
generator, Philox2x32 (Salmon et al., 2011): the random bits of a score are a pure function of
a key and a counter (where the score is), so any program, in any order and any tile shape, gets
the same bits for the same score. It runs 7 rounds, not Random123's default 10: the rounds are
most of the instructions dropout adds to a kernel, and FlashAttention-2 draws its masks from
Philox4x32 in 7 rounds too; Random123 publishes known-answer vectors for both counts, and the
tests check 7 and 10 against them.

The key and counter of score (row i, key j) of sequence b, head h (H heads), and its bits:

    key   = seed_lo + (b * H + h) * 0x2545F491    (mod 2^32)
    i0, j0 = 16 (i // 16) + i % 8, 16 (j // 16) + j % 8 - j % 2   (the 2 x 4 group {i0, i0+8} x {j0, j0+1, j0+8, j0+9})
    w0, w1 = philox2x32(key, counter = ((j0 // 16 * 4 + j0 % 8 // 2) ^ seed_hi, (i0 // 16 * 8 + i0 % 8) ^ offset_lo))
    bits(i, j) = byte 2 ((j // 8) % 2) + (i // 8) % 2 (low first) of word w_{j % 2}
    keep(i, j) = bits(i, j) >= threshold = round(p * 2^8)      (_checks.dropout_threshold)

(ops.philox.dropout_keep says why the groups are 2 x 4.) seed and offset, 64 bits each, come
from torch's generator (`draw_rng`), so `torch.manual_seed` reproduces a run; 96 of their bits set
the call's stream (the XORs keep one call's counters distinct). The tests hold this
module and the kernels' helper equal, and philox2x32 to Random123's known-answer vectors.
"""

from __future__ import annotations

import torch

from flashtile import _checks

_M32 = 0xFFFFFFFF
PHILOX2_M, PHILOX2_W = 0xD256D193, 0x9E3779B9  # Random123's Philox2x32 multiplier and key increment
PHILOX_ROUNDS = 7  # the kernels' ops.philox.PHILOX_ROUNDS
HEAD_KEY_STRIDE = 0x2545F491  # odd, so the heads of one call get distinct keys


def draw_rng(device) -> torch.Tensor:
    """(2,) int64 (seed, offset) drawn from torch's default generator of `device`, on the device:
    no host sync, and under CUDA-graph capture each replay draws anew (as torch's own dropout)."""
    return torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, device=device)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a * b for a < 2^32 and int64 b < 2^32, without int64 overflow."""
    b_lo, b_hi = b & 0xFFFF, b >> 16
    t, u = a * b_lo, a * b_hi  # each < 2^48
    return ((t >> 16) + u) >> 16, (t + ((u & 0xFFFF) << 16)) & _M32


def philox2x32(key, c0, c1, rounds: int = PHILOX_ROUNDS):
    """Philox2x32 of counters (c0, c1) under key (int64 tensors or ints holding uint32 values,
    broadcastable); returns the two output words (int64 tensors holding uint32 values)."""
    key, c0, c1 = torch.broadcast_tensors(*(torch.as_tensor(x, dtype=torch.int64) for x in (key, c0, c1)))
    for _ in range(rounds):
        hi, lo = _mulhilo(PHILOX2_M, c0)
        c0, c1 = hi ^ key ^ c1, lo
        key = (key + PHILOX2_W) & _M32
    return c0, c1


class DropoutMask:
    """The keep-mask of one call: p, the (seed, offset) tensor, the number of heads, and which
    sequence index (the b of the key) each batch row is - a varlen reference runs one sequence
    at a time, as batch row 0 of its own problem, with sequences=[b]."""

    def __init__(self, dropout_p: float, rng: torch.Tensor, nheads: int, sequences):
        self.p = _checks.check_dropout_p(dropout_p)
        self.threshold, self.scale = _checks.dropout_threshold(self.p)
        seed, offset = (int(x) for x in rng.tolist())
        self.key, self.x0, self.x1 = seed & _M32, (seed >> 32) & _M32, offset & _M32
        self.nheads = nheads
        self.sequences = torch.as_tensor(sequences, dtype=torch.int64).view(-1)

    def keep(self, r0: int, r1: int, c0: int, c1: int, device=None) -> torch.Tensor:
        """Bool (b, h, r1 - r0, c1 - c0): which scores of rows r0:r1 x keys c0:c1 survive.
        Computed on `device` (the CPU by default)."""
        i = torch.arange(r0, r1, device=device).view(1, 1, -1, 1)
        j = torch.arange(c0, c1, device=device).view(1, 1, 1, -1)
        bh = self.sequences.to(device).view(-1, 1) * self.nheads + torch.arange(self.nheads, device=device)
        key = (self.key + bh.view(-1, self.nheads, 1, 1) * HEAD_KEY_STRIDE) & _M32
        w0, w1 = philox2x32(key, (j // 16 * 4 + j % 8 // 2) ^ self.x0, (i // 16 * 8 + i % 8) ^ self.x1)
        word = torch.where(j % 2 == 1, w1, w0)
        return ((word >> (8 * (2 * ((j // 8) % 2) + (i // 8) % 2))) & 0xFF) >= self.threshold

    def full(self, sq: int, sk: int, device=None) -> torch.Tensor:
        """The whole (b, h, sq, sk) mask, for naive.attention's dropout_mask."""
        return self.keep(0, sq, 0, sk, device)
