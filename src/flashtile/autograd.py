"""Autograd for the public API: torch.library custom ops for torch.compile, a plain
autograd.Function in eager mode; both run the same forward and backward functions.

Registering `flashtile::attention_fwd` / `flashtile::attention_bwd` as custom ops lets
`torch.compile(fullgraph=True)` trace through `flash_attn_func` without graph breaks: the compiler
sees an opaque op with known output shapes (the fake impls) and a registered backward. Calling a
custom op in eager mode costs host time in torch.library's dispatch (filling defaults, redispatch,
the autograd wrapper): on the H100 machine's host a tiny forward + backward took 1083 us per call
through them against 359 us for SDPA-flash (scripts/profile_host.py), so `attention` takes the
custom op only while compiling.

`backend` is "triton" (ops/, on CUDA or under TRITON_INTERPRET=1) or "reference" (the blockwise
PyTorch FA2 of reference/fa2.py); api.py picks it by the dispatch rule. A window side of None is
unbounded.

The attention sink (`sink`, (h,) or None) is an input like q: the kernels fold it into the LSE
(the reference folds it in after its loop, reference.decoding.add_sink), the backward kernels
need nothing more (P recomputed from that LSE is already the sink's softmax), and its gradient is
a reduction of the backward's delta (sink_grad), computed the same way for both backends.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashtile import _checks
from flashtile.reference._tiles import exp_minus


def _window(left: Optional[int], right: Optional[int]) -> tuple[int, int]:
    """(left, right) for the kernels/reference: -1 = unbounded (negative right stays as given)."""
    return (-1 if left is None else left), (-1 if right is None else right)


def _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table):
    if cu_seqlens_q is None:
        return None
    return _checks.Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table)


def _forward(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, rng,
             cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table, backend, sink=None):
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table)
    dropout = (dropout_p, rng) if dropout_p > 0 else None
    if backend == "triton":
        from flashtile.ops.prefill import attention_forward

        return attention_forward(q, k, v, softmax_scale, (window_left, window_right), softcap, alibi_slopes,
                                 varlen=varlen, dropout=dropout, sink=sink)
    window = _window(window_left, window_right)
    if varlen is not None:
        from flashtile.reference import varlen as reference_varlen

        out, lse = reference_varlen.forward(q, k, v, varlen, softmax_scale, window, softcap, alibi_slopes, dropout)
    else:
        from flashtile.reference import fa2
        from flashtile.reference.dropout import DropoutMask

        mask = None if dropout is None else DropoutMask(dropout_p, rng, q.shape[2], range(q.shape[0]))
        out, lse = fa2.forward(q, k, v, softmax_scale=softmax_scale, window_size=window, softcap=softcap,
                               alibi_slopes=alibi_slopes, dropout=mask)
        out, lse = out.to(q.dtype), lse.float()
    if sink is not None:
        from flashtile.reference.decoding import add_sink

        rows, lse = add_sink(by_head(out).float(), lse, sink[:, None])  # lse: (b, h, sq) or (h, total_q)
        out = by_head(rows).to(q.dtype).contiguous()
    return out, lse


def by_head(t):
    """BSHD (b, s, h, d) <-> (b, h, s, d), packed (total, h, d) <-> (h, total, d): out in the LSE's
    row order (a view)."""
    return t.transpose(-3, -2)


def sink_grad(sink, lse, delta):
    """d(sink) (h,) in sink's dtype: the sink's column of dS is P_sink (0 - delta) with P_sink =
    exp(sink - lse), summed over every row of each head. lse and delta shaped alike, the head dim
    second to last: (b, h, sq) or (h, total_q). A torch reduction: deterministic."""
    g = exp_minus(sink.float()[:, None], lse) * delta  # a sink of +inf: weight 1 in every row
    dims = tuple(i for i in range(g.dim()) if i != g.dim() - 2)
    return (-g.sum(dims)).to(sink.dtype)


def _backward_impl(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, softcap,
                   alibi_slopes, dropout_p, rng, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   seqused_k, backend, sink=None, deterministic=False, dq_acc=None):
    """(dq, dk, dv, dsink): dsink None without a sink. deterministic: bitwise reproducible
    gradients (ops.prefill.attention_backward; the reference path always is). dq_acc: a float32
    tensor shaped like q that dQ / softmax_scale is added into (then dq is dq_acc), as ring
    attention sums its pieces' (attention_backward's accumulate_dq)."""
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, None)
    dropout = (dropout_p, rng) if dropout_p > 0 else None
    delta = None
    if backend == "triton":
        from flashtile.ops.prefill import attention_backward

        delta = None if sink is None else torch.empty_like(lse)
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, softmax_scale, (window_left, window_right),
                                        softcap, alibi_slopes, dq=dq_acc, varlen=varlen, dropout=dropout, delta=delta,
                                        deterministic=deterministic, accumulate_dq=dq_acc is not None)
    else:
        window = _window(window_left, window_right)
        if varlen is not None:
            from flashtile.reference import varlen as reference_varlen

            dq, dk, dv = reference_varlen.backward(dout, q, k, v, out, lse, varlen, softmax_scale, window, softcap,
                                                   alibi_slopes, dropout)
        else:
            from flashtile.reference import fa2
            from flashtile.reference.dropout import DropoutMask

            mask = None if dropout is None else DropoutMask(dropout_p, rng, q.shape[2], range(q.shape[0]))
            dq, dk, dv = fa2.backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, window_size=window,
                                      softcap=softcap, alibi_slopes=alibi_slopes, dropout=mask)
            dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        if dq_acc is not None:
            dq = dq_acc.add_(dq, alpha=1 / softmax_scale)
        if sink is not None:
            delta = by_head(dout.float() * out.float()).sum(-1)  # rowsum(dO * O), shaped like lse
    return dq, dk, dv, None if sink is None else sink_grad(sink, lse, delta)


@torch.library.custom_op("flashtile::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                  window_left: Optional[int], window_right: Optional[int], softcap: float,
                  alibi_slopes: Optional[torch.Tensor], dropout_p: float, rng: Optional[torch.Tensor],
                  cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
                  max_seqlen_q: int, max_seqlen_k: int, seqused_k: Optional[torch.Tensor],
                  block_table: Optional[torch.Tensor], backend: str,
                  sink: Optional[torch.Tensor], deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, rng,
                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table, backend, sink)


@attention_fwd.register_fake
def _(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, rng,
      cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table, backend, sink,
      deterministic):
    h = q.shape[-2]
    lse_shape = (q.shape[0], h, q.shape[1]) if cu_seqlens_q is None else (h, q.shape[0])
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("flashtile::attention_bwd", mutates_args=())
def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, softmax_scale: float,
                  window_left: Optional[int], window_right: Optional[int], softcap: float,
                  alibi_slopes: Optional[torch.Tensor], dropout_p: float, rng: Optional[torch.Tensor],
                  cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
                  max_seqlen_q: int, max_seqlen_k: int, seqused_k: Optional[torch.Tensor],
                  backend: str, sink: Optional[torch.Tensor], deterministic: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink); a custom op returns tensors only, so dsink is empty without a sink."""
    dq, dk, dv, dsink = _backward_impl(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, softcap,
                                       alibi_slopes, dropout_p, rng, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, seqused_k, backend, sink, deterministic)
    return dq, dk, dv, q.new_empty(0) if dsink is None else dsink


