"""Test helpers shared by the test suite, the benchmarks and `flashtile demo`.

The 2x rule (flash-attn's, DESIGN.md Numerics): a kernel passes when its max error against the
float64 oracle is at most twice the error of plain PyTorch in the same dtype, plus a tiny atol.
"""

from __future__ import annotations

import torch


def max_err(x: torch.Tensor, oracle: torch.Tensor) -> float:
    """Max abs error of x against oracle; inf when x has a NaN where the oracle has none."""
    diff = (x.double() - oracle.double()).abs()
    both_inf = torch.isinf(x.double()) & torch.isinf(oracle.double()) & (torch.sign(x.double()) == torch.sign(oracle.double()))
    diff = diff.masked_fill(both_inf, 0.0)
    return float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0


def assert_2x(name: str, got: torch.Tensor, oracle: torch.Tensor, baseline: torch.Tensor,
              atol: float = 1e-5, factor: float = 2.0) -> None:
    """got and baseline against the float64 oracle; fails with the worst elements shown.

    factor = 2 is the project's rule; a test that relaxes it says why next to the call.
    """
    if got.shape != oracle.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != oracle {tuple(oracle.shape)}")
    err = max_err(got, oracle)
    base = max_err(baseline, oracle)
    bound = factor * base + atol
    if not err <= bound:
        diff = (got.double() - oracle.double()).abs().nan_to_num(nan=float("inf")).flatten()
        worst = torch.topk(diff, min(5, diff.numel())).indices
        idx = [tuple(int(i) for i in torch.unravel_index(w, got.shape)) for w in worst]
        rows = ", ".join(f"{i}: got {got[i].item():.6g} want {oracle[i].item():.6g}" for i in idx)
        raise AssertionError(
            f"{name}: max error {err:.3g} > {factor:g} x baseline {base:.3g} + {atol:g}; worst: {rows}")


def poison(*tensors: torch.Tensor) -> None:
    """Fill outputs with NaN before a kernel writes them, so an unwritten element fails."""
    for t in tensors:
        t.fill_(float("nan"))


def randn(*shape, dtype=torch.float16, device="cpu", requires_grad=False, generator=None) -> torch.Tensor:
    """Random normal test input (never zeros or constants)."""
    t = torch.randn(*shape, dtype=torch.float32, device=device, generator=generator).to(dtype)
    return t.requires_grad_(requires_grad)
