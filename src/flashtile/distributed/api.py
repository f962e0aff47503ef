"""The user-facing context-parallel functions: argument checks, the rank agreement check, docstrings."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashtile import _checks
from flashtile._checks import ArgumentError
from flashtile.api import _device_guard, backend_for
from flashtile.distributed import comm, plan, ring, shard

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _options(q, d, dropout_p, softmax_scale, causal, window_size, softcap, layout):
    if q.dtype not in _DTYPES:
        raise TypeError(f"q, k, v must be float16, bfloat16 or float32, got {q.dtype}")
    return (_checks.check_dropout_p(dropout_p), _checks.default_scale(softmax_scale, d),
            _checks.check_window(window_size, causal), _checks.check_softcap(softcap), plan.check_layout(layout))


def _signature(q, k, dropout_p, scale, window, softcap, layout, sink) -> dict:
    return {"batch (q.shape[0])": q.shape[0], "tokens per rank (q.shape[1])": q.shape[1],
            "nheads": q.shape[-2], "nheads_k": k.shape[-2], "headdim": q.shape[-1],
            "dtype": str(q.dtype).replace("torch.", ""), "dropout_p": dropout_p, "softmax_scale": scale,
            "window left": window[0], "window right (0 = causal)": window[1], "softcap": softcap,
            "layout": layout, "learnable_sink given": sink is not None}


def _run(q, k, v, sink, steps, group, rank, world, dropout_p, scale, softcap, layout):
    """The ring of one call through autograd -> (out, lse)."""
    r = ring.Ring(rank, world, steps, scale, softcap, dropout_p, backend_for(q))
    with _device_guard(q):
        if dropout_p > 0:
            from flashtile.reference.dropout import draw_rng

            r.rngs = ring.piece_rngs(draw_rng(q.device), rank, world, plan.max_pieces(layout))
        return ring._RingAttention.apply(q, k, v, sink, r, group)


def ring_flash_attn_func(q, k, v, group=None, dropout_p=0.0, softmax_scale=None, causal=False,
                         window_size=(-1, -1), softcap=0.0, return_attn_probs=False, *, layout="zigzag",
                         learnable_sink=None):
    """Exact attention over a sequence sharded across the ranks of `group` (ring attention):
    flash_attn_func's arguments and results, each rank holding and getting back its own shard.

    Every rank calls it at the same time, with its shards of one global sequence of
    world * s_local tokens, cut by flashtile.distributed.shard_sequence with the same `layout`.
    K/V shards travel around the ring (P2P to the next rank, overlapped with the kernels of the
    current shard; no rank ever holds the whole K/V), partial results merge by log-sum-exp, and
    the backward sends dK/dV back around the ring to their owner.

    Arguments:
        q: (batch, s_local, nheads, headdim), float16 / bfloat16 / float32: this rank's queries.
        k, v: (batch, s_local, nheads_k, headdim), nheads % nheads_k == 0 (GQA/MQA).
        group: the torch.distributed process group to shard over (default: the world).
            torch.distributed.init_process_group must have run (nccl for CUDA tensors, gloo for CPU).
        dropout_p, softmax_scale, softcap: as flash_attn_func. With dropout, every (rank, step,
            piece) call draws its own Philox stream from one seed drawn per call from torch's
            generator of q's device (ring.piece_rngs); the backward regenerates them.
        causal, window_size: as flash_attn_func, over the global sequence (global query position
            i sees key j iff i - left <= j <= i + right; causal: j <= i).
        return_attn_probs: also return softmax_lse (batch, nheads, s_local) float32 of this rank's
            rows (in its shard's order), and None in place of the attention matrix.
        layout (keyword): "zigzag" (default) or "contiguous", as the shards were cut. Zigzag gives
            every rank the same causal work (each holds an early and a late chunk) and needs
            s_local even; contiguous is there to compare against (under a causal mask the last
            rank then works 2 * world - 1 times as long as the first). Without a mask the layout
            changes nothing but which tokens a rank holds.
        learnable_sink (keyword): optional (nheads,) float tensor, an attention sink: a logit per
            head that joins every row's softmax with a zero value (gpt-oss). It is replicated on
            every rank, and its gradient on each rank covers that rank's rows only: the
            data-parallel / FSDP reduction that sums a replicated weight's gradients over the
            context-parallel ranks (as for every other weight of the layer) makes it the full one.
    Returns:
        out: (batch, s_local, nheads, headdim), q's dtype: this rank's rows of the global output.
        (out, softmax_lse, None) with return_attn_probs.

    Checks: shapes, dtypes and options on each rank, and on every call that every rank has the
    same ones (one all_gather of ~14 numbers on the host, through gloo: no CUDA synchronisation;
    ranks that disagree all raise, where mismatched transfers would abort or hang the group).
    zigzag needs s_local even. Every step's kernels run through the same dispatch as
    flash_attn_func (backend_for). No torch.compile support: P2P calls break the graph.
    """
    group = comm.check_group(group, "ring_flash_attn_func")
    b, sq, sk, h, hk, d = _checks.check_qkv(q, k, v)
    if sk != sq:
        raise ArgumentError(f"k must hold as many tokens as q on each rank ({sq}, q.shape[1]), got {sk}: q, k and v "
                            f"are shards of one sequence")
    dropout_p, scale, window, softcap, layout = _options(q, d, dropout_p, softmax_scale, causal, window_size,
                                                         softcap, layout)
    sink = _checks.check_sink(learnable_sink, h, q.device)
    if layout == "zigzag" and sq % 2:
        raise ArgumentError(f"q.shape[1] (tokens per rank) must be even with layout='zigzag' (two chunks per rank), "
                            f"got {sq}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    comm.check_ranks_agree(group, _signature(q, k, dropout_p, scale, window, softcap, layout, sink),
                           "ring_flash_attn_func")
    steps = ring.dense_steps(rank, world, layout, sq, window)
    out, lse = _run(q, k, v, sink, steps, group, rank, world, dropout_p, scale, softcap, layout)
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, group=None, dropout_p=0.0, softmax_scale=None,
                                causal=False, window_size=(-1, -1), softcap=0.0, return_attn_probs=False, *,
                                layout="zigzag", learnable_sink=None):
    """ring_flash_attn_func over a packed batch of sequences (flash_attn_varlen_func's layout).

    Arguments:
        q: (total_local, nheads, headdim), k, v: (total_local, nheads_k, headdim): this rank's
            shard of the packed batch, every sequence sharded on its own
            (shard_sequence(x, rank, world, dim=0, layout=..., cu_seqlens=cu_seqlens)): sequence b's
            local rows are cu_seqlens[b] // world .. cu_seqlens[b + 1] // world.
        cu_seqlens: (batch + 1,) int32 on q's device, the *global* offsets (the same on every
            rank): from 0, non-decreasing, ending at world * total_local. Every sequence's length
            must be a multiple of 2 * world (zigzag) or world (contiguous).
        max_seqlen: at least the longest global sequence.
        causal, window_size: causal or full attention per sequence; a sliding window is refused
            (the kernels take one window per call, and a window's offset within a chunk pair
            depends on the sequence's chunk length).
        the rest: as ring_flash_attn_func.
    Returns:
        out: (total_local, nheads, headdim); with return_attn_probs (out, softmax_lse
        (nheads, total_local) float32, None).

    cu_seqlens is read on the host (once per tensor and version, as flash_attn_varlen_func does).
    """
    group = comm.check_group(group, "ring_flash_attn_varlen_func")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.check_tensor(name, t, 3)
    _, sq, sk, h, hk, d = _checks.check_qkv(q[None], k[None], v[None])
    if sk != sq:
        raise ArgumentError(f"k must hold as many tokens as q on each rank ({sq}, q.shape[0]), got {sk}")
    dropout_p, scale, window, softcap, layout = _options(q, d, dropout_p, softmax_scale, causal, window_size,
                                                         softcap, layout)
    if window[0] >= 0 or window[1] > 0:
        raise ArgumentError(f"window_size must be (-1, -1) with a packed batch (causal or full attention only), "
                            f"got {tuple(window_size) if not isinstance(window_size, torch.Tensor) else window_size}")
    sink = _checks.check_sink(learnable_sink, h, q.device)
    _checks.check_index_tensor("cu_seqlens", cu_seqlens, q.device, (None,))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    values = _checks.host_values(cu_seqlens)
    if values is None:
        raise RuntimeError("ring_flash_attn_varlen_func reads cu_seqlens on the host: it cannot run under "
                           "CUDA-graph capture or torch.compile")
    if not values:
        raise ArgumentError("cu_seqlens must hold batch + 1 offsets, got an empty tensor")
    lengths = _checks._check_offsets("cu_seqlens", values, world * sq)
    max_seqlen = _checks.check_int("max_seqlen", max_seqlen)
    if lengths and max(lengths) > max_seqlen:
        raise ArgumentError(f"max_seqlen ({max_seqlen}) is smaller than the longest sequence ({max(lengths)} tokens)")
    shard._check_split(lengths, world, layout, "cu_seqlens")
    signature = _signature(q, k, dropout_p, scale, window, softcap, layout, sink)
    signature.update({"batch (q.shape[0])": len(lengths), "tokens per rank (q.shape[1])": sq,
                      "cu_seqlens (a hash of its values)": hash(tuple(values))})
    comm.check_ranks_agree(group, signature, "ring_flash_attn_varlen_func")
    steps = ring.varlen_steps(rank, world, layout, lengths, window[1] == 0, q.device)
    out, lse = _run(q[None], k[None], v[None], sink, steps, group, rank, world, dropout_p, scale, softcap, layout)
    return (out[0], lse[0], None) if return_attn_probs else out[0]
