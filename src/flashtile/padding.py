"""Between padded batches and packed sequences: flash-attn's bert_padding helpers, with autograd.

A padded batch (batch, seqlen, ...) with an attention_mask (batch, seqlen) of 1 for real tokens
becomes the packed rows flash_attn_varlen_func takes, and back:

    x_packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    out_padded = pad_input(out, indices, batch, seqlen)        # zeros at the padding

Left and right padding work alike: only the mask's ones are kept, in order.
"""

from __future__ import annotations

import torch

from flashtile import _checks
from flashtile._checks import ArgumentError


def _check_mask(name: str, mask, shape) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ArgumentError(f"{name} must have shape (batch, seqlen) = {tuple(shape)}, got {tuple(mask.shape)}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"{name} must be bool or integer (1 = a real token), got {mask.dtype}")
    return mask.bool()


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """Keep the rows the mask marks, packed sequence after sequence.

    Arguments:
        hidden_states: (batch, seqlen, ...).
        attention_mask: (batch, seqlen) bool or int, 1 (True) for tokens that attend and are attended.
        unused_mask: optional (batch, seqlen): tokens kept in the packed rows but not attended
            (flash-attn >= 2.7's argument; their keys fall outside seqused).
    Returns:
        hidden_states[mask]: (total, ...), differentiable;
        indices: (total,) int64, each kept row's position in the flattened (batch * seqlen) rows;
        cu_seqlens: (batch + 1,) int32 offsets of the sequences in the packed rows;
        max_seqlen: int, the longest sequence (one host read of the lengths);
        seqused: (batch,) int32, the attended tokens of each sequence (= its length without
            unused_mask).
    """
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a tensor (batch, seqlen, ...), got {type(hidden_states).__name__}")
    if hidden_states.dim() < 2:
        raise ArgumentError(f"hidden_states must be a tensor (batch, seqlen, ...), got {tuple(hidden_states.shape)}")
    indices, cu_seqlens, max_seqlen, seqused = packing(attention_mask, unused_mask, hidden_states.shape[:2])
    return hidden_states.flatten(0, 1).index_select(0, indices), indices, cu_seqlens, max_seqlen, seqused


def packing(attention_mask: torch.Tensor, unused_mask=None, shape=None):
    """unpad_input's (indices, cu_seqlens, max_seqlen, seqused) for a mask alone, so that a caller
    packing several tensors by one mask (the layers of a model) computes them once: max_seqlen is a
    host read of the lengths. shape: the (batch, seqlen) the mask must have (default its own)."""
    if shape is None and isinstance(attention_mask, torch.Tensor):
        shape = attention_mask.shape
    mask = _check_mask("attention_mask", attention_mask, shape)
    shape = tuple(shape)
    keep = mask if unused_mask is None else mask | _check_mask("unused_mask", unused_mask, shape)
    seqused = mask.sum(-1, dtype=torch.int32)
    lengths = keep.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    max_seqlen = int(lengths.max()) if shape[0] else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of unpad_input: packed rows (total, ...) -> (batch, seqlen, ...), zeros at the
    positions indices does not name; differentiable (the gradient reads the named rows back)."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1:
        raise TypeError(f"hidden_states must be a tensor (total, ...), got {type(hidden_states).__name__}")
    if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be an int32 or int64 tensor, got "
                        f"{indices.dtype if isinstance(indices, torch.Tensor) else type(indices).__name__}")
    if indices.dim() != 1 or indices.shape[0] != hidden_states.shape[0]:
        raise ArgumentError(f"indices must have shape ({hidden_states.shape[0]},) (one per packed row), got "
                            f"{tuple(indices.shape)}")
    batch, seqlen = _checks.check_int("batch", batch), _checks.check_int("seqlen", seqlen)
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    if indices.device.type == "cpu" and indices.numel():  # on the GPU index_copy asserts on the device
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= batch * seqlen:
            raise ArgumentError(f"indices must name rows of the batch * seqlen = {batch * seqlen} padded positions, "
                                f"got values in [{lo}, {hi}]")
    return out.index_copy(0, indices.long(), hidden_states).unflatten(0, (batch, seqlen))
