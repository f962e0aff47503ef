"""Cold start: the first forward and backward of a configuration in a fresh process (GPU machine).

    PYTHONPATH=src python scripts/cold_start.py [OUT_FILE] [--fa4]

Each row runs in a process of its own: import, inputs, then the first forward and the first
backward of one configuration (bf16, 2 x 4096 tokens, 16 heads, synchronised), seconds each; then
calls at other lengths and batches in the same process (1 x 5123, 3 x 17, 1 x 1, 2 x 127, 1 x
65537), their total seconds and the kernels Triton compiled for them (none expected). flashtile
runs twice, with an empty Triton cache (TRITON_CACHE_DIR a new folder: every kernel compiled) and
with the cache the first run left; FlashAttention-4 (--fa4, when flash_attn.cute imports) keeps
no cache across processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CONFIGS = {"d128-causal": dict(d=128, causal=True), "d64-full": dict(d=64, causal=False),
           "d128-causal-varlen": dict(d=128, causal=True, varlen=True)}
OTHERS = ((1, 5123), (3, 17), (1, 1), (2, 127), (1, 65537))


def child(impl: str, name: str) -> None:
    t0 = time.perf_counter()
    import torch
    import triton

    compiled = []

    def hook(*args, **kwargs):  # sees every compilation; False: compile as usual
        compiled.append(kwargs["fn"].name)
        return False

    triton.knobs.runtime.jit_cache_hook = hook
    if impl == "fa4":
        from flash_attn.cute import flash_attn_func as fa4
        from flash_attn.cute import flash_attn_varlen_func as fa4_varlen
    else:
        import flashtile
    cfg = CONFIGS[name]
    d, causal, varlen = cfg["d"], cfg["causal"], cfg.get("varlen", False)

    def call(b, s):
        if varlen:
            cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
            q, k, v = (torch.randn(b * s, 16, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            if impl == "fa4":
                out = fa4_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s,
                                 causal=causal)[0]
            else:
                out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, s, s, causal=causal)
        else:
            q, k, v = (torch.randn(b, s, 16, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            out = fa4(q, k, v, causal=causal)[0] if impl == "fa4" else flashtile.flash_attn_func(q, k, v,
                                                                                                   causal=causal)
        torch.cuda.synchronize()
        return out, (q, k, v)

    imported = time.perf_counter()
    t = time.perf_counter()
    out, leaves = call(2, 4096)
    fwd = time.perf_counter() - t
    t = time.perf_counter()
    torch.autograd.grad(out, leaves, torch.randn_like(out))
    torch.cuda.synchronize()
    bwd = time.perf_counter() - t
    first = len(compiled)
    t = time.perf_counter()
    for b, s in OTHERS:
        out, leaves = call(b, s)
        torch.autograd.grad(out, leaves, torch.randn_like(out))
    torch.cuda.synchronize()
    others = time.perf_counter() - t
    print(json.dumps(dict(impl=impl, config=name, import_s=imported - t0, first_fwd_s=fwd, first_bwd_s=bwd,
                          compiled_first=first, others_s=others, compiled_others=compiled[first:])))


def main(out=None, fa4=False) -> None:
    lines = []
    runs = [("flashtile", "cold cache"), ("flashtile", "warm cache")] + ([("fa4", "")] if fa4 else [])
    for name in CONFIGS:
        cache = tempfile.mkdtemp(prefix="triton-cache-")  # empty for the cold run, which fills it for the warm one
        for impl, note in runs:
            env = dict(os.environ, PYTHONUNBUFFERED="1", TRITON_CACHE_DIR=cache)
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", impl, name], env=env,
                                 capture_output=True, text=True, timeout=900)
            if run.returncode != 0:
                lines.append(f"{impl} {name} {note}: failed {run.stderr[-400:]!r}")
            else:
                r = json.loads(run.stdout.strip().splitlines()[-1])
                lines.append(f"{impl:9s} {name:20s} {note:10s} first forward {r['first_fwd_s']:6.2f} s, first backward "
                             f"{r['first_bwd_s']:6.2f} s ({r['compiled_first']} kernels compiled); other lengths "
                             f"{r['others_s']:5.2f} s, compiled {r['compiled_others']}")
            print(lines[-1], flush=True)
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3])
    else:
        args = [a for a in sys.argv[1:] if a != "--fa4"]
        main(args[0] if args else None, "--fa4" in sys.argv)
