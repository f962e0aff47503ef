"""The IO model: FLOPs and HBM bytes of each attention algorithm for one (batch, head).

Conventions (ours, used by every function here and checked against the reference loops by
`IOCounter`):
- HBM traffic counts every element a step reads from or writes to HBM, each at `element_size` bytes:
  inputs, outputs and the row statistics (l, m, lse, delta) alike. (flash-attn keeps the statistics
  in float32; the difference is O(N) bytes.)
- FLOPs are the matmuls' only: 2 per multiply-add, so a forward is 4 * N_q * N_k * d for what is
  computed (skipped blocks are not), a backward 10 * N_q * N_k * d (2.5x). Softmax and rescaling
  FLOPs are left out, as in the papers' TFLOP/s.
- N_q = seqlen_q queries against N_k = seqlen_k keys; d the head dim; tiles follow the reference
  loops exactly, including the short last block of an N that is not a multiple of the block size.

Seed 001 writes standard attention's traffic as MAC = 4N^2 + 3Nd and its work as 4N^2 d + N^2: it
counts the reads of Q, K, V but not the write of O, and adds the softmax's N^2. Seed 003 counts
S = QK^T written once and read once (softmax fused into the PV kernel): `standard(kernels=2)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashtile import _checks
from flashtile.reference._tiles import Mask, check_block
from flashtile.reference.decoding import split_bounds


@dataclass(frozen=True)
class Cost:
    """Work and HBM traffic of one call for one (batch, head); bytes at the given element size.

    scratch_bytes: HBM the algorithm allocates beyond its inputs and outputs (out, lse, gradients):
    S and P for standard attention, l and m for FA1's forward, delta for FA2's backward, the
    partial outputs for Flash-Decoding.
    """

    flops: int
    bytes_read: int
    bytes_written: int
    scratch_bytes: int

    @property
    def hbm_bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per HBM byte."""
        return self.flops / self.hbm_bytes


def _check_sizes(seqlen_q: int, seqlen_k: int, headdim: int, element_size: int) -> None:
    for name, value in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), ("headdim", headdim),
                        ("element_size", element_size)):
        check_block(name, value)


def attention_matrix_bytes(seqlen_q: int, seqlen_k: int, element_size: int) -> int:
    """Bytes of one (seqlen_q, seqlen_k) score matrix S (or P) of one (batch, head)."""
    _check_sizes(seqlen_q, seqlen_k, 1, element_size)
    return seqlen_q * seqlen_k * element_size


def standard(seqlen_q: int, seqlen_k: int, headdim: int, element_size: int, kernels: int = 3) -> Cost:
    """Attention with S and P materialised in HBM.

    kernels=3 (the default, PyTorch eager):        kernels=2 (seed 003, softmax fused into PV):
      S = Q K^T       reads Q, K    writes S         S = Q K^T         reads Q, K    writes S
      P = softmax(S)  reads S       writes P         O = softmax(S) V  reads S, V    writes O
      O = P V         reads P, V    writes O
    For N_q = N_k = N, kernels=3 moves e * (4N^2 + 4Nd) bytes and kernels=2 e * (2N^2 + 4Nd).
    """
    _check_sizes(seqlen_q, seqlen_k, headdim, element_size)
    if kernels not in (2, 3):
        raise ValueError(f"kernels must be 2 or 3, got {kernels!r}")
    nq, nk, d, e = seqlen_q, seqlen_k, headdim, element_size
    s = nq * nk  # elements of S, and of P
    reads = (nq + nk) * d + (kernels - 1) * s + nk * d  # Q, K; S (and P); V
    writes = (kernels - 1) * s + nq * d  # S (and P); O
    return Cost(4 * nq * nk * d, e * reads, e * writes, e * (kernels - 1) * s)


