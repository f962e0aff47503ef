"""The Hopper backward's Q-block rows with and without dropout, alternating in one process.

    PYTHONPATH=src python scripts/ab_dropout_tiles.py [ROUNDS] [D]

bf16, 16k tokens (4 x 4096), heads x d = 2048, causal and not; the forward once with dropout
p = 0.1, then the backward alone (triton.testing.do_bench) with p = 0 and p = 0.1 under each
tile of TILES, forced through configs.hopper_backward_config. Prints ms per round and the median.
"""

import statistics
import sys

import torch
import triton

from flashtile.ops import backward, configs, forward
from flashtile.ops.configs import BlockConfig
from flashtile.reference.dropout import draw_rng

TILES = (BlockConfig(128, 128, 4, 2), BlockConfig(64, 128, 4, 2))


def main(rounds: int = 3, d: int = 64) -> None:
    chosen = configs.hopper_backward_config
    seqlen, batch, heads = 4096, 4, 2048 // d
    try:
        for causal in (False, True):
            q, k, v, dout = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16)
                             for _ in range(4))
            window = (None, 0) if causal else (None, None)
            dropout = (0.1, draw_rng("cuda"))
            out, lse = forward.attention_forward(q, k, v, d ** -0.5, window, dropout=dropout)
            times = {}
            for _ in range(rounds):
                for tiles in TILES:
                    configs.hopper_backward_config = lambda *a, t=tiles, **kw: t
                    for p in (0.0, 0.1):
                        drop = dropout if p else None
                        ms = triton.testing.do_bench(lambda: backward.attention_backward(
                            dout, q, k, v, out, lse, d ** -0.5, window, dropout=drop), warmup=25, rep=100)
                        times.setdefault((tiles.block_m, p), []).append(ms)
            for (rows, p), ms in times.items():
                print(f"d={d} causal={int(causal)} rows={rows} p={p}: {' '.join(f'{x:.3f}' for x in ms)}"
                      f" median {statistics.median(ms):.3f} ms", flush=True)
    finally:
        configs.hopper_backward_config = chosen


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, int(sys.argv[2]) if len(sys.argv) > 2 else 64)