@attention_bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
      rng, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, backend, sink, deterministic):
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(k, memory_format=torch.contiguous_format), \
        torch.empty_like(v, memory_format=torch.contiguous_format), \
        q.new_empty(0) if sink is None else torch.empty_like(sink)


def _refuse_paged():
    # the API gathers the pages into contiguous k/v whenever a gradient is wanted
    raise RuntimeError("flashtile: no backward through a paged k/v (block_table); call with gradients "
                       "enabled and the API gathers the pages first")


def _grads(dout, saved, args, extra, backward):
    """(dq, dk, dv, dsink) through `backward` (the custom op while compiling, its implementation in
    eager mode) from what the forward kept: saved = (q, k, v, out, lse, alibi_slopes, sink), args =
    (scale, window_left, window_right, softcap, backend, deterministic), extra = (dropout_p, rng,
    Varlen)."""
    q, k, v, out, lse, alibi_slopes, sink = saved
    softmax_scale, window_left, window_right, softcap, backend, deterministic = args
    dropout_p, rng, varlen = extra
    if varlen.block_table is not None:
        _refuse_paged()
    # dlse is not propagated: the LSE is returned for inspection/merging, like flash-attn.
    return backward(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                    dropout_p, rng, *varlen[:5], backend, sink, deterministic)


