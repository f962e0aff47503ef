"""FlashAttention-2 (Dao, 2023) in plain PyTorch: Algorithm 1 forward, Algorithm 2 backward.

What changes from FA1 (seed 002): the Q blocks move to the outer loop and K/V to the inner one, so
O_i, l_i and m_i stay on chip for a whole row of blocks and are written once; O is kept unnormalised
and scaled by diag(l)^-1 once at the end; the output is the log-sum-exp L = m + log l instead of
(l, m); and blocks that the causal or sliding-window mask hides completely are skipped.

This module is also the CPU path of the public API: BSHD inputs, GQA/MQA, bottom-right aligned causal
and windowed masks with sq != sk, softcap, ALiBi and dropout (the kernels' mask, reference.dropout,
drawn tile by tile: the mask is never materialised either; Z below). It loops over
blocks only; every tile carries all (b, h) at once, and the largest temporary is one (b, h, block_m,
block_n) score tile, so the extra memory is O(N), never O(N^2). An `analysis.IOCounter` passed as
`counter` sees every tile that moves between "HBM" and "SRAM" (`analysis.fa2` predicts the count).
"""

from __future__ import annotations

import torch

from flashtile.reference import _tiles
from flashtile.reference._tiles import finite_or_zero, nonzero

# Tiles of the CPU path: large, because each tile costs Python overhead; the GPU kernels' tiles are
# chosen in ops/configs.py.
BLOCK_M = 128
BLOCK_N = 128


