"""Tile sweep for the prefill kernels on the GPU: which BlockConfig per kernel and head dim.

Replaces one configs function at a time (forward, dK/dV, dQ) and times the forward or the whole
backward at bf16, seqlen 4096, batch x seqlen = 16k, nheads x d = 2048, causal and not. Prints a
table and writes sweep_<kernels>_d<ds>_s<seqlens>.json (after every row) to the folder given as the
first argument, with each compiled kernel's registers and spills.

    PYTHONPATH=src python scripts/sweep_prefill.py OUTDIR [d,d,...] [seqlen,seqlen,...] [kernel,...]
"""

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
    # dK/dV and dQ: the spill-free tiles at d=128 (BLOCK_N = 32, found by compiling for sm_90 off
    # the GPU, ptxas -v) measured 1.5-2.5x slower than the spilling (64, 128) / (64, 64) ones
    # (sweep_dkdv_d64-128_s4096.json), so these lists stay near those
    "dkdv": {
        64: [C(32, 128, 4, 3), C(64, 64, 4, 2), C(32, 128, 8, 2), C(64, 128, 8, 1), C(64, 128, 8, 2),
             C(64, 128, 8, 3), C(32, 64, 4, 3)],
        128: [C(64, 128, 8, 1), C(64, 64, 4, 2), C(64, 128, 8, 2), C(64, 128, 8, 3), C(32, 128, 8, 2),
              C(64, 64, 4, 3), C(32, 64, 4, 2)],
        256: [C(32, 64, 4, 1), C(32, 64, 8, 2), C(32, 64, 8, 1), C(64, 64, 8, 1), C(32, 32, 4, 2),
              C(64, 32, 4, 1), C(16, 64, 8, 2), C(32, 128, 8, 1)],
    },
    "dq": {
        64: [C(64, 32, 4, 3), C(128, 64, 8, 2), C(64, 64, 8, 3), C(128, 32, 8, 2), C(64, 64, 4, 2),
             C(128, 64, 8, 3)],
        128: [C(64, 64, 4, 2), C(128, 64, 8, 3), C(128, 64, 8, 2), C(64, 64, 4, 3), C(128, 128, 8, 2)],
        256: [C(64, 32, 4, 1), C(64, 64, 8, 1), C(32, 32, 4, 2), C(64, 32, 8, 2), C(64, 64, 8, 2),
              C(128, 32, 8, 2), C(32, 64, 4, 2)],
    },
}
KERNELS = {"forward": "_fwd_kernel", "dkdv": "_dkdv_kernel", "dq": "_dq_kernel"}
PATCH = {"forward": "forward_config", "dkdv": "dkdv_config", "dq": "dq_config"}


def time_config(kernel, cfg, d, causal, seqlen=4096, tokens=16384):
    b, h = tokens // seqlen, 2048 // d
    q, k, v, do = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale, window = d ** -0.5, (None, 0 if causal else None)
    original = getattr(configs, PATCH[kernel])
    setattr(configs, PATCH[kernel], lambda *a, **k: cfg)
    jit = getattr(forward if kernel == "forward" else backward, KERNELS[kernel])
    jit.__dict__.pop("_flashtile_launches", None)  # ops._launch's cache: only this config's kernel
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
    compiled = [c for c, _ in jit.__dict__.get("_flashtile_launches", {}).values()]
    regs = {"regs": compiled[0].n_regs, "spills": compiled[0].n_spills} if compiled else {}
    return ms, f / (2 if causal else 1) / ms * 1e-9, regs


def main():
    out_dir = sys.argv[1]
    ds = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [64, 128]
    seqlens = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [4096]
    kernels = sys.argv[4].split(",") if len(sys.argv) > 4 else list(CANDIDATES)
    rows, env = [], harness.environment()
    name = f"sweep_{'-'.join(kernels)}_d{'-'.join(map(str, ds))}_s{'-'.join(map(str, seqlens))}.json"
    path = os.path.join(out_dir, name)  # rewritten after every row
    for kernel in kernels:
        for d in ds:
            for seqlen in seqlens:
                for causal in (False, True):
                    for cfg in CANDIDATES[kernel][d]:
                        try:
                            ms, tflops, regs = time_config(kernel, cfg, d, causal, seqlen)
                        except Exception as e:
                            print(f"{kernel:7s} d={d} s={seqlen} causal={causal:d} {tuple(cfg)}: {repr(e)[:100]}",
                                  flush=True)
                            continue
                        rows.append(dict(kernel=kernel, d=d, seqlen=seqlen, causal=causal, config=list(cfg),
                                         ms=ms, tflops=tflops, **regs))
                        print(f"{kernel:7s} d={d:3d} s={seqlen:5d} causal={causal:d} {tuple(cfg)!s:20s} "
                              f"{ms:7.3f} ms {tflops:6.1f} TFLOP/s {regs}", flush=True)
                        harness.write_result(path, {"env": env, "rows": rows}, quiet=True)
    best = {}
    for r in rows:
        key = (r["kernel"], r["d"], r["seqlen"], r["causal"])
        if key not in best or r["tflops"] > best[key]["tflops"]:
            best[key] = r
    for key, r in sorted(best.items()):
        print("BEST", key, r["config"], f"{r['tflops']:.1f}")


if __name__ == "__main__":
    main()
