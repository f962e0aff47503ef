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
"""

from __future__ import annotations

from typing import Optional

import torch


def _window(left: Optional[int], right: Optional[int]) -> tuple[int, int]:
    """(left, right) for the kernels/reference: -1 = unbounded (negative right stays as given)."""
    return (-1 if left is None else left), (-1 if right is None else right)


def _forward(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, backend):
    if backend == "triton":
        from flashtile.ops.forward import attention_forward

        return attention_forward(q, k, v, softmax_scale, (window_left, window_right), softcap, alibi_slopes)
    from flashtile.reference import fa2

    out, lse = fa2.forward(q, k, v, softmax_scale=softmax_scale,
                           window_size=_window(window_left, window_right), softcap=softcap,
                           alibi_slopes=alibi_slopes)
    return out.to(q.dtype), lse.float()


def _backward_impl(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, softcap,
                   alibi_slopes, backend):
    if backend == "triton":
        from flashtile.ops.backward import attention_backward

        return attention_backward(dout, q, k, v, out, lse, softmax_scale, (window_left, window_right),
                                  softcap, alibi_slopes)
    from flashtile.reference import fa2

    dq, dk, dv = fa2.backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                              window_size=_window(window_left, window_right), softcap=softcap,
                              alibi_slopes=alibi_slopes)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("flashtile::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                  window_left: Optional[int], window_right: Optional[int], softcap: float,
                  alibi_slopes: Optional[torch.Tensor], backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, backend)


@attention_fwd.register_fake
def _(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, backend):
    b, sq, h, d = q.shape
    return q.new_empty((b, sq, h, d)), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("flashtile::attention_bwd", mutates_args=())
def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, softmax_scale: float,
                  window_left: Optional[int], window_right: Optional[int], softcap: float,
                  alibi_slopes: Optional[torch.Tensor],
                  backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, softcap,
                          alibi_slopes, backend)


@attention_bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, softcap, alibi_slopes,
      backend):
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(k, memory_format=torch.contiguous_format), \
        torch.empty_like(v, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
    ctx.args = (softmax_scale, window_left, window_right, softcap, backend)


def _grads(ctx, dout, backward):
    """(dq, dk, dv, None...) from what _setup_context saved, through `backward` (the custom op
    while compiling, its implementation in eager mode)."""
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    softmax_scale, window_left, window_right, softcap, backend = ctx.args
    # dlse is not propagated: the LSE is returned for inspection/merging, like flash-attn.
    dq, dk, dv = backward(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, softcap,
                          alibi_slopes, backend)
    return dq, dk, dv, None, None, None, None, None, None


def _backward(ctx, dout, dlse):
    return _grads(ctx, dout, attention_bwd)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _Attention(torch.autograd.Function):
    """The eager twin of attention_fwd + its registered backward: same functions, no dispatch."""

    @staticmethod
    def forward(ctx, *inputs):
        out, lse = _forward(*inputs)
        _setup_context(ctx, inputs, (out, lse))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _grads(ctx, dout, _backward_impl)


def attention(q, k, v, softmax_scale: float, window_left: Optional[int], window_right: Optional[int],
              softcap: float, alibi_slopes: Optional[torch.Tensor], backend: str):
    """(out, lse) with autograd: the custom op while torch.compile traces, _Attention otherwise."""
    if torch.compiler.is_compiling():
        return attention_fwd(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, backend)
    return _Attention.apply(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, backend)
