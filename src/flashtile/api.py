"""The user-facing functions: argument checks, layouts, dispatch and docstrings.

Dispatch rule (one place, `backend_for`): CUDA tensors run the Triton kernels; CPU tensors run the
Triton kernels under the Triton interpreter when TRITON_INTERPRET=1 is set (float16 and float32:
the interpreter's bfloat16 is wrong, and bfloat16 there raises), and the PyTorch reference path
otherwise. `use_backend("reference" | "triton")` forces one; asking for Triton on a CPU tensor
without the interpreter is an error, never a silent switch.
"""

from __future__ import annotations

import contextlib
import operator
from typing import NamedTuple

import torch

from flashtile import _checks, autograd
from flashtile._checks import ArgumentError
from flashtile.ops import dispatch

_BACKENDS = ("auto", "triton", "reference")
_forced = "auto"


@contextlib.contextmanager
def use_backend(name: str):
    """Force the backend inside a `with` block: "triton", "reference" or "auto" (the default)."""
    global _forced
    if name not in _BACKENDS:
        raise ArgumentError(f"backend must be one of {_BACKENDS}, got {name!r}")
    old, _forced = _forced, name
    try:
        yield
    finally:
        _forced = old


def _device_guard(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it t's (tensors on cuda:1 and so on) when
    it is another (entering torch.cuda.device costs more than asking)."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


interpreter_on = dispatch.interpreter_on


def backend_for(t: torch.Tensor) -> str:
    """"triton" (the kernels, compiled or interpreted) or "reference" for a tensor on t.device, by
    ops.dispatch.backend's rule."""
    cuda = t.is_cuda  # (the environment is read only for other devices: this runs on every call)
    choice = dispatch.backend("cuda" if cuda else t.device.type, _forced, not cuda and interpreter_on())
    if _forced == "triton" and choice.kernel == "reference":
        raise RuntimeError(
            f"use_backend('triton') needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
            f"imported for CPU tensors; got a tensor on {t.device}")
    if choice.kernel == "interpreter" and t.dtype == torch.bfloat16:
        raise TypeError(
            "bfloat16 inputs on the CPU under the Triton interpreter (TRITON_INTERPRET=1): triton 3.6's "
            "interpreter computes bfloat16 wrongly; use float16 or float32 there, or "
            "flashtile.use_backend('reference')")
    return "reference" if choice.kernel == "reference" else "triton"


class Explanation(NamedTuple):
    """The kernels a call runs, forward and backward, each an ops.dispatch.Choice (kernel, reason,
    and why each faster kernel was refused)."""

    forward: dispatch.Choice
    backward: dispatch.Choice

    def __str__(self) -> str:
        return f"forward: {self.forward}\nbackward: {self.backward}"


def explain(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, deterministic=False) -> Explanation:
    """Which kernel flash_attn_func(q, k, v, ...) with these arguments runs, forward and backward,
    and why a faster one was refused; nothing runs. The backward's answer assumes a gradient laid
    out like q (an expanded one, as out.sum() gives, takes the pointer path). Setting
    FLASHTILE_EXPLAIN=1 prints the same for every new call shape as it is planned.

        >>> print(flashtile.explain(q, k, v, causal=True))
        forward: hopper: sm_90, bfloat16, head dim 128
        backward: hopper: sm_90, bfloat16, head dim 128
    """
    scale, window, softcap, dropout_p = _check_common(q, k, v, softmax_scale, causal, window_size, softcap,
                                                      alibi_slopes, dropout_p)
    backend = dispatch.backend(q.device.type, _forced, interpreter_on())
    if backend.kernel == "reference":
        return Explanation(backend, backend)
    from flashtile.ops import prefill

    dropout = (dropout_p, None) if dropout_p > 0 else None
    deterministic = bool(deterministic) or torch.are_deterministic_algorithms_enabled()
    forward, _ = prefill.forward_choice(q, k, v, torch.empty_like(q), scale, window, softcap, alibi_slopes, None,
                                        dropout)
    backward, _ = prefill.backward_choice(torch.empty_like(q), q, k, v, None, torch.empty_like(k),
                                          torch.empty_like(v), scale, window, softcap, alibi_slopes, None, dropout,
                                          deterministic, False)
    return Explanation(forward, backward)


# --------------------------------------------------------------------------------------------
# Training and prefill: flash-attn 2.x compatible functions (BSHD layout)
# --------------------------------------------------------------------------------------------

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _attention(q, k, v, softmax_scale, window, softcap, alibi_slopes, dropout_p=0.0, varlen=None, sink=None,
               deterministic=False):
    """Checked inputs and a (left, right) window with None = unbounded -> (out, lse).

    deterministic (or torch.use_deterministic_algorithms(True)) asks for a bitwise reproducible
    backward (ops.prefill.attention_backward).

    Dropout draws its Philox seed from torch's generator of q's device here (so torch.manual_seed
    reproduces a run; reference.dropout.draw_rng). A paged k/v that needs gradients is gathered
    into contiguous keys first (a differentiable index: pages shared by sequences sum their
    gradients), since the backward kernels read contiguous k/v."""
    deterministic = _checks.check_flag("deterministic", deterministic, ints=True)
    backend = backend_for(q)
    if varlen is not None and varlen.block_table is not None and torch.is_grad_enabled() and \
            any(t.requires_grad for t in (q, k, v)):
        k, v, varlen = _gather_pages(k, v, varlen)
    rng = None
    if dropout_p > 0:
        from flashtile.reference.dropout import draw_rng

        rng = draw_rng(q.device)
    with _device_guard(q):  # the backward runs on autograd's thread for q's device
        return autograd.attention(q, k, v, softmax_scale, window[0], window[1], softcap, alibi_slopes,
                                  backend, dropout_p, rng, varlen, sink,
                                  deterministic or torch.are_deterministic_algorithms_enabled())


def _gather_pages(k, v, varlen):
    """Paged k/v (num_pages, page_size, hk, d) -> the keys of every sequence packed end to end
    (total_k, hk, d), with the Varlen that describes them (one host read of the lengths)."""
    if varlen.seqused_k is not None:
        lengths = _checks.host_values(varlen.seqused_k)
    else:
        offsets = _checks.host_values(varlen.cu_seqlens_k)
        lengths = None if offsets is None else [b - a for a, b in zip(offsets, offsets[1:])]
    if lengths is None:
        raise RuntimeError("gradients through a paged k/v (block_table) need the sequence lengths on the "
                           "host, which cannot be read under CUDA-graph capture or torch.compile")
    page_size = k.shape[1]
    device = k.device
    n = torch.tensor(lengths, dtype=torch.int64, device=device)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), n)  # sequence of each key
    starts = torch.cumsum(n, 0) - n
    pos = torch.arange(int(sum(lengths)), device=device) - starts[seq]  # each key's position in it
    rows = varlen.block_table[seq, pos // page_size].long() * page_size + pos % page_size
    cu_k = torch.nn.functional.pad(torch.cumsum(n, 0), (1, 0)).to(torch.int32)
    gathered = _checks.Varlen(varlen.cu_seqlens_q, cu_k, varlen.max_seqlen_q, varlen.max_seqlen_k)
    return k.flatten(0, 1)[rows], v.flatten(0, 1)[rows], gathered


def _check_options(q, b, h, d, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                   scale_name="softmax_scale"):
    """The options every prefill function shares -> (scale, window with None = unbounded, softcap,
    dropout_p). scale_name: what the caller calls softmax_scale (SDPA: scale)."""
    if q.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"q, k, v must be float16, bfloat16 or float32, got {q.dtype}")
    dropout_p = _checks.check_dropout_p(dropout_p)
    scale = _checks.default_scale(softmax_scale, d, scale_name)
    left, right = _checks.check_window(window_size, causal)
    softcap = _checks.check_softcap(softcap)
    _checks.check_alibi(alibi_slopes, b, h, q.device)
    window = (None if left < 0 else left, None if right < 0 else right)
    return scale, window, softcap, dropout_p


