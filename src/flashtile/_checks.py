"""Argument checks shared by the public API and the reference code.

Every failure names the argument, the expected value and the given one, so a user can fix the call
without reading our source.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEADDIM = 256


def check_tensor(name: str, t, ndim: int, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {t.dtype}")


def check_same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """`t` must share dtype and device with `ref`."""
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on the device of {ref_name} ({ref.device}), got {t.device}")


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
        raise ValueError(f"k must have batch size {b} (as q), got {bk}")
    if dk != d:
        raise ValueError(f"k must have head dim {d} (as q), got {dk}")
    if tuple(v.shape) != (b, sk, hk, d):
        raise ValueError(f"v must have shape {(b, sk, hk, d)} (as k), got {tuple(v.shape)}")
    if d < 1 or d > MAX_HEADDIM:
        raise ValueError(f"head dim must be in 1..{MAX_HEADDIM}, got {d}")
    if hk < 1 or h % hk != 0:
        raise ValueError(
            f"the number of query heads ({h}) must be a multiple of the number of key/value heads ({hk})"
        )
    return b, sq, sk, h, hk, d


def check_window(window_size, causal: bool) -> tuple[int, int]:
    """Normalise (left, right): -1 means unbounded; causal forces right = 0."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = (int(x) for x in window_size)
    for side, x in (("left", left), ("right", right)):
        if x < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1 = unbounded), got {x}")
    if causal:
        right = 0
    return left, right


def check_softcap(softcap: float) -> float:
    softcap = float(softcap)
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    return softcap


def check_alibi(alibi_slopes, b: int, h: int, device) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((h,), (b, h)):
        raise ValueError(f"alibi_slopes must have shape ({h},) or ({b}, {h}), got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes must be on {device}, got {alibi_slopes.device}")


def check_dropout_p(dropout_p: float) -> float:
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return dropout_p


def default_scale(softmax_scale, d: int) -> float:
    if softmax_scale is None:
        return d ** -0.5
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale) or softmax_scale == 0:
        raise ValueError(f"softmax_scale must be a finite non-zero number, got {softmax_scale}")
    return softmax_scale
