"""One CUDA graph of decoding calls timed two ways, alternating (GPU machine).

    PYTHONPATH=src python scripts/graph_timing.py [--out FILE] [--rounds N]

bench decode's device time is a graph of one call on every rotating cache buffer (>= 640 MB in
all), replayed. Timed with triton's do_bench, each replay follows a 256 MB memset (its L2 flush),
whose last lines are still dirty in L2 when the replay starts; timed with harness.replay_ms, the
replays follow one another. The rotation keeps the caches out of L2 either way, so the difference
is what the flush's write-back costs the replay, per call. Rows: bench decode's read floor, SDPA
with enable_gqa and flashtile at seed 004's and issue 11's shapes (fp16, d=128), the two timings
of one graph taking turns ROUNDS times; us per call, median of the rounds.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from flashtile.bench import decode, harness

SHAPES = ((64, 1024, 16, 2), (256, 256, 16, 2), (16, 4096, 16, 2), (1, 65536, 16, 2), (1, 131072, 16, 2),
          (1, 32768, 32, 8))
IMPLS = ("read-floor", "sdpa-gqa", "flashtile")


def main(out=None, rounds=5):
    dtype = torch.float16
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; fp16, d={decode.HEADDIM}; us per call, "
             f"median of {rounds} alternating rounds: do_bench (256 MB flush before each replay) / back-to-back "
             "replays (harness.replay_ms); calls per graph = rotating buffers"]
    for batch, context, h, hk in SHAPES:
        buffers, kv_bytes = decode._buffers(batch, context, hk, dtype)
        q = torch.randn(batch, 1, h, decode.HEADDIM, device="cuda", dtype=dtype)
        seqlens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        table = decode.implementations(batch, context, h, hk, seqlens, dtype)
        for name in IMPLS:
            fn = table[name][0]
            graph, _ = harness.capture(lambda: [fn(q, k, v) for k, v in buffers])
            flushed, back_to_back = [], []
            for _ in range(rounds):
                flushed.append(harness.bench_ms(graph.replay) * 1e3 / len(buffers))
                back_to_back.append(harness.replay_ms(graph) * 1e3 / len(buffers))
            a, b = statistics.median(flushed), statistics.median(back_to_back)
            lines.append(f"{batch:3d} x {context:6d} {h}/{hk} ({kv_bytes / 1e6:6.1f} MB, {len(buffers):2d} calls) "
                         f"{name:10s} {a:7.2f} / {b:7.2f}  ({a - b:+.2f})")
            print(lines[-1], flush=True)
            del graph
        del buffers
        torch.cuda.empty_cache()
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    main(args.out, args.rounds)
