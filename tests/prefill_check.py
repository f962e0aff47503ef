"""One check of the prefill kernels against the float64 oracle, shared by interpret and cuda tests.

Forward output, LSE and all three gradients must satisfy the 2x rule; outputs are poisoned first,
inputs are fresh random normals in the requested memory layout.
"""

from __future__ import annotations

import math

import torch

from flashtile.autograd import by_head, sink_grad
from flashtile.ops.prefill import attention_backward, attention_forward
from flashtile.reference import naive
from flashtile.reference.dropout import DropoutMask, draw_rng
from flashtile.testing import assert_2x, poison


def make_qkv(b, sq, sk, h, hk, d, dtype, device, layout="bshd", std=1.0):
    """q (b, sq, h, d), k/v (b, sk, hk, d) as BSHD views of the requested storage, normal with
    standard deviation std."""
    def rand(*shape):
        return (torch.randn(*shape, device=device, dtype=torch.float32) * std).to(dtype)

    if layout == "bshd":
        return rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    if layout == "bhsd":  # (b, h, s, d) storage, viewed as BSHD without a copy
        return (rand(b, h, sq, d).transpose(1, 2), rand(b, hk, sk, d).transpose(1, 2),
                rand(b, hk, sk, d).transpose(1, 2))
    if layout == "packed":  # one (b, s, 3, h, d) buffer
        assert sq == sk and h == hk
        qkv = rand(b, sq, 3, h, d)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    raise ValueError(layout)


def check_prefill(b, sq, sk, h, hk, d, dtype, device, causal=False, window=(-1, -1), softcap=0.0,
                  alibi=False, layout="bshd", backward=True, factor=2, dropout_p=0.0, sink=False, std=1.0):
    """dropout_p > 0: the oracle applies the kernels' own mask (reference.dropout.DropoutMask).
    sink: an attention sink (h,) fp32 near the rows' LSE (so it takes a real share), its gradient
    checked as well. alibi: slopes (h,) in [0, 1), or with alibi="batch" (b, h). std: the inputs'
    standard deviation (3 makes scores of 30-50, where the softmax is nearly one-hot)."""
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device, layout, std)
    scale = d ** -0.5
    left, right = window[0], (0 if causal else window[1])
    slopes = torch.rand(*((b, h) if alibi == "batch" else (h, )), device=device) if alibi else None
    kw = dict(softmax_scale=scale, window_size=(left, right), softcap=softcap, alibi_slopes=slopes)
    win = (None if left < 0 else left, None if right < 0 else right)
    kw["learnable_sink"] = sink_t = sink_logits(h, sk, device) if sink else None
    dropout = None
    if dropout_p:
        dropout = (dropout_p, draw_rng(device))
        kw.update(dropout_p=dropout_p, dropout_mask=DropoutMask(dropout_p, dropout[1], h, range(b)).full(sq, sk, device))

    out = torch.empty(b, sq, h, d, dtype=dtype, device=device)
    poison(out)
    out, lse = attention_forward(q, k, v, scale, win, softcap, kw["alibi_slopes"], out=out, dropout=dropout,
                                 sink=sink_t)
    ref_out, ref_lse = naive.attention(q, k, v, **kw, compute_dtype=torch.float64)
    base_out, base_lse = naive.attention(q, k, v, **kw)
    assert_2x("out", out, ref_out, base_out, factor=factor)
    assert_2x("lse", lse, ref_lse, base_lse, factor=factor)
    if not backward:
        return
    dout = torch.randn_like(out)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    poison(*grads)
    delta = None if sink_t is None else torch.empty_like(lse)
    got = attention_backward(dout, q, k, v, out, lse, scale, win, softcap, kw["alibi_slopes"],
                             *grads, dropout=dropout, delta=delta)
    ref = naive.attention_backward(dout, q, k, v, **kw, compute_dtype=torch.float64)
    base = naive.attention_backward(dout, q, k, v, **kw)
    for name, g, r, bb in zip(("dq", "dk", "dv"), got, ref, base):
        assert_2x(name, g, r, bb, factor=factor)
    if sink_t is not None:
        check_sink_grad(sink_t, lse, delta, dout, (ref_out, ref_lse), (base_out, base_lse), factor)


