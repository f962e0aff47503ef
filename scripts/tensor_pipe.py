"""How busy each prefill kernel keeps the tensor cores, flashtile beside FlashAttention-4 (GPU machine).

    PYTHONPATH=src python scripts/tensor_pipe.py [D:CAUSAL:SEQLEN,...] [--fa4] [--out FILE]

For each shape (bf16, 16k tokens, heads x d = 2048: the prefill benchmark's), one process of
scripts/profile_backward.py (a forward, then two backwards) runs under Nsight Compute, which takes
every launch of the main kernels (flashtile's _fwd_kernel_sm90 / _bwd_kernel_sm90, FA4's Sm90
forward and backward) with a handful of counters: duration, SM clock, the tensor pipe's active
cycles as a share of its peak over the cycles the SMs were active, warp instructions, shared-memory
wavefronts. Clocks are not locked (--clock-control none), as in the benchmark. The table gives per
kernel its TFLOP/s from the duration (the benchmark's FLOP count: 4 b h s^2 d forward, 2.5x that
backward, half of each causal) and what the tensor pipe's busy share implies the kernel would reach
at 100%, so "achieved against possible" reads off one row, and the kernel's cycles with the tensor
pipe's share of them (two kernels doing the same tensor work have equal tensor cycles). --fa4 adds
FA4's kernels (its pack must be installed: ../shared/tools/fa4_peer.sh).
"""

from __future__ import annotations

import csv
import io
import subprocess
import sys

METRICS = ("gpu__time_duration.sum", "sm__cycles_elapsed.avg.per_second",
           "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", "smsp__inst_executed.sum",
           "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum")
KERNELS = "regex:_fwd_kernel_sm90|_bwd_kernel_sm90|ForwardSm90|BackwardSm90|fwd_sm90|bwd_sm90"
SHAPES = "128:0:8192,128:1:8192,64:0:8192,64:1:8192"


def profile(d: int, causal: bool, s: int, fa4: bool) -> list[dict]:
    """One profile_backward.py process under ncu: its main kernels' counters, in launch order."""
    cmd = ["ncu", "--clock-control", "none", "-k", KERNELS, "-c", "3", "--csv", "--metrics", ",".join(METRICS),
           sys.executable, "scripts/profile_backward.py", str(d), str(s)] + (["--causal"] if causal else []) \
        + (["--fa4"] if fa4 else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    text = done.stdout
    if done.returncode != 0 or '"ID"' not in text:
        print(f"ncu failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}{text[-2000:]}", flush=True)
        return []
    rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
    kernels: dict[str, dict] = {}
    for r in rows:
        k = kernels.setdefault(r["ID"], {"name": r["Kernel Name"]})
        value = float(r["Metric Value"].replace(",", ""))
        # durations to us, clocks to GHz (ncu's CSV spells units either way); counts as printed
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "ghz": 1.0,
                 "mhz": 1e-3, "cycle/nsecond": 1.0, "cycle/usecond": 1e-3}.get(r["Metric Unit"].lower(), 1.0)
        k[r["Metric Name"]] = value * scale
    return list(kernels.values())


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    if out in args:
        args.remove(out)
    impls = ["flashtile"] + (["fa4"] if "--fa4" in sys.argv else [])
    lines = ["impl       d causal seqlen kernel  us   GHz tensor%  TFLOP/s  at-100%  Mcycles  tensor-Mcycles  Minst  "
             "Mwavefronts(shared)"]
    for item in (args[0] if args else SHAPES).split(","):
        d, causal, s = (int(x) for x in item.split(":"))
        b, h = 16384 // s, 2048 // d
        fwd = 4 * b * h * s * s * d / (2 if causal else 1)
        for impl in impls:
            for k in profile(d, bool(causal), s, impl == "fa4"):
                backward = "bwd" in k["name"].lower() or "backward" in k["name"].lower()
                us = k["gpu__time_duration.sum"]
                busy = k["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"]
                ghz = k["sm__cycles_elapsed.avg.per_second"]
                tflops = (2.5 if backward else 1.0) * fwd / us / 1e6
                mcycles = us * ghz / 1e3
                lines.append(f"{impl:9s} {d:3d} {causal:d} {s:6d} {'bwd' if backward else 'fwd'} {us:9.1f} "
                             f"{ghz:5.2f} {busy:5.1f} {tflops:6.0f} {tflops / busy * 100:6.0f} {mcycles:7.2f} "
                             f"{mcycles * busy / 100:7.2f} {k['smsp__inst_executed.sum'] / 1e6:6.1f} "
                             f"{k['l1tex__data_pipe_lsu_wavefronts_mem_shared.sum'] / 1e6:8.1f}  {k['name'][:60]}")
                print(lines[-1], flush=True)
    text = "\n".join(lines)
    if out:
        open(out, "w").write(text + "\n")


if __name__ == "__main__":
    main()