def fa1(seqlen_q: int, seqlen_k: int, headdim: int, element_size: int, block_c: int) -> Cost:
    """FA1's forward, Algorithm 1 (`reference.fa1.forward`), with K/V blocks of block_c rows.

    Line 2 writes O, l, m once; line 6 reads each K_j, V_j once; for each of the T_c = ceil(N_k / B_c)
    K/V blocks, lines 8 and 12-13 read and write all of Q, O, l, m (Q and l, m read, O, l, m written):
        reads  = 2 N_k d + T_c (2 N_q d + 2 N_q)
        writes = N_q d + 2 N_q + T_c (N_q d + 2 N_q)
    B_r does not enter: every Q_i is read once per K/V block whatever its size. With B_c = M / 4de
    (`reference.fa1.block_sizes`) the total is about 12 e^2 N^2 d^2 / M: Theta(N^2 d^2 / M).
    """
    _check_sizes(seqlen_q, seqlen_k, headdim, element_size)
    check_block("block_c", block_c)
    nq, nk, d, e = seqlen_q, seqlen_k, headdim, element_size
    t_c = -(-nk // block_c)
    reads = 2 * nk * d + t_c * (2 * nq * d + 2 * nq)
    writes = nq * d + 2 * nq + t_c * (nq * d + 2 * nq)
    return Cost(4 * nq * nk * d, e * reads, e * writes, e * 2 * nq)


def fa1_backward(seqlen_q: int, seqlen_k: int, headdim: int, element_size: int, block_c: int) -> Cost:
    """FA1's backward, Algorithm 4 without dropout (`reference.fa1.backward`).

    Line 5 writes dQ, dK, dV as zeros; line 7 reads K_j, V_j; line 10 reads Q_i, O_i, dO_i, dQ_i,
    l_i, m_i for every (i, j); line 21 writes dQ_i back for every (i, j); line 24 writes dK_j, dV_j.
    """
    _check_sizes(seqlen_q, seqlen_k, headdim, element_size)
    check_block("block_c", block_c)
    nq, nk, d, e = seqlen_q, seqlen_k, headdim, element_size
    t_c = -(-nk // block_c)
    reads = 2 * nk * d + t_c * (4 * nq * d + 2 * nq)
    writes = nq * d + 2 * nk * d + t_c * nq * d + 2 * nk * d
    return Cost(10 * nq * nk * d, e * reads, e * writes, 0)


def _mask(seqlen_q: int, seqlen_k: int, causal: bool, window_size) -> Mask:
    return Mask(seqlen_q, seqlen_k, *_checks.check_window(window_size, causal))


def _fa2_forward_elements(mask: Mask, d: int, block_m: int, block_n: int, lo: int, hi: int):
    """(flops, elements read, elements written) of `reference.fa2.attend` over keys [lo, hi)."""
    flops, reads, writes = 0, 0, 0
    for r0 in range(0, mask.n_q, block_m):
        rows = min(r0 + block_m, mask.n_q) - r0
        starts = mask.key_blocks(r0, r0 + rows, block_n, lo, hi)
        cols = min(starts[-1] + block_n, hi) - starts[0] if starts else 0  # keys of the blocks read
        reads += rows * d + 2 * cols * d  # Q_i (line 4); K_j, V_j (line 7)
        writes += rows * d + rows  # O_i, L_i (lines 14-15)
        flops += 4 * rows * cols * d
    return flops, reads, writes


def fa2(seqlen_q: int, seqlen_k: int, headdim: int, element_size: int, block_m: int, block_n: int,
        causal: bool = False, window_size=(-1, -1)) -> Cost:
    """FA2's forward, Algorithm 1 of the FA2 paper (`reference.fa2.forward`).

    Q_i is read once and O_i, L_i written once per query block; each query block reads the K/V blocks
    it can see (all T_c of them without a mask; about half under a causal mask):
        reads  = N_q d + 2 d * (K/V rows read, summed over query blocks)
        writes = N_q d + N_q
    Without a mask that is N_q d + 2 T_r N_k d + N_q d + N_q with T_r = ceil(N_q / block_m).
    """
    _check_sizes(seqlen_q, seqlen_k, headdim, element_size)
    check_block("block_m", block_m)
    check_block("block_n", block_n)
    mask = _mask(seqlen_q, seqlen_k, causal, window_size)
    flops, reads, writes = _fa2_forward_elements(mask, headdim, block_m, block_n, 0, seqlen_k)
    e = element_size
    return Cost(flops, e * reads, e * writes, 0)


def fa2_backward(seqlen_q: int, seqlen_k: int, headdim: int, element_size: int, block_m: int,
                 block_n: int, causal: bool = False, window_size=(-1, -1)) -> Cost:
    """FA2's backward, Algorithm 2 of the FA2 paper (`reference.fa2.backward`).

    Line 3 writes dQ = 0; line 4 reads O, dO and writes delta; line 6 reads every K_j, V_j; for every
    visible (i, j), line 9 reads Q_i, dO_i, dQ_i, L_i, D_i and line 15 writes dQ_i; line 18 writes
    every dK_j, dV_j.
    """
    _check_sizes(seqlen_q, seqlen_k, headdim, element_size)
    check_block("block_m", block_m)
    check_block("block_n", block_n)
    mask = _mask(seqlen_q, seqlen_k, causal, window_size)
    nq, nk, d, e = seqlen_q, seqlen_k, headdim, element_size
    flops = 0
    reads = 2 * nq * d + 2 * nk * d  # O, dO (line 4); K, V (line 6)
    writes = nq * d + nq + 2 * nk * d  # dQ = 0 (line 3), delta (line 4); dK, dV (line 18)
    for c0 in range(0, nk, block_n):
        cols = min(c0 + block_n, nk) - c0
        starts = mask.query_blocks(c0, c0 + cols, block_m)
        rows = min(starts[-1] + block_m, nq) - starts[0] if starts else 0  # queries of the blocks read
        reads += 3 * rows * d + 2 * rows  # Q_i, dO_i, dQ_i, L_i, D_i (line 9)
        writes += rows * d  # dQ_i (line 15)
        flops += 10 * rows * cols * d
    return Cost(flops, e * reads, e * writes, e * nq)


def decoding(seqlen_q: int, seqlen_k: int, headdim: int, element_size: int, num_splits: int,
             block_m: int, block_n: int, causal: bool = False, window_size=(-1, -1)) -> Cost:
    """Flash-Decoding (`reference.decoding.attention`): FA2 on each of S chunks of the keys, then merge.

    Each split reads Q and the K/V blocks it can see and writes its partial O_s, L_s; the merge reads
    all partials and writes O, L. Without a mask, with T_r = ceil(N_q / block_m):
        reads  = S N_q d + 2 T_r N_k d + S N_q (d + 1)
        writes = S N_q (d + 1) + N_q (d + 1)
    so the K/V stream dominates and the merge adds only 2 S N_q (d + 1) elements (seed 004).
    """
    _check_sizes(seqlen_q, seqlen_k, headdim, element_size)
    check_block("block_m", block_m)
    check_block("block_n", block_n)
    bounds = split_bounds(seqlen_k, num_splits)
    mask = _mask(seqlen_q, seqlen_k, causal, window_size)
    nq, d, e, s = seqlen_q, headdim, element_size, num_splits
    flops, reads, writes = 0, 0, 0
    for lo, hi in zip(bounds, bounds[1:]):
        f, r, w = _fa2_forward_elements(mask, d, block_m, block_n, lo, hi)
        flops, reads, writes = flops + f, reads + r, writes + w
    partials = s * nq * (d + 1)
    reads += partials  # the merge reads every O_s, L_s
    writes += nq * (d + 1)  # and writes O, L
    return Cost(flops, e * reads, e * writes, e * partials)

