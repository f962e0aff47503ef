"""The user-facing functions: argument checks, layouts, dispatch and docstrings.

Dispatch rule (one place, `backend_for`): CUDA tensors run the Triton kernels; CPU tensors run the
Triton kernels under the Triton interpreter when TRITON_INTERPRET=1 is set, and the PyTorch reference
path otherwise. `use_backend("reference" | "triton")` forces one; asking for Triton on a CPU tensor
without the interpreter is an error, never a silent switch.
"""

from __future__ import annotations

import contextlib
import os

import torch

from flashtile import _checks, autograd

_BACKENDS = ("auto", "triton", "reference")
_forced = "auto"


@contextlib.contextmanager
def use_backend(name: str):
    """Force the backend inside a `with` block: "triton", "reference" or "auto" (the default)."""
    global _forced
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {name!r}")
    old, _forced = _forced, name
    try:
        yield
    finally:
        _forced = old


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def backend_for(t: torch.Tensor) -> str:
    """"triton" or "reference" for a tensor on t.device, by the dispatch rule above."""
    if _forced == "reference":
        return "reference"
    triton_ok = t.is_cuda or (t.device.type == "cpu" and interpreter_on())
    if _forced == "triton" and not triton_ok:
        raise RuntimeError(
            f"use_backend('triton') needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
            f"imported for CPU tensors; got a tensor on {t.device}")
    return "triton" if triton_ok else "reference"


# --------------------------------------------------------------------------------------------
# Training and prefill: flash-attn 2.x compatible functions (BSHD layout)
# --------------------------------------------------------------------------------------------

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _unsupported(dropout_p, name="dropout_p"):
    dropout_p = _checks.check_dropout_p(dropout_p)
    if dropout_p > 0:
        raise NotImplementedError(
            f"{name} > 0 is not implemented in flashtile's kernels yet (got {dropout_p}); "
            "use dropout_p=0.0, or torch.nn.functional.scaled_dot_product_attention")


def _attention(q, k, v, softmax_scale, window, softcap, alibi_slopes):
    """Checked BSHD inputs and a (left, right) window with None = unbounded -> (out, lse)."""
    backend = backend_for(q)
    return autograd.attention_fwd(q, k, v, softmax_scale, window[0], window[1], softcap,
                                  alibi_slopes, backend)


def _check_common(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p):
    b, sq, sk, h, hk, d = _checks.check_qkv(q, k, v)
    if q.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"q, k, v must be float16, bfloat16 or float32, got {q.dtype}")
    _unsupported(dropout_p)
    scale = _checks.default_scale(softmax_scale, d)
    left, right = _checks.check_window(window_size, causal)
    softcap = _checks.check_softcap(softcap)
    _checks.check_alibi(alibi_slopes, b, h, q.device)
    window = (None if left < 0 else left, None if right < 0 else right)
    return scale, window, softcap


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Exact attention, flash-attn 2.x's `flash_attn_func`.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 / float32, any strides.
        k, v: (batch, seqlen_k, nheads_k, headdim), same dtype and device; nheads % nheads_k == 0
            (MQA/GQA: query head i reads key/value head i // (nheads // nheads_k)).
        dropout_p: must be 0.0 (dropout is not implemented yet; a clear error otherwise).
        softmax_scale: defaults to headdim ** -0.5.
        causal: bottom-right aligned causal mask. With seqlen_q = 2, seqlen_k = 5:
                1 1 1 1 0
                1 1 1 1 1
            and with seqlen_q = 5, seqlen_k = 2 (the first three rows see nothing; output 0):
                0 0
                0 0
                0 0
                1 0
                1 1
        window_size: (left, right); query i sees keys j with
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 = unbounded.
        softcap: > 0 caps scores as softcap * tanh(score / softcap).
        alibi_slopes: (nheads,) or (batch, nheads) float32; adds -slope * |i + seqlen_k - seqlen_q - j|.
        deterministic: accepted for compatibility; the backward is always deterministic (no atomics).
        return_attn_probs: also return softmax_lse (and None in place of the attention matrix).
    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype.
        softmax_lse (only with return_attn_probs): (batch, nheads, seqlen_q) float32, natural log;
            -inf for a row that sees no key (flash-attn writes +inf there).
        None (only with return_attn_probs): flashtile never materialises the attention matrix.
    """
    scale, window, softcap = _check_common(q, k, v, softmax_scale, causal, window_size, softcap,
                                           alibi_slopes, dropout_p)
    out, lse = _attention(q, k, v, scale, window, softcap, alibi_slopes)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """`flash_attn_func` on qkv (batch, seqlen, 3, nheads, headdim): q, k, v are read as strided views."""
    _checks.check_tensor("qkv", qkv, 5)
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """`flash_attn_func` with kv (batch, seqlen_k, 2, nheads_k, headdim), read as strided views."""
    _checks.check_tensor("kv", kv, 5)
    if kv.shape[2] != 2:
        raise ValueError(f"kv must have shape (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention's layout and semantics, on flashtile.

    query (..., L, E) with L = target length, key/value (..., S, E); 4-D (batch, heads, L, E) runs
    the flashtile kernels. `is_causal` is top-left aligned, as in torch (query i sees keys j <= i).
    With `enable_gqa`, query heads may be a multiple of key/value heads.
    An `attn_mask` or `dropout_p > 0` is handed to torch's own SDPA unchanged (flashtile has no
    arbitrary-mask or dropout kernel), so results are always torch's, never a silently wrong mask.
    """
    if attn_mask is not None or float(dropout_p) > 0 or query.dim() != 4:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa)
    _checks.check_tensor("query", query, 4)
    _checks.check_tensor("key", key, 4)
    _checks.check_tensor("value", value, 4)
    if not enable_gqa and key.shape[1] != query.shape[1]:
        raise ValueError(f"key must have {query.shape[1]} heads (as query) unless enable_gqa=True, "
                         f"got {key.shape[1]}")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # BHLE -> BSHD views
    sq, sk = q.shape[1], k.shape[1]
    scale_, window, softcap = _check_common(q, k, v, scale, False, (-1, -1), 0.0, None, 0.0)
    if is_causal:
        window = (None, sq - sk)  # top-left: j <= i, i.e. bottom-right with right = sq - sk
    out, _ = _attention(q, k, v, scale_, window, softcap, None)
    return out.transpose(1, 2)
