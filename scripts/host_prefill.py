"""Host time of one training call: flash_attn_func's forward and backward, piece by piece (GPU machine).

    PYTHONPATH=src python scripts/host_prefill.py [OUT_FILE] [--profile]

A shape whose kernels take a few microseconds (1 x 128 tokens, 4 heads, d=128, bf16, causal), so
that a loop of calls runs at the host's speed. Rows, us per call: the eager loop with the real
launches, then with every cached launch a no-op (bench.small.launches_stubbed: the host path up to
the driver's launch call), for flash_attn_func with inputs that require grad (forward), forward +
backward, the same packed (flash_attn_varlen_func), and SDPA-flash's forward and forward + backward
beside them. With --profile, cProfile of the stubbed forward and of the stubbed forward + backward,
top entries by own time.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys

import torch

import flashtile
from flashtile.bench import harness
from flashtile.bench.small import launches_stubbed


def main(out=None, profile=False):
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; 1 x 128 x 4 x 128 bf16 causal; us per call"]

    def row(name, fn, n=2000):
        for _ in range(20):
            fn()
        lines.append(f"{name:60s} {harness.wall_us(fn, n):8.1f}")
        print(lines[-1], flush=True)

    q, k, v = (torch.randn(1, 128, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    cu = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    qp, kp, vp, dop = (t.detach()[0].requires_grad_(t.requires_grad) for t in (q, k, v, do))
    calls = {
        "flash_attn_func forward": lambda: flashtile.flash_attn_func(q, k, v, causal=True),
        "flash_attn_func forward + backward": lambda: torch.autograd.grad(
            flashtile.flash_attn_func(q, k, v, causal=True), (q, k, v), do),
        "flash_attn_varlen_func forward": lambda: flashtile.flash_attn_varlen_func(qp, kp, vp, cu, cu, 128, 128,
                                                                                    causal=True),
        "flash_attn_varlen_func forward + backward": lambda: torch.autograd.grad(
            flashtile.flash_attn_varlen_func(qp, kp, vp, cu, cu, 128, 128, causal=True), (qp, kp, vp), dop),
    }
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)

    row("sdpa-flash forward (peer)", sdpa)
    row("sdpa-flash forward + backward (peer)", lambda: torch.autograd.grad(sdpa(), (q, k, v), do))
    for name, fn in calls.items():
        row(name, fn)
    with launches_stubbed():
        for name, fn in calls.items():
            row(f"{name}, launches stubbed", fn)
        if profile:
            for name in ("flash_attn_func forward", "flash_attn_func forward + backward"):
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(2000):
                    calls[name]()
                pr.disable()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
                lines.append(f"===== cProfile, {name}, launches stubbed, 2000 calls\n{s.getvalue()}")
                print(lines[-1], flush=True)
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--profile"]
    main(args[0] if args else None, "--profile" in sys.argv)
