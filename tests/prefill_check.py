"""One check of the prefill kernels against the float64 oracle, shared by interpret and cuda tests.

Forward output, LSE and all three gradients must satisfy the 2x rule; outputs are poisoned first,
inputs are fresh random normals in the requested memory layout.
"""

from __future__ import annotations


import torch

from flashtile.ops.backward import attention_backward
from flashtile.ops.forward import attention_forward
from flashtile.reference import naive
from flashtile.reference.dropout import DropoutMask, draw_rng
from flashtile.testing import assert_2x, poison


def make_qkv(b, sq, sk, h, hk, d, dtype, device, layout="bshd"):
    """q (b, sq, h, d), k/v (b, sk, hk, d) as BSHD views of the requested storage."""
    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)

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
                  alibi=False, layout="bshd", backward=True, factor=2, dropout_p=0.0):
    """dropout_p > 0: the oracle applies the kernels' own mask (reference.dropout.DropoutMask)."""
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device, layout)
    scale = d ** -0.5
    left, right = window[0], (0 if causal else window[1])
    kw = dict(softmax_scale=scale, window_size=(left, right), softcap=softcap,
              alibi_slopes=torch.rand(h, device=device) if alibi else None)
    win = (None if left < 0 else left, None if right < 0 else right)
    dropout = None
    if dropout_p:
        dropout = (dropout_p, draw_rng(device))
        kw.update(dropout_p=dropout_p, dropout_mask=DropoutMask(dropout_p, dropout[1], h, range(b)).full(sq, sk, device))

    out = torch.empty(b, sq, h, d, dtype=dtype, device=device)
    poison(out)
    out, lse = attention_forward(q, k, v, scale, win, softcap, kw["alibi_slopes"], out=out, dropout=dropout)
    ref_out, ref_lse = naive.attention(q, k, v, **kw, compute_dtype=torch.float64)
    base_out, base_lse = naive.attention(q, k, v, **kw)
    assert_2x("out", out, ref_out, base_out, factor=factor)
    assert_2x("lse", lse, ref_lse, base_lse, factor=factor)
    if not backward:
        return
    dout = torch.randn_like(out)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    poison(*grads)
    dq_, dk, dv = attention_backward(dout, q, k, v, out, lse, scale, win, softcap, kw["alibi_slopes"],
                                     *grads, dropout=dropout)
    ref = naive.attention_backward(dout, q, k, v, **kw, compute_dtype=torch.float64)
    base = naive.attention_backward(dout, q, k, v, **kw)
    for name, got, r, bb in zip(("dq", "dk", "dv"), (dq_, dk, dv), ref, base):
        assert_2x(name, got, r, bb, factor=factor)
