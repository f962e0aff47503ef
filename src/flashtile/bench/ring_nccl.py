"""`flashtile bench ring --nccl W`: ring attention on W GPUs of one host, NCCL between them.

Each rank holds its zigzag shard of one sequence (batch 1, bf16, d = 128, 16 heads) and runs
flashtile.distributed.ring_flash_attn_func, forward and forward + backward, as a training step
would; a timed run starts and ends at a barrier, so it lasts as long as the slowest rank. The
baseline is one GPU's flash_attn_func on the same work per GPU: without a mask, the shard's
T / W queries over all T keys (the same (query, key) pairs a rank computes); causal, one causal
sequence of T / sqrt(W) tokens (the same pair count: T^2 / 2W). So

    efficiency = per-GPU TFLOP/s of the ring (forward + backward) / the baseline's

is what the ring keeps of one GPU's kernel: 1 when communication is hidden and the shards' extra
merges cost nothing. Rows go to ring.json (world_size, backend, total_tokens, causal,
fwd / bwd TFLOP/s per GPU and the baseline's, efficiencies, milliseconds, peak memory per GPU),
the plot to ring.png. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the two others, unless
set) in the ranks' environment.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtile.bench import harness

NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _flops(nheads: int, d: int, pairs: float) -> float:
    """Forward FLOPs over `pairs` (query, key) pairs; the backward is 2.5x."""
    return 4 * nheads * d * pairs


def _ms(fn, reps: int, ranks: bool) -> float:
    """Median milliseconds of fn() over reps runs after one untimed run; with ranks, each run
    starts and ends at a barrier (the slowest rank's time)."""
    def once():
        torch.cuda.synchronize()
        if ranks:
            dist.barrier()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if ranks:
            dist.barrier()
        return (time.perf_counter() - start) * 1e3

    once()
    return statistics.median(once() for _ in range(reps))


def _step(fn, q, k, v, dout, backward: bool):
    """One forward (and backward) of fn over leaves q, k, v."""
    def run():
        out = fn(q, k, v)
        if backward:
            torch.autograd.backward(out, dout)
        q.grad = k.grad = v.grad = None
    return run


def _baseline(tokens: int, world: int, causal: bool, nheads: int, d: int, dtype, reps: int) -> dict:
    """One GPU's flash_attn_func on a rank's work: its ms and the pairs it computes."""
    from flashtile import flash_attn_func

    gen = torch.Generator("cuda").manual_seed(1)
    if causal:
        sq = sk = max(256, round(tokens / math.sqrt(world) / 256) * 256)
        pairs = sq * sq / 2
    else:
        sq, sk = tokens // world, tokens
        pairs = sq * sk
    q, dout = (torch.randn(1, sq, nheads, d, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, sk, nheads, d, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fn = lambda a, b, c: flash_attn_func(a, b, c, causal=causal)  # noqa: E731
    fwd = _ms(_step(fn, q, k, v, dout, False), reps, ranks=False)
    total = _ms(_step(fn, q, k, v, dout, True), reps, ranks=False)
    return dict(fwd_ms=fwd, bwd_ms=total - fwd, pairs=pairs)


def _rank(rank: int, world: int, init: str, opts: dict, out_path: str) -> None:
    from flashtile.distributed import ring_flash_attn_func, shard_sequence

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    dtype, h, d, reps = getattr(torch, opts["dtype"]), opts["nheads"], opts["headdim"], opts["reps"]
    rows = []
    try:
        for tokens in opts["tokens"]:
            for causal in opts["causal"]:
                gen = torch.Generator("cuda").manual_seed(tokens)
                full = [torch.randn(1, tokens, h, d, generator=gen, device="cuda", dtype=dtype) for _ in range(4)]
                q, k, v, dout = (shard_sequence(t, rank, world, layout="zigzag") for t in full)
                del full
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                fn = lambda a, b, c: ring_flash_attn_func(a, b, c, causal=causal, layout="zigzag")  # noqa: E731
                torch.cuda.reset_peak_memory_stats()
                fwd = _ms(_step(fn, q, k, v, dout, False), reps, ranks=True)
                total = _ms(_step(fn, q, k, v, dout, True), reps, ranks=True)
                peak = torch.tensor([torch.cuda.max_memory_allocated() / 1e9], device="cuda")
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                del q, k, v, dout
                torch.cuda.empty_cache()
                base = _baseline(tokens, world, causal, h, d, dtype, reps) if rank == 0 else None
                dist.barrier()
                if rank:
                    continue
                work = _flops(h, d, tokens * tokens / (2 if causal else 1)) / world  # per GPU, forward
                base_work = _flops(h, d, base["pairs"])
                fwd_tf, bwd_tf = work / fwd / 1e9, 2.5 * work / (total - fwd) / 1e9
                single_fwd, single_bwd = base_work / base["fwd_ms"] / 1e9, 2.5 * base_work / base["bwd_ms"] / 1e9
                row = dict(world_size=world, backend="nccl", layout="zigzag", total_tokens=tokens, causal=causal,
                           nheads=h, headdim=d, fwd_ms=fwd, bwd_ms=total - fwd, fwd_tflops_per_gpu=fwd_tf,
                           bwd_tflops_per_gpu=bwd_tf, single_fwd_tflops=single_fwd, single_bwd_tflops=single_bwd,
                           single_fwd_ms=base["fwd_ms"], single_bwd_ms=base["bwd_ms"],
                           fwd_efficiency=fwd_tf / single_fwd, bwd_efficiency=bwd_tf / single_bwd,
                           efficiency=(3.5 * work / total) / (3.5 * base_work / (base["fwd_ms"] + base["bwd_ms"])),
                           peak_gb_per_gpu=float(peak))
                rows.append(row)
                print(f"W={world} tokens={tokens:7d} {'causal' if causal else 'full  '} fwd {fwd_tf:6.1f} / "
                      f"{single_fwd:6.1f} TFLOP/s per GPU / one GPU, bwd {bwd_tf:6.1f} / {single_bwd:6.1f}, "
                      f"efficiency {row['efficiency']:.3f}, peak {float(peak):.1f} GB", flush=True)
                with open(out_path, "w") as f:
                    json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def run(world: int, tokens: list, causal: list, nheads: int, headdim: int, dtype: str, reps: int) -> dict:
    """The rows of every (tokens, causal) on `world` GPUs, with the environment."""
    if torch.cuda.device_count() < world:
        raise SystemExit(f"--nccl {world} needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    for name, value in NVLS_OFF.items():
        os.environ.setdefault(name, value)
    opts = dict(tokens=tokens, causal=causal, nheads=nheads, headdim=headdim, dtype=dtype, reps=reps)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.spawn(_rank, (world, os.path.join(tmp, "init"), opts, out_path), nprocs=world)
        with open(out_path) as f:
            rows = json.load(f)
    env = harness.environment()
    env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    env["nvls_env"] = {name: os.environ[name] for name in NVLS_OFF}
    return {"env": env, "complete": True, "rows": rows}


def plot(json_path: str, out_dir: str) -> str:
    """ring.png: per-GPU TFLOP/s of the ring and of one GPU on the same work, forward and backward,
    against total tokens; the efficiency on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    rows = data["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, causal in zip(axes, (False, True)):
        mine = sorted((r for r in rows if r["causal"] == causal), key=lambda r: r["total_tokens"])
        if not mine:
            continue
        x = [r["total_tokens"] // 1024 for r in mine]
        for key, label, style in (("fwd_tflops_per_gpu", "ring forward, per GPU", "o-"),
                                  ("single_fwd_tflops", "one GPU forward, same work", "o--"),
                                  ("bwd_tflops_per_gpu", "ring backward, per GPU", "s-"),
                                  ("single_bwd_tflops", "one GPU backward, same work", "s--")):
            ax.plot(x, [r[key] for r in mine], style, label=label)
        for xi, r in zip(x, mine):
            ax.annotate(f"{r['efficiency']:.2f}", (xi, r["bwd_tflops_per_gpu"]), textcoords="offset points",
                        xytext=(0, -14), ha="center", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{t}k" for t in x])
        ax.set_xlabel("total tokens (batch 1, 16 heads, d=128, bf16)")
        ax.set_title(f"{'causal (zigzag)' if causal else 'no mask'}: labels = efficiency")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TFLOP/s per GPU")
    axes[0].legend(fontsize=8)
    world = rows[0]["world_size"] if rows else "?"
    fig.suptitle(f"Ring attention on {world} x {data['env']['gpu']} (NCCL)")
    fig.tight_layout()
    png = os.path.join(out_dir, "ring.png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