def attend(p: _tiles.Problem, lo: int, hi: int, block_m: int, block_n: int,
           io, dropout=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 over the keys [lo, hi) only: (O (b, h, sq, d), L (b, h, sq)) in p.dtype.

    The K/V block grid starts at lo, so `decoding` runs this once per split of the keys. Rows that see
    no key of [lo, hi) get O = 0 and L = -inf. With dropout (a reference.dropout.DropoutMask) P V
    uses P o Z, scaled once at the end; l and L stay those of the softmax before dropout.
    """
    O = torch.empty_like(p.qh)  # (b, h, sq, d) in HBM
    L = torch.empty(p.b, p.h, p.sq, dtype=p.dtype, device=p.qh.device)  # (b, h, sq)
    for r0 in range(0, p.sq, block_m):  # Algorithm 1, line 3: for 1 <= i <= T_r
        r1 = min(r0 + block_m, p.sq)
        Q_i = p.qh[:, :, r0:r1]  # (b, h, Br, d)  line 4
        io.read(Q_i)
        O_i = torch.zeros_like(Q_i)  # (b, h, Br, d)  line 5, on chip
        l_i = torch.zeros(Q_i.shape[:-1], dtype=p.dtype, device=Q_i.device)  # (b, h, Br)
        m_i = torch.full_like(l_i, _tiles.NEG_INF)  # (b, h, Br)
        for c0 in p.mask.key_blocks(r0, r1, block_n, lo, hi):  # line 6, fully masked blocks skipped
            c1 = min(c0 + block_n, hi)
            K_j = p.kv_tile(p.kh, c0, c1)  # (b, h, Bc, d)  line 7
            V_j = p.kv_tile(p.vh, c0, c1)  # (b, h, Bc, d)
            io.read(K_j, V_j)
            S_ij, _ = p.scores(Q_i, K_j, r0, c0)  # (b, h, Br, Bc)  line 8
            m_new = torch.maximum(m_i, S_ij.amax(-1))  # (b, h, Br)  line 9
            P_tilde = torch.exp(S_ij - finite_or_zero(m_new)[..., None])  # (b, h, Br, Bc)
            alpha = torch.exp(m_i - finite_or_zero(m_new))  # (b, h, Br) e^{m_i^(j-1) - m_i^(j)}
            l_i = alpha * l_i + P_tilde.sum(-1)  # (b, h, Br)
            if dropout is not None:
                P_tilde = P_tilde * dropout.keep(r0, r1, c0, c1, P_tilde.device)  # P_tilde o Z_ij
            O_i = alpha[..., None] * O_i + P_tilde @ V_j  # (b, h, Br, d)  line 10, unnormalised
            m_i = m_new
        O_i = O_i / nonzero(l_i)[..., None]  # (b, h, Br, d)  line 12: the one diag(l)^-1
        if dropout is not None:
            O_i = O_i * dropout.scale  # 1 / (1 - p)
        L_i = m_i + torch.log(l_i)  # (b, h, Br)  line 13; -inf where the row saw no key
        O[:, :, r0:r1] = O_i  # line 14
        L[:, :, r0:r1] = L_i  # line 15
        io.write(O_i, L_i)
    return O, L


def forward(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, block_m=BLOCK_M, block_n=BLOCK_N, counter=None, dropout=None):
    """Exact attention, FA2's loop. Returns (out, lse).

    q (b, sq, h, d), k and v (b, sk, hk, d) with h % hk == 0; fp16, bf16, fp32 or fp64. Scores are
    `softmax_scale * q.k` (default d**-0.5), then `softcap * tanh(s / softcap)` if softcap > 0, then
    `- slope * |i + sk - sq - j|` with alibi_slopes (h,) or (b, h) float32. Masks are aligned to the
    bottom-right corner; causal=True means window right = 0. With sq=2, sk=5, causal:
        1 1 1 1 0
        1 1 1 1 1
    Computes in float32 (float64 for float64 inputs). out (b, sq, h, d) in q's dtype; lse (b, h, sq)
    float32 (float64 for float64 inputs), natural log. A row that sees no key has out 0, lse -inf.
    dropout: a reference.dropout.DropoutMask (the kernels' mask) or None.
    """
    p = _tiles.Problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes)
    _tiles.check_block("block_m", block_m)
    _tiles.check_block("block_n", block_n)
    O, L = attend(p, 0, p.sk, block_m, block_n, counter or _tiles.NO_COUNTER, dropout)
    return p.bshd(O), L


def backward(dout, q, k, v, out, lse, softmax_scale=None, causal=False, window_size=(-1, -1),
             softcap=0.0, alibi_slopes=None, block_m=BLOCK_M, block_n=BLOCK_N, counter=None,
             dropout=None):
    """Algorithm 2: recompute P from the LSE, block by block. Returns (dq, dk, dv).

    dout and out (b, sq, h, d) with q's dtype, lse (b, h, sq) as `forward` returned them; the other
    arguments as in `forward`. dq (b, sq, h, d), dk and dv (b, sk, hk, d) in q's dtype; dk and dv are
    summed over the query heads that share a kv head (GQA/MQA). Query blocks that see none of a K/V
    block's keys are skipped. dQ_i is accumulated in HBM (line 15: an atomic add on a GPU).
    """
    p = _tiles.Problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes)
    _tiles.check_block("block_m", block_m)
    _tiles.check_block("block_n", block_n)
    io = counter or _tiles.NO_COUNTER
    dO = p.like_q("dout", dout)  # (b, h, sq, d)
    O = p.like_q("out", out)  # (b, h, sq, d)
    L = p.row_stat("lse", lse)  # (b, h, sq)
    dQ = torch.zeros_like(p.qh)  # (b, h, sq, d)  Algorithm 2, line 3, in HBM
    io.write(dQ)
    io.read(O, dO)
    D = (dO * O).sum(-1)  # (b, h, sq)  line 4: delta = rowsum(dO * O)
    io.write(D)
    dK = torch.empty(p.b, p.h, p.sk, p.d, dtype=p.dtype, device=q.device)  # per query head
    dV = torch.empty_like(dK)  # (b, h, sk, d)
    for c0 in range(0, p.sk, block_n):  # line 5: for 1 <= j <= T_c
        c1 = min(c0 + block_n, p.sk)
        K_j = p.kv_tile(p.kh, c0, c1)  # (b, h, Bc, d)  line 6
        V_j = p.kv_tile(p.vh, c0, c1)  # (b, h, Bc, d)
        io.read(K_j, V_j)
        dK_j = torch.zeros_like(K_j)  # (b, h, Bc, d)  line 7, on chip
        dV_j = torch.zeros_like(V_j)  # (b, h, Bc, d)
        for r0 in p.mask.query_blocks(c0, c1, block_m):  # line 8, fully masked blocks skipped
            r1 = min(r0 + block_m, p.sq)
            Q_i, dO_i, dQ_i = (t[:, :, r0:r1] for t in (p.qh, dO, dQ))  # (b, h, Br, d)  line 9
            L_i, D_i = L[:, :, r0:r1], D[:, :, r0:r1]  # (b, h, Br); O_i is not needed after line 4
            io.read(Q_i, dO_i, dQ_i, L_i, D_i)
            S_ij, tanh = p.scores(Q_i, K_j, r0, c0)  # (b, h, Br, Bc)  line 10
            P_ij = torch.exp(S_ij - finite_or_zero(L_i)[..., None])  # (b, h, Br, Bc)  line 11
            Z_ij = 1.0 if dropout is None else dropout.keep(r0, r1, c0, c1, P_ij.device) * dropout.scale
            dV_j += (P_ij * Z_ij).transpose(-1, -2) @ dO_i  # (b, h, Bc, d)  line 12
            dP_ij = (dO_i @ V_j.transpose(-1, -2)) * Z_ij  # (b, h, Br, Bc)  line 13
            dS_ij = p.through_softcap(P_ij * (dP_ij - D_i[..., None]), tanh)  # (b, h, Br, Bc)  line 14
            dQ_new = dQ_i + p.scale * (dS_ij @ K_j)  # (b, h, Br, d)  line 15
            dQ[:, :, r0:r1] = dQ_new
            io.write(dQ_new)
            dK_j += p.scale * (dS_ij.transpose(-1, -2) @ Q_i)  # (b, h, Bc, d)  line 16
        dK[:, :, c0:c1] = dK_j  # line 18
        dV[:, :, c0:c1] = dV_j
        io.write(dK_j, dV_j)
    return p.bshd(dQ), p.bshd(p.group_sum(dK)), p.bshd(p.group_sum(dV))