def _check_common(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                  scale_name="softmax_scale"):
    b, sq, sk, h, hk, d = _checks.check_qkv(q, k, v)
    return _check_options(q, b, h, d, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                          scale_name)


def _outputs(out, lse, return_attn_probs):
    # S_dmask: flashtile never materialises the attention matrix, with or without dropout
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    learnable_sink=None):
    """Exact attention, flash-attn 2.x's `flash_attn_func`.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 / float32, any strides.
        k, v: (batch, seqlen_k, nheads_k, headdim), same dtype and device; nheads % nheads_k == 0
            (MQA/GQA: query head i reads key/value head i // (nheads // nheads_k)).
        dropout_p: probability of dropping each attention probability (training only: pass 0.0 in
            evaluation, as flash-attn). The mask comes from Philox in the kernel, seeded from
            torch's generator of q's device, so torch.manual_seed reproduces it; the backward
            regenerates the same mask; kept probabilities are scaled by 1 / (1 - dropout_p). CUDA
            graphs replay fresh masks, as torch's own dropout. (Probabilities are dropped when 8
            random bits fall below round(p * 2^8), as flash-attn draws them: p to the nearest 1/256,
            at least 1/256; the scale matches the rate drawn, so the output stays unbiased.)
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
        window_size: (left, right), a tuple, list or 2-element tensor of ints; query i sees keys j with
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; a negative side
            (-1) is unbounded.
        softcap: > 0 caps scores as softcap * tanh(score / softcap).
        alibi_slopes: (nheads,) or (batch, nheads) float32; adds -slope * |i + seqlen_k - seqlen_q - j|.
        deterministic: True (or torch.use_deterministic_algorithms(True)) makes the backward
            bitwise reproducible. By default, as in flash-attn, the Hopper backward (H100, head
            dims 33-256 that are multiples of 8; softcap, ALiBi, dropout and packed batches too)
            adds dQ's key blocks up with TMA reductions, in an order that varies from run to run;
            every other call is reproducible either way. With True it adds them in a fixed order
            at head dims up to 128 (2-17% slower than the default; configs.hopper_backward_ordered);
            elsewhere dQ gets Triton programs of its own (no atomics).
        return_attn_probs: also return softmax_lse (and None in place of the attention matrix).
        learnable_sink: optional (nheads,) float32 / bfloat16 / float16, keyword (FlashAttention-4's
            name; gpt-oss's attention sinks): one logit t_h per query head that joins every row's
            softmax and carries no value, so a head can attend "nowhere":
            lse_i = log(exp(t_h) + sum_j exp(s_ij)), P_ij = exp(s_ij - lse_i). It gets a gradient
            (d t_h = -sum over batch and rows of exp(t_h - lse) * rowsum(dO * O)).
    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype.
        softmax_lse (only with return_attn_probs): (batch, nheads, seqlen_q) float32, natural log, of
            the softmax before dropout, the sink included; -inf for a row that sees no key (flash-attn
            writes +inf there), or t_h with a sink. It carries no gradient (as in flash-attn, whose
            backward drops it): a loss through it does not reach q, k or v, so pieces of the keys
            merged by their LSE (merge_attention_states) get correct outputs but not correct
            gradients; for training, attend over all the keys in one call.
        None (only with return_attn_probs): flashtile never materialises the attention matrix, so
            there is no S_dmask, with or without dropout (reference.dropout.DropoutMask rebuilds the
            mask of a call for tests).
    """
    scale, window, softcap, dropout_p = _check_common(q, k, v, softmax_scale, causal, window_size, softcap,
                                                      alibi_slopes, dropout_p)
    sink = _checks.check_sink(learnable_sink, q.shape[2], q.device)
    out, lse = _attention(q, k, v, scale, window, softcap, alibi_slopes, dropout_p, sink=sink,
                          deterministic=deterministic)
    return _outputs(out, lse, return_attn_probs)


