"""Which kernel runs a call, and why: decided here and nowhere else.

The kernels, fastest first where they apply:
  hopper       the Gluon kernels for sm_90 (ops.forward_sm90, ops.backward_sm90, ops.decode_sm90)
  triton       the portable Triton kernels (ops.forward, ops.backward, ops.decode), any CUDA GPU
  interpreter  the same Triton kernels on CPU tensors under TRITON_INTERPRET=1 (tests, CPU users)
  reference    the PyTorch reference (flashtile.reference), on CPU tensors without the interpreter

Each choice is a `Choice`: the kernel, the reason it was taken, and for every faster kernel the
reason it was refused (FLA's backends carry verifiers that report this; here the verifiers are
configs.hopper_refusal for what a kernel takes at all, configs' tuning functions for where it is
the faster one, and each Hopper kernel file's `refusal` for the tensors it can address).

The choice functions are pure and cached: a call's plan (ops.prefill) asks once per description
of the call. `flashtile.explain(...)` returns the choices of a call without running it, and with
FLASHTILE_EXPLAIN=1 in the environment every new plan prints its choice to stderr. Host time: the
choice is part of a plan, so a call that replays a plan asks nothing here; `backend` is one cached
lookup per call.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import NamedTuple

import torch


class Choice(NamedTuple):
    kernel: str  # "hopper", "triton", "interpreter" or "reference"
    reason: str  # why this kernel
    refused: tuple = ()  # (kernel, why not) for each faster kernel that was considered

    def __str__(self) -> str:
        text = f"{self.kernel}: {self.reason}"
        for kernel, why in self.refused:
            text += f"; not {kernel}: {why}"
        return text


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def backend(device_type: str, forced: str | None, interpreted: bool) -> Choice:
    """Kernels or the PyTorch reference for tensors on a device of this type (DESIGN.md's rule):
    CUDA tensors run the kernels, CPU tensors the kernels under the interpreter where
    TRITON_INTERPRET=1 is set, else the reference. forced: flashtile.use_backend's choice."""
    if forced == "reference":
        return Choice("reference", "use_backend('reference')")
    if device_type == "cuda":
        return Choice("triton", "CUDA tensors" + (": use_backend('triton')" if forced == "triton" else ""))
    if device_type == "cpu" and interpreted:
        return Choice("interpreter", "CPU tensors under TRITON_INTERPRET=1")
    return Choice("reference", f"{device_type} tensors without TRITON_INTERPRET=1 (the kernels need CUDA or the "
                               "Triton interpreter)")


@functools.lru_cache(maxsize=1024)
def prefill_kernel(pass_: str, d: int, dtype: torch.dtype, device: torch.device, right_bounded: bool,
                   softcap: bool, dropout: bool, deterministic: bool, refusal: str | None,
                   generation: int) -> tuple[Choice, object]:
    """(the choice, the Hopper kernel's tiles or None) for a prefill pass ("forward" or
    "backward") at head dim d in dtype on device. right_bounded: any right bound of the mask (the
    causal tiles); refusal: why the Hopper kernel cannot address this call's tensors (its file's
    `refusal`), or None; generation: configs.generation (a replaced config function decides anew)."""
    from flashtile.ops import configs  # (importing this module imports no triton: backend() needs none)

    if pass_ == "forward":
        tiles = configs.hopper_forward_config(d, dtype, device, causal=right_bounded, softcap=softcap)
    else:
        tiles = configs.hopper_backward_config(d, dtype, device, dropout=dropout, softcap=softcap)
    if tiles is None:
        why_not = (configs.hopper_refusal(d, dtype, device)
                   or f"configs.hopper_{pass_}_config keeps the Triton kernel for these flags (docs/tuning.md)")
    elif pass_ == "backward" and deterministic and not configs.hopper_backward_ordered(d):
        why_not = "a deterministic dQ has no fixed order in the Hopper backward at head dims over 128"
    else:
        why_not = refusal
    if why_not is None:
        return Choice("hopper", f"sm_90, {str(dtype).replace('torch.', '')}, head dim {d}"), tiles
    if configs.on_gpu(device):
        return Choice("triton", "the portable kernel", (("hopper", why_not),)), None
    return Choice("interpreter", "CPU tensors under TRITON_INTERPRET=1", (("hopper", why_not),)), None


@functools.lru_cache(maxsize=1024)
def decode_kernel(rows: int, d: int, dtype: torch.dtype, device: torch.device, kv_rows: int, max_keys: int,
                  num_splits: int, generation: int) -> tuple[Choice, object]:
    """(the choice, the Gluon split kernel's (tiles, splits) or None) for a decoding step: rows query
    rows a KV head, kv_rows = batch x KV heads, max_keys the longest key range (configs.decode_warp_tiles'
    arguments); generation: configs.generation."""
    from flashtile.ops import configs

    warps = configs.decode_warp_tiles(rows, d, dtype, device, kv_rows, max_keys, num_splits)
    if warps is not None:
        return Choice("hopper", f"sm_90, {str(dtype).replace('torch.', '')}, head dim {d}, {rows} rows a KV head: "
                                "each warp on keys of its own"), warps
    why_not = configs.hopper_refusal(d, dtype, device) or (
        "configs.decode_warp_tiles keeps the Triton kernel here (it takes d=64/128, <= 16 rows a KV head, and a grid "
        "of at most one program an SM or long rows: docs/tuning.md)")
    portable = "triton" if configs.on_gpu(device) else "interpreter"
    return Choice(portable, "the portable split kernel", (("hopper", why_not),)), None


def report(pass_: str, description: str, choice: Choice) -> None:
    """With FLASHTILE_EXPLAIN set, print a new plan's choice (a plan is made once per description
    of a call, so this prints once per shape, not per call)."""
    if os.environ.get("FLASHTILE_EXPLAIN", "0") not in ("", "0"):
        print(f"flashtile {pass_} {description}: {choice}", file=sys.stderr)
