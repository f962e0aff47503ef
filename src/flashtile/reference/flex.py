"""FlexAttention's semantics written out densely: the oracle that programmable attention is checked
against (issue 74), in torch's layout and conventions.

Layout is torch's (B, H, S, D): q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D); Hq % Hkv == 0 with
enable_gqa. A score mod `score_mod(score, b, h, q_idx, kv_idx) -> score` and a mask mod
`mask_mod(b, h, q_idx, kv_idx) -> bool` are written in torch operations as for
`torch.nn.attention.flex_attention`; torch calls them on scalars through vmap, this file on index
tensors that broadcast against the (B, H, Sq, Sk) scores, which gives the same values for mods made
of elementwise operations and indexing (what FlexAttention accepts). Tensors a mod captures get
their gradients from autograd.

A BlockMask (torch's, or anything with its fields) decides per (query block, key block): blocks in
neither its partial nor its full lists are masked whatever the mask mod says, full blocks are
visible without it, partial blocks apply it: the kernels' semantics (torch's GPU kernels, FA4's).
torch's CPU flex_attention applies the mask mod at every position instead; the two agree for a
BlockMask made from its mask mod. A row that sees no key gets output 0 and LSE -inf, torch's
convention (flash-attn's too).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def _blocks(num_blocks: torch.Tensor, indices: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(B, H, q blocks, kv blocks) bool from a BlockMask's per-row block count and block indices."""
    rank = torch.arange(indices.shape[-1], device=indices.device)
    listed = rank < num_blocks[..., None]  # the first num_blocks entries of each row are its blocks
    dense = torch.zeros(*indices.shape[:-1], n_kv + 1, dtype=torch.bool, device=indices.device)
    # unlisted entries go to a spare column, dropped below
    dense.scatter_(-1, torch.where(listed, indices.long(), n_kv), True)
    return dense[..., :n_kv]


def block_visibility(block_mask, sq: int, sk: int):
    """(partial, full): bool (B or 1, H or 1, sq, sk) of a BlockMask spread to elements: partial
    where its partial blocks lie (the mask mod decides there), full where its full blocks lie."""
    q_block, kv_block = block_mask.BLOCK_SIZE
    n_kv = block_mask.kv_indices.shape[-1]
    partial = _blocks(block_mask.kv_num_blocks, block_mask.kv_indices, n_kv)
    if block_mask.full_kv_num_blocks is not None:
        full = _blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n_kv)
    else:
        full = torch.zeros_like(partial)
    rows = torch.arange(sq, device=partial.device) // q_block
    cols = torch.arange(sk, device=partial.device) // kv_block
    return tuple(x[..., rows, :][..., cols] for x in (partial, full))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: Optional[Callable] = None,
              block_mask=None, scale: Optional[float] = None, enable_gqa: bool = False,
              mask_mod: Optional[Callable] = None, compute_dtype: Optional[torch.dtype] = None):
    """(out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) float32, natural log) of FlexAttention.

    mask_mod applies where block_mask is None (as if every block were partial); with a BlockMask
    its own mask_mod applies in its partial blocks. compute_dtype: the dtype the scores, softmax and
    products are computed in (torch.float64 for the oracle), else q's."""
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if hk != h:
        if not enable_gqa or h % hk:
            raise ValueError(f"query heads ({h}) differ from key/value heads ({hk}): pass enable_gqa=True "
                             f"with a multiple")
        k, v = (x.repeat_interleave(h // hk, dim=1) for x in (k, v))
    dtype = compute_dtype or q.dtype
    scale = d ** -0.5 if scale is None else scale
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    device = q.device
    bi = torch.arange(b, device=device)[:, None, None, None]
    hi = torch.arange(h, device=device)[None, :, None, None]
    qi = torch.arange(sq, device=device)[None, None, :, None]
    ki = torch.arange(sk, device=device)[None, None, None, :]
    if score_mod is not None:
        scores = score_mod(scores, bi, hi, qi, ki)
    if block_mask is not None:
        partial, full = block_visibility(block_mask, sq, sk)
        mask_mod = block_mask.mask_mod
        ok = full | (partial & mask_mod(bi, hi, qi, ki)) if mask_mod is not None else full | partial
    else:
        ok = mask_mod(bi, hi, qi, ki) if mask_mod is not None else None
    if ok is not None:
        scores = scores.masked_fill(~torch.broadcast_to(ok, scores.shape), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where a row sees nothing
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])  # 0 in such rows
    out = p @ v.to(dtype)
    return out.to(q.dtype), lse.float()
