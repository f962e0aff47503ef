"""Time flashtile's prefill forward and backward from two source trees, alternating, in one run.

    python scripts/ab_prefill.py OLD_SRC NEW_SRC [ROUNDS] [SHAPES] [--forward]

Each tree runs in its own process (PYTHONPATH=TREE) over the same shapes, old, new, old, new, ...,
so a difference between the trees can be told from the run-to-run spread. The shapes are the
benchmark's (bf16, 16k tokens, heads x d = 2048, the prefill harness's do_bench medians). Prints one
JSON line per process: [d, causal, seqlen, fwd TFLOP/s, bwd TFLOP/s] per shape. SHAPES replaces the
default list: d:causal:seqlen,... (e.g. 128:1:2048,64:0:16384); a fourth field d:causal:seqlen:p
times the shape with dropout_p = p (TFLOP/s of the same FLOPs, so ratios to p = 0 are time ratios),
a fifth d:causal:seqlen:p:c with softcap = c, a sixth d:causal:seqlen:p:c:flags with flags from
"d" (deterministic=True), "a" (ALiBi, slopes 2^(-8 i / heads), i = 1 .. heads), "s" (a learnable
sink per head) and "v" (flash_attn_varlen_func over the batch packed, every sequence seqlen long).
--forward times the forward alone (the backward's column is then null), in a third of the time.
"""

import json
import os
import subprocess
import sys

SHAPES = [(128, True, 512), (128, True, 1024), (64, True, 16384), (64, True, 1024), (128, False, 2048)]


def child(tag: str, shapes, forward_only: bool) -> None:
    import torch

    import flashtile
    from flashtile.bench import harness, prefill

    rows = []
    for d, causal, s, p, cap, flags in shapes:
        b, h = 16384 // s, 2048 // d
        slopes = 2.0 ** (-8.0 * torch.arange(1, h + 1, device="cuda") / h) if "a" in flags else None

        sink = torch.randn(h, device="cuda", dtype=torch.float32) if "s" in flags else None
        cu = torch.arange(0, b * s + 1, s, device="cuda", dtype=torch.int32) if "v" in flags else None

        def impl(q, k, v, causal, p=p, cap=cap, slopes=slopes, det="d" in flags, sink=sink, cu=cu):
            kw = dict(dropout_p=p, causal=causal, softcap=cap, alibi_slopes=slopes, deterministic=det,
                      learnable_sink=sink)
            if cu is None:
                return flashtile.flash_attn_func(q, k, v, **kw)
            packed = (x.flatten(0, 1) for x in (q, k, v))  # the batch's sequences packed, one length
            return flashtile.flash_attn_varlen_func(*packed, cu, cu, q.shape[1], q.shape[1], **kw).unflatten(0, q.shape[:2])

        f = prefill.flops(b, h, s, d, causal)
        if forward_only:
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            fwd, bwd = harness.bench_ms(lambda: impl(q, k, v, causal)), None
        else:
            fwd, bwd, _, _ = prefill.measure(impl, b, s, h, d, causal, torch.bfloat16)
        rows.append((d, causal, s, *([p] if p or cap or flags else []), *([cap] if cap or flags else []),
                     *([flags] if flags else []), round(f / fwd * 1e-9, 1),
                     bwd and round(2.5 * f / bwd * 1e-9, 1)))
    print(tag, json.dumps(rows), flush=True)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--forward"]
    forward = [] if len(args) == len(sys.argv) - 1 else ["--forward"]
    if args[0] == "--child":
        shapes = [(int(d), c == "1", int(s), float(extra[0]) if extra else 0.0, float(extra[1]) if extra[1:] else 0.0,
                   extra[2] if extra[2:] else "") for d, c, s, *extra in (x.split(":") for x in args[2].split(","))]
        return child(args[1], shapes, bool(forward))
    old, new = args[0], args[1]
    rounds = int(args[2]) if len(args) > 2 else 2
    shapes = args[3] if len(args) > 3 else ",".join(f"{d}:{int(c)}:{s}" for d, c, s in SHAPES)
    for r in range(1, rounds + 1):
        for tag, tree in (("old", old), ("new", new)):
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), PYTHONUNBUFFERED="1")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f"{tag}{r}", shapes, *forward],
                           env=env, check=True)


if __name__ == "__main__":
    main()
