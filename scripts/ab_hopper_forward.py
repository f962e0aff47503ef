"""The Hopper forward against the Triton kernel it replaces, alternating in one process.

    PYTHONPATH=src python scripts/ab_hopper_forward.py [ROUNDS] [SHAPES]

bf16, 16k tokens, heads x d = 2048 (bench prefill's shapes); each round times both kernels
(triton.testing.do_bench) on the same inputs: the Hopper one forced wherever it can run (the
dispatch's thresholds aside), the Triton one by making configs.hopper_forward_config answer None.
SHAPES replaces the default list: d:causal:seqlen,... (e.g. 64:1:2048,64:0:1024).
Prints TFLOP/s per round and the ratio of medians:
alternating within a run separates the kernels from the clock drift that moves whole bench runs.
"""

import statistics
import sys

import torch
import triton

import flashtile
from flashtile.ops import configs

SHAPES = ((64, False, 16384), (64, False, 8192), (64, True, 16384), (64, False, 4096), (128, False, 16384))


def main(rounds: int = 5, shapes=SHAPES) -> None:
    hopper = configs.hopper_forward_config
    forced = lambda d, *a, **kw: configs.hopper_forward_tiles(d)  # noqa: E731
    for d, causal, seqlen in shapes:
        batch, heads = 16384 // seqlen, 2048 // d
        q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
        tflops = {"hopper": [], "triton": []}
        try:
            for _ in range(rounds):
                for name in tflops:
                    configs.hopper_forward_config = forced if name == "hopper" else (lambda *a, **kw: None)
                    ms = triton.testing.do_bench(lambda: flashtile.flash_attn_func(q, k, v, causal=causal),
                                                 warmup=25, rep=100)
                    tflops[name].append(flops / ms * 1e-9)
        finally:
            configs.hopper_forward_config = hopper
        ratio = statistics.median(tflops["hopper"]) / statistics.median(tflops["triton"])
        print(f"d={d} causal={int(causal)} s={seqlen}: hopper {' '.join(f'{x:.0f}' for x in tflops['hopper'])}"
              f" | triton {' '.join(f'{x:.0f}' for x in tflops['triton'])} | median ratio {ratio:.3f}", flush=True)


if __name__ == "__main__":
    shapes = SHAPES
    if len(sys.argv) > 2:
        shapes = [(int(d), c == "1", int(s)) for d, c, s in (x.split(":") for x in sys.argv[2].split(","))]
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, shapes)
