"""Host time of a training call without a GPU: flash_attn_func's forward and forward + backward as
on an H100 (the dispatch told it is one, so the Hopper kernels are planned), every launch a no-op.

    python scripts/host_prefill_cpu.py

1 x 128 tokens, 4 heads, d=128, bf16, causal, inputs that require grad; medians of 7 loops of
1000 calls, us per call. What is timed is the Python host path up to the launch: the checks, the
plan lookup, the outputs' allocation, autograd, the launchers' arguments. The backward's dQ
scaling (torch.mul) runs on the CPU here, so the backward's row is an upper bound.
"""

import os
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors reach the kernels' host path
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch  # noqa: E402
from compile_keys import recording  # noqa: E402

import flashtile  # noqa: E402
from flashtile import api  # noqa: E402
from flashtile.ops import _launch  # noqa: E402


def per_call_us(fn, calls=1000, loops=7) -> float:
    for _ in range(200):
        fn()
    runs = []
    for _ in range(loops):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(runs)


def main():
    with recording(as_h100=True):
        _launch.Prepared.__call__ = lambda self, tensors, scalars, stream=None, key=None: None
        saved = api.backend_for, api.interpreter_on
        api.backend_for, api.interpreter_on = (lambda t: "triton"), (lambda: True)
        try:
            x = [torch.randn(1, 128, 4, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
            do = torch.randn_like(x[0])
            fwd = per_call_us(lambda: flashtile.flash_attn_func(*x, causal=True))
            both = per_call_us(lambda: torch.autograd.grad(flashtile.flash_attn_func(*x, causal=True), x, do))
        finally:
            api.backend_for, api.interpreter_on = saved
    print(f"torch {torch.__version__}, CPU, launches stubbed: forward {fwd:.1f} us, forward + backward "
          f"{both:.1f} us, backward {both - fwd:.1f} us a call")


if __name__ == "__main__":
    main()
