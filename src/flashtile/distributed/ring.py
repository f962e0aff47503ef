"""Ring attention (Liu, Zaharia, Abbeel, 2023) on flashtile's kernels: the sequence is sharded over
the ranks of a process group, K/V shards travel around the ring, and each rank merges the partial
attention of its queries over every shard by log-sum-exp (the merge of Flash-Decoding, seed 004).

Forward, step t = 0 .. world - 1 on rank r (holding the K/V of rank src = (r - t) mod world):

    start sending the held K/V to rank r + 1 and receiving rank r - 1's  (P2P, overlapped)
    for each piece of plan.pieces(r, src): (O_p, L_p) = kernels(Q rows, K/V rows, window)
        L_new = logaddexp(L, L_p);  O = O exp(L - L_new) + O_p exp(L_p - L_new);  L = L_new
    wait for the transfer

O and L are float32 accumulators merged in place: merge_attention_states would round O to the
input dtype at every step (world roundings instead of one) and needs the two states stacked into
a new tensor first; the in-place merge costs two elementwise passes over O per piece (a scale and
a multiply-add), the same order of bytes as reading the piece's output once more.

An attention sink (one logit t_h per head, gpt-oss) joins after the last step, once, as one more
state with O = 0 and L = t_h. The backward runs the ring again; each piece's kernels recompute P
from the *final* L (the global softmax, sink included) and take delta = rowsum(dO * O) of the
final O, so their dQ, dK, dV are exactly that block's share of the gradient (as flash-attn's ring
implementations do): dQ accumulates on the rank in float32, added there by the kernels themselves
and unscaled (attention_backward's accumulate_dq: no dQ buffer per piece, no pass to add it, but
with dropout at d <= 128, where the Hopper kernel's dS is in units of its own, backward_ds_unit;
the sum is scaled once at the end); dK/dV of the
held shard accumulate in float32 buffers that travel with it, one hop behind the K/V, and arrive
at the owner after the last step. float32 because each hop adds to them, and bf16 would round at
every hop (the price: dK/dV travel with twice the bytes of bf16 K/V).

ring.py holds the loops and the per-step helpers (`forward_step`, `backward_step`), shared by the
distributed functions and by the one-GPU simulation of `flashtile bench ring` (comm.SimulatedRing
in place of comm.P2PRing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flashtile import _checks, autograd
from flashtile.distributed import comm, plan
from flashtile.reference.decoding import add_sink

_NO_VARLEN = (None, None, 0, 0)


@dataclass(frozen=True)
class Call:
    """One piece of a step as the kernels take it: query rows `q` of the rank's shard, keys `k` of
    the held K/V shard, the kernels' window (None = unbounded side), and for a packed batch the
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of the call (rows are then all rows).
    index names the piece's dropout stream within its step."""

    q: slice
    k: slice
    left: Optional[int]
    right: Optional[int]
    varlen: Optional[tuple]
    index: int


@dataclass
class Ring:
    """One call's ring: who this rank is, the options, and the calls of every step.

    Tensors inside the loops are (b, s, h, d) shards and (b, h, s) LSEs; a packed batch runs as
    b = 1 (its (total, h, d) tensors with a leading 1, its (h, total) LSE likewise).
    rngs: (world, calls per step, 2) int64 Philox seeds of every piece (piece_rngs), or None.
    """

    rank: int
    world: int
    steps: list  # steps[t]: the Calls of step t
    scale: float
    softcap: float
    dropout_p: float
    backend: str
    rngs: Optional[torch.Tensor] = None

    def rng(self, step: int, call: Call) -> Optional[torch.Tensor]:
        return None if self.rngs is None else self.rngs[step, call.index]


def dense_steps(rank: int, world: int, layout: str, seqlen_local: int, window: tuple) -> list:
    """The Calls of every step for shards of seqlen_local tokens; window (left, right), -1 = unbounded."""
    chunk = seqlen_local // len(plan.chunks_of(rank, world, layout))
    steps = []
    for t in range(world):
        pieces = plan.pieces(rank, (rank - t) % world, world, layout, chunk, *window)
        steps.append([Call(slice(p.q0, p.q1), slice(p.k0, p.k1), p.left, p.right, None, i)
                      for i, p in enumerate(pieces)])
    return steps


