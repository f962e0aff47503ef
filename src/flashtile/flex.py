"""Programmable attention's host side: block masks (issue 74).

`create_block_mask` is torch's function with torch's contract and result (a
`torch.nn.attention.flex_attention.BlockMask`, usable with torch's flex_attention too), built
without the (B, H, Q_LEN, KV_LEN) mask: the mask mod is evaluated a band of query blocks at a
time (or a band of key blocks of one query block, for long keys), on the device given, and each
band is reduced to its blocks at once.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

# elements of the mask evaluated at once, at least one block of every batch and head: a band of query
# blocks with every key, or one query block and a band of key blocks
BAND_ELEMENTS = 1 << 24


def _ordered(dense: torch.Tensor):
    """(num_blocks, indices) int32 of a (B, H, q blocks, kv blocks) bool: each row's blocks first,
    ascending, as torch orders them."""
    num = dense.sum(-1, dtype=torch.int32)
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num, indices


def create_block_mask(mask_mod: Callable, B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int,
                      device: Union[str, torch.device] = "cuda", BLOCK_SIZE: Union[int, tuple] = 128,
                      _compile: bool = False):
    """torch.nn.attention.flex_attention.create_block_mask's result, the same fields: for every
    (batch, head, query block, key block), whether mask_mod(b, h, q_idx, kv_idx) holds at every
    position of the block (a full block), at some (partial) or at none (left out). B or H None:
    one for all batches or heads (mask_mod must not depend on it). A block past Q_LEN or KV_LEN
    counts its missing positions as masked, as torch's. `_compile` is accepted for torch's
    signature; nothing here is compiled."""
    q_block, kv_block = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    for name, value in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN), ("BLOCK_SIZE", q_block), ("BLOCK_SIZE", kv_block)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    b, h = B or 1, H or 1
    n_q, n_kv = -(-Q_LEN // q_block), -(-KV_LEN // kv_block)
    kv_pad = n_kv * kv_block
    bi = torch.arange(b, device=device)[:, None, None, None]
    hi = torch.arange(h, device=device)[None, :, None, None]
    # a band: q_band query blocks x kv_band key blocks of every batch and head
    q_band = max(1, BAND_ELEMENTS // (b * h * q_block * kv_pad))
    kv_band = n_kv if q_band > 1 else max(1, BAND_ELEMENTS // (b * h * q_block * kv_block))
    partial = torch.empty(b, h, n_q, n_kv, dtype=torch.bool, device=device)
    full = torch.empty_like(partial)
    for q0 in range(0, n_q, q_band):
        nq = min(q_band, n_q - q0)
        qi = torch.arange(q0 * q_block, (q0 + nq) * q_block, device=device)[None, None, :, None]
        for k0 in range(0, n_kv, kv_band):
            nk = min(kv_band, n_kv - k0)
            ki = torch.arange(k0 * kv_block, (k0 + nk) * kv_block, device=device)[None, None, None, :]
            # the mod sees positions inside the lengths only (it may index by them); the others are masked
            mask = torch.broadcast_to(mask_mod(bi, hi, qi.clamp(max=Q_LEN - 1), ki.clamp(max=KV_LEN - 1)),
                                      (b, h, nq * q_block, nk * kv_block))
            mask = mask & (qi < Q_LEN) & (ki < KV_LEN)
            counts = mask.reshape(b, h, nq, q_block, nk, kv_block).sum(dim=(3, 5))
            whole = counts == q_block * kv_block
            full[:, :, q0:q0 + nq, k0:k0 + nk] = whole
            partial[:, :, q0:q0 + nq, k0:k0 + nk] = (counts > 0) & ~whole
    from torch.nn.attention.flex_attention import BlockMask

    kv_num, kv_indices = _ordered(partial)
    full_num, full_indices = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=(q_block, kv_block),
                                    mask_mod=mask_mod, seq_lengths=(Q_LEN, KV_LEN))