def _unpack(name: str, t, ndim: int, n: int, layout: str):
    """The n tensors packed along dim -3 of t (qkv / kv), as strided views."""
    _checks.check_tensor(name, t, ndim)
    if t.shape[-3] != n:
        raise ArgumentError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
    return t.unbind(-3)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, learnable_sink=None):
    """`flash_attn_func` on qkv (batch, seqlen, 3, nheads, headdim): q, k, v are read as strided views."""
    q, k, v = _unpack("qkv", qkv, 5, 3, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, learnable_sink=learnable_sink)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, learnable_sink=None):
    """`flash_attn_func` with kv (batch, seqlen_k, 2, nheads_k, headdim), read as strided views."""
    k, v = _unpack("kv", kv, 5, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, learnable_sink=learnable_sink)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False,
                           block_table=None, *, seqused_k=None, learnable_sink=None):
    """Exact attention over a packed batch of sequences of different lengths: flash-attn 2.x's
    `flash_attn_varlen_func` (flashtile.padding turns a padded batch into one and back).

    Arguments:
        q: (total_q, nheads, headdim): every sequence's queries end to end; any strides.
        k, v: (total_k, nheads_k, headdim), or with block_table the pages of a paged cache
            (num_pages, page_size, nheads_k, headdim), page_size a multiple of 16.
        cu_seqlens_q: (batch + 1,) int32 on q's device: sequence b's queries are rows
            cu_seqlens_q[b]:cu_seqlens_q[b + 1]; starts at 0, non-decreasing, ends at total_q.
        cu_seqlens_k: (batch + 1,) int32, the same for keys (ends at total_k). With block_table it
            gives each sequence's key count only; it may then be None if seqused_k is given.
        max_seqlen_q, max_seqlen_k: ints, at least every sequence's length (they size the grid).
        dropout_p, softmax_scale, softcap, deterministic: as flash_attn_func.
        causal, window_size: as flash_attn_func, aligned to each sequence's own bottom-right corner
            (seqlen_q = its queries, seqlen_k = its keys). Sequences of length 0 are allowed; a
            query that sees no key outputs 0.
        alibi_slopes: (nheads,) or (batch, nheads) float32, per sequence.
        block_table: optional (batch, max_pages) int32: key j of sequence b is row j % page_size of
            page block_table[b, j // page_size] (chunked prefill and prefix caching over a paged
            cache). Gradients through pages are supported (the pages are gathered first).
        seqused_k: optional (batch,) int32, keyword: sequence b attends only its first
            seqused_k[b] keys (FlashAttention-3 / vLLM); the other keys get zero gradients.
        learnable_sink: optional (nheads,), keyword: the attention sink, as flash_attn_func.
    Returns:
        out: (total_q, nheads, headdim), q's dtype.
        softmax_lse (only with return_attn_probs): (nheads, total_q) float32, natural log; no
            gradient, as flash_attn_func's.
        None (only with return_attn_probs): no attention matrix, as flash_attn_func.

    Checks: shapes, dtypes, devices always; the values of cu_seqlens (from 0, non-decreasing, the
    last entry equal to the packed total), max_seqlen (not below any length), seqused_k and the
    pages a sequence reads, on the host: a CUDA cu_seqlens is read once per tensor and version
    (one sync per batch when every layer gets the same tensor), and not at all under CUDA-graph
    capture, where the kernels clamp every index to the tensors they were given (a wrong table
    then gives wrong rows, never a read or write outside them).
    """
    varlen = _checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                  block_table)
    h, d = q.shape[1:]
    scale, window, softcap, dropout_p = _check_options(q, varlen.batch, h, d, softmax_scale, causal, window_size,
                                                       softcap, alibi_slopes, dropout_p)
    sink = _checks.check_sink(learnable_sink, h, q.device)
    out, lse = _attention(q, k, v, scale, window, softcap, alibi_slopes, dropout_p, varlen, sink, deterministic)
    return _outputs(out, lse, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                     deterministic=False, return_attn_probs=False, *, learnable_sink=None):
    """`flash_attn_varlen_func` on qkv (total, 3, nheads, headdim), one cu_seqlens for q and k."""
    q, k, v = _unpack("qkv", qkv, 4, 3, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, learnable_sink=learnable_sink)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                    softcap=0.0, alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, learnable_sink=None):
    """`flash_attn_varlen_func` with kv (total_k, 2, nheads_k, headdim)."""
    k, v = _unpack("kv", kv, 4, 2, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, learnable_sink=learnable_sink)


