"""Standard attention with S and P materialised: the oracle every kernel is checked against.

Layout is flash-attn's BSHD: q (b, sq, h, d), k and v (b, sk, hk, d) with h % hk == 0. Everything in
the API contract is here: bottom-right aligned causal and sliding-window masks, softcap, ALiBi,
GQA/MQA, dropout given an explicit keep-mask, softmax scale, the attention sink (a per-head logit
with no value that joins every row's softmax: the softmax over the scores with a sink column
appended, then dropped), and the log-sum-exp of each row (the sink's included).

`compute_dtype=torch.float64` gives the oracle; `compute_dtype=None` computes the way a plain PyTorch
user would in the input dtype (matmuls in that dtype, softmax in float32), which is the baseline of
the 2x rule (DESIGN.md, Numerics).

The backward is written out, not left to autograd:
    dV = P_drop^T dO,   dP = (dO V^T) * Z / (1 - p),   delta = rowsum(dO * O),
    dS = P * (dP - delta),   then through softcap, dQ = scale * dS K,   dK = scale * dS^T Q,
    and with a sink t: d t = -sum over batch and rows of exp(t - lse) * delta (its column's dS).
"""

from __future__ import annotations

import torch

from flashtile import _checks
from flashtile.reference import _tiles


def visible(sq: int, sk: int, window_size=(-1, -1), causal: bool = False, device=None) -> torch.Tensor:
    """Boolean (sq, sk): may query i see key j? Bottom-right aligned, as flash-attn 2.x.

    Query i sits at key position i + sk - sq. With sq=2, sk=5 and causal=True:
        1 1 1 1 0
        1 1 1 1 1
    With sq=5, sk=2 and causal=True the first three rows see nothing (they output zeros):
        0 0
        0 0
        0 0
        1 0
        1 1
    """
    left, right = _checks.check_window(window_size, causal)
    i = torch.arange(sq, device=device).view(sq, 1)
    j = torch.arange(sk, device=device).view(1, sk)
    diag = i + sk - sq  # the key position aligned with query i
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok


def alibi_bias(alibi_slopes: torch.Tensor, b: int, h: int, sq: int, sk: int, dtype) -> torch.Tensor:
    """(b, h, sq, sk) bias -slope * |i + sk - sq - j|."""
    slopes = alibi_slopes.to(dtype).reshape(-1, h).expand(b, h)  # (b, h)
    i = torch.arange(sq, device=alibi_slopes.device, dtype=dtype).view(sq, 1)
    j = torch.arange(sk, device=alibi_slopes.device, dtype=dtype).view(1, sk)
    dist = (i + sk - sq - j).abs()  # (sq, sk)
    return -slopes[:, :, None, None] * dist


