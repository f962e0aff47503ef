"""FlashAttention-1 (Dao et al., 2022) in plain PyTorch: Algorithm 1 forward, Algorithm 4 backward.

The loop order is the paper's (seed 001 walks it step by step): K/V blocks in the outer loop, Q blocks
in the inner loop. O, l and m live in "HBM" (full tensors) and every inner step reads its blocks and
writes them back, which is why FA1 moves Theta(N^2 d^2 / M) bytes: Q and O are streamed T_c times.
`analysis.fa1` counts those bytes and an `analysis.IOCounter` passed as `counter` sees every tile move.

Beyond Algorithm 1 the score tile S_ij also carries what the API supports (softmax scale and masks as
in the paper's Algorithm 2, and softcap, ALiBi, GQA/MQA); dropout is left to `naive`. Every (Br, Bc)
block is computed, as in the paper's algorithms: skipping masked blocks is FA2's step (`fa2`).

All tensors carry a leading (b, h): "a block" Q_i is (b, h, B_r, d), computed for all heads at once.
"""

from __future__ import annotations

import torch

from flashtile.reference import _tiles
from flashtile.reference._tiles import finite_or_zero, nonzero

A100_SRAM_BYTES = 192 * 1024  # on-chip SRAM per SM of an A100, the M of seed 000's example


def block_sizes(sram_bytes: int, headdim: int, element_size: int) -> tuple[int, int]:
    """(B_r, B_c) for an SRAM of `sram_bytes` bytes: Algorithm 1, line 1.

    B_c = ceil(M / 4d) and B_r = min(B_c, d), with M = sram_bytes / element_size counted in elements,
    so that K_j, V_j (B_c x d each) and Q_i, O_i (B_r x d each) fill at most the SRAM. Seed 001 writes
    the two names the other way round in its step 1; this is the paper's (and seed 000's) order.
    """
    for name, value in (("sram_bytes", sram_bytes), ("headdim", headdim), ("element_size", element_size)):
        _tiles.check_block(name, value)
    block_c = -(-sram_bytes // (4 * headdim * element_size))  # ceil(M / 4d) in elements
    return min(block_c, headdim), block_c


def forward(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, sram_bytes=A100_SRAM_BYTES, counter=None):
    """Algorithm 1. Returns (out, l, m).

    q (b, sq, h, d), k and v (b, sk, hk, d), any float dtype; the masks, softcap and ALiBi follow
    `naive.attention` (bottom-right aligned when sq != sk). Block sizes come from `sram_bytes` and
    q's element size (`block_sizes`). Computes in float32 (float64 for float64 inputs).
    out (b, sq, h, d) in q's dtype; l and m (b, h, sq) in the compute dtype: the row sums and row
    maxima the paper's Algorithm 2 hands to the backward (lse = m + log l). A row that sees no key has
    out 0, l 0 and m -inf.
    """
    p = _tiles.Problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes)
    io = counter or _tiles.NO_COUNTER
    block_r, block_c = block_sizes(sram_bytes, p.d, q.element_size())  # Algorithm 1, line 1
    O = torch.zeros(p.b, p.h, p.sq, p.d, dtype=p.dtype, device=q.device)  # line 2, in HBM
    l = torch.zeros(p.b, p.h, p.sq, dtype=p.dtype, device=q.device)  # (b, h, N)
    m = torch.full((p.b, p.h, p.sq), _tiles.NEG_INF, dtype=p.dtype, device=q.device)  # (b, h, N)
    io.write(O, l, m)
    # lines 3-4: the blocks Q_i, K_j, V_j, O_i, l_i, m_i are the slices taken below
    for c0 in range(0, p.sk, block_c):  # line 5: for 1 <= j <= T_c
        c1 = min(c0 + block_c, p.sk)
        K_j = p.kv_tile(p.kh, c0, c1)  # (b, h, Bc, d)  line 6
        V_j = p.kv_tile(p.vh, c0, c1)  # (b, h, Bc, d)
        io.read(K_j, V_j)
        for r0 in range(0, p.sq, block_r):  # line 7: for 1 <= i <= T_r
            r1 = min(r0 + block_r, p.sq)
            Q_i = p.qh[:, :, r0:r1]  # (b, h, Br, d)  line 8
            O_i = O[:, :, r0:r1]  # (b, h, Br, d)
            l_i = l[:, :, r0:r1]  # (b, h, Br)
            m_i = m[:, :, r0:r1]  # (b, h, Br)
            io.read(Q_i, O_i, l_i, m_i)
            S_ij, _ = p.scores(Q_i, K_j, r0, c0)  # (b, h, Br, Bc)  line 9
            m_tilde = S_ij.amax(-1)  # (b, h, Br)  line 10
            P_tilde = torch.exp(S_ij - finite_or_zero(m_tilde)[..., None])  # (b, h, Br, Bc)
            l_tilde = P_tilde.sum(-1)  # (b, h, Br)
            m_new = torch.maximum(m_i, m_tilde)  # (b, h, Br)  line 11
            alpha = torch.exp(m_i - finite_or_zero(m_new))  # e^{m_i - m_new}
            beta = torch.exp(m_tilde - finite_or_zero(m_new))  # e^{m~_ij - m_new}
            l_new = alpha * l_i + beta * l_tilde  # (b, h, Br)
            # line 12: O_i <- diag(l_new)^-1 (diag(l_i) e^{m_i - m_new} O_i + e^{m~_ij - m_new} P~_ij V_j)
            O_new = ((l_i * alpha)[..., None] * O_i + beta[..., None] * (P_tilde @ V_j)) \
                / nonzero(l_new)[..., None]  # (b, h, Br, d)
            O[:, :, r0:r1] = O_new
            l[:, :, r0:r1] = l_new  # line 13
            m[:, :, r0:r1] = m_new
            io.write(O_new, l_new, m_new)
    return p.bshd(O), l, m  # line 16


