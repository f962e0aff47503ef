"""Where a decoding call's device time goes: each kernel's duration and the call's span, by CUPTI.

    PYTHONPATH=src python scripts/profile_decode.py [SHAPES] [--calls N] [--json FILE] [--bare]

SHAPES: comma-separated BATCHxCONTEXT[xHEADSxKV_HEADS] (default: the seed shapes, 16 / 2 heads, d=128,
fp16). For each shape, over four rotating caches (so no call finds the last one's bytes in the L2),
times under torch.profiler: the read floor (bench decode's kernel that reads the cache once), SDPA
with enable_gqa, and flashtile.flash_attn_with_kvcache with cache_seqlens as a tensor. Prints per implementation
the mean duration of every kernel it launched and the mean span of a call (first kernel's start to
the last one's end, so a programmatic dependent launch's overlap is counted once), in microseconds.
--bare makes the same calls without torch.profiler, for ncu (which cannot share CUPTI with it):
    ncu -k regex:_split_kernel --launch-skip 8 -c 1 --section ... python scripts/profile_decode.py 1x65536 --bare
"""

import argparse
import json
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import flashtile
from flashtile.bench.decode import _read_floor, _sdpa_gqa

SHAPES = "256x256,128x512,16x4096,8x8192,2x32768,1x65536,1x131072"
ROTATE = 4


def parse(spec: str):
    parts = [int(x) for x in spec.split("x")]
    return (parts + [16, 2])[:4] if len(parts) == 2 else parts


def spans(prof, calls: int) -> tuple:
    """(mean us per kernel name, mean us per call span) from the profile's kernel events in start
    order; every call launches the same kernels, so call i is the i-th run of len(kernels) / calls."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    per_name = defaultdict(list)
    for e in kernels:
        per_name[e.name].append(e.time_range.elapsed_us())
    n = len(kernels) // calls
    call_spans = [kernels[i * n + n - 1].time_range.end - kernels[i * n].time_range.start for i in range(calls)]
    return ({k[:60]: sum(v) / len(v) for k, v in per_name.items()}, sum(call_spans) / calls)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="?", default=SHAPES)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--json", default=None)
    ap.add_argument("--bare", action="store_true", help="no torch.profiler (for ncu)")
    args = ap.parse_args(argv)
    dev, dt, d = "cuda", torch.float16, 128
    results = []
    for spec in args.shapes.split(","):
        b, s, h, hk = parse(spec)
        caches = [(torch.randn(b, s, hk, d, device=dev, dtype=dt), torch.randn(b, s, hk, d, device=dev, dtype=dt))
                  for _ in range(ROTATE)]
        q = torch.randn(b, 1, h, d, device=dev, dtype=dt)
        seqlens = torch.full((b,), s, dtype=torch.int32, device=dev)
        impls = {
            "read-floor": lambda k, v: _read_floor(q, k, v),
            "sdpa-gqa": lambda k, v: _sdpa_gqa(q, k, v),
            "flashtile": lambda k, v: flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens),
        }
        for name, fn in impls.items():
            for i in range(8):  # compile, warm the clocks
                fn(*caches[i % ROTATE])
            torch.cuda.synchronize()
            if args.bare:
                for i in range(args.calls):
                    fn(*caches[i % ROTATE])
                torch.cuda.synchronize()
                continue
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(args.calls):
                    fn(*caches[i % ROTATE])
                torch.cuda.synchronize()
            per_kernel, span = spans(prof, args.calls)
            row = dict(shape=spec, impl=name, kv_mb=2 * b * s * hk * d * 2 / 1e6, span_us=span, kernels=per_kernel)
            results.append(row)
            print(f"{spec:>14} {name:>10} span {span:7.1f} us  " +
                  "  ".join(f"{k[:40]} {v:.1f}" for k, v in per_kernel.items()), flush=True)
        del caches
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, argv=sys.argv, rows=results),
                      f, indent=1)


if __name__ == "__main__":
    main()
