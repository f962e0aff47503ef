"""Time flashtile's decoding under two settings of its configs, alternating, in one run.

    PYTHONPATH=src python scripts/ab_decode.py [--rounds N] [--a NAME=VALUE ...] [--b NAME=VALUE ...]
        [--a-src DIR] [--b-src DIR] [-- BENCH_ARGS]

Each setting runs `flashtile bench decode` in its own process, a, b, a, b, ..., so a difference
between them can be told from the run-to-run spread. --a / --b assign a value to an attribute of
flashtile.ops.configs in that setting's processes (e.g. --b DECODE_FUSED_MAX_SPLITS=0: every merge by
the combine kernel). --a-src / --b-src put a source tree first on that setting's PYTHONPATH (two
versions of the code: `git archive REV src | tar -x -C DIR` gives DIR/src). BENCH_ARGS go to the
benchmark (default: BENCH_ARGS below, the seed shapes with splits, SDPA, flashtile and the plan).
Prints one JSON line per process: [impl, batch, context, heads, device us (CUDA graphs), eager us
(best loop), splits] per row.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

BENCH_ARGS = ["--shapes", "16x4096,8x8192,2x32768,1x65536,1x131072", "--impls", "sdpa-gqa,flashtile,flashtile-plan",
              "--no-plot"]


def child(tag: str, settings: list, bench_args: list) -> None:
    from flashtile.bench import decode
    from flashtile.ops import configs

    for setting in settings:
        name, value = setting.split("=")
        setattr(configs, name, type(getattr(configs, name))(value))
    with tempfile.TemporaryDirectory() as out:
        decode.main(["--out", out, *bench_args])
        with open(os.path.join(out, "decode.json")) as f:
            rows = json.load(f)["rows"]
    print(tag, json.dumps([(r["impl"], r["batch"], r["context"], r["nheads"], round(r.get("graph_us", -1), 1),
                            round(r.get("loop_us", -1), 1), r.get("num_splits")) for r in rows]), flush=True)


def main() -> None:
    argv = sys.argv[1:]
    bench_args = BENCH_ARGS
    if "--" in argv:
        argv, bench_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    if argv and argv[0] == "--child":
        return child(argv[1], argv[2:], bench_args)
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--a", action="append", default=[])
    p.add_argument("--b", action="append", default=[])
    p.add_argument("--a-src")
    p.add_argument("--b-src")
    args = p.parse_args(argv)
    for r in range(1, args.rounds + 1):
        for tag, settings, src in (("a", args.a, args.a_src), ("b", args.b, args.b_src)):
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            if src:
                env["PYTHONPATH"] = os.pathsep.join(filter(None, (os.path.abspath(src), env.get("PYTHONPATH"))))
            subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f"{tag}{r}", *settings, "--",
                            *bench_args], env=env, check=True)


if __name__ == "__main__":
    main()
