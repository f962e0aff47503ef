"""Decoding device time over one cache stored different ways, same kernel (H100 question of issue 11:
where do the 16-token pages' extra 10% and the split shapes' last 15% of copy bandwidth go?).

    PYTHONPATH=src python scripts/decode_layouts.py [ROUNDS]

fp16, 16 q / 2 kv heads, d=128, device time per call from CUDA-graph replay over rotating caches
(bench.decode._graph_us), min-max over ROUNDS (default 3) alternating rounds:
- contiguous (b, s, hk, d), as the benchmark stores it; head-major: (b, hk, s, d) storage viewed
  as (b, s, hk, d), each kv head's keys contiguous;
- pages of 16 and 64 tokens over the same buffers through three tables: the identity (the pages in
  storage order: the contiguous cache's bytes, reached through the table), a permutation of all
  pages, and each sequence's own pages shuffled;
- the read floor (bench.decode: every byte read once, nothing else) and SDPA enable_gqa.
"""

import sys

import torch

import flashtile
from flashtile.bench import decode

H, HK, D = 16, 2, 128


def paged(batch, context, page, order, seqlens):
    n = context // page
    if order == "identity":
        table = torch.arange(batch * n, device="cuda")
    elif order == "permuted":
        table = torch.randperm(batch * n, device="cuda")
    else:  # each sequence keeps its own region of the pool
        table = torch.cat([i * n + torch.randperm(n, device="cuda") for i in range(batch)])
    table = table.view(batch, n).int()
    views = {}

    def run(q, k, v):
        kv = views.get(k.data_ptr())
        if kv is None:
            kv = views[k.data_ptr()] = (k.view(-1, page, HK, D), v.view(-1, page, HK, D))
        return flashtile.flash_attn_with_kvcache(q, *kv, block_table=table, cache_seqlens=seqlens)

    return run


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for batch, context in [(8, 8192), (2, 32768), (1, 65536), (128, 512), (256, 256)]:
        seqlens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, 1, H, D, device="cuda", dtype=torch.float16)
        buffers, _ = decode._buffers(batch, context, HK, torch.float16)
        head_major = [tuple(x.view(batch, HK, context, D).transpose(1, 2) for x in kv) for kv in buffers]

        def contiguous(q, k, v):
            return flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens)

        cases = [("contiguous", buffers, contiguous), ("head-major", head_major, contiguous)]
        cases += [(f"page{p} {o}", buffers, paged(batch, context, p, o, seqlens))
                  for p in (16, 64) for o in ("identity", "permuted", "per-sequence")]
        cases += [("read floor", buffers, decode._read_floor), ("sdpa", buffers, decode._sdpa_gqa),
                  ("sdpa head-major", head_major, decode._sdpa_gqa)]
        times = {}
        for _ in range(rounds):
            for name, bufs, fn in cases:
                times.setdefault(name, []).append(decode._graph_us(fn, q, bufs))
        print(f"{batch} x {context}: " + ", ".join(f"{n} {min(t):.1f}-{max(t):.1f}" for n, t in times.items()),
              flush=True)


if __name__ == "__main__":
    main()
