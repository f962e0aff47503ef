"""What ALiBi costs the Hopper kernels, on the H100.

    PYTHONPATH=src python scripts/alibi_costs.py slopes   # forward TFLOP/s: no ALiBi, zero, standard, tiny slopes
    PYTHONPATH=src python scripts/alibi_costs.py rows     # d=64 backward: 64-row against 128-row Q blocks

bf16, 16k tokens at 4k, heads x d = 2048, the prefill harness's medians. `slopes`: at d 64 / 128 /
256, causal and not, the forward with slopes None, zeros, 2^(-8 (i + 1) / h) and those / 1000, then
None again (a cost that follows the slopes' size would be the exponentials of far keys; one that
does not is the bias's instructions). `rows`: the d=64 ALiBi backward with the Q blocks
configs.hopper_backward_tiles gives (128 rows) against 64-row ones (what softcap and dropout take
there), three alternating rounds.
"""

import sys

import torch

import flashtile
from flashtile.bench import harness
from flashtile.bench.prefill import alibi_slopes
from flashtile.ops import configs


def slopes() -> None:
    for d in (64, 128, 256):
        b, s, h = 4, 4096, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        std = alibi_slopes(h, "cuda")
        for causal in (False, True):
            f = 4 * b * h * s * s * d / (2 if causal else 1)
            cells = []
            for name, sl in (("none", None), ("zeros", torch.zeros_like(std)), ("std", std), ("std/1000", std / 1000),
                             ("none", None)):
                ms = harness.bench_ms(lambda: flashtile.flash_attn_func(q, k, v, causal=causal, alibi_slopes=sl))
                cells.append(f"{name} {f / ms * 1e-9:.0f}")
            print(f"d={d} causal={causal:d} fwd TFLOP/s: " + ", ".join(cells), flush=True)


def rows() -> None:
    tiles = configs.hopper_backward_tiles

    def rows64(d, dropout=False, softcap=False):
        return tiles(d, dropout, True)  # the 64-row blocks softcap takes at d=64

    b, s, h, d = 4, 4096, 32, 64
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    sl = alibi_slopes(h, "cuda")
    for causal in (False, True):
        f = 4 * b * h * s * s * d * 2.5 / (2 if causal else 1)
        res = {64: [], 128: []}
        for _ in range(3):
            for n in (64, 128):
                configs.hopper_backward_tiles = rows64 if n == 64 else tiles
                out = flashtile.flash_attn_func(q, k, v, causal=causal, alibi_slopes=sl)
                ms = harness.bench_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                res[n].append(f / ms * 1e-9)
        configs.hopper_backward_tiles = tiles
        print(f"causal={causal} bwd TFLOP/s 64 rows {[round(x) for x in res[64]]}  "
              f"128 rows {[round(x) for x in res[128]]}")


if __name__ == "__main__":
    {"slopes": slopes, "rows": rows}[sys.argv[1]]()