def backward(dout, q, k, v, out, l, m, softmax_scale=None, causal=False, window_size=(-1, -1),
             softcap=0.0, alibi_slopes=None, sram_bytes=A100_SRAM_BYTES, counter=None):
    """Algorithm 4 (without dropout): recompute P_ij from l and m, block by block. Returns (dq, dk, dv).

    dout and out (b, sq, h, d) with q's dtype; l and m (b, h, sq) as `forward` returned them; the other
    arguments as in `forward`. dq (b, sq, h, d), dk and dv (b, sk, hk, d) in q's dtype; dk and dv are
    summed over the query heads that share a kv head. D_i = rowsum(dO_i * O_i) is recomputed in the
    inner loop as the paper does (line 19); FA2 computes it once up front.
    """
    p = _tiles.Problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes)
    io = counter or _tiles.NO_COUNTER
    dO = p.like_q("dout", dout)  # (b, h, sq, d)
    O = p.like_q("out", out)  # (b, h, sq, d)
    l = p.row_stat("l", l)  # (b, h, sq)
    m = p.row_stat("m", m)  # (b, h, sq)
    block_r, block_c = block_sizes(sram_bytes, p.d, q.element_size())  # Algorithm 4, line 2
    dQ = torch.zeros_like(p.qh)  # (b, h, sq, d)  line 5, in HBM
    dK = torch.zeros(p.b, p.h, p.sk, p.d, dtype=p.dtype, device=q.device)  # per query head
    dV = torch.zeros_like(dK)  # (b, h, sk, d)
    io.write(dQ, dK, dV)
    for c0 in range(0, p.sk, block_c):  # line 6
        c1 = min(c0 + block_c, p.sk)
        K_j = p.kv_tile(p.kh, c0, c1)  # (b, h, Bc, d)  line 7
        V_j = p.kv_tile(p.vh, c0, c1)  # (b, h, Bc, d)
        io.read(K_j, V_j)
        dK_j = torch.zeros_like(K_j)  # (b, h, Bc, d)  line 8, on chip
        dV_j = torch.zeros_like(V_j)  # (b, h, Bc, d)
        for r0 in range(0, p.sq, block_r):  # line 9
            r1 = min(r0 + block_r, p.sq)
            Q_i, O_i, dO_i, dQ_i = (t[:, :, r0:r1] for t in (p.qh, O, dO, dQ))  # (b, h, Br, d)  line 10
            l_i, m_i = l[:, :, r0:r1], m[:, :, r0:r1]  # (b, h, Br)
            io.read(Q_i, O_i, dO_i, dQ_i, l_i, m_i)
            S_ij, tanh = p.scores(Q_i, K_j, r0, c0)  # (b, h, Br, Bc)  lines 11-12
            P_ij = torch.exp(S_ij - finite_or_zero(m_i)[..., None]) / nonzero(l_i)[..., None]  # line 13
            # lines 14-15 and 18 apply dropout, which this reference leaves to `naive`
            dV_j += P_ij.transpose(-1, -2) @ dO_i  # (b, h, Bc, d)  line 16
            dP_ij = dO_i @ V_j.transpose(-1, -2)  # (b, h, Br, Bc)  line 17
            D_i = (dO_i * O_i).sum(-1)  # (b, h, Br)  line 19
            dS_ij = p.through_softcap(P_ij * (dP_ij - D_i[..., None]), tanh)  # (b, h, Br, Bc)  line 20
            dQ_new = dQ_i + p.scale * (dS_ij @ K_j)  # (b, h, Br, d)  line 21
            dQ[:, :, r0:r1] = dQ_new
            io.write(dQ_new)
            dK_j += p.scale * (dS_ij.transpose(-1, -2) @ Q_i)  # (b, h, Bc, d)  line 22
        dK[:, :, c0:c1] = dK_j  # line 24
        dV[:, :, c0:c1] = dV_j
        io.write(dK_j, dV_j)
    return p.bshd(dQ), p.bshd(p.group_sum(dK)), p.bshd(p.group_sum(dV))  # line 26
