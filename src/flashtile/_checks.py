"""Argument checks shared by the public API and the reference code.

Every failure names the argument, the expected value and the given one, so a user can fix the call
without reading our source.
"""

from __future__ import annotations

import itertools
import math
import operator
import weakref
from typing import NamedTuple, Optional

import numpy as np
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEADDIM = 256


class ArgumentError(ValueError, RuntimeError):
    """A bad argument value (a shape, a length, a cache that overflows, a page index out of range):
    a ValueError, and a RuntimeError as well, which is what flash-attn's checks raise, so code
    written against flash-attn (`pytest.raises(RuntimeError, match="block_table")`) catches it."""


def check_tensor(name: str, t, ndim: int, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ArgumentError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(dict.fromkeys(str(d).replace("torch.", "") for d in dtypes))  # (float32, q's) once
        raise TypeError(f"{name} must have dtype in ({allowed}), got {t.dtype}")


def check_same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """`t` must share dtype and device with `ref`."""
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")
    if t.device != ref.device:
        raise ArgumentError(f"{name} must be on the device of {ref_name} ({ref.device}), got {t.device}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """Check BSHD q (b, sq, h, d), k/v (b, sk, hk, d); return (b, sq, sk, h, hk, d)."""
    check_tensor("q", q, 4)
    check_tensor("k", k, 4)
    check_tensor("v", v, 4)
    check_same("k", k, "q", q)
    check_same("v", v, "q", q)
    b, sq, h, d = q.shape
    bk, sk, hk, dk = k.shape
    if bk != b:
        raise ArgumentError(f"k must have batch size {b} (as q), got {bk}")
    if dk != d:
        raise ArgumentError(f"k must have head dim {d} (as q), got {dk}")
    if tuple(v.shape) != (b, sk, hk, d):
        raise ArgumentError(f"v must have shape {(b, sk, hk, d)} (as k), got {tuple(v.shape)}")
    if d < 1 or d > MAX_HEADDIM:
        raise ArgumentError(f"head dim must be in 1..{MAX_HEADDIM}, got {d}")
    if hk < 1 or h % hk != 0:
        raise ArgumentError(
            f"the number of query heads ({h}) must be a multiple of the number of key/value heads ({hk})"
        )
    return b, sq, sk, h, hk, d


def check_int(name: str, x, minimum: int = 0) -> int:
    """An integer argument as a Python int: an int, a numpy integer, or a one-element integer
    tensor (flash-attn's own tests pass window_size = torch.randint(0, seqlen_k, (2,)))."""
    if type(x) is int and x >= minimum:  # the common case, several times per decoding plan
        return x
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name} must be an int, got a {x.dtype} tensor of shape {tuple(x.shape)}")
        x = int(x.item())
    elif isinstance(x, bool):
        raise TypeError(f"{name} must be an int, got {x!r}")
    else:
        try:
            x = operator.index(x)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(x).__name__}") from None
    if x < minimum:
        raise ArgumentError(f"{name} must be >= {minimum}, got {x}")
    return x


def check_flag(name: str, x, ints: bool = False) -> bool:
    """A boolean argument: True, False or a numpy bool; with ints (flash-attn's flags: its
    torch.library schemas, and pybind11 before them, take causal=1) also the integers 0 and 1.
    Anything else is refused rather than read by its truth value ("False", 0.5 and 2 are true,
    None false), as torch's own bool parameters (SDPA's is_causal) refuse even 1."""
    if type(x) is bool:
        return x
    if isinstance(x, np.bool_):
        return bool(x)
    if ints and isinstance(x, (int, np.integer)) and x in (0, 1):
        return bool(x)
    allowed = "a bool or 0 / 1" if ints else "a bool"
    raise TypeError(f"{name} must be {allowed}, got {type(x).__name__} {x!r}")


def check_window(window_size, causal: bool) -> tuple[int, int]:
    """Normalise (left, right): a negative side is unbounded (-1, as flash-attn's C++ reads any
    negative value); causal (check_flag, 0 / 1 included) forces right = 0. A tuple, a list or a
    2-element tensor or numpy array of ints, as flash-attn accepts."""
    if type(causal) is not bool:
        causal = check_flag("causal", causal, ints=True)
    if type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int \
            and type(window_size[1]) is int and window_size[0] >= -1 and window_size[1] >= -1:
        return window_size[0], (0 if causal else window_size[1])  # the common case, on every call's host path
    if isinstance(window_size, (torch.Tensor, np.ndarray)):
        if (window_size.size if isinstance(window_size, np.ndarray) else window_size.numel()) != 2:
            raise ArgumentError(f"window_size must be a pair (left, right), got a {type(window_size).__name__} of "
                                f"shape {tuple(window_size.shape)}")
        if isinstance(window_size, torch.Tensor) and window_size.device.type == "meta":
            raise ArgumentError("window_size must hold values, got a tensor on the meta device")
        window_size = window_size.flatten()
    elif not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ArgumentError(f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = (max(check_int(f"window_size {side}", x, -math.inf), -1)
                   for side, x in zip(("left", "right"), window_size))
    if causal:
        right = 0
    return left, right


def check_softcap(softcap: float) -> float:
    softcap = _real("softcap", softcap)
    if not math.isfinite(softcap) or softcap < 0:
        raise ArgumentError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    return softcap


def _real(name: str, x) -> float:
    """x as a float: a real number (not a bool or a string) or a one-element tensor."""
    if type(x) is float:
        return x
    if isinstance(x, (bool, str, bytes)) or (isinstance(x, torch.Tensor) and x.numel() != 1):
        raise TypeError(f"{name} must be a real number, got {x!r}")
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}") from None


def check_alibi(alibi_slopes, b: int, h: int, device) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((h,), (b, h)):
        raise ArgumentError(f"alibi_slopes must have shape ({h},) or ({b}, {h}), got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != device:
        raise ArgumentError(f"alibi_slopes must be on {device}, got {alibi_slopes.device}")


SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_sink(learnable_sink, h: int, device) -> Optional[torch.Tensor]:
    """The attention sink as the kernels read it: None, or (h,) contiguous (a strided view is
    copied; autograd carries its gradient back through the copy)."""
    if learnable_sink is None:
        return None
    if not isinstance(learnable_sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a torch.Tensor or None, got {type(learnable_sink).__name__}")
    if learnable_sink.dtype not in SINK_DTYPES:
        raise TypeError(f"learnable_sink must be float32, bfloat16 or float16, got {learnable_sink.dtype}")
    if tuple(learnable_sink.shape) != (h,):
        raise ArgumentError(f"learnable_sink must have shape ({h},) (one logit per query head), "
                            f"got {tuple(learnable_sink.shape)}")
    if learnable_sink.device != device:
        raise ArgumentError(f"learnable_sink must be on {device}, got {learnable_sink.device}")
    return learnable_sink.contiguous()


def check_sink_rows(learnable_sink, rows: tuple, device) -> None:
    """An attention sink given per row of a merge: None, or a float tensor that broadcasts to rows."""
    if learnable_sink is None:
        return
    if not isinstance(learnable_sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a torch.Tensor or None, got {type(learnable_sink).__name__}")
    if learnable_sink.dtype not in SINK_DTYPES:
        raise TypeError(f"learnable_sink must be float32, bfloat16 or float16, got {learnable_sink.dtype}")
    try:
        ok = torch.broadcast_shapes(learnable_sink.shape, rows) == rows
    except RuntimeError:
        ok = False
    if not ok:
        raise ArgumentError(f"learnable_sink must broadcast to {rows} (lse_partial without S), got "
                            f"{tuple(learnable_sink.shape)}")
    if learnable_sink.device != device:
        raise ArgumentError(f"learnable_sink must be on {device}, got {learnable_sink.device}")


def check_dropout_p(dropout_p: float) -> float:
    if type(dropout_p) is float and 0.0 <= dropout_p < 1.0:
        return dropout_p
    dropout_p = _real("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ArgumentError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return dropout_p


_FP32_MAX = torch.finfo(torch.float32).max  # the kernels take the scale as float32


def default_scale(softmax_scale, d: int, name: str = "softmax_scale") -> float:
    """The scale of the scores (d ** -0.5 by default); name: the caller's argument (SDPA's `scale`)."""
    if softmax_scale is None:
        return d ** -0.5
    softmax_scale = _real(name, softmax_scale)
    if not math.isfinite(softmax_scale) or softmax_scale == 0 or abs(softmax_scale) > _FP32_MAX:
        raise ArgumentError(f"{name} must be a finite non-zero number within float32's range, got {softmax_scale}")
    return softmax_scale


def dropout_threshold(dropout_p: float) -> tuple[int, float]:
    """(threshold, scale) of dropout as the kernels and reference.dropout apply it.

    A score is dropped when its 8 random bits fall below threshold = round(p * 2^8), at least 1
    for p > 0, so the drop probability is threshold / 256: p to the nearest 1/256 (flash-attn also
    draws 8 bits per score; p = 0.1 drops 26 / 256 = 0.1016 of the scores). Kept scores are scaled
    by 256 / (256 - threshold), which makes the output's expectation the no-dropout output
    exactly. Eight bits rather than sixteen halve the Philox calls per score, which is most of
    dropout's cost in the kernels (ops.philox.dropout_keep).
    """
    threshold = min(max(round(dropout_p * 256), 1 if dropout_p > 0 else 0), 255)
    return threshold, 256.0 / (256 - threshold)


class Varlen(NamedTuple):
    """A checked packed batch: sequence b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of
    q (total_q, h, d), its keys rows cu_seqlens_k[b]:cu_seqlens_k[b+1] of k/v (total_k, hk, d), only
    the first seqused_k[b] of them when given. With block_table, k/v are pages (num_pages,
    page_size, hk, d) and key j of sequence b is row j % page_size of page block_table[b, j //
    page_size] (cu_seqlens_k then only gives the lengths)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_k: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


# --------------------------------------------------------------------------------------------
# Values of index tensors (cu_seqlens, seqused_k, block_table) on the host
# --------------------------------------------------------------------------------------------

_host_cache: dict = {}  # (id(tensor), what) -> (weakref to it, its version, the value): per_version


def host_values(t: torch.Tensor) -> Optional[list]:
    """t's values as Python ints, or None when they cannot be read now (host_copy)."""
    copy = host_copy(t)
    return None if copy is None else copy.tolist()


def host_copy(t: torch.Tensor) -> Optional[torch.Tensor]:
    """t on the host, or None when it cannot be read now (CUDA-graph capture, or torch.compile
    tracing): the caller then skips the value checks, and the kernels clamp.

    A CUDA tensor is copied to the host once per version (cached_copy): training passes the same
    cu_seqlens to every layer of a step, so one sync per batch checks them all.
    """
    if torch.compiler.is_compiling():
        return None
    if t.device.type != "cuda":
        return t
    if torch.cuda.is_current_stream_capturing():
        return None
    return cached_copy(t)


def cached_copy(t: torch.Tensor) -> torch.Tensor:
    """t.cpu(), copied once per tensor and version (per_version), so an in-place update (or a new
    tensor) is read again. Writes that bypass the version counter (a custom kernel writing its
    memory, t.data) are not seen: pass a new tensor then. Inference-mode tensors have no version
    counter and are read every time."""
    if t.is_inference():
        return t.cpu()
    return per_version(t, "host", lambda: t.cpu() if t.device.type != "cpu" else t.clone())


def per_version(t: torch.Tensor, what, compute):
    """compute(), kept for tensor t's current version under `what` (a hashable naming what was
    derived from t): whatever needs t's values on the host (a synchronisation) is computed once
    however many callers ask (cached_copy; the transformers integration's masks and positions).
    A weak reference to t and its version counter key it, so an in-place update, or a new tensor
    at a freed one's address, computes again. Inference tensors have no version counter: callers
    compute for them every time."""
    key = (id(t), what)
    hit = _host_cache.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    value = compute()
    _host_cache[key] = (weakref.ref(t, lambda _, key=key: _host_cache.pop(key, None)), t._version, value)
    return value


def set_host_copy(t: torch.Tensor, host: torch.Tensor) -> None:
    """Record host (a CPU tensor of t's values) as t's host copy for t's current version, so that
    host_copy needs no device read: for a caller that wrote t from values it holds on the host
    (the KVCache helpers, DecodePlan). host must not change afterwards."""
    if t.device.type == "cpu" or t.is_inference():
        return
    key = (id(t), "host")
    _host_cache[key] = (weakref.ref(t, lambda _, key=key: _host_cache.pop(key, None)), t._version, host)


def upload(host: torch.Tensor, dst: torch.Tensor) -> None:
    """dst.copy_(host) without waiting for the device, and host recorded as dst's host copy.

    A plain copy from pageable host memory makes the host wait until the device has run everything
    queued before it (torch synchronises the stream); from pinned memory with non_blocking it is
    queued like a kernel, and torch's pinned allocator keeps the staging buffer until it has run.
    """
    if dst.is_cuda:
        dst.copy_(host.pin_memory(), non_blocking=True)
    else:
        dst.copy_(host)
    set_host_copy(dst, host)


def check_index_tensor(name: str, t, device, shape: tuple) -> None:
    """An int32 index tensor of the given shape (None = any size there) on device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = "(" + ", ".join("n" if w is None else str(w) for w in shape) + ("," if len(shape) == 1 else "") + ")"
        raise ArgumentError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if t.device != device:
        raise ArgumentError(f"{name} must be on the device of q ({device}), got {t.device}")


def _check_offsets(name: str, values: list, total: Optional[int]) -> list[int]:
    """cu_seqlens values: from 0, non-decreasing, ending at total (when given); returns the lengths."""
    if values[0] != 0:
        raise ArgumentError(f"{name}[0] must be 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    for i, n in enumerate(lengths):
        if n < 0:
            raise ArgumentError(f"{name} must be non-decreasing, but {name}[{i + 1}] = {values[i + 1]} < "
                                f"{name}[{i}] = {values[i]}")
    if total is not None and values[-1] != total:
        raise ArgumentError(f"{name}[-1] must equal the number of packed rows ({total}), got {values[-1]}")
    return lengths


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None,
                 block_table=None) -> Varlen:
    """Check a packed batch (flash_attn_varlen_func's arguments); return it as a Varlen.

    Shapes, dtypes and devices always. Values (offsets from 0, non-decreasing, ending at the packed
    totals; max_seqlen at least every length; seqused_k within its sequence; page indices inside
    k) whenever host_values can read them: once per cu_seqlens tensor (see host_values); never
    under CUDA-graph capture, where the kernels clamp every index instead (a wrong table then gives
    wrong rows, never an access outside the tensors).
    """
    paged = block_table is not None
    check_tensor("q", q, 3)
    check_tensor("k", k, 4 if paged else 3)
    check_tensor("v", v, 4 if paged else 3)
    check_same("k", k, "q", q)
    check_same("v", v, "q", q)
    total_q, h, d = q.shape
    hk = k.shape[-2]
    if k.shape[-1] != d:
        raise ArgumentError(f"k must have head dim {d} (as q), got {k.shape[-1]}")
    if v.shape != k.shape:
        raise ArgumentError(f"v must have shape {tuple(k.shape)} (as k), got {tuple(v.shape)}")
    if d < 1 or d > MAX_HEADDIM:
        raise ArgumentError(f"head dim must be in 1..{MAX_HEADDIM}, got {d}")
    if hk < 1 or h % hk != 0:
        raise ArgumentError(f"the number of query heads ({h}) must be a multiple of the number of "
                            f"key/value heads ({hk})")
    check_index_tensor("cu_seqlens_q", cu_seqlens_q, q.device, (None,))
    b = cu_seqlens_q.shape[0] - 1
    if b < 0:
        raise ArgumentError("cu_seqlens_q must hold batch + 1 offsets, got an empty tensor")
    if seqused_k is not None:
        check_index_tensor("seqused_k", seqused_k, q.device, (b,))
    derived_k = cu_seqlens_k is None
    if derived_k:
        if not (paged and seqused_k is not None):
            raise ArgumentError("cu_seqlens_k may be None only with block_table and seqused_k (the keys of "
                                "each sequence are then its first seqused_k[b] paged keys)")
        cu_seqlens_k = torch.nn.functional.pad(seqused_k.cumsum(0, dtype=torch.int32), (1, 0))
    check_index_tensor("cu_seqlens_k", cu_seqlens_k, q.device, (b + 1,))
    max_seqlen_q = check_int("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = check_int("max_seqlen_k", max_seqlen_k)
    if paged:
        check_index_tensor("block_table", block_table, q.device, (b, None))
        if block_table.shape[1] < 1:
            raise ArgumentError(f"block_table must have shape (batch, max_pages) with max_pages >= 1, got "
                                f"{tuple(block_table.shape)}")
        if k.shape[0] < 1:
            raise ArgumentError(f"k must hold at least one page with a block_table, got shape {tuple(k.shape)}")
        page_size = k.shape[1]
        if page_size % 16 != 0:
            raise ArgumentError(f"the page size (k.shape[1] with a block_table) must be a multiple of 16, "
                                f"got {page_size}")
        capacity = block_table.shape[1] * page_size

    vq = host_values(cu_seqlens_q)
    if vq is not None:
        lengths_q = _check_offsets("cu_seqlens_q", vq, total_q)
        if b and max(lengths_q) > max_seqlen_q:
            row = lengths_q.index(max(lengths_q))
            raise ArgumentError(f"max_seqlen_q ({max_seqlen_q}) is smaller than sequence {row}'s length "
                                f"{lengths_q[row]} (cu_seqlens_q)")
    # cu_seqlens_k derived from seqused_k above is a new tensor each call: check seqused_k instead
    vk = host_values(seqused_k) if derived_k else host_values(cu_seqlens_k)
    if vk is not None:
        if derived_k:  # offsets of seqused_k's values: a negative one is seqused_k's error, not cu_seqlens_k's
            for i, n in enumerate(vk):
                if n < 0:
                    raise ArgumentError(f"seqused_k[{i}] = {n} must be >= 0")
            vk = [0, *itertools.accumulate(vk)]
        lengths_k = _check_offsets("cu_seqlens_k", vk, None if paged else k.shape[0])
        used = host_values(seqused_k) if seqused_k is not None else lengths_k
        if used is not None:
            for i, (n, m) in enumerate(zip(used, lengths_k)):
                if paged and n > capacity:
                    source = "seqused_k" if seqused_k is not None else "cu_seqlens_k"
                    raise ArgumentError(f"sequence {i} has {n} keys ({source}) but block_table reaches {capacity} "
                                        f"({block_table.shape[1]} pages of {k.shape[1]})")
                if n < 0 or (not paged and n > m):
                    limit = f"{capacity} (the page table's reach)" if paged else f"{m} (its cu_seqlens_k length)"
                    raise ArgumentError(f"seqused_k[{i}] = {n} must be in 0..{limit}")
            if b and max(used) > max_seqlen_k:
                row = used.index(max(used))
                raise ArgumentError(f"max_seqlen_k ({max_seqlen_k}) is smaller than sequence {row}'s "
                                    f"{used[row]} keys")
            if paged:
                table = host_copy(block_table)
                if table is not None:  # one vectorised pass: serving batches hold thousands of slots
                    pages_read = (torch.tensor(used, dtype=torch.int64) + k.shape[1] - 1) // k.shape[1]  # (b,)
                    reads = torch.arange(table.shape[1])[None, :] < pages_read[:, None]  # (b, max_pages)
                    bad = reads & ((table < 0) | (table >= k.shape[0]))
                    if bool(bad.any()):
                        i, slot = (int(x) for x in bad.nonzero()[0])
                        raise ArgumentError(f"block_table[{i}, {slot}] = {int(table[i, slot])} is not a page of k "
                                            f"(it holds {k.shape[0]}), and sequence {i} reads it")
    # the kernels read index tensors with unit strides (a view with other strides is copied)
    return Varlen(cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k,
                  None if seqused_k is None else seqused_k.contiguous(),
                  None if block_table is None else block_table.contiguous())


# --------------------------------------------------------------------------------------------
# Values of a KV cache's index tensors (flash_attn_with_kvcache, DecodePlan)
# --------------------------------------------------------------------------------------------

def check_cache_values(lengths, b: int, seqlen_new: int, capacity: int, cache_rows: int, *,
                       leftpad=None, batch_idx=None, table=None, page_size: int = 0,
                       rotary_len: Optional[int] = None, rotary_reach: int = 0) -> int:
    """Check the host values of a decoding call's indices; return the longest key range of a row.

    lengths (b,), or an int >= 0 that every row holds: tokens already cached per batch row
    (cache_seqlens); seqlen_new appended after them. Contiguous: capacity = k_cache.shape[1],
    cache_rows = k_cache.shape[0] sequences (batch_idx (b,) picks them). Paged: table (b, max_pages)
    of pages of page_size rows, capacity = max_pages * page_size, cache_rows = pages in k_cache.
    leftpad (b,): the first position a row reads. The rotary tables (rotary_len positions) must
    reach lengths + rotary_reach. Besides bounds, no cache row may be appended to twice (one write
    would replace the other), nor appended to by one batch row and read by another (the launch
    that appends also attends, so the other row would race the write), nor appended to through one
    block_table column and read through another; pages shared for reading, as prefix caches do,
    are fine.

    Every argument is a CPU tensor, read as a numpy array: one vectorised pass each, no loop over
    rows (serving batches hold hundreds), and numpy's ~1 us per operation on small arrays against
    torch's ~3 (this runs once per decoding step: DecodePlan).
    """
    if b == 0:
        return 0
    if isinstance(lengths, int) and leftpad is None and batch_idx is None and table is None:
        # one length for every row, each row its own cache sequence: nothing to vectorise
        if lengths + seqlen_new > capacity:
            _overflow(0, lengths, seqlen_new, capacity, page_size)
        if rotary_len is not None and lengths + rotary_reach > rotary_len:
            _rotary_short(rotary_len, lengths + rotary_reach)
        return lengths + seqlen_new
    n = np.full(b, lengths, dtype=np.int64) if isinstance(lengths, int) else lengths.numpy().astype(np.int64)
    ends = n + seqlen_new  # one past the last position each row writes or reads
    if n.min() < 0 or ends.max() > capacity:
        row = int(np.flatnonzero((n < 0) | (ends > capacity))[0])
        if n[row] < 0:
            raise ArgumentError(f"cache_seqlens[{row}] = {n[row]} must be >= 0")
        _overflow(row, n[row], seqlen_new, capacity, page_size)
    starts = np.zeros_like(n)
    if leftpad is not None:
        starts = leftpad.numpy().astype(np.int64)
        bad = (starts < 0) | (starts > n)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise ArgumentError(f"cache_leftpad[{row}] = {starts[row]} must be in [0, cache_seqlens[{row}] = {n[row]}]")
    if batch_idx is not None:
        rows = batch_idx.numpy()
        if rows.min() < 0 or rows.max() >= cache_rows:
            row = int(np.flatnonzero((rows < 0) | (rows >= cache_rows))[0])
            raise ArgumentError(f"cache_batch_idx[{row}] = {rows[row]} is not a sequence of k_cache (it holds "
                                f"{cache_rows})")
        if seqlen_new:
            _check_disjoint(rows[:, None], lambda r: f"sequence {r} of k_cache (cache_batch_idx)")
    if table is not None:
        pages = table.numpy()
        slot = np.arange(pages.shape[1])[None, :]  # (1, max_pages)
        reads = slot < (-(-ends // page_size))[:, None]  # (b, max_pages): the pages up to each row's end
        if leftpad is not None:
            reads &= slot >= (starts // page_size)[:, None]
        bad = reads & (pages.view(np.uint32) >= cache_rows)  # a negative page reads as a huge unsigned one
        if bad.any():
            row, col = (int(x) for x in np.argwhere(bad)[0])
            raise ArgumentError(f"block_table[{row}, {col}] = {pages[row, col]} is not a page of k_cache "
                                f"(num_blocks = {cache_rows}), and batch row {row} uses it")
        if seqlen_new:
            pos = n[:, None] + np.arange(seqlen_new)[None, :]  # (b, seqlen_new) written positions
            slots = np.take_along_axis(pages, pos // page_size, 1) * page_size + pos % page_size
            _check_disjoint(slots, lambda r: f"row {r % page_size} of page {r // page_size} (block_table)")
            _check_unread(slots, pages, reads, starts, ends, page_size, cache_rows)
    if rotary_len is not None and n.max() + rotary_reach > rotary_len:
        _rotary_short(rotary_len, n.max() + rotary_reach)
    return int((ends - starts).max())


def _overflow(row: int, held: int, seqlen_new: int, capacity: int, page_size: int):
    reach = (f"block_table reaches {capacity} ({capacity // page_size} pages of {page_size})" if page_size
             else f"k_cache holds {capacity} per sequence (k_cache.shape[1])")
    raise ArgumentError(f"cache overflow: batch row {row} holds {held} tokens (cache_seqlens) and appends "
                        f"{seqlen_new}, but {reach}")


def _rotary_short(rotary_len: int, reach: int):
    raise ArgumentError(f"rotary_cos/rotary_sin have {rotary_len} positions, but the new tokens and queries "
                        f"reach position {reach - 1}")


def _check_unread(slots, pages, reads, starts, ends, page_size: int, cache_rows: int) -> None:
    """slots (b, seqlen_new): the page rows (page * page_size + row) each batch row appends to;
    pages (b, max_pages) with reads marking the pages each row reads (its written pages among
    them). No row may read a slot another row appends to. The common case is decided by counting:
    when the table entries the rows write through name that many distinct pages, and the read
    entries that land on those pages are no more than these entries, every written page is read by
    its writer alone. Otherwise the shared pages are looked at slot by slot."""
    b, s_new = slots.shape
    entries = int(((ends - 1) // page_size - (ends - s_new) // page_size + 1).sum())  # columns written through
    is_written = np.zeros(cache_rows, dtype=bool)
    is_written[slots.ravel() // page_size] = True
    hits = np.take(is_written, pages, mode="clip") & reads  # pages outside k_cache are never read
    if np.count_nonzero(is_written) == entries and np.count_nonzero(hits) == entries:
        return
    writer = np.repeat(np.arange(b), s_new)
    column = (((ends - s_new)[:, None] + np.arange(s_new)) // page_size).ravel()  # block_table column of a write
    written = {}  # page -> {page row: (the batch row appending to it, through which column)}
    for row, col, slot in zip(writer, column, slots.ravel()):
        written.setdefault(int(slot) // page_size, {})[int(slot) % page_size] = (int(row), int(col))
    for r, c in zip(*np.nonzero(hits)):
        page = int(pages[r, c])
        lo, hi = max(int(starts[r]) - c * page_size, 0), min(int(ends[r]) - c * page_size, page_size)
        for slot, (w, wc) in written[page].items():
            if w != r and lo <= slot < hi:
                raise ArgumentError(f"batch row {w} would append into row {slot} of page {page} (block_table), which "
                                    f"batch row {r} reads: a page shared that far cannot take new keys")
            if wc != c and lo <= slot < hi:
                raise ArgumentError(f"batch row {r} lists page {page} in columns {c} and {wc} of block_table: its "
                                    f"append through column {wc} would overwrite keys it reads through column {c}")


def _check_disjoint(written: np.ndarray, where) -> None:
    """written (b, n): the cache rows each batch row appends to; none may be written twice (the
    second write would replace the first). where(row) names a cache row for the message."""
    if written.size < 2:
        return
    flat = written.ravel()
    order = np.argsort(flat, kind="stable")
    same = np.flatnonzero(flat[order[1:]] == flat[order[:-1]])
    if same.size:
        j = int(same[0])
        a, b = (int(order[i]) // written.shape[1] for i in (j, j + 1))
        cache_row = where(int(flat[order[j]]))
        raise ArgumentError(f"batch rows {a} and {b} would both append into {cache_row}: one write would replace "
                            f"the other" if a != b else
                            f"batch row {a} would append into {cache_row} twice (its block_table lists a page twice)")