def _for_torch_sdpa(query, key, value, attn_mask, enable_gqa) -> bool:
    """Whether scaled_dot_product_attention hands the call to torch's SDPA: a mask, or what the
    kernels do not take and torch does (torch then computes it, or raises its own error)."""
    if attn_mask is not None:
        return True
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        return False  # the checks name the argument
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return True  # torch takes other ranks and broadcasts the leading dims
    d = query.shape[-1]
    if query.dtype == torch.float64 or key.dtype != query.dtype or value.dtype != query.dtype \
            or value.shape[-1] != d or not 1 <= d <= _checks.MAX_HEADDIM:
        return True
    (b, h), (bk, hk), (bv, hv) = query.shape[:2], key.shape[:2], value.shape[:2]
    if not b == bk == bv or hk != hv:
        return True  # torch broadcasts a batch (or head) dim of 1, on either side, or raises
    # heads the kernels take: a multiple of key/value's with enable_gqa, or one key/value head
    # (torch broadcasts it over query's: multi-query attention); another multiple without
    # enable_gqa gets flashtile's error naming it. torch broadcasts query heads of 1 (or raises).
    return h % hk != 0


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention's layout and semantics, on flashtile.

    query (..., L, E) with L = target length, key/value (..., S, E); 4-D (batch, heads, L, E) runs
    the flashtile kernels, dropout included (flashtile's Philox mask, drawn from torch's generator
    as flash_attn_func does). `is_causal` is top-left aligned, as in torch (query i sees keys
    j <= i). With `enable_gqa`, query heads may be a multiple of key/value heads.
    An `attn_mask` is handed to torch's own SDPA unchanged (flashtile has no arbitrary-mask kernel),
    so results are always torch's, never a silently wrong mask; so are what the kernels do not take
    and torch does: float64, mixed dtypes, a value head dim other than the query's, a head dim
    outside 1..256, inputs other than 4-D, and batch dims of 1 (or query heads of 1) that torch
    broadcasts. One key/value head is broadcast over query's heads by the kernels (multi-query
    attention). is_causal and enable_gqa must be bools, as torch's. (scale = 0 raises: torch's CPU
    SDPA returns NaN there.)
    """
    is_causal = _checks.check_flag("is_causal", is_causal)
    enable_gqa = _checks.check_flag("enable_gqa", enable_gqa)
    if _for_torch_sdpa(query, key, value, attn_mask, enable_gqa):
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa)
    _checks.check_tensor("query", query, 4)
    _checks.check_tensor("key", key, 4)
    _checks.check_tensor("value", value, 4)
    if not enable_gqa and key.shape[1] not in (query.shape[1], 1):
        raise ArgumentError(f"key must have {query.shape[1]} heads (as query) or one unless enable_gqa=True, "
                            f"got {key.shape[1]}")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # BHLE -> BSHD views
    sq, sk = q.shape[1], k.shape[1]
    scale_, window, softcap, dropout_p = _check_common(q, k, v, scale, False, (-1, -1), 0.0, None, dropout_p,
                                                       scale_name="scale")
    if is_causal:
        # top-left: query i sees keys j <= i. With sq <= sk no query sees past key sq - 1, so that
        # is bottom-right causal over the first sq keys; with sq > sk it is a window right = sq - sk.
        if sq <= sk:
            k, v, window = k[:, :sq], v[:, :sq], (None, 0)
        else:
            window = (None, sq - sk)
    out, _ = _attention(q, k, v, scale_, window, softcap, None, dropout_p)
    return out.transpose(1, 2)


# --------------------------------------------------------------------------------------------
# Decoding: flash_attn_with_kvcache, DecodePlan and merge_attention_states (ops.decode;
# reference.kvcache)
# --------------------------------------------------------------------------------------------

def _check_tensors(q, k_cache, v_cache, k, v) -> int:
    """Types, dimensions, dtypes, devices and shapes of a decoding call's tensors -> seqlen_new."""
    _checks.check_tensor("q", q, 4, _KERNEL_DTYPES)
    _checks.check_tensor("k_cache", k_cache, 4)
    _checks.check_tensor("v_cache", v_cache, 4)
    _checks.check_same("k_cache", k_cache, "q", q)
    _checks.check_same("v_cache", v_cache, "q", q)
    b, sq, h, d = q.shape
    if sq < 1:
        raise ArgumentError(f"q must hold at least one query per sequence, got shape {tuple(q.shape)}")
    if k_cache.shape[3] != d:
        raise ArgumentError(f"k_cache must have head dim {d} (as q), got {k_cache.shape[3]}")
    if v_cache.shape != k_cache.shape:
        raise ArgumentError(f"v_cache must have shape {tuple(k_cache.shape)} (as k_cache), got {tuple(v_cache.shape)}")
    if (k is None) != (v is None):
        raise ArgumentError("k and v must be given together (the new keys and values to append)")
    if k is None:
        return 0
    _checks.check_tensor("k", k, 4)
    _checks.check_tensor("v", v, 4)
    _checks.check_same("k", k, "q", q)
    _checks.check_same("v", v, "q", q)
    s_new, hk = k.shape[1], k_cache.shape[2]
    if tuple(k.shape) != (b, s_new, hk, d):
        raise ArgumentError(f"k must have shape (batch, seqlen_new, nheads_k, headdim) = {(b, s_new, hk, d)}, "
                            f"got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ArgumentError(f"v must have shape {tuple(k.shape)} (as k), got {tuple(v.shape)}")
    return s_new


def _check_dtype(dtype) -> None:
    """A cache's dtype (DecodePlan, KVCache, PagedKVCache): one the kernels take."""
    if dtype not in _KERNEL_DTYPES:
        raise TypeError(f"dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype!r}")


def _check_no_aliased_rows(k_cache, v_cache) -> None:
    """A cache that takes appended keys may not hold one memory row for several cache rows (a
    stride of 0 in a dimension of size > 1, as expand() makes): one write would land in all."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if any(stride == 0 and n > 1 for stride, n in zip(t.stride(), t.shape)):
            raise ArgumentError(f"{name} has stride 0 in a dimension of size > 1 (strides {tuple(t.stride())}, shape "
                                f"{tuple(t.shape)}): appending k and v would write one memory row for several cache "
                                f"rows; pass a cache with memory of its own (e.g. .contiguous())")


def _lengths_to_device(lengths, batch: int, device) -> torch.Tensor:
    """A list of ints -> the (batch,) int32 tensor on device that the kernels read, copied without
    waiting for the device; its values are recorded as its host copy, for the checks."""
    if len(lengths) != batch:
        raise ArgumentError(f"cache_seqlens must hold {batch} lengths (batch), got {len(lengths)}")
    host = torch.tensor(list(lengths)) if batch else torch.zeros(0, dtype=torch.int64)
    if host.dtype != torch.int64:
        raise TypeError(f"cache_seqlens must be a list of ints, got {host.dtype} values")
    if batch and not -2**31 <= int(host.min()) <= int(host.max()) < 2**31:
        raise ArgumentError(f"cache_seqlens must fit in int32, got values in [{int(host.min())}, {int(host.max())}]")
    out = torch.empty(batch, dtype=torch.int32, device=device)
    _checks.upload(host.to(torch.int32), out)
    return out


class DecodePlan:
    """Flash-Decoding of one batch step, planned once and run for every layer (FlashInfer's plan /
    run split).

    Everything that depends only on the batch - the checks of shapes, options and index values,
    the split count (ops.configs.decode_num_splits), the split partials and the packed launch
    arguments - is done when the plan is made; run() then checks what may differ between layers
    (the tensors' shapes, dtype and device), appends the new keys and launches. A generate loop
    makes one plan per step (after its lengths change) and runs it in every layer:

        plan = DecodePlan(batch, nheads, k_cache.shape, lengths, dtype=torch.bfloat16, device="cuda",
                          seqlen_new=1, block_table=block_table, causal=True)
        for layer in model.layers:
            q, k, v = layer.qkv(x)             # (batch, 1, nheads, d), (batch, 1, nheads_k, d) x 2
            x = layer.out(plan.run(q, k_caches[layer], v_caches[layer], k, v))

    Arguments (the meaning of each is flash_attn_with_kvcache's):
        batch, nheads: q's batch and head count; seqlen_q (keyword, default 1): q's length.
        cache_shape: the shape of one layer's k_cache (and v_cache): (batch_cache, seqlen_cache,
            nheads_k, headdim), or with block_table (num_blocks, page_size, nheads_k, headdim).
        cache_seqlens: the tokens already in each sequence's cache: a list of ints (copied to the
            device without waiting for it; the checks read the list), an int, a (batch,) int32
            tensor on `device` (read on the host once per tensor version: one device sync for a
            CUDA tensor, none if it was written by flashtile's KVCache), or None (the whole cache).
        dtype, device: of q and the cache.
        seqlen_new: new tokens appended per sequence by every run (run's k and v).
        cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
        alibi_slopes, rotary_cos, rotary_sin, rotary_interleaved, num_splits: as in
            flash_attn_with_kvcache; tensors on `device`. The plan keeps these tensors and the
            kernels read their current values at each run, so a plan captured in a CUDA graph can be
            replayed after updating them in place (within the checked bounds: see below).

    Checks: everything flash_attn_with_kvcache checks, once. Values the plan reads on the host:
    cache overflow (cache_seqlens + seqlen_new beyond the cache or beyond what block_table
    addresses), page indices, cache_leftpad, cache_batch_idx, rotary table length, that no two
    batch rows append into the same cache row, and that no row reads a page row another appends to
    (the launch that appends also reads). A call that fails raises and writes nothing.

    The runs on one CUDA stream share the split partials, allocated at the first run there (a stream
    runs them in order; a model's layers are); runs on different streams have their own. float32
    dots follow torch.backends.cuda.matmul.allow_tf32 as it was at planning. run() reads nothing on
    the host, so it can be captured in a CUDA graph (a first run on the capture stream allocates
    from the graph's pool); keep the plan alive as long as the graph. Index values changed after
    planning (in place, or under capture, where nothing is checked) are not checked: the kernels
    then clamp every index into the tensors it addresses - new rows at positions outside the
    cache, on a page index outside k_cache, or for a cache_batch_idx outside k_cache are not
    written; a row reads only cache positions in [0, capacity), and keys on pages outside k_cache
    as zeros; rotary positions outside the tables are not rotated.
    The outputs of such rows mean nothing, but nothing outside the given tensors is read or written.
    """

    def __init__(self, batch, nheads, cache_shape, cache_seqlens=None, *, dtype, device, seqlen_q=1,
                 seqlen_new=0, cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                 causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, rotary_cos=None,
                 rotary_sin=None, rotary_interleaved=True, num_splits=0):
        batch = _checks.check_int("batch", batch)
        nheads = _checks.check_int("nheads", nheads, 1)
        seqlen_q = _checks.check_int("seqlen_q", seqlen_q, 1)
        seqlen_new = _checks.check_int("seqlen_new", seqlen_new)
        if not isinstance(cache_shape, (tuple, list)) or len(cache_shape) != 4:
            raise ArgumentError(f"cache_shape must be k_cache's shape (4 ints), got {cache_shape!r}")
        cache_shape = torch.Size(_checks.check_int(f"cache_shape[{i}]", n) for i, n in enumerate(cache_shape))
        _check_dtype(dtype)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # the tensors' device names its index
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.type == "cpu":  # and a CPU tensor's names none
            device = torch.device("cpu")
        if isinstance(cache_seqlens, (list, tuple)):
            cache_seqlens = _lengths_to_device(cache_seqlens, batch, device)
        self._plan(batch, seqlen_q, nheads, cache_shape, dtype, device, seqlen_new, cache_seqlens, cache_batch_idx,
                   cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   rotary_cos, rotary_sin, rotary_interleaved, num_splits)

    @classmethod
    def _for_call(cls, q, k_cache, seqlen_new, *args) -> "DecodePlan":
        """The plan of one flash_attn_with_kvcache call (its tensors checked by _check_tensors)."""
        plan = cls.__new__(cls)
        b, sq, h, _ = q.shape
        plan._plan(b, sq, h, k_cache.shape, q.dtype, q.device, seqlen_new, *args)
        return plan

    def _plan(self, b, sq, h, cache_shape, dtype, device, s_new, cache_seqlens, cache_batch_idx, cache_leftpad,
              block_table, softmax_scale, causal, window_size, softcap, alibi_slopes, rotary_cos, rotary_sin,
              rotary_interleaved, num_splits):
        """Every check of the batch and the launch plan: the one path of DecodePlan and
        flash_attn_with_kvcache."""
        cache_rows, rows_per_block, hk, d = cache_shape
        if not 1 <= d <= _checks.MAX_HEADDIM:
            raise ArgumentError(f"head dim must be in 1..{_checks.MAX_HEADDIM}, got {d}")
        if hk < 1 or h % hk != 0:
            raise ArgumentError(f"the number of query heads ({h}) must be a multiple of the number of "
                                f"key/value heads ({hk})")
        if block_table is not None:
            _checks.check_index_tensor("block_table", block_table, device, (b, None))
            if block_table.shape[1] < 1:
                raise ArgumentError(f"block_table must have shape (batch, max_blocks_per_seq) with max_blocks_per_seq "
                                    f">= 1, got {tuple(block_table.shape)}")
            if rows_per_block % 16 != 0:
                raise ArgumentError(f"the page size (k_cache.shape[1] with a block_table) must be a multiple of 16, "
                                    f"got {rows_per_block}")
            if cache_batch_idx is not None:
                raise ArgumentError("cache_batch_idx cannot be combined with block_table: index the pages instead")
            page_size, capacity = rows_per_block, block_table.shape[1] * rows_per_block
        else:
            page_size, capacity = 0, rows_per_block
            if cache_batch_idx is None and cache_rows < b:
                raise ArgumentError(f"k_cache must hold at least {b} sequences (the batch of q), got {cache_rows}; "
                                    f"or pass cache_batch_idx")

        if cache_seqlens is None:
            if s_new:
                raise ArgumentError("cache_seqlens is required to append k and v: it says where they go")
            cache_seqlens = capacity
        if isinstance(cache_seqlens, torch.Tensor):
            _checks.check_index_tensor("cache_seqlens", cache_seqlens, device, (b,))
            lengths = _checks.host_copy(cache_seqlens)
        else:
            cache_seqlens = lengths = _checks.check_int("cache_seqlens", cache_seqlens)  # every row's
        for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if t is not None:
                _checks.check_index_tensor(name, t, device, (b,))

        if (rotary_cos is None) != (rotary_sin is None):
            raise ArgumentError("rotary_cos and rotary_sin must be given together")
        if rotary_cos is not None:
            if not s_new:
                raise ArgumentError("rotary_cos/rotary_sin rotate the new k (and q): pass k and v as well")
            _checks.check_tensor("rotary_cos", rotary_cos, 2, (dtype, torch.float32))
            _checks.check_tensor("rotary_sin", rotary_sin, 2, (dtype, torch.float32))
            if rotary_sin.shape != rotary_cos.shape:
                raise ArgumentError(f"rotary_sin must have shape {tuple(rotary_cos.shape)} (as rotary_cos), "
                                    f"got {tuple(rotary_sin.shape)}")
            if not 1 <= 2 * rotary_cos.shape[1] <= d:
                raise ArgumentError(f"rotary_cos must have shape (seqlen_ro, rotary_dim / 2) with rotary_dim "
                                    f"<= headdim = {d}, got {tuple(rotary_cos.shape)}")
            for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
                if t.device != device:
                    raise ArgumentError(f"{name} must be on the device of q ({device}), got {t.device}")

        scale = _checks.default_scale(softmax_scale, d)
        causal = _checks.check_flag("causal", causal, ints=True)
        rotary_interleaved = _checks.check_flag("rotary_interleaved", rotary_interleaved, ints=True)
        left, right = _checks.check_window(window_size, causal)
        softcap = _checks.check_softcap(softcap)
        _checks.check_alibi(alibi_slopes, b, h, device)
        num_splits = _checks.check_int("num_splits", num_splits)  # 0 = choose from the lengths

        # the values, when every one can be read on the host now (not under CUDA-graph capture)
        host = [None if t is None else _checks.host_copy(t) for t in (cache_leftpad, cache_batch_idx, block_table)]
        self._checked = lengths is not None and all(h is not None for h, t in zip(
            host, (cache_leftpad, cache_batch_idx, block_table)) if t is not None)
        max_keys = None
        if self._checked:
            local = left >= 0 or right >= 0
            max_keys = _checks.check_cache_values(
                lengths, b, s_new, capacity, cache_rows, leftpad=host[0], batch_idx=host[1], table=host[2],
                page_size=page_size, rotary_len=None if rotary_cos is None else rotary_cos.shape[0],
                rotary_reach=max(s_new, sq if local else 1))
        if left >= 0:  # one M block of query rows sees at most this many keys
            max_keys = min(capacity if max_keys is None else max_keys, left + sq + max(right, 0))

        self.batch, self.nheads, self.seqlen_q, self.seqlen_new = b, h, sq, s_new
        self.cache_shape, self.dtype, self.device = cache_shape, dtype, device
        self._q_shape = torch.Size((b, sq, h, d))
        self._k_shape = torch.Size((b, s_new, hk, d)) if s_new else None
        # what the kernels (or the reference) read, besides the tensors of a run
        self._args = dict(cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                          block_table=block_table, alibi_slopes=alibi_slopes, rotary_cos=rotary_cos,
                          rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved)
        self._options = dict(softmax_scale=scale, window=(left, right), softcap=softcap, num_splits=num_splits,
                             max_keys=max_keys)
        self._causal = causal
        self._geometry = dict(page_size=page_size, capacity=capacity, cache_rows=cache_rows)
        # the kernels' plan; kept off the reference path, which must not import triton. Runs with an
        # attention sink take a variant of it, planned at the first such run
        self._launch = self._kernel_plan() if device.type == "cuda" or interpreter_on() else None
        self._sink_launch = None

    def _kernel_plan(self, has_sink=False):
        from flashtile.ops import decoding

        b, sq, h, d = self._q_shape
        return decoding.plan(b, sq, h, self.cache_shape[2], d, self.dtype, self.device, seqlen_new=self.seqlen_new,
                             **self._geometry, **self._args, **self._options, has_sink=has_sink)

    @property
    def num_splits(self) -> int:
        """Pieces each sequence's keys are cut into (the heuristic's choice when num_splits = 0)."""
        if self._launch is None:
            self._launch = self._kernel_plan()
        return self._launch.num_splits

    def run(self, q, k_cache, v_cache, k=None, v=None, return_softmax_lse=False, *, learnable_sink=None):
        """Append k, v and attend q over one layer's cache, as planned.

        Arguments:
            q: (batch, seqlen_q, nheads, headdim), the plan's dtype and device.
            k_cache, v_cache: shaped cache_shape, same dtype and device; any strides.
            k, v: (batch, seqlen_new, nheads_k, headdim) when the plan has seqlen_new > 0, else None.
            return_softmax_lse: also return the log-sum-exp.
            learnable_sink: optional (nheads,) float32 / bfloat16 / float16 on the plan's device:
                this layer's attention sink (as flash_attn_func's), added once per row, after the
                splits are merged. Layers may differ in it; the first run with a sink plans the
                kernels' variant that reads one.
        Inference only: with gradients enabled, a q, k, v or learnable_sink that requires grad is an
        error (no output silently detached from the graph).
        Returns:
            out (batch, seqlen_q, nheads, headdim) in q's dtype, and with return_softmax_lse
            softmax_lse (batch, nheads, seqlen_q) float32 (as flash_attn_with_kvcache).
        """
        if not self._matches(q, k_cache, v_cache, k, v):
            self._mismatch(q, k_cache, v_cache, k, v)
        return self._run_matched(q, k_cache, v_cache, k, v, return_softmax_lse, learnable_sink)

    def _matches(self, q, k_cache, v_cache, k, v) -> bool:
        """Whether a run's tensors are of the plan's types, shapes, dtypes and device."""
        dtype, device, cache_shape, k_shape = self.dtype, self.device, self.cache_shape, self._k_shape
        return (isinstance(q, torch.Tensor) and q.shape == self._q_shape and q.dtype == dtype and q.device == device
                and isinstance(k_cache, torch.Tensor) and k_cache.shape == cache_shape and k_cache.dtype == dtype
                and k_cache.device == device and isinstance(v_cache, torch.Tensor) and v_cache.shape == cache_shape
                and v_cache.dtype == dtype and v_cache.device == device
                and (k is None and v is None if k_shape is None else
                     isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.shape == k_shape
                     and v.shape == k_shape and k.dtype == dtype and v.dtype == dtype and k.device == device
                     and v.device == device))

    def _run_matched(self, q, k_cache, v_cache, k, v, return_softmax_lse, learnable_sink):
        """run's work once its tensors matched the plan."""
        if learnable_sink is not None:
            learnable_sink = _checks.check_sink(learnable_sink, self.nheads, self.device)
        if k is not None:
            if 0 in k_cache.stride() or 0 in v_cache.stride():
                _check_no_aliased_rows(k_cache, v_cache)
            for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
                if cache.requires_grad:
                    raise RuntimeError(f"{name} requires grad: appending k and v writes into it in place, under "
                                       f"autograd's feet (nothing was written); pass a cache that does not require "
                                       f"grad, e.g. {name}.detach() or a buffer of its own")
        if torch.is_grad_enabled() and (q.requires_grad or k is not None and (k.requires_grad or v.requires_grad)
                                        or k_cache.requires_grad or v_cache.requires_grad
                                        or learnable_sink is not None and learnable_sink.requires_grad):
            raise RuntimeError("flash_attn_with_kvcache / DecodePlan.run have no backward (as flash-attn's): call "
                               "them under torch.no_grad() or torch.inference_mode(), or train through "
                               "flash_attn_func / flash_attn_varlen_func (q, k, v, k_cache, v_cache or "
                               "learnable_sink requires grad)")
        out, lse = self._run(q, k_cache, v_cache, k, v, return_softmax_lse, learnable_sink)
        return (out, lse) if return_softmax_lse else out

    def _mismatch(self, q, k_cache, v_cache, k, v):
        """Raise the error of a run whose tensors differ from the plan: theirs if they disagree among
        themselves (_check_tensors), else the first that differs from the plan."""
        s_new = _check_tensors(q, k_cache, v_cache, k, v)
        for name, got, want in (("q's shape", tuple(q.shape), tuple(self._q_shape)), ("q's dtype", q.dtype, self.dtype),
                                ("q's device", q.device, self.device),
                                ("k_cache's shape", tuple(k_cache.shape), tuple(self.cache_shape)),
                                ("seqlen_new (k.shape[1])", s_new, self.seqlen_new)):
            if got != want:
                raise ArgumentError(f"{name} is {got}, but the plan was made for {want}")
        raise ArgumentError("the tensors do not match the plan")  # run's test and this one disagree: a bug

    def _run(self, q, k_cache, v_cache, k, v, want_lse=True, sink=None):
        """(out, lse) of checked tensors; lse may be None when not want_lse."""
        if backend_for(q) == "reference":
            from flashtile.reference.kvcache import attention_with_kvcache

            args, options = self._args, self._options
            out, lse = attention_with_kvcache(
                q, k_cache, v_cache, k, v, softmax_scale=options["softmax_scale"], causal=self._causal,
                window_size=options["window"], softcap=options["softcap"], compute_dtype=torch.float32,
                learnable_sink=sink, **args)
            return out.to(q.dtype), lse

        if sink is None:
            launch = self._launch
            if launch is None:  # planned for the reference path, run on the interpreter
                launch = self._launch = self._kernel_plan()
        else:
            launch = self._sink_launch
            if launch is None:
                launch = self._sink_launch = self._kernel_plan(has_sink=True)
        from flashtile.ops import decoding

        with _device_guard(q):
            return decoding.decode_attention(launch, q, k_cache, v_cache, k, v, want_lse, sink)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, learnable_sink=None):
    """Attention of q over a KV cache, appending new keys first: flash-attn 2.x's function.

    Flash-Decoding: the keys of each sequence are cut into splits that run in parallel, then merged
    by their log-sum-exp, so even one sequence fills the GPU. A serving loop that runs many layers
    over one batch plans once per step with DecodePlan instead (flashtile.kvcache.KVCache and
    PagedKVCache do that for a generate loop).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 / float32. seqlen_q = 1 when
            decoding; a few for speculative decoding or chunked prefill.
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), q's dtype and device,
            nheads % nheads_k == 0; or, with block_table, pages (num_blocks, page_size, nheads_k,
            headdim) with page_size a multiple of 16. Any strides.
        k, v: optional (batch, seqlen_new, nheads_k, headdim), written into the cache in place at
            positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 before attending.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2), q's dtype or float32; only
            with k and v. k is rotated at its cache positions; q at cache_seqlens[b] + i with a
            causal or local mask, else every query at cache_seqlens[b] (flash-attn's rule).
            rotary_interleaved: rotate pairs (2i, 2i+1) (GPT-J) rather than (i, i + rotary_dim/2)
            (GPT-NeoX). Dims past rotary_dim are left alone.
        cache_seqlens: int, or (batch,) int32 on q's device: the tokens already in each sequence's
            cache. None means the whole cache (then k/v cannot be appended).
        cache_batch_idx: optional (batch,) int32: batch row b uses cache sequence
            cache_batch_idx[b] (contiguous cache only).
        cache_leftpad: optional (batch,) int32: each sequence's keys start at that cache position;
            the rows before it are padding nobody attends.
        block_table: optional (batch, max_blocks_per_seq) int32: cache position p of batch row b
            is row p % page_size of page block_table[b, p // page_size].
        softmax_scale: defaults to headdim ** -0.5.
        causal, window_size, softcap, alibi_slopes: as flash_attn_func, aligned to the bottom-right
            corner of (seqlen_q, seqlen_k) with seqlen_k = cache_seqlens[b] - cache_leftpad[b] +
            seqlen_new. With seqlen_q = 2, seqlen_k = 5 and causal=True:
                1 1 1 1 0
                1 1 1 1 1
            With seqlen_q = 1 causal changes nothing: the query sits at the last key.
        num_splits: pieces per sequence; 0 picks them from the lengths and the GPU's SM count
            (ops.configs.decode_num_splits). 1 runs no combine kernel. The result does not depend
            on it beyond fp32 rounding.
        return_softmax_lse: also return the log-sum-exp.
        learnable_sink: optional (nheads,), keyword: the attention sink, as flash_attn_func's; it
            joins each row once, after the splits are merged.
    Returns:
        out: (batch, seqlen_q, nheads, headdim) in q's dtype; rows that see no key are zero.
        softmax_lse (only with return_softmax_lse): (batch, nheads, seqlen_q) float32, natural log,
            -inf for a row that sees no key (the sink's logit with a sink).

    Checks: shapes, dtypes and devices always; and the index values - cache overflow (an append or
    cache_seqlens beyond the cache, or beyond what block_table addresses), page indices,
    cache_leftpad, cache_batch_idx, the rotary table's length, no two rows appending into one cache
    row, no row reading a page row that another appends to - read on the host: a CUDA index tensor
    is copied to the host once per tensor and version (the layers of a decoding step that pass the
    same tensors share one copy and one plan; KVCache's tensors need no copy). Index tensors made
    under torch.inference_mode have no version counter, so each call reads (a device sync) and
    checks them again: a serving loop under inference_mode plans with DecodePlan instead. A call
    that fails a check raises ValueError naming the argument and writes nothing.
    Under CUDA-graph capture (or torch.compile) nothing is read on the host, so the values are not
    checked; the kernels then clamp every index into the given tensors, as DecodePlan describes: a
    row with out-of-range indices gets a meaningless output and its out-of-range new keys are not
    written, but nothing outside the tensors is ever read or written.
    """
    args = (cache_seqlens, cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
            alibi_slopes, rotary_cos, rotary_sin, rotary_interleaved, num_splits)
    plan = _last_plan(args, q, k_cache, v_cache, k, v)
    if plan is not None:
        return plan._run_matched(q, k_cache, v_cache, k, v, return_softmax_lse, learnable_sink)
    return _plan_of_call(q, k_cache, v_cache, k, v, args).run(q, k_cache, v_cache, k, v, return_softmax_lse,
                                                             learnable_sink=learnable_sink)


# The plans of recent flash_attn_with_kvcache calls. The layers of a decoding step pass the same
# index tensors (same objects, unchanged), so they share one plan: made and checked by the first
# layer, looked up by the others, whose tensors DecodePlan.run then checks against it. A tensor
# argument is keyed by identity and version counter: each entry, (plan, the key's tensors), holds
# them, so no other tensor can take their ids while it is here, and writing one in place moves its
# version, so the next call plans (and checks) again. Plain values are keyed with their types (2
# and 2.0 are equal keys, and the checks refuse one of them; 1 and True get a plan each). Bounded:
# each entry keeps its tensors alive (and _last_call below those of the last call, after they leave
# this dict).
_recent_plans: dict = {}
RECENT_PLANS = 8
_PLAIN_TYPES = frozenset((type(None), bool, int, float))  # keyed by value without asking isinstance
# The last call's (arguments, their tensors, the tensors' versions, allow_tf32, plan): a call whose
# arguments are the same objects, unchanged, and whose tensors match the plan takes it without
# building the key above (the next layer of a decoding step: ~2 us of host time less on a CPU
# where a call costs ~12)
_last_call: list = [None]


def _last_plan(args: tuple, q, k_cache, v_cache, k, v):
    """The last call's plan if this call's arguments (cache_seqlens to num_splits) are the same
    objects, its tensors unchanged since, and q, the caches, k and v match the plan; else None."""
    last = _last_call[0]
    if last is None or torch.compiler.is_compiling():
        return None
    last_args, tensors, versions, tf32, plan = last
    # identity is safe: _last_call holds the last call's objects, so none of their ids is reused
    if not all(map(operator.is_, args, last_args)) or [t._version for t in tensors] != versions \
            or not plan._matches(q, k_cache, v_cache, k, v):
        return None
    if plan.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 != tf32:
        return None
    return plan


def _key_part(x):
    """One argument of a call as it keys _recent_plans: a tensor by identity and version (a tuple's
    tensors too: window_size may be a pair of one-element tensors, flash-attn's tests pass such), a
    tuple of plain values by its values and their types, anything else as itself (unhashable ones
    make the call unkeyed)."""
    if isinstance(x, torch.Tensor):
        return id(x), x._version
    if type(x) is tuple:  # its elements' types too: (3.0, 0) is refused where (3, 0) is not
        return tuple(_key_part(e) for e in x) if any(isinstance(e, torch.Tensor) for e in x) else (x, *map(type, x))
    return x


def _arg_tensors(args: tuple) -> tuple:
    """The tensors among a call's arguments, those inside a tuple included (see _key_part)."""
    found = []
    for x in args:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif type(x) is tuple:
            found.extend(e for e in x if isinstance(e, torch.Tensor))
    return tuple(found)


def _plan_of_call(q, k_cache, v_cache, k, v, args: tuple) -> DecodePlan:
    """The plan of a flash_attn_with_kvcache call; args are its arguments from cache_seqlens to
    num_splits, in DecodePlan._for_call's order."""
    key = None
    if isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor) and isinstance(k, (torch.Tensor, type(None))) \
            and not torch.compiler.is_compiling():
        try:
            # float32 dots follow allow_tf32 as it is when the plan is made; a tensor argument (one
            # in a tuple too) is keyed by identity and version, anything else by value (_key_part)
            tf32 = q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
            parts = [x if type(x) in _PLAIN_TYPES else _key_part(x) for x in args]
            key = (q.shape, q.dtype, q.device, k_cache.shape, None if k is None else k.shape, tf32, *parts,
                   *map(type, args))
            tensors = _arg_tensors(args)
            versions = [t._version for t in tensors]  # before planning: the versions the plan checks
            plan = _recent_plans.get(key, (None, ))[0]
        except (RuntimeError, TypeError):  # an inference tensor (no version counter), an unhashable option
            key = plan = None
        if plan is None and key is not None:
            plan = DecodePlan._for_call(q, k_cache, _check_tensors(q, k_cache, v_cache, k, v), *args)
            if not plan._checked:  # a plan made under capture has not seen the values
                return plan
            if len(_recent_plans) >= RECENT_PLANS:
                del _recent_plans[next(iter(_recent_plans))]
            # the key's tensors stay alive with it: a tensor the plan read as a value (a window side,
            # a 0-d scale) would otherwise free its id for another tensor to match the key
            _recent_plans[key] = (plan, tensors)
        if plan is not None:  # the versions the plan was checked at (read before planning)
            _last_call[0] = (args, tensors, versions, tf32, plan)
            return plan
    return DecodePlan._for_call(q, k_cache, _check_tensors(q, k_cache, v_cache, k, v), *args)


def merge_attention_states(out_partial, lse_partial, learnable_sink=None):
    """Exact merge of attention computed over disjoint pieces of the keys (splits, prefix caches,
    ring attention): out = sum_s exp(lse_s - lse) out_s with lse = logsumexp_s lse_s.

    Arguments:
        out_partial: (S, *, headdim), float16 / bfloat16 / float32: each piece's normalised output.
        lse_partial: (S, *) float32, natural log. A piece with lse = -inf saw no key: it contributes
            nothing, whatever its out_partial holds (NaN included). Pieces with lse = +inf (a sink
            of +inf) take all the weight, in equal shares: out is their mean, lse +inf.
        learnable_sink: optional attention sink (float32 / bfloat16 / float16) broadcastable to (*)
            - for pieces laid out (S, batch, nheads, seqlen), the sink (nheads,) as
            learnable_sink[:, None] - counted once, as one more piece with lse = the sink and out 0
            (the pieces themselves must not include it).
    Returns:
        out: (*, headdim) in out_partial's dtype (zeros where every piece is empty);
        lse: (*) float32 (-inf where every piece is empty).
    Differentiable: with gradients enabled and an input that requires grad, the merge runs as
    torch operations (float32, as the kernel) so that autograd carries the gradients back. An
    out_partial that requires grad beside an lse_partial that does not raises RuntimeError: the
    merged output's gradient runs through both (the softmax_lse that flash_attn_func returns
    carries none: see its docstring).
    """
    if not isinstance(out_partial, torch.Tensor):
        raise TypeError(f"out_partial must be a torch.Tensor, got {type(out_partial).__name__}")
    if out_partial.dim() < 2 or out_partial.shape[0] < 1:
        raise ArgumentError(f"out_partial must have shape (S, *, headdim) with S >= 1, got {tuple(out_partial.shape)}")
    _checks.check_tensor("out_partial", out_partial, out_partial.dim(), _KERNEL_DTYPES)
    _checks.check_tensor("lse_partial", lse_partial, out_partial.dim() - 1, (torch.float32,))
    if lse_partial.shape != out_partial.shape[:-1]:
        raise ArgumentError(f"lse_partial must have shape {tuple(out_partial.shape[:-1])} (out_partial "
                            f"without headdim), got {tuple(lse_partial.shape)}")
    if lse_partial.device != out_partial.device:
        raise ArgumentError(f"lse_partial must be on the device of out_partial ({out_partial.device}), "
                            f"got {lse_partial.device}")
    _checks.check_sink_rows(learnable_sink, tuple(lse_partial.shape[1:]), out_partial.device)
    # the merge kernel has no backward: a merge that autograd must differentiate runs the torch
    # merge (float32, the kernel's arithmetic), so no output comes back detached from the graph
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (out_partial, lse_partial, learnable_sink))
    if needs_grad and out_partial.requires_grad and not lse_partial.requires_grad:
        raise RuntimeError("out_partial requires grad and lse_partial does not: the merged output depends on "
                           "the pieces' LSE too, so its gradients would be incomplete (flash_attn_func's "
                           "softmax_lse carries none); attend over all the keys in one call to train, or "
                           "detach out_partial to merge without gradients")
    if needs_grad or backend_for(out_partial) == "reference":
        from flashtile.reference.decoding import merge

        return merge(out_partial, lse_partial, sink=learnable_sink)

    from flashtile.ops import decoding

    with _device_guard(out_partial):
        return decoding.merge_states(out_partial, lse_partial, learnable_sink)