def check_sink_grad(sink, lse, delta, dout, ref, base, factor=2):
    """d(sink) = -sum over rows of exp(t - lse) * delta (autograd.sink_grad), delta = rowsum(dO * O).

    Its error is a sum of the rows' rounding errors (of O to its dtype, mostly), so with a few heads
    it is a max over a few sums of random errors: too few samples for the 2x rule to be stable
    (on the H100 grid, 15 of 384 cases had the kernel's error 2-4x a baseline whose own error was
    as random). So the rule holds for the terms, one per row, against the oracle's (float64 out
    and LSE) and the baseline's, and the sum must be the sum of the kernel's terms. ref / base:
    (out, lse) of the oracle and of the baseline; layouts as the kernel's (dense or packed)."""
    def terms(out, l, d=None):
        d = by_head(dout.double() * out.double()).sum(-1) if d is None else d.double()
        return torch.exp(sink.double()[:, None] - l.double()) * d

    got = terms(None, lse, delta)
    assert_2x("dsink terms", got, terms(*ref), terms(*base), factor=factor)
    dims = tuple(i for i in range(got.dim()) if i != got.dim() - 2)
    torch.testing.assert_close(sink_grad(sink, lse, delta).double(), -got.sum(dims), rtol=1e-5, atol=1e-5)


def sink_logits(h, sk, device):
    """Sink logits (h,) fp32 around log(sk), where a row's LSE of random scores lies: each sink then
    holds a real share of its rows' softmax (from ~5% to ~95%)."""
    return torch.randn(h, device=device) * 1.5 + math.log(max(sk, 1))


def check_dq_accumulates(b, sq, sk, h, hk, d, dtype, device, causal=True, **backward_kw):
    """attention_backward(accumulate_dq=True) into rows [3, 3 + sq) of a float32 buffer of sq + 5
    rows holding random values: those rows end as their start + the plain call's dQ / scale (to
    dQ's rounding), the other rows untouched, dK and dV equal to the plain call's (ring attention
    sums its pieces' dQ so)."""
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device)
    dout = torch.randn_like(q)
    scale, window = d ** -0.5, (None, 0 if causal else None)
    out, lse = attention_forward(q, k, v, scale, window)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, scale, window, **backward_kw)
    start = torch.randn(b, sq + 5, h, d, device=device)
    buf = start.clone()
    rows = buf[:, 3:3 + sq]
    got = attention_backward(dout, q, k, v, out, lse, scale, window, dq=rows, accumulate_dq=True, **backward_kw)
    assert got[0] is rows
    assert torch.equal(got[1], dk) and torch.equal(got[2], dv)
    assert torch.equal(buf[:, :3], start[:, :3]) and torch.equal(buf[:, 3 + sq:], start[:, 3 + sq:])
    expected = start[:, 3:3 + sq] + dq.float() / scale
    err = float((rows - expected).abs().max())
    assert err <= 4 * torch.finfo(dtype).eps * float(dq.float().abs().max()) / scale, err


def check_past_65535_heads(s, d, causal, exact=True, h=16, b=4100):
    """batch x heads = 65600: more than the 65535 programs a CUDA grid's y axis holds, so the
    kernels take batch and heads on two grid axes (as flash-attn). The call must equal the same
    sequences run in batches of 2048, forward and backward: bit for bit, or with exact=False (the
    Hopper backward adds dQ in any order) to float32 rounding."""
    import flashtile

    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    for lo in range(0, b, 2048):
        rows = slice(lo, lo + 2048)
        part = [t.detach()[rows].clone().requires_grad_() for t in (q, k, v)]
        want = flashtile.flash_attn_func(*part, causal=causal)
        want.backward(dout[rows])
        assert torch.equal(out[rows], want), f"out, sequences {lo}.."
        for name, t, p in zip("qkv", (q, k, v), part):
            if exact or name != "q":
                assert torch.equal(t.grad[rows], p.grad), f"d{name}, sequences {lo}.."
            else:
                torch.testing.assert_close(t.grad[rows], p.grad, atol=2e-2, rtol=0)
