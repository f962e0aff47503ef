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