def varlen_steps(rank: int, world: int, layout: str, lengths: list, causal: bool, device) -> list:
    """The Calls of every step for a packed batch whose sequence b has lengths[b] tokens in all,
    each split into equal chunks (plan.num_chunks of them) and laid out by `layout` per sequence.

    Causal or full attention only: then every chunk pair is full, diagonal or empty whatever the
    chunk length, so the pieces of a one-sequence plan (chunk = 2 tokens, then read in chunks) hold
    for every sequence, with the same window. A piece (q chunks [a, b), key chunks [a2, b2)) is
    one varlen call over all rows: each sequence becomes five, (its rows before a, no keys), (no
    rows, its keys before a2), (the piece's rows, the piece's keys), (rows after b, no keys), (no
    rows, keys after b2); the empty ones cost a program that exits, and no tensor is copied.
    """
    n_local = len(plan.chunks_of(rank, world, layout))
    chunks = [n // plan.num_chunks(world, layout) for n in lengths]  # tokens per chunk, per sequence
    unit = 2  # the shortest chunk that tells a diagonal chunk pair (window right = 0) from a full one
    cache = {}
    steps = []
    for t in range(world):
        calls = []
        for i, p in enumerate(plan.pieces(rank, (rank - t) % world, world, layout, unit, -1, 0 if causal else -1)):
            key = (p.q0 // unit, p.q1 // unit, p.k0 // unit, p.k1 // unit)
            if key not in cache:
                cache[key] = _piece_offsets(*key, n_local, chunks, device)
            calls.append(Call(slice(None), slice(None), p.left, p.right, cache[key], i))
        steps.append(calls)
    return steps


def _piece_offsets(a: int, b: int, a2: int, b2: int, n_local: int, chunks: list, device) -> tuple:
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of one varlen piece (varlen_steps)."""
    rows, keys = [], []
    for c in chunks:
        n = n_local * c
        for nq, nk in ((a * c, 0), (0, a2 * c), ((b - a) * c, (b2 - a2) * c), (n - b * c, 0), (0, n - b2 * c)):
            if nq or nk:
                rows.append(nq)
                keys.append(nk)
    host = [torch.tensor([0] + x, dtype=torch.int64).cumsum(0).to(torch.int32) for x in (rows, keys)]
    cu = []
    for h in host:
        t = torch.empty_like(h, device=device)
        _checks.upload(h, t)
        cu.append(t)
    return cu[0], cu[1], max(rows, default=0), max(keys, default=0)


def piece_rngs(rng: torch.Tensor, rank: int, world: int, per_step: int) -> torch.Tensor:
    """(world, per_step, 2) int64: the Philox (seed, offset) of every piece rank runs, from the
    call's rng ((2,) int64, reference.dropout.draw_rng).

    Pieces must not share a stream: the kernels' counters are a piece's local (row, key), so two
    pieces with one seed would drop the same pattern. Each piece's seed and offset are Philox2x32
    of the call's (under the key tag = (rank * world + step) * per_step + index): a bijection of
    the call's words for each tag, so the streams of distinct pieces (and of ranks that drew the
    same rng, as ranks seeded alike do) are unrelated. The top bit of each high word is cleared to
    keep the values non-negative int64. Computed on rng's device without reading it (no sync);
    the backward reuses the tensor, so it regenerates every piece's mask.
    """
    from flashtile.reference.dropout import philox2x32

    m32, m31 = 0xFFFFFFFF, 0x7FFFFFFF
    steps = torch.arange(world, dtype=torch.int64, device=rng.device)[:, None]
    tags = (rank * world + steps) * per_step + torch.arange(per_step, dtype=torch.int64, device=rng.device)
    seed, offset = rng[0], rng[1]
    s0, s1 = philox2x32(tags, seed & m32, (seed >> 32) & m32)
    o0, o1 = philox2x32(tags, offset & m32, (offset >> 32) & m32)
    return torch.stack((s0 | ((s1 & m31) << 32), o0 | ((o1 & m31) << 32)), -1)


# --------------------------------------------------------------------------------------------
# One piece, one step, the loops
# --------------------------------------------------------------------------------------------

def _squeeze(call: Call, *tensors):
    """The views a call passes to the kernels: a packed batch drops its leading 1 ((1, h, n) LSEs too)."""
    return tensors if call.varlen is None else tuple(t[0] for t in tensors)


def attend(ring: Ring, step: int, call: Call, q, k, v):
    """One piece's forward kernels: (out (b, n, h, d) in q's dtype, lse (b, h, n) float32)."""
    qs, ks, vs = _squeeze(call, q[:, call.q], k[:, call.k], v[:, call.k])
    out, lse = autograd._forward(qs, ks, vs, ring.scale, call.left, call.right, ring.softcap, None, ring.dropout_p,
                                 ring.rng(step, call), *(call.varlen or _NO_VARLEN), None, None, ring.backend)
    return (out, lse) if call.varlen is None else (out[None], lse[None])


def attend_backward(ring: Ring, step: int, call: Call, dout, q, k, v, out, lse, dq):
    """One piece's backward kernels, P recomputed from the final lse: its rows' dQ / scale added
    into dq (float32, by the kernels), (dk, dv) of its keys returned."""
    r = call.q
    # the kernels read the LSE as the forward writes it, (b, h, n) contiguous: a slice of rows is copied
    *args, dq_rows = _squeeze(call, dout[:, r], q[:, r], k[:, call.k], v[:, call.k], out[:, r],
                              lse[:, :, r].contiguous(), dq[:, r])
    # [1:3]: dq is dq_rows; the sink's gradient (the 4th value) is taken once for the whole ring
    grads = autograd._backward_impl(*args, ring.scale, call.left, call.right, ring.softcap, None, ring.dropout_p,
                                    ring.rng(step, call), *(call.varlen or _NO_VARLEN), None, ring.backend,
                                    dq_acc=dq_rows)[1:3]
    return grads if call.varlen is None else tuple(g[None] for g in grads)


def merge_(out: torch.Tensor, lse: torch.Tensor, out_p: torch.Tensor, lse_p: torch.Tensor) -> None:
    """(out, lse) <- the log-sum-exp merge of (out, lse) and (out_p, lse_p), in place.

    out (b, n, h, d) and lse (b, h, n) float32 (views of the accumulators); out_p in any float
    dtype. A state with lse = -inf holds nothing: where both are empty the result stays 0 / -inf
    (exp is taken against 0 there, not against -inf, which would give NaN)."""
    new = torch.logaddexp(lse, lse_p)  # (b, h, n)
    ref = new.masked_fill(new == float("-inf"), 0.0)
    out.mul_(torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1))
    out.addcmul_(out_p, torch.exp(lse_p - ref).transpose(1, 2).unsqueeze(-1))
    lse.copy_(new)


def forward_step(ring: Ring, step: int, q, k, v, out, lse) -> None:
    """Every piece of `step`: the kernels over the held K/V, merged into out / lse (float32)."""
    for call in ring.steps[step]:
        out_p, lse_p = attend(ring, step, call, q, k, v)
        merge_(out[:, call.q], lse[:, :, call.q], out_p, lse_p)


def backward_step(ring: Ring, step: int, dout, q, k, v, out, lse, dq, dkv) -> None:
    """Every piece of `step`: dQ / scale added into dq, dK/dV of the held shard into dkv (float32)."""
    for call in ring.steps[step]:
        dk_p, dv_p = attend_backward(ring, step, call, dout, q, k, v, out, lse, dq)
        dkv[0][:, call.k] += dk_p
        dkv[1][:, call.k] += dv_p


def forward_pass(ring: Ring, q, k, v, transport):
    """The forward ring: (out (b, s, h, d) float32, lse (b, h, s) float32) of the rank's queries
    over every shard. transport: comm.P2PRing or comm.SimulatedRing."""
    b, s, h, d = q.shape
    out = torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    kv = [k.contiguous(), v.contiguous()]  # sent as they are: P2P needs dense tensors
    for step in range(ring.world):
        pending = transport.start(kv, "kv", step + 1) if step + 1 < ring.world else None
        forward_step(ring, step, q, *kv, out, lse)
        if pending is not None:
            kv = transport.wait(pending)
    return out, lse


def backward_pass(ring: Ring, dout, q, k, v, out, lse, transport):
    """The backward ring: (dq, dk, dv) float32 of the rank's own shards. out and lse are the
    forward's final ones (sink included)."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = [k.contiguous(), v.contiguous()]
    partial = None  # the dK/dV partials of the shard held next, in flight from rank - 1
    for step in range(ring.world):
        pending = transport.start(kv, "kv", step + 1) if step + 1 < ring.world else None
        dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in kv]
        backward_step(ring, step, dout, q, *kv, out, lse, dq, dkv)
        if partial is not None:  # what the ranks before this one added for this shard
            for mine, theirs in zip(dkv, transport.wait(partial)):
                mine += theirs
        if ring.world == 1:
            return dq.mul_(ring.scale), *dkv
        partial = transport.start(dkv, "dkv", step + 1)
        if pending is not None:
            kv = transport.wait(pending)
    dk, dv = transport.wait(partial)  # after world hops, this rank's own shard, complete
    return dq.mul_(ring.scale), dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, ring, group):
        out, lse = forward_pass(ring, q, k, v, comm.P2PRing(group) if ring.world > 1 else None)
        if sink is not None:  # once, after the merge: one more state (O = 0, L = t_h)
            rows, lse = add_sink(autograd.by_head(out), lse, sink[:, None])
            out = autograd.by_head(rows)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.ring, ctx.group = ring, group
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):  # the LSE is returned for inspection: no gradient, as flash-attn
        q, k, v, out, lse, sink = ctx.saved_tensors
        ring = ctx.ring
        with torch.no_grad():  # under create_graph=True too (autograd.first_order_only)
            dq, dk, dv = backward_pass(ring, dout, q, k, v, out, lse,
                                       comm.P2PRing(ctx.group) if ring.world > 1 else None)
            # this rank's rows only (see ring_flash_attn_func)
            dsink = None if sink is None else autograd.sink_grad(
                sink, lse, autograd.by_head(dout.float() * out.float()).sum(-1))
        grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink
        return *autograd.first_order_only((dout, q, k, v), grads), None, None
