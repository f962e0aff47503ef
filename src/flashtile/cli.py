"""The `flashtile` command: `demo`, `analyze`, `bench NAME [args...]`.

Each subcommand imports its module only when it runs: `flashtile demo` must set TRITON_INTERPRET
on a CPU-only machine before anything imports triton.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


MAX_SEQLEN = 1 << 30  # the IO model walks the query blocks: 2^30 takes ~10 s on a CPU, far more hangs


def _seqlen(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_SEQLEN:
        raise argparse.ArgumentTypeError(f"must be at most 2^30 = {MAX_SEQLEN}, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from flashtile import demo  # neither module imports triton
    from flashtile.analysis import report
    from flashtile.analysis.gpus import DTYPES, GPUS

    parser = argparse.ArgumentParser(
        prog="flashtile", description="Exact, IO-aware attention for PyTorch: demo, IO model, benchmarks.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,analyze,bench}")

    demo_cmd = sub.add_parser("demo", help="run every implementation available here against the float64 "
                                       "oracle and print one table")
    demo_cmd.add_argument("--seqlens", type=_positive_int, nargs="+", default=demo.SEQLENS, metavar="N",
                          help="sequence lengths (default: %(default)s)")
    demo_cmd.add_argument("--dtypes", nargs="+", choices=sorted(demo.DTYPES), default=demo.DTYPES_RUN,
                          help="input dtypes (default: %(default)s)")
    demo_cmd.add_argument("--repeats", type=_positive_int, default=demo.REPEATS,
                          help="timed runs per entry, the median is shown (default: %(default)s)")
    demo_cmd.add_argument("--model", action="store_true",
                          help="instead: a small GPT (flashtile.models) with each attention path - logits against "
                               "eager, a training step, generation - tiny on a CPU, GPT-2 small sized on a GPU")

    analyze = sub.add_parser("analyze", help="FLOPs, HBM bytes, arithmetic intensity and roofline time of "
                                             "standard attention, FA1, FA2 and Flash-Decoding")
    analyze.add_argument("--seqlen", type=_seqlen, required=True, metavar="N")
    analyze.add_argument("--headdim", type=_positive_int, required=True, metavar="D")
    analyze.add_argument("--dtype", choices=sorted(DTYPES), default="float16",
                         help="input dtype: sets the element size (default: %(default)s)")
    analyze.add_argument("--sram", type=_positive_int, required=True, metavar="BYTES",
                         help="on-chip SRAM per SM in bytes (A100: 196608); sets FA1's block sizes")
    analyze.add_argument("--gpu", choices=sorted(GPUS), default="h100",
                         help="roofline GPU (default: %(default)s)")
    analyze.add_argument("--block-m", type=_positive_int, default=report.BLOCK_M,
                         help="FA2 query rows per tile (default: %(default)s)")
    analyze.add_argument("--block-n", type=_positive_int, default=report.BLOCK_N,
                         help="FA2 / Flash-Decoding keys per tile (default: %(default)s)")
    analyze.add_argument("--splits", type=_positive_int, default=report.NUM_SPLITS,
                         help="Flash-Decoding key splits (default: %(default)s)")
    analyze.add_argument("--json", action="store_true", help="print one JSON object")
    analyze.add_argument("--plot", metavar="FILE.png", help="plot HBM bytes and roofline time against N")

    bench = sub.add_parser("bench", help="run flashtile.bench.NAME (e.g. prefill, decode) with its own args")
    bench.add_argument("name", help="benchmark module in flashtile.bench")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    return parser


def _analyze(args, parser) -> int:
    from flashtile.analysis import report

    try:
        summary = report.summary(args.seqlen, args.headdim, args.dtype, args.sram, args.gpu,
                                 args.block_m, args.block_n, args.splits)
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(summary, indent=1) if args.json else report.text(summary))
    if args.plot:
        try:
            report.plot(args.plot, args.headdim, args.dtype, args.sram, args.gpu, block_m=args.block_m,
                        block_n=args.block_n, num_splits=args.splits)
        except OSError as e:  # a missing folder, no permission: the argument's error, not a traceback
            parser.error(f"argument --plot: cannot write {args.plot!r}: {e.strerror or e}")
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _bench(args, parser) -> int:
    import flashtile.bench

    module_name = f"flashtile.bench.{args.name}"
    try:
        module = importlib.import_module(module_name) if args.name.isidentifier() else None
    except ModuleNotFoundError as e:
        if e.name != module_name:  # the benchmark exists but needs something missing: show that
            raise
        module = None
    if module is None:
        # harness holds the helpers the benchmarks share, prefill_report draws and tabulates
        # prefill.json: neither is a benchmark itself
        available = sorted(m.name for m in pkgutil.iter_modules(flashtile.bench.__path__)
                           if not m.name.startswith("_") and m.name not in ("harness", "prefill_report"))
        parser.error(f"no benchmark named {args.name!r} (no module {module_name}); "
                     f"available: {', '.join(available) or 'none yet'}")
    if not callable(getattr(module, "main", None)):
        parser.error(f"{module_name} is not a benchmark: it has no main(argv) function")
    return module.main(list(args.args)) or 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from flashtile import demo

        if args.model:
            return demo.run_model(repeats=args.repeats)
        return demo.run(seqlens=args.seqlens, dtypes=args.dtypes, repeats=args.repeats)
    if args.command == "analyze":
        return _analyze(args, parser)
    return _bench(args, parser)


if __name__ == "__main__":  # python -m flashtile.cli ...
    sys.exit(main())
