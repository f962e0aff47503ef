"""Tile sweep for the prefill kernels on the GPU: which BlockConfig per kernel and head dim.

Replaces one configs function at a time (forward, dK/dV, dQ) and times the forward or the whole
backward at bf16, seqlen 4096, batch x seqlen = 16k, nheads x d = 2048, causal and not. Prints a
table and writes sweep.json to the folder given as the first argument.

    PYTHONPATH=src python scripts/sweep_prefill.py OUTDIR [d,d,...] [seqlen,seqlen,...] [kernel,...]
"""

import json
import os
import sys

import torch

from flashtile.bench import harness
from flashtile.ops import backward, configs, forward
from flashtile.ops.configs import BlockConfig

C = BlockConfig
CANDIDATES = {
    "forward": {
        64: [C(128, 64, 4, 3), C(128, 64, 8, 3), C(128, 128, 8, 3), C(128, 128, 8, 2), C(64, 64, 4, 3),
             C(128, 32, 4, 4), C(64, 128, 4, 3), C(128, 128, 4, 3)],
        128: [C(128, 64, 8, 3), C(128, 128, 8, 3), C(128, 64, 4, 3), C(64, 64, 4, 3), C(128, 32, 4, 3),
              C(128, 128, 8, 2), C(64, 128, 4, 3), C(128, 64, 8, 4)],
        256: [C(64, 64, 4, 2), C(128, 64, 8, 2), C(64, 32, 4, 3), C(128, 32, 8, 3), C(64, 64, 8, 2),
              C(128, 64, 8, 3), C(64, 32, 8, 2)],
    },
    "dkdv": {
        64: [C(64, 128, 8, 2), C(32, 128, 8, 2), C(64, 64, 4, 2), C(32, 64, 4, 3), C(64, 128, 8, 3),
             C(128, 128, 8, 2), C(32, 128, 4, 3)],
        128: [C(64, 128, 8, 2), C(32, 128, 8, 2), C(64, 64, 4, 2), C(32, 64, 4, 2), C(64, 128, 8, 1),
              C(32, 128, 8, 3), C(64, 64, 8, 3)],
        256: [C(32, 64, 4, 1), C(32, 64, 8, 2), C(32, 64, 8, 1), C(64, 64, 8, 1), C(32, 32, 4, 2),
              C(64, 32, 4, 1), C(16, 64, 8, 2), C(32, 128, 8, 1)],
    },
    "dq": {
        64: [C(128, 64, 8, 2), C(128, 32, 4, 2), C(64, 64, 4, 2), C(128, 128, 8, 2), C(64, 32, 4, 3),
             C(128, 64, 8, 3)],
        128: [C(128, 64, 8, 2), C(128, 32, 8, 2), C(64, 64, 4, 2), C(128, 32, 4, 3), C(64, 32, 4, 2),
              C(128, 64, 8, 3)],
        256: [C(64, 32, 4, 1), C(64, 64, 8, 1), C(32, 32, 4, 2), C(64, 32, 8, 2), C(64, 64, 8, 2),
              C(128, 32, 8, 2), C(32, 64, 4, 2)],
    },
}
PATCH = {"forward": "forward_config", "dkdv": "dkdv_config", "dq": "dq_config"}


def time_config(kernel, cfg, d, causal, seqlen=4096, tokens=16384):
    b, h = tokens // seqlen, 2048 // d
    q, k, v, do = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale, window = d ** -0.5, (None, 0 if causal else None)
    original = getattr(configs, PATCH[kernel])
    setattr(configs, PATCH[kernel], lambda *a, **k: cfg)
    try:
        out, lse = forward.attention_forward(q, k, v, scale, window)
        if kernel == "forward":
            ms = harness.bench_ms(lambda: forward.attention_forward(q, k, v, scale, window))
            f = 4 * b * h * seqlen * seqlen * d
        else:
            backward.attention_backward(do, q, k, v, out, lse, scale, window)
            ms = harness.bench_ms(lambda: backward.attention_backward(do, q, k, v, out, lse, scale, window))
            f = 2.5 * 4 * b * h * seqlen * seqlen * d
    finally:
        setattr(configs, PATCH[kernel], original)
    return ms, f / (2 if causal else 1) / ms * 1e-9


def main():
    out_dir = sys.argv[1]
    ds = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [64, 128]
    seqlens = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [4096]
    kernels = sys.argv[4].split(",") if len(sys.argv) > 4 else list(CANDIDATES)
    rows = []
    for kernel in kernels:
        for d in ds:
            for seqlen in seqlens:
                for causal in (False, True):
                    for cfg in CANDIDATES[kernel][d]:
                        try:
                            ms, tflops = time_config(kernel, cfg, d, causal, seqlen)
                        except Exception as e:
                            print(f"{kernel:7s} d={d} s={seqlen} causal={causal:d} {tuple(cfg)}: {repr(e)[:100]}",
                                  flush=True)
                            continue
                        rows.append(dict(kernel=kernel, d=d, seqlen=seqlen, causal=causal, config=list(cfg),
                                         ms=ms, tflops=tflops))
                        print(f"{kernel:7s} d={d:3d} s={seqlen:5d} causal={causal:d} {tuple(cfg)!s:20s} "
                              f"{ms:7.3f} ms {tflops:6.1f} TFLOP/s", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    name = f"sweep_d{'-'.join(map(str, ds))}_s{'-'.join(map(str, seqlens))}.json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump({"env": harness.environment(), "rows": rows}, f, indent=1)
    best = {}
    for r in rows:
        key = (r["kernel"], r["d"], r["seqlen"], r["causal"])
        if key not in best or r["tflops"] > best[key]["tflops"]:
            best[key] = r
    for key, r in sorted(best.items()):
        print("BEST", key, r["config"], f"{r['tflops']:.1f}")


if __name__ == "__main__":
    main()
