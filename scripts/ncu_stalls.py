"""Warp-stall samples of an Nsight Compute source export, summed by instruction and by reason.

    ncu --clock-control none -k regex:_fwd_kernel_sm90 --launch-skip 1 -c 1 --section WarpStateStats \
        --section SourceCounters -o fwd python scripts/profile_backward.py 64 8192
    ncu --import fwd.ncu-rep --page source --csv --print-source sass > fwd.csv
    python scripts/ncu_stalls.py fwd.csv [LO HI]
    python scripts/ncu_stalls.py --totals fwd.csv [more.csv ...]

Prints the kernel's samples per 2 KB of code (which part of the program the warps sit in: the
consumer partitions, the loader, idle warps parked at a barrier) and, for the byte offsets
[LO, HI) of the code (hex; e.g. one consumer's loop), the samples per opcode with their main reasons.
--totals: per file, the warp instructions executed (all, and HGMMA) and the whole kernel's samples
by opcode and by reason, in percent, so two kernels' exports compare line by line.
"""

import collections
import csv
import re
import sys


def instructions(path: str) -> tuple[str, list]:
    """(kernel name, [(byte offset from the code's start, opcode, samples, times executed,
    {stall reason: samples})]) of an ncu source export, one entry per SASS instruction."""
    rows = list(csv.reader(open(path)))
    header, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    base = int(data[0][0], 16)
    return rows[0][1], [(int(r[0], 16) - base, re.sub(r"^@!?U?P\w+\s+", "", r[1].strip()).split(" ")[0].split(".")[0],
                         int(r[col["# Samples"]] or 0), int(r[col["Instructions Executed"]] or 0),
                         {h[6:]: int(r[col[h]] or 0) for h in reasons}) for r in data]


def main(path: str, lo: int | None = None, hi: int | None = None) -> None:
    windows = collections.defaultdict(collections.Counter)
    by_op = collections.defaultdict(collections.Counter)
    for offset, op, _, _, counts in instructions(path)[1]:
        windows[offset // 0x800].update(counts)
        if lo is not None and lo <= offset < hi:
            by_op[op].update(counts)
    for w, c in sorted(windows.items()):
        if sum(c.values()) > 500:
            print(f"{w * 0x800:6x} {sum(c.values()):8d} samples  {c.most_common(4)}")
    total = sum(sum(c.values()) for c in by_op.values())
    for op, c in sorted(by_op.items(), key=lambda kv: -sum(kv[1].values()))[:14]:
        print(f"{op:10s} {100 * sum(c.values()) / total:5.1f}%  {c.most_common(4)}")


def totals(path: str) -> None:
    name, code = instructions(path)
    by_op, by_reason, executed = collections.Counter(), collections.Counter(), collections.Counter()
    for _, op, samples, times, counts in code:
        by_op[op] += samples
        executed[op] += times
        by_reason.update(counts)
    n = sum(by_op.values())
    print(f"{path}: {name}; {sum(executed.values()) / 1e6:.1f}M warp instructions, "
          f"{executed['HGMMA'] / 1e6:.1f}M HGMMA; {n} samples")
    print("  by opcode %:", ", ".join(f"{k} {100 * v / n:.1f}" for k, v in by_op.most_common(12)))
    print("  by reason %:", ", ".join(f"{k} {100 * v / n:.1f}" for k, v in by_reason.most_common(9)))


if __name__ == "__main__":
    if sys.argv[1] == "--totals":
        for path in sys.argv[2:]:
            totals(path)
    else:
        main(sys.argv[1], *(int(x, 16) for x in sys.argv[2:4]))
