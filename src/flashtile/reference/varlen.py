"""Packed variable-length batches in plain PyTorch: each sequence is its own attention problem.

flash-attn's varlen layout packs the batch's sequences end to end, q (total_q, h, d) and k, v
(total_k, hk, d), and says where each one starts in cu_seqlens (b + 1 offsets from 0). Sequence b
is attention of q[cu_q[b]:cu_q[b+1]] over its keys with every mask aligned to its own bottom-right
corner; nothing crosses a sequence boundary. So the reference is a loop: cut each sequence out,
run `fa2` (or any BSHD attention) on it as a batch of one, put the results back. The kernels do
the same in one launch (ops.masks.seq_bounds).

Keys of sequence b: rows cu_k[b]:cu_k[b+1] of k/v, only the first seqused_k[b] of them when given;
or, with a block_table, pages (num_pages, page_size, hk, d) where key j is row j % page_size of page
block_table[b, j // page_size]. Dropout draws the counter of sequence b (reference.dropout).
"""

from __future__ import annotations

import torch

from flashtile.reference import fa2
from flashtile.reference.dropout import DropoutMask


def bounds(varlen) -> list[tuple[int, int, int, int]]:
    """(q0, q1, k0, k1) of each sequence of a _checks.Varlen, host ints: its rows of q, and its
    keys: rows of k (contiguous) or logical positions from 0 (paged)."""
    cu_q = varlen.cu_seqlens_q.tolist()
    cu_k = varlen.cu_seqlens_k.tolist()
    used = varlen.seqused_k.tolist() if varlen.seqused_k is not None else None
    out = []
    for b in range(len(cu_q) - 1):
        k0 = 0 if varlen.block_table is not None else cu_k[b]
        n_k = cu_k[b + 1] - cu_k[b] if used is None else used[b]
        out.append((cu_q[b], cu_q[b + 1], k0, k0 + n_k))
    return out


def keys(t: torch.Tensor, varlen, b: int, k0: int, k1: int) -> torch.Tensor:
    """Keys (or values) k0:k1 of sequence b as (k1 - k0, hk, d): a slice, or gathered from pages."""
    if varlen.block_table is None:
        return t[k0:k1]
    page_size = t.shape[1]
    pos = torch.arange(k0, k1, device=t.device)
    pages = varlen.block_table[b].to(t.device).long()[pos // page_size]
    return t[pages, pos % page_size]


def _slopes(alibi_slopes, b: int):
    return alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]


def _dropout(dropout, h: int, b: int):
    """(p, rng) or None -> the DropoutMask of sequence b."""
    if dropout is None or dropout[0] == 0:
        return None
    return DropoutMask(dropout[0], dropout[1], h, [b])


def forward(q, k, v, varlen, softmax_scale, window_size, softcap=0.0, alibi_slopes=None, dropout=None):
    """out (total_q, h, d) in q's dtype and lse (h, total_q) float32, by fa2.forward per sequence.
    dropout = (p, rng) or None; rows outside every sequence are left zero (lse -inf)."""
    h = q.shape[1]
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as the kernels' (and the fake impl's)
    lse = torch.full((h, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for b, (q0, q1, k0, k1) in enumerate(bounds(varlen)):
        if q1 == q0:
            continue
        o, l = fa2.forward(q[None, q0:q1], keys(k, varlen, b, k0, k1)[None], keys(v, varlen, b, k0, k1)[None],
                           softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                           alibi_slopes=_slopes(alibi_slopes, b), dropout=_dropout(dropout, h, b))
        out[q0:q1] = o[0].to(q.dtype)
        lse[:, q0:q1] = l[0].float()
    return out, lse


def backward(dout, q, k, v, out, lse, varlen, softmax_scale, window_size, softcap=0.0,
             alibi_slopes=None, dropout=None):
    """(dq, dk, dv) shaped like q, k, v (contiguous k/v only), by fa2.backward per sequence; keys
    no sequence uses get zero gradients."""
    if varlen.block_table is not None:
        raise ValueError("the backward reads contiguous k/v: gather the pages first (the API does)")
    h = q.shape[1]
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    for b, (q0, q1, k0, k1) in enumerate(bounds(varlen)):
        if q1 == q0:
            continue
        grads = fa2.backward(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                             out[None, q0:q1], lse[None, :, q0:q1], softmax_scale=softmax_scale,
                             window_size=window_size, softcap=softcap, alibi_slopes=_slopes(alibi_slopes, b),
                             dropout=_dropout(dropout, h, b))
        dq[q0:q1] = grads[0][0]
        dk[k0:k1] = grads[1][0]
        dv[k0:k1] = grads[2][0]
    return dq, dk, dv
