"""Benchmark harness: medians from do_bench, the two ceilings, result files tagged with versions.

Protocol (BENCHMARKS.md): peers are timed in the same process and run as ours; every result file
names the GPU, torch and triton versions, the date and the exact command.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time

import torch


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def gpu_slug() -> str:
    """Folder name for benchmarks/results/<gpu>/, e.g. 'h100' for 'NVIDIA H100 80GB HBM3'."""
    name = gpu_name().lower()
    for known in ("h100", "h200", "a100", "b200", "l40s", "a10g", "l4"):
        if known in name:
            return known
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def environment() -> dict:
    import triton

    return {
        "gpu": gpu_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
    }


def command_line() -> str:
    """The command that is running, as someone would retype it (`python -m ...` for modules)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    prog = f"python -m {spec.name}" if spec is not None and spec.name else os.path.basename(sys.argv[0])
    return " ".join([prog] + [shlex.quote(a) for a in sys.argv[1:]])


def fa4_module():
    """FlashAttention-4's interface (flash_attn.cute: CuTe DSL), or None when it does not import
    (../shared/tools/fa4_peer.sh brings it to the GPU machine)."""
    try:
        import flash_attn.cute as fa4
    except Exception:  # not installed, or its CuTe DSL / CUDA bindings fail to load: a peer we go without
        return None
    return fa4


def bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of fn() (triton.testing.do_bench; warmup and rep are milliseconds)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def replay_ms(graph, rep: float = 100.0) -> float:
    """Median milliseconds of graph.replay() over back-to-back replays for about rep milliseconds
    (as do_bench's rep), CUDA events around each, after one untimed replay. No L2 flush in
    between, where do_bench zeroes 256 MB before each run: the memset's last lines are still dirty
    in L2 when the run starts, and writing them back costs the run bandwidth (on the H200 ~9 us a
    run: 0.7-0.9 us a call on bench decode's graphs of ten calls over 67 MB caches, 1.8-2.0 on its
    graphs of five over 134 MB; scripts/graph_timing.py). For a graph whose calls rotate over inputs
    larger than L2 in all, which keeps them out of it already."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    synchronize()
    replays = max(10, int(rep / max(start.elapsed_time(end), 1e-3)))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def synchronize() -> None:
    """Wait for the GPU, where there is one (scripts/profile_host.py also times host paths on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synchronisations(fn) -> dict:
    """{where: count} of the device synchronisations fn() makes (torch.cuda.set_sync_debug_mode):
    "file:function <- caller <- caller" of the line that asked for each. Call it once fn's first
    run is behind it (compilation and first-use caches synchronise too)."""
    import collections
    import traceback
    import warnings

    seen = collections.Counter()

    def note(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        seen[" <- ".join(f"{f.filename.split('/')[-1]}:{f.name}" for f in stack[-3:][::-1])] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode(1)
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return {where: n for where, n in seen.items() if "set_sync_debug_mode" not in where}


def capture(fn, warmup: int = 1):
    """(graph, what fn() returned while captured): fn() first runs warmup times on a side stream,
    so compilation, launch caches and the allocator's first requests stay out of the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def wall_us(call, n: int = 50, warmup: int = 0) -> float:
    """Wall-clock microseconds per call of call() run n times back to back (host time included),
    after warmup untimed calls."""
    for _ in range(warmup):
        call()
    synchronize()
    start = time.perf_counter()
    for _ in range(n):
        call()
    synchronize()
    return (time.perf_counter() - start) / n * 1e6


def ceilings() -> dict:
    """The two ceilings of this GPU, measured now: copy GB/s (read + write) and bf16 matmul TFLOP/s."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    del src, dst
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench_ms(lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_GBps": 2 * n / copy_ms * 1e-6, "matmul_bf16_TFLOPs": 2 * m**3 / mm_ms * 1e-9}


def write_result(path: str, payload: dict, quiet: bool = False) -> None:
    """Write payload as JSON; through a temporary file, so a run killed mid-write leaves the last
    complete version (the benchmarks rewrite their file after every row)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    if not quiet:
        print(f"wrote {path}")
