"""The backward with deterministic=True against deterministic=False, and reruns of the first.

    PYTHONPATH=src python scripts/ab_deterministic.py [time|reruns] [ROUNDS] [SEQLENS] [--all-ordered] [--chunk=N]

time: bf16, 16k tokens, heads x d = 2048 (bench prefill's shapes), d 64 / 128, causal and not,
1k-16k; ops.prefill.attention_backward alone (forward done once), each round timing both
settings one after the other (harness.bench_ms). Prints TFLOP/s and det / any-order. SEQLENS: a
comma list (default 1024-16384). --all-ordered: deterministic=True takes the ordered Hopper kernel
wherever it can (configs.hopper_backward_ordered's length cut at d=64 off). --chunk=N: the ordered
kernel's rows without a right bound in chunks of N (configs.hopper_backward_head_chunk's L2 fit off).
reruns: deterministic=True ROUNDS times (default 150) on shapes where an ordering race would
show (GQA 16/4 causal at 4 x 4k among them): how many dQ differ bitwise from the first call's.
Used for the ordered Hopper backward tried in c0bb5c2 (docs/changelog.md, "Backward") and
for the one with a dQ writer warp (9c30b54, now what deterministic=True runs at d <= 128 on the H100).
"""

import sys

import torch

from flashtile.bench import harness
from flashtile.ops import configs
from flashtile.ops.prefill import attention_backward, attention_forward


def qkv(b, s, h, hk, d):
    return [torch.randn(b, s, h if i == 0 else hk, d, device="cuda", dtype=torch.bfloat16) for i in range(3)]


def timing(rounds: int, seqlens=(1024, 2048, 4096, 8192, 16384)) -> None:
    for d in (128, 64):
        for causal in (False, True):
            for seqlen in seqlens:
                b, h = 16384 // seqlen, 2048 // d
                q, k, v = qkv(b, seqlen, h, h, d)
                dout, window = torch.randn_like(q), (None, 0 if causal else None)
                out, lse = attention_forward(q, k, v, d ** -0.5, window)
                ms = {False: [], True: []}
                for _ in range(rounds):
                    for det in ms:
                        ms[det].append(harness.bench_ms(lambda: attention_backward(
                            dout, q, k, v, out, lse, d ** -0.5, window, deterministic=det)))
                flops = 2.5 * 4 * b * h * seqlen * seqlen * d / (2 if causal else 1)
                print(f"d={d} causal={causal:d} s={seqlen:5d}: any-order {flops / min(ms[False]) * 1e-9:.0f} "
                      f"deterministic {flops / min(ms[True]) * 1e-9:.0f} TFLOP/s, "
                      f"det / any {min(ms[False]) / min(ms[True]):.3f}", flush=True)


def reruns(rounds: int) -> None:
    for b, s, h, hk, causal in ((4, 4096, 16, 4, True), (4, 4096, 16, 4, False), (8, 2048, 16, 16, True)):
        q, k, v = qkv(b, s, h, hk, 128)
        dout, window = torch.randn_like(q), (None, 0 if causal else None)
        out, lse = attention_forward(q, k, v, 128 ** -0.5, window)
        first = attention_backward(dout, q, k, v, out, lse, 128 ** -0.5, window, deterministic=True)[0].clone()
        differ = sum(not torch.equal(attention_backward(dout, q, k, v, out, lse, 128 ** -0.5, window,
                                                        deterministic=True)[0], first) for _ in range(rounds))
        print(f"b={b} s={s} heads={h}/{hk} causal={causal}: dQ differs from the first in {differ} of {rounds} reruns",
              flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    unknown = [a for a in sys.argv[1:] if a.startswith("--") and a != "--all-ordered" and not a.startswith("--chunk=")]
    if unknown:
        sys.exit(f"unknown option(s) {unknown}: --all-ordered, --chunk=N")
    if "--all-ordered" in sys.argv:
        configs.hopper_backward_ordered = lambda d, seqlen_k, right_bounded: d <= 128
    forced = [int(a.split("=")[1]) for a in sys.argv if a.startswith("--chunk=")]
    if forced:
        chunk = configs.hopper_backward_head_chunk
        configs.hopper_backward_head_chunk = lambda d, sq, group, causal, device, ordered=False: (
            forced[0] if ordered and not causal else chunk(d, sq, group, causal, device, ordered))
    mode = args[0] if args else "time"
    count = int(args[1]) if len(args) > 1 else (2 if mode == "time" else 150)
    if mode == "time" and len(args) > 2:
        timing(count, tuple(int(s) for s in args[2].split(",")))
    else:
        {"time": timing, "reruns": reruns}[mode](count)
