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


def main(path: str, lo: int | None = None, hi: int | None = None) -> None:
    rows = list(csv.reader(open(path)))
    header, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    base = int(data[0][0], 16)
    windows = collections.defaultdict(collections.Counter)
    by_op = collections.defaultdict(collections.Counter)
    for r in data:
        offset = int(r[0], 16) - base
        counts = {h[6:]: int(r[col[h]] or 0) for h in reasons}
        windows[offset // 0x800].update(counts)
        if lo is not None and lo <= offset < hi:
            op = re.sub(r"^@!?U?P\w+\s+", "", r[1].strip()).split(" ")[0].split(".")[0]
            by_op[op].update(counts)
    for w, c in sorted(windows.items()):
        if sum(c.values()) > 500:
            print(f"{w * 0x800:6x} {sum(c.values()):8d} samples  {c.most_common(4)}")
    total = sum(sum(c.values()) for c in by_op.values())
    for op, c in sorted(by_op.items(), key=lambda kv: -sum(kv[1].values()))[:14]:
        print(f"{op:10s} {100 * sum(c.values()) / total:5.1f}%  {c.most_common(4)}")


def totals(path: str) -> None:
    rows = list(csv.reader(open(path)))
    header, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    by_op, by_reason, executed = collections.Counter(), collections.Counter(), collections.Counter()
    for r in data:
        op = re.sub(r"^@!?U?P\w+\s+", "", r[1].strip()).split(" ")[0].split(".")[0]
        by_op[op] += int(r[col["# Samples"]] or 0)
        executed[op] += int(r[col["Instructions Executed"]] or 0)
        by_reason.update({h[6:]: int(r[col[h]] or 0) for h in reasons})
    n = sum(by_op.values())
    print(f"{path}: {rows[0][1]}; {sum(executed.values()) / 1e6:.1f}M warp instructions, "
          f"{executed['HGMMA'] / 1e6:.1f}M HGMMA; {n} samples")
    print("  by opcode %:", ", ".join(f"{k} {100 * v / n:.1f}" for k, v in by_op.most_common(12)))
    print("  by reason %:", ", ".join(f"{k} {100 * v / n:.1f}" for k, v in by_reason.most_common(9)))


if __name__ == "__main__":
    if sys.argv[1] == "--totals":
        for path in sys.argv[2:]:
            totals(path)
    else:
        main(sys.argv[1], *(int(x, 16) for x in sys.argv[2:4]))