def _prepare(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
             dropout_mask, compute_dtype):
    b, sq, sk, h, hk, d = _checks.check_qkv(q, k, v)
    scale = _checks.default_scale(softmax_scale, d)
    window = _checks.check_window(window_size, causal)
    softcap = _checks.check_softcap(softcap)
    _checks.check_alibi(alibi_slopes, b, h, q.device)
    dropout_p = _checks.check_dropout_p(dropout_p)
    if dropout_p > 0 and dropout_mask is None:
        raise ValueError("the reference needs dropout_mask (b, h, sq, sk) bool when dropout_p > 0")
    if dropout_mask is not None and tuple(dropout_mask.shape) != (b, h, sq, sk):
        raise ValueError(f"dropout_mask must have shape {(b, h, sq, sk)}, got {tuple(dropout_mask.shape)}")
    cdt = compute_dtype or q.dtype
    # (b, h, s, d) with kv heads repeated over their query group
    qh = q.transpose(1, 2).to(cdt)
    kh = k.transpose(1, 2).repeat_interleave(h // hk, dim=1).to(cdt)
    vh = v.transpose(1, 2).repeat_interleave(h // hk, dim=1).to(cdt)
    return (b, sq, sk, h, hk, d), scale, window, softcap, dropout_p, qh, kh, vh


def _scores(qh, kh, scale, window, softcap, alibi_slopes, shape):
    """Masked scores (b, h, sq, sk) in the softmax dtype, and the pre-softcap tanh for backward."""
    b, sq, sk, h, _, _ = shape
    s = (qh @ kh.transpose(-1, -2)).float() if qh.dtype in (torch.float16, torch.bfloat16) \
        else qh @ kh.transpose(-1, -2)  # (b, h, sq, sk)
    s = s * scale
    tanh = None
    if softcap > 0:
        tanh = torch.tanh(s / softcap)
        s = softcap * tanh
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, b, h, sq, sk, s.dtype)
    ok = visible(sq, sk, window, False, device=s.device)
    s = s.masked_fill(~ok, float("-inf"))
    return s, ok, tanh


def _softmax(s: torch.Tensor, ok: torch.Tensor, sink=None):
    """P and LSE of masked scores (b, h, sq, sk), with the sink (h,) in the sum when given; rows
    that see no key get P = 0 and LSE = -inf (the sink's logit with a sink)."""
    lse = torch.logsumexp(s, dim=-1)  # (b, h, sq); -inf on empty rows
    if sink is not None:
        lse = torch.logaddexp(lse, sink.to(lse.dtype)[:, None])
    # an empty row (lse -inf) subtracts 0; a sink of +inf (lse +inf) leaves every key P = 0
    p = torch.exp(s - lse.unsqueeze(-1).masked_fill((lse == float("-inf")).unsqueeze(-1), 0.0))
    p = p.masked_fill(~ok, 0.0)
    return p, lse


def attention(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, dropout_p=0.0, dropout_mask=None, compute_dtype=None, learnable_sink=None):
    """Attention with S and P materialised. Returns (out, lse).

    q (b, sq, h, d), k and v (b, sk, hk, d), any float dtype. dropout_mask (b, h, sq, sk) bool marks
    the kept probabilities, scaled as the kernels scale them (_checks.dropout_threshold: 1 / (1 - p)
    to within 1e-5; reference.dropout.DropoutMask.full gives the kernels' mask). out is
    (b, sq, h, d) in compute_dtype
    (the input dtype when None); lse is (b, h, sq), float32 (float64 when computing in float64),
    natural log, -inf on rows that see no key (their output is 0). learnable_sink: None or (h,),
    the sink's logit per head (differentiable: the oracle's d(sink) comes from autograd); a row
    that sees no key then has lse = the sink.
    """
    shape, scale, window, softcap, dropout_p, qh, kh, vh = _prepare(
        q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, dropout_mask,
        compute_dtype)
    s, ok, _ = _scores(qh, kh, scale, window, softcap, alibi_slopes, shape)
    p, lse = _softmax(s, ok, learnable_sink)
    if dropout_mask is not None:
        p = p * (dropout_mask.to(p.dtype) * _checks.dropout_threshold(dropout_p)[1])
    out = p.to(vh.dtype) @ vh  # (b, h, sq, d)
    return out.transpose(1, 2), lse


def attention_backward(dout, q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_mask=None,
                       compute_dtype=None, learnable_sink=None):
    """The written-out backward: returns (dq, dk, dv) shaped like q, k, v, in compute_dtype, and
    with learnable_sink (h,) also d(sink) (h,) in the softmax dtype.

    dk and dv are summed over the query heads that share a key/value head (GQA/MQA).
    """
    shape, scale, window, softcap, dropout_p, qh, kh, vh = _prepare(
        q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, dropout_mask,
        compute_dtype)
    b, sq, sk, h, hk, d = shape
    doh = dout.transpose(1, 2).to(qh.dtype)  # (b, h, sq, d)
    s, ok, tanh = _scores(qh, kh, scale, window, softcap, alibi_slopes, shape)
    p, lse = _softmax(s, ok, learnable_sink)  # (b, h, sq, sk)
    keep = 1.0 if dropout_mask is None else dropout_mask.to(p.dtype) * _checks.dropout_threshold(dropout_p)[1]
    p_drop = p * keep
    out = p_drop.to(vh.dtype) @ vh  # (b, h, sq, d)
    dv = p_drop.to(doh.dtype).transpose(-1, -2) @ doh  # (b, h, sk, d)
    dp = (doh @ vh.transpose(-1, -2)).to(p.dtype) * keep  # (b, h, sq, sk)
    delta = (doh.to(p.dtype) * out.to(p.dtype)).sum(-1, keepdim=True)  # (b, h, sq, 1)
    ds = p * (dp - delta)  # (b, h, sq, sk)
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    ds = ds.to(qh.dtype)
    dq = scale * (ds @ kh)  # (b, h, sq, d)
    dk = scale * (ds.transpose(-1, -2) @ qh)  # (b, h, sk, d)
    # sum over each kv head's group of query heads
    dk = dk.view(b, hk, h // hk, sk, d).sum(2)
    dv = dv.view(b, hk, h // hk, sk, d).sum(2)
    grads = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if learnable_sink is None:
        return grads
    t = learnable_sink.to(lse.dtype)[:, None]  # (h, 1)
    return (*grads, -(_tiles.exp_minus(t, lse) * delta[..., 0]).sum((0, 2)))
