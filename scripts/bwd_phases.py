"""Where a step of the Hopper backward spends its clocks, read off the SM clock inside the kernel.

    mkdir -p .ab/trace && git archive HEAD src | tar -x -C .ab/trace && git -C .ab/trace apply \\
        ../../scripts/bwd_phases.patch   # (or: cd .ab/trace && patch -p1 < ../../scripts/bwd_phases.patch)
    PYTHONPATH=.ab/trace/src python scripts/bwd_phases.py 128:1:8192 128:0:8192 [--out FILE]
    PYTHONPATH=src python scripts/bwd_phases.py 128:1:8192 128:0:8192     # the same shapes untraced: times only

scripts/bwd_phases.patch (made against the commit that added it) has each consumer warpgroup of
ops.backward._bwd_kernel_sm90 read %clock at fixed points of every step (_bwd_sm90_step; not the
d=256 SPLIT_D step) into 16 KB of shared memory, and copy them out at the end of the program to an
int32 buffer (programs, 2 warpgroups, 128 rows, 16 slots; row 127 a header: SM, globaltimer >> 10
at the start and end, clock at the start, after the loop and at the end, steps, first key), which the
patched _launch_sm90 allocates and passes in the ALiBi slopes' slot (ops.backward.LAST_TRACE). Steps
past 126 overwrite row 126 and are left out here. The stamps cost registers (ptxas spills 88 bytes
at d=128 causal where the kernel spills 28, 56 where 40 non-causal): the script prints the traced
backward's time, so that the two trees' times can be compared.

Shapes as bench prefill's: d:causal:seqlen, bf16, 16k tokens, heads x d = 2048. For each shape the
script prints the backward's time (CUDA events over 20 calls, after 3 to compile and warm), then
per consumer warpgroup each phase's median and mean clocks a step (steps 2 onwards of every
program, the first two being the pipeline's fill), the step's total, how far warpgroup 1's step
start trails warpgroup 0's, and the programs' share of the SMs' time (globaltimer, ~1 us units).
"""

from __future__ import annotations

import sys

import torch

# slot -> the point of _bwd_sm90_step it stamps (scripts/bwd_phases.patch)
POINTS = {
    0: "step start",
    1: "Q wait begins (DEFER_DQ: after step i-1's dQ issue)",
    2: "Q ready",
    3: "previous dQ out (DEFER_DQ)",
    4: "dO ready",
    5: "S^T back",
    6: "dV issued",
    7: "dP^T back",
    8: "dK issued",
    9: "dS^T stored, fenced, passed",
    10: "dV, dK back",
    11: "other's dS^T waited, dQ issued",
    12: "dQ back",
    13: "dQ out, step end",
    14: "P^T made",
    15: "dS^T made",
}
ORDER = [0, 1, 2, 3, 4, 5, 14, 6, 7, 15, 8, 9, 10, 11, 12, 13]  # the slots in the step's order


def backward_time(d: int, causal: bool, seqlen: int):
    import flashtile

    b, h = 16384 // seqlen, 2048 // d
    q, k, v = (torch.randn(b, seqlen, h, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    for _ in range(3):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 20
    flops = 4 * b * h * seqlen * seqlen * d * 2.5 / (2 if causal else 1)
    return ms, flops / ms / 1e9


def clocks(a, b):
    """b - a of two 32-bit clock readings, across a wrap."""
    return (b - a) % (1 << 32)


def phases(trace: torch.Tensor) -> list[str]:
    t = trace.cpu().to(torch.int64)
    head = t[:, :, 127]
    n_steps = head[:, :, 4]
    lines = []
    used = [s for s in ORDER if bool((t[:, :, :126, s] != 0).any())]
    for half in range(2):
        rows, totals, loops = [], [], []
        for p in range(t.shape[0]):
            n = min(int(n_steps[p, half]), 126)
            for i in range(2, n):
                rows.append(t[p, half, i, used])
                if i + 1 < n:
                    totals.append(clocks(t[p, half, i, 0], t[p, half, i + 1, 0]))
                    loops.append(clocks(t[p, half, i, used[-1]], t[p, half, i + 1, 0]))
        if not rows:
            continue
        r = torch.stack(rows)
        lines.append(f"  warpgroup {half}: {r.shape[0]} steps")
        for j in range(1, len(used)):
            d = clocks(r[:, j - 1], r[:, j]).double()
            lines.append(f"    {POINTS[used[j - 1]]:>36} -> {POINTS[used[j]]:<36} median {d.median():7.0f}"
                         f"  mean {d.mean():7.0f}")
        loop, total = torch.tensor(loops).double(), torch.tensor(totals).double()
        lines.append(f"    {'(next step)':>77} median {loop.median():7.0f}  mean {loop.mean():7.0f}")
        lines.append(f"    {'step':>77} median {total.median():7.0f}  mean {total.mean():7.0f}")
    lag = []
    for p in range(t.shape[0]):
        n = min(int(n_steps[p, 0]), 126)
        for i in range(2, n):
            x = int(clocks(t[p, 0, i, 0], t[p, 1, i, 0]))
            lag.append(x if x < (1 << 31) else x - (1 << 32))
    if lag:
        lag = torch.tensor(lag).double()
        lines.append(f"  warpgroup 1's step start after warpgroup 0's: median {lag.median():.0f}, "
                     f"mean {lag.mean():.0f}")
    sm, t0, t1 = head[:, 0, 0], head[:, 0, 1], head[:, 0, 3]
    busy = (t1 - t0).clamp(min=0).sum().item()
    span = (t1.max() - t0.min()).item()
    n_sm = int(sm.max().item()) + 1
    loop_share = (clocks(head[:, 0, 2], head[:, 0, 6]).double().sum()
                  / clocks(head[:, 0, 2], head[:, 0, 7]).double().sum())
    lines.append(f"  programs {t.shape[0]} on {n_sm} SMs: their time {busy / max(span * n_sm, 1):.3f} of the SMs' "
                 f"{span} x 1.024 us; the step loop {loop_share:.3f} of a program's clocks")
    return lines


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    if out in args:
        args.remove(out)
    from flashtile.ops import backward

    traced = hasattr(backward, "LAST_TRACE")
    report = [f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; "
              f"{'traced (scripts/bwd_phases.patch)' if traced else 'untraced'}"]
    print(report[0], flush=True)
    for shape in args:
        d, causal, seqlen = (int(x) for x in shape.split(":"))
        ms, tflops = backward_time(d, bool(causal), seqlen)
        lines = [f"d={d} causal={bool(causal)} seqlen={seqlen}: backward {ms:.3f} ms, {tflops:.0f} TFLOP/s"]
        if traced:
            lines += phases(backward.LAST_TRACE)
        print("\n".join(lines), flush=True)
        report += lines
    if out:
        with open(out, "w") as f:
            f.write("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
