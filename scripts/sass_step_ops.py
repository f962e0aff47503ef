"""Where a feature's instructions go in a Hopper kernel's step: the SASS of the consumer's loop,
compiled for sm_90 on the CPU with and without one flag, opcode by opcode.

    PYTHONPATH=src python scripts/sass_step_ops.py forward-sm90|backward-sm90 D FLAG [--causal]

FLAG: dropout, softcap or alibi (tests/codegen_check.py's variants of the kernel, bf16). The
step loop is the first innermost loop (a backward branch with no other inside it) that issues
wgmma (HGMMA); every such loop's size is printed, since a kernel may hold more than one copy of
its step (a first step peeled off, the other warpgroup's order). A step covers one K/V block of
the forward or one Q block of the backward per consumer warp; its instruction count is per warp,
so per score it is that over the scores a thread holds (BLOCK_M x BLOCK_N / 128 per warpgroup).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import codegen_check  # noqa: E402


def sass(compiled) -> list[tuple[int, str]]:
    """(address, instruction) of the cubin's SASS."""
    path = f"/tmp/flashtile_sass_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        text = subprocess.run([codegen_check._tool("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.remove(path)
    return [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;/]*?);", text)]


def opcode(instruction: str) -> str:
    """The opcode and its first modifiers, without a predicate: 'IMAD.WIDE.U32', 'FFMA'."""
    return ".".join(re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[:3])


def step_loops(code) -> list[list[str]]:
    """The instructions of each innermost loop that issues wgmma, in address order."""
    branches = [(int(m.group(1), 16), a) for a, t in code if (m := re.search(r"BRA.*?(0x[0-9a-f]+)", t))
                and int(m.group(1), 16) < a]
    loops = []
    for lo, hi in branches:
        if any(lo < lo2 and hi2 < hi for lo2, hi2 in branches):
            continue  # holds another loop
        body = [opcode(t) for a, t in code if lo <= a <= hi]
        if any(op.startswith("HGMMA") for op in body):
            loops.append(body)
    return loops


def compile_variant(kind: str, d: int, flag: str | None, causal: bool):
    if kind == "forward-sm90":
        extra = {} if flag in (None, "dropout") else {flag: True}
        return codegen_check.compile_hopper_forward(d, causal, flag == "dropout", False, **extra)
    extra = {} if flag in (None, "dropout") else {flag: True}
    return codegen_check.compile_hopper_backward(d, causal, flag == "dropout", False, **extra)


def main(argv) -> None:
    kind, d, flag = argv[0], int(argv[1]), argv[2]
    causal = "--causal" in argv
    loops = {}
    for name, f in (("without", None), (f"with {flag}", flag)):
        found = step_loops(sass(compile_variant(kind, d, f, causal)))
        print(f"{name}: innermost wgmma loops of {[len(body) for body in found]} instructions")
        loops[name] = collections.Counter(found[0])
    (a_name, a), (b_name, b) = loops.items()
    print(f"{'opcode':24s} {a_name:>8s} {b_name:>12s} {'difference':>10s}")
    for op in sorted(set(a) | set(b), key=lambda op: (a[op] - b[op], op)):
        if a[op] != b[op]:
            print(f"{op:24s} {a[op]:8d} {b[op]:12d} {b[op] - a[op]:+10d}")
    print(f"{'step, per warp':24s} {sum(a.values()):8d} {sum(b.values()):12d} {sum(b.values()) - sum(a.values()):+10d}")


if __name__ == "__main__":
    main(sys.argv[1:])
