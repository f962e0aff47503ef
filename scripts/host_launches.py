"""Host time of a decoding call's launches, the variants interleaved (GPU machine).

    PYTHONPATH=src python scripts/host_launches.py [OUT_FILE]

A tiny cache (1 x 256 tokens, 16 q / 2 kv heads, d=128, fp16) keeps every kernel at a few µs, so
each loop is host-bound and its wall time per call is host time. The rows take turns within each
of ROUNDS rounds (loops of CALLS calls) and each reports its best and median loop: this machine's
host speed drifts by tens of percent within a run, so rows timed one after the other are not
comparable, rows of one round are.

Rows: torch SDPA (enable_gqa) as the peer; DecodePlan.run with one split, with 4 (the merge fused
into the split kernel) and with 16 (the combine kernel: two launches); flash_attn_with_kvcache with
one split and with 16; the split and the combine launch of the 16-split plan alone through their
Prepared launches, and through the compiled launcher with every argument ready (what no Python
around a launch can go below); the output's allocation.
"""

from __future__ import annotations

import statistics
import sys

import torch

import flashtile
from flashtile.bench import harness
from flashtile.ops import _launch

ROUNDS, CALLS = 12, 300


def captured(prepared: _launch.Prepared, call):
    """(tensors, scalars, stream, key) of prepared's launch inside call()."""
    seen = {}
    real = type(prepared).__call__

    def spy(self, tensors, scalars, stream=None, key=None):
        if self is prepared:
            seen["args"] = (tensors, scalars, stream, key)
        return real(self, tensors, scalars, stream, key)

    type(prepared).__call__ = spy
    try:
        call()
    finally:
        type(prepared).__call__ = real
    return seen["args"]


def ready_launch(prepared: _launch.Prepared, args):
    """The compiled launcher's call of prepared with args, every argument computed beforehand."""
    tensors, scalars, stream, key = args
    every = tensors + prepared.tensors
    device = every[0].get_device()
    run, function, head, tail, boxes = prepared.kernel._flashtile_launches[(prepared._id, device, scalars, key)]
    g0, g1, g2 = prepared._grid3
    bound = (g0, g1, g2, stream, function, *head, *_launch._pointers(every, boxes), *scalars, *prepared.scalars,
             *tail)
    return lambda: run(*bound)


def main(out=None):
    b, ctx, h, hk, d = 1, 256, 16, 2, 128
    dev = torch.device("cuda")
    q = torch.randn(b, 1, h, d, device=dev, dtype=torch.float16)
    kc, vc = (torch.randn(b, ctx, hk, d, device=dev, dtype=torch.float16) for _ in range(2))
    lengths = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    plans = {n: flashtile.DecodePlan(b, h, kc.shape, lengths, dtype=q.dtype, device=dev, num_splits=n)
             for n in (1, 4, 16)}
    assert plans[4]._launch.fused and plans[16]._launch.combine is not None
    rows = {
        "sdpa enable_gqa (peer)": lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), enable_gqa=True),
        "DecodePlan.run, 1 split": lambda: plans[1].run(q, kc, vc),
        "DecodePlan.run, 4 splits (fused merge)": lambda: plans[4].run(q, kc, vc),
        "DecodePlan.run, 16 splits (combine kernel)": lambda: plans[16].run(q, kc, vc),
        "flash_attn_with_kvcache, 1 split": lambda: flashtile.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=lengths, num_splits=1),
        "flash_attn_with_kvcache, 16 splits": lambda: flashtile.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=lengths, num_splits=16),
        "torch.empty_like (the output)": lambda: torch.empty_like(q, memory_format=torch.contiguous_format),
    }
    launch = plans[16]._launch
    for part in ("split", "combine"):
        prepared = getattr(launch, part)
        args = captured(prepared, lambda: plans[16].run(q, kc, vc))
        rows[f"  16 splits: the {part} launch (Prepared)"] = lambda p=prepared, a=args: p(*a)
        rows[f"  16 splits: the {part} launch, arguments ready"] = ready_launch(prepared, args)
    for fn in rows.values():
        fn()
    harness.synchronize()
    loops = {name: [] for name in rows}
    for _ in range(ROUNDS):
        for name, fn in rows.items():
            loops[name].append(harness.wall_us(fn, CALLS, warmup=10))
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; b={b} ctx={ctx} h={h}/{hk} d={d} fp16; "
             f"{ROUNDS} rounds of {CALLS} calls, rows interleaved; us per call: best / median loop"]
    lines += [f"{name:52s} {min(t):7.1f} / {statistics.median(t):7.1f}" for name, t in loops.items()]
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