def _setup_context(ctx, inputs, output):
    (q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, rng,
     cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table, backend, sink,
     deterministic) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sink, rng, cu_seqlens_q, cu_seqlens_k, seqused_k)
    ctx.args = (softmax_scale, window_left, window_right, softcap, backend, deterministic)
    ctx.scalars = (dropout_p, max_seqlen_q, max_seqlen_k, block_table is not None)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, alibi_slopes, sink, rng, cu_seqlens_q, cu_seqlens_k, seqused_k = ctx.saved_tensors
    dropout_p, max_seqlen_q, max_seqlen_k, paged = ctx.scalars
    if paged:
        _refuse_paged()
    varlen = _checks.Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)
    dq, dk, dv, dsink = _grads(dout, (q, k, v, out, lse, alibi_slopes, sink), ctx.args, (dropout_p, rng, varlen),
                               attention_bwd)
    return (dq, dk, dv) + (None,) * 14 + (None if sink is None else dsink, None)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)

SECOND_ORDER = ("flashtile: second-order gradients through attention are not supported (its backward, a kernel or "
                "the blockwise reference, is not differentiable): the gradients of flash_attn_func and the other "
                "attention functions cannot be differentiated again (autograd.grad(..., create_graph=True), then a "
                "backward through them). flashtile.reference.naive.attention is plain PyTorch and can be.")


def _refuse_second_order(ctx, *grads):
    raise RuntimeError(SECOND_ORDER)


attention_bwd.register_autograd(_refuse_second_order, setup_context=lambda ctx, inputs, output: None)


class _FirstOrderOnly(torch.autograd.Function):
    """The gradients of a backward run with create_graph=True, as they are, tied to the tensors they
    came from: differentiating them again raises SECOND_ORDER (instead of a silently wrong value on
    the reference path, or torch's 'does not require grad' on the kernel path)."""

    @staticmethod
    def forward(ctx, n_sources, *tensors):
        return tuple(t.view_as(t) if t is not None else None for t in tensors[n_sources:])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(SECOND_ORDER)


def first_order_only(sources: tuple, grads: tuple) -> tuple:
    """grads unchanged outside create_graph=True; inside it, grads whose own backward refuses."""
    if not torch.is_grad_enabled():
        return grads
    return _FirstOrderOnly.apply(len(sources), *sources, *grads)

_NO_EXTRA = (0.0, None, _checks.Varlen(None, None, 0, 0))


class _Attention(torch.autograd.Function):
    """The eager twin of attention_fwd + its registered backward: the same functions underneath,
    no dispatch, and dropout / varlen arguments travelling as one opaque `extra` (a Function's
    host cost grows with its argument count: 17 flat arguments cost ~6 us more per forward +
    backward than 10, measured with the launches stubbed)."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, extra, backend,
                sink, deterministic):
        dropout_p, rng, varlen = extra
        out, lse = _forward(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
                            rng, *varlen, backend, sink)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sink)
        ctx.args = (softmax_scale, window_left, window_right, softcap, backend, deterministic)
        ctx.extra = extra  # index and seed tensors only: nothing that needs a gradient
        ctx.mark_non_differentiable(lse)
        # lse's gradient is never used: unmaterialised, the engine does not allocate and zero-fill a
        # tensor for it on every backward (a memset launch on the GPU)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:  # nothing flowed into out
            return (None,) * 12
        saved = ctx.saved_tensors
        with torch.no_grad():  # under create_graph=True too: the reference path would record a wrong graph
            grads = _grads(dout, saved, ctx.args, ctx.extra, _backward_impl)
        dq, dk, dv, dsink = first_order_only((dout, *saved[:3]), grads)
        return dq, dk, dv, None, None, None, None, None, None, None, dsink, None


def attention(q, k, v, softmax_scale: float, window_left: Optional[int], window_right: Optional[int],
              softcap: float, alibi_slopes: Optional[torch.Tensor], backend: str, dropout_p: float = 0.0,
              rng: Optional[torch.Tensor] = None, varlen: Optional[_checks.Varlen] = None,
              sink: Optional[torch.Tensor] = None, deterministic: bool = False):
    """(out, lse) with autograd: the custom op while torch.compile traces, _Attention otherwise.

    dropout_p > 0 needs rng, the (2,) int64 Philox seed (reference.dropout.draw_rng), saved for the
    backward so it regenerates the forward's mask. varlen: a checked packed batch (q (total_q, h, d)
    and so on; lse is then (h, total_q)). sink: the attention sink, (h,) contiguous, or None; it
    gets a gradient like q. deterministic: a bitwise reproducible backward (attention_backward)."""
    if torch.compiler.is_compiling():
        vl = varlen if varlen is not None else _NO_EXTRA[2]
        return attention_fwd(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                             float(dropout_p), rng, *vl, backend, sink, deterministic)
    extra = _NO_EXTRA if dropout_p == 0 and varlen is None else \
        (float(dropout_p), rng, varlen if varlen is not None else _NO_EXTRA[2])
    return _Attention.apply(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, extra, backend,
                            sink, deterministic)
