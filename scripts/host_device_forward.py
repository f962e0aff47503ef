"""Host time per call against device time: the Hopper forward beside the Triton kernel.

    PYTHONPATH=src python scripts/host_device_forward.py [--profile]

bf16, 16k tokens, heads x d = 2048 (bench prefill's shapes). Per kernel: host microseconds a call
(200 back-to-back calls, no sync), then TFLOP/s of eager calls (triton.testing.do_bench) and of a
CUDA-graph replay of one call, three reads each. Where the host time passes the device time, eager
calls measure the host. The Triton kernel runs where configs.hopper_forward_config answers None.
--profile: instead, cProfile of 300 eager calls per kernel at d=256 causal 256 keys (the shortest
shape above), the top 22 entries by own time, then 300 calls timed without the profiler.
"""

import cProfile
import io
import pstats
import sys
import time

import torch
import triton

import flashtile
from flashtile.ops import configs

SHAPES = ((256, False, 512), (256, True, 256), (256, True, 1024), (128, True, 1024))


def host_us(fn, calls: int = 200) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def captured(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def main(profile: bool = False) -> None:
    hopper = configs.hopper_forward_config
    try:
        for d, causal, seqlen in SHAPES[1:2] if profile else SHAPES:
            batch, heads = 16384 // seqlen, 2048 // d
            q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
            for name in ("hopper", "triton"):
                configs.hopper_forward_config = hopper if name == "hopper" else (lambda *a, **kw: None)
                fn = lambda: flashtile.flash_attn_func(q, k, v, causal=causal)  # noqa: E731
                for _ in range(3):
                    fn()
                if profile:
                    profiler = cProfile.Profile()
                    profiler.enable()
                    for _ in range(300):
                        fn()
                    profiler.disable()
                    torch.cuda.synchronize()
                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(22)
                    print(f"===== {name}\n{text.getvalue()}\n{name} host us/call {host_us(fn, 300)}", flush=True)
                    continue
                host = host_us(fn)
                eager = [flops / triton.testing.do_bench(fn, warmup=25, rep=100) * 1e-9 for _ in range(3)]
                graph = captured(fn)
                replay = [flops / triton.testing.do_bench(graph.replay, warmup=25, rep=100) * 1e-9 for _ in range(3)]
                print(f"d={d} causal={int(causal)} s={seqlen} {name}: host {host:.0f} us/call "
                      f"(device {flops / max(replay) / 1e6:.0f} us), "
                      f"eager TFLOP/s {' '.join(f'{x:.0f}' for x in eager)}, "
                      f"graph {' '.join(f'{x:.0f}' for x in replay)}", flush=True)
    finally:
        configs.hopper_forward_config = hopper


if __name__ == "__main__":
    main("--profile" in sys.argv[1:])
