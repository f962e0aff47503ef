"""flash_attn_with_kvcache in plain PyTorch: append, rotary, gather, then the naive attention.

The semantics the decode kernels implement (flash-attn 2.x), written one batch row at a time:
  1. new k/v rows go into the cache at positions cache_seqlens[b] + t (through the page table when
     paged, into cache row cache_batch_idx[b] otherwise), k rotated at those positions;
  2. the row attends logical keys j = 0 .. seqlen_k - 1, seqlen_k = cache_seqlens[b] -
     cache_leftpad[b] + seqlen_new, stored at positions cache_leftpad[b] + j;
  3. q is rotated at cache_seqlens[b] + i with a causal or local mask, else all rows at
     cache_seqlens[b]; masks and ALiBi are bottom-right aligned on (seqlen_q, seqlen_k).
With compute_dtype=torch.float64 this is the oracle of the decode tests; the API's CPU fallback
runs it in float32.
"""

from __future__ import annotations

import torch

from flashtile.reference import naive


def apply_rotary(x, cos, sin, positions, interleaved: bool):
    """x (b, s, h, d) rotated on its first rotary_dim = 2 * cos.shape[1] dims.

    cos/sin (seqlen_ro, rotary_dim / 2); positions (b, s) long. Interleaved (GPT-J) rotates pairs
    (2i, 2i+1) by angle i, otherwise (GPT-NeoX) pairs (i, i + rotary_dim / 2). Computed in x's dtype.
    """
    rd = 2 * cos.shape[1]
    c = cos[positions].unsqueeze(2).to(x.dtype)  # (b, s, 1, rd / 2)
    s = sin[positions].unsqueeze(2).to(x.dtype)
    xr = x[..., :rd]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rotated, x[..., rd:]), dim=-1)


def _lengths(cache_seqlens, b: int, capacity: int) -> list[int]:
    if cache_seqlens is None:
        return [capacity] * b
    if isinstance(cache_seqlens, int):
        return [cache_seqlens] * b
    return [int(x) for x in cache_seqlens.tolist()]


def _rows(b, positions, k_cache, cache_batch_idx, block_table):
    """Index tuple addressing cache rows `positions` (long, 1-D) of batch row b."""
    if block_table is not None:
        page_size = k_cache.shape[1]
        return block_table[b].long()[positions // page_size], positions % page_size
    cb = b if cache_batch_idx is None else int(cache_batch_idx[b])
    return cb, positions


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                           cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                           block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                           compute_dtype=None, learnable_sink=None):
    """Arguments as flash_attn_with_kvcache (checked by the caller). Writes k/v into the cache.

    Returns out (b, sq, h, d) in compute_dtype (q's dtype when None) and lse (b, h, sq) float32
    (float64 when computing in float64), -inf for rows that see no key (the sink's logit with
    learnable_sink (h,)).
    """
    b, sq, h, d = q.shape
    cdt = compute_dtype or q.dtype
    capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    lengths = _lengths(cache_seqlens, b, capacity)
    s_new = 0 if k is None else k.shape[1]
    local = causal or tuple(window_size) != (-1, -1)
    outs, lses = [], []
    for bi in range(b):
        n = lengths[bi]
        pad = 0 if cache_leftpad is None else int(cache_leftpad[bi])
        qb = q[bi:bi + 1].to(cdt)  # (1, sq, h, d)
        if k is not None:
            new_pos = torch.arange(n, n + s_new, device=q.device)
            kb = k[bi:bi + 1].to(cdt)
            if rotary_cos is not None:
                kb = apply_rotary(kb, rotary_cos, rotary_sin, new_pos[None], rotary_interleaved)
                q_pos = n + torch.arange(sq, device=q.device) * int(local)
                qb = apply_rotary(qb, rotary_cos, rotary_sin, q_pos[None], rotary_interleaved)
            idx = _rows(bi, new_pos, k_cache, cache_batch_idx, block_table)
            k_cache[idx] = kb[0].to(k_cache.dtype)
            v_cache[idx] = v[bi].to(v_cache.dtype)
        idx = _rows(bi, torch.arange(pad, n + s_new, device=q.device), k_cache, cache_batch_idx,
                    block_table)
        keys = k_cache[idx].unsqueeze(0).to(cdt)  # (1, seqlen_k, hk, d)
        values = v_cache[idx].unsqueeze(0).to(cdt)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[bi]
        out, lse = naive.attention(qb, keys, values, softmax_scale, causal, window_size, softcap,
                                   slopes, compute_dtype=cdt, learnable_sink=learnable_sink)
        outs.append(out)
        lses.append(lse)
    if not outs:  # an empty batch: empty outputs, as the kernels return
        lse_dtype = torch.float64 if cdt == torch.float64 else torch.float32
        return q.new_empty((0, sq, h, d), dtype=cdt), q.new_empty((0, h, sq), dtype=lse_dtype)
    return torch.cat(outs), torch.cat(lses)
