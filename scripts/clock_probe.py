"""SM clock and board power while a prefill kernel runs back to back, against its one-call time.

    PYTHONPATH=src python scripts/clock_probe.py [SECONDS] [PEERS] [SHAPES]

For each shape (d:causal:seqlen, bf16, 16k tokens, heads x d = 2048, as bench prefill) and each
peer of bench prefill (default flashtile,cudnn,fa4 when flash_attn.cute imports), the forward, then
the backward: (1) one call timed alone after a second of idle, (2) bench prefill's time (do_bench
medians, an L2 flush before every call), (3) SECONDS (default 3) of calls back to back, timed as a
whole, while nvidia-smi samples the SM clock, board power and temperature every 50 ms. Prints one
JSON line per measurement: TFLOP/s of each timing and the loop's mean / min clock (MHz), mean
power (W) and last temperature. (1) starts from the clocks an idle GPU drops to; (3) shows the
clocks a sustained run settles at: kernels at the same clock and power in (3) differ by their
schedules alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from flashtile.bench import harness, prefill


def sampled(fn, seconds: float) -> dict:
    """fn() back to back for `seconds`; its mean ms and nvidia-smi's samples meanwhile."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.perf_counter()
    start.record()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    rows = [[float(x) for x in line.split(",")] for line in smi.communicate()[0].splitlines() if line.count(",") == 2]
    rows = rows[len(rows) // 5:]  # the loop's steady part
    clocks, power = [r[0] for r in rows], [r[1] for r in rows]
    return dict(ms=start.elapsed_time(end) / calls, clock_mean=round(sum(clocks) / len(clocks)),
                clock_min=round(min(clocks)), power_mean=round(sum(power) / len(power)), temp=rows[-1][2])


def one_call_ms(fn) -> float:
    """fn() once after a second of idle (its clocks as a single call finds them)."""
    fn()
    torch.cuda.synchronize()
    time.sleep(1.0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def main(argv) -> None:
    seconds = float(argv[0]) if argv else 3.0
    names = argv[1].split(",") if len(argv) > 1 else ["flashtile", "cudnn", "fa4"]
    shapes = [(int(d), c == "1", int(s)) for d, c, s in (x.split(":") for x in argv[2].split(","))] \
        if len(argv) > 2 else [(128, False, 16384), (128, False, 4096)]
    impls = prefill.implementations(prefill.available_peers(names))
    env = harness.environment()
    print(json.dumps(dict(env=env, command="scripts/clock_probe.py " + " ".join(argv))), flush=True)
    for d, causal, s in shapes:
        b, h = 16384 // s, 2048 // d
        f = prefill.flops(b, h, s, d, causal)
        for name, fn in impls.items():
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn_like(q)
            out = fn(q, k, v, causal)
            passes = {"fwd": (lambda: fn(q, k, v, causal), f),
                      "bwd": (lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), 2.5 * f)}
            for part, (call, flop) in passes.items():
                row = dict(impl=name, d=d, causal=causal, seqlen=s, part=part,
                           one_call=round(flop / one_call_ms(call) * 1e-9, 1),
                           bench=round(flop / harness.bench_ms(call) * 1e-9, 1))
                loop = sampled(call, seconds)
                row.update(loop=round(flop / loop.pop("ms") * 1e-9, 1), **loop)
                print(json.dumps(row), flush=True)
            del q, k, v, dout, out
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
