"""Cutting a sequence into the shards ring attention expects, and putting it back together.

    zigzag (the default):  2 * world equal chunks, rank r holds chunks r and 2 * world - 1 - r
    contiguous:            world equal chunks, rank r holds chunk r

With world = 2, zigzag gives rank 0 chunks [0, 3] and rank 1 chunks [1, 2] of a sequence cut in
4. The same layout must shard q, k and v (and the labels and position ids a model uses with them:
`shard_sequence(torch.arange(seqlen), rank, world, dim=0)` is each local token's position). A
packed batch (cu_seqlens) is sharded sequence by sequence; the shards then have offsets
cu_seqlens // world.
"""

from __future__ import annotations

import torch

from flashtile import _checks
from flashtile._checks import ArgumentError
from flashtile.distributed import comm, plan


def _lengths(cu_seqlens, total: int) -> list[int]:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
        raise TypeError(f"cu_seqlens must be a 1-D integer tensor of offsets, got "
                        f"{cu_seqlens if not isinstance(cu_seqlens, torch.Tensor) else cu_seqlens.dtype}")
    values = _checks.host_values(cu_seqlens)
    if values is None:
        raise RuntimeError("cu_seqlens must be readable on the host (not under CUDA-graph capture)")
    return _checks._check_offsets("cu_seqlens", values, total)


def _check_split(lengths: list[int], world: int, layout: str, what: str) -> int:
    """The number of chunks; every length must split into them."""
    n = plan.num_chunks(world, plan.check_layout(layout))
    for i, length in enumerate(lengths):
        if length % n:
            seq = f"sequence {i} of {what}" if len(lengths) > 1 else what
            raise ArgumentError(f"{seq} has {length} tokens, not a multiple of {n}: layout={layout!r} over "
                                f"{world} ranks cuts every sequence into {n} equal chunks")
    return n


def shard_index(seqlen: int, rank: int, world: int, layout: str = "zigzag", cu_seqlens=None) -> torch.Tensor:
    """The global rows rank's shard holds, in its order: (seqlen // world,) int64. With cu_seqlens
    (the packed batch's offsets, ending at seqlen) every sequence is split on its own."""
    world = _checks.check_int("world", world, 1)
    rank = _checks.check_int("rank", rank)
    if rank >= world:
        raise ArgumentError(f"rank must be in 0..{world - 1}, got {rank}")
    lengths = [seqlen] if cu_seqlens is None else _lengths(cu_seqlens, seqlen)
    _check_split(lengths, world, layout, "the sequence" if cu_seqlens is None else "cu_seqlens")
    starts = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    return torch.cat([int(start) + torch.from_numpy(plan.positions(n, rank, world, layout))
                      for start, n in zip(starts.tolist(), lengths)]) if lengths else torch.zeros(0, dtype=torch.int64)


def _check_dim(dim: int, shape, what: str) -> None:
    if not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
        raise ArgumentError(f"dim must name a dimension of {what} (shape {tuple(shape)}), got {dim!r}")


def shard_sequence(x: torch.Tensor, rank: int, world: int, *, dim: int = 1, layout: str = "zigzag",
                   cu_seqlens=None) -> torch.Tensor:
    """rank's shard of x along dim (the sequence dim: 1 for (batch, seqlen, ...), 0 for a packed
    (total, ...) batch with cu_seqlens), as a new tensor. x.shape[dim] must split into
    plan.num_chunks(world, layout) equal chunks (per sequence with cu_seqlens)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_dim(dim, x.shape, "x")
    index = shard_index(x.shape[dim], rank, world, layout, cu_seqlens)
    return x.index_select(dim, index.to(x.device))


def unshard_sequence(shards, *, dim: int = 1, layout: str = "zigzag", cu_seqlens=None) -> torch.Tensor:
    """The global tensor from every rank's shard (a list in rank order), undoing shard_sequence.
    cu_seqlens: the global offsets, for a packed batch."""
    shards = list(shards)
    if not shards or not all(isinstance(s, torch.Tensor) for s in shards):
        raise TypeError("shards must be a non-empty list of tensors, one per rank in rank order")
    world = len(shards)
    shape = list(shards[0].shape)
    for r, s in enumerate(shards):
        if list(s.shape) != shape:
            raise ArgumentError(f"every shard must have shape {tuple(shape)} (as rank 0's), rank {r}'s has "
                                f"{tuple(s.shape)}")
    _check_dim(dim, shape, "the shards")
    seqlen = shape[dim] * world
    shape[dim] = seqlen
    full = shards[0].new_empty(shape)
    for r, s in enumerate(shards):
        full.index_copy_(dim, shard_index(seqlen, r, world, layout, cu_seqlens).to(s.device), s)
    return full


def gather_sequence(x: torch.Tensor, group=None, *, dim: int = 1, layout: str = "zigzag",
                    cu_seqlens=None) -> torch.Tensor:
    """The global tensor on every rank of group, from each rank's shard x (an all_gather, then
    unshard_sequence): for outputs and checks; ring attention itself never gathers K/V."""
    group = comm.check_group(group, "gather_sequence")
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format)
             for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return unshard_sequence(parts, dim=dim, layout=layout, cu_seqlens=cu_seqlens)
