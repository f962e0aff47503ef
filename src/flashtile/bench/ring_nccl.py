"""`flashtile bench ring --nccl W`: ring attention on W GPUs of one host, NCCL between them.

Each rank holds its zigzag shard of one sequence (batch 1, bf16, d = 128, 16 heads) and runs
flashtile.distributed.ring_flash_attn_func, forward and forward + backward, as a training step
would; a timed run starts and ends at a barrier, so it lasts as long as the slowest rank. The
baseline is one GPU's flash_attn_func on the same work per GPU: without a mask, the shard's
T / W queries over all T keys (the same (query, key) pairs a rank computes); causal, one causal
sequence of T / sqrt(W) tokens (the same pair count: T^2 / 2W). So

    efficiency = per-GPU TFLOP/s of the ring (forward + backward) / the baseline's

is what the ring keeps of one GPU's kernel: 1 when communication is hidden and the shards' extra
merges cost nothing. The peer, measured alike in the same run: torch's own context parallel
(torch.distributed.tensor.experimental.context_parallel around SDPA's FlashAttention-2), its
efficiency against SDPA's FlashAttention-2 on one GPU. Rows go to ring.json (impl, world_size,
backend, total_tokens, causal, fwd / bwd TFLOP/s per GPU and the baseline's, efficiencies,
milliseconds, peak memory per GPU; the ring's rows also its speed-up over torch's), the plot to
ring.png.

--long: one causal training step (forward + backward) on a sequence longer than one GPU holds,
with its length, the footprints per token of one GPU's step and of the ring's (measured at two
short lengths), the ring's peak memory per GPU and rows checked against float64 (long.json).

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the two others, unless set) in the ranks'
environment.
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


def _sdpa(causal: bool):
    """torch's SDPA on (b, h, s, d) tensors; the caller picks the backend (sdpa_kernel)."""
    import torch.nn.functional as F

    return lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal)


def _baseline(tokens: int, world: int, causal: bool, nheads: int, d: int, dtype, reps: int, impl: str) -> dict:
    """One GPU's kernel on a rank's work: its ms and the pairs it computes. impl: "flashtile"
    (flash_attn_func) or "sdpa" (torch's SDPA, FlashAttention-2 backend, torch CP's kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

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
    if impl == "sdpa":  # SDPA's layout, as views (the layout its FlashAttention-2 reads natively)
        q, k, v, dout = (t.transpose(1, 2) for t in (q, k, v, dout))
        fn = _sdpa(causal)
    else:
        fn = lambda a, b, c: flash_attn_func(a, b, c, causal=causal)  # noqa: E731
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        fwd = _ms(_step(fn, q, k, v, dout, False), reps, ranks=False)
        total = _ms(_step(fn, q, k, v, dout, True), reps, ranks=False)
    return dict(fwd_ms=fwd, bwd_ms=total - fwd, pairs=pairs)


def _inputs(tokens: int, h: int, d: int, dtype) -> list:
    """q, k, v, dout of the whole sequence, (1, tokens, h, d), alike on every rank."""
    gen = torch.Generator("cuda").manual_seed(tokens)
    return [torch.randn(1, tokens, h, d, generator=gen, device="cuda", dtype=dtype) for _ in range(4)]


def _peak_gb(extra: int = 0) -> float:
    """The largest peak of allocated memory over the ranks, in GB, less `extra` bytes."""
    peak = torch.tensor([(torch.cuda.max_memory_allocated() - extra) / 1e9], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)


def _time_ring(rank, world, tokens, causal, h, d, dtype, reps) -> tuple:
    """(fwd ms, fwd + bwd ms, peak GB per GPU) of ring_flash_attn_func on the zigzag shards."""
    from flashtile.distributed import ring_flash_attn_func, shard_sequence

    full = _inputs(tokens, h, d, dtype)
    q, k, v, dout = (shard_sequence(t, rank, world, layout="zigzag") for t in full)
    del full
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fn = lambda a, b, c: ring_flash_attn_func(a, b, c, causal=causal, layout="zigzag")  # noqa: E731
    torch.cuda.reset_peak_memory_stats()
    fwd = _ms(_step(fn, q, k, v, dout, False), reps, ranks=True)
    total = _ms(_step(fn, q, k, v, dout, True), reps, ranks=True)
    return fwd, total, _peak_gb()


def _time_torch_cp(mesh, tokens, causal, h, d, dtype, reps) -> tuple:
    """The same for torch's context parallel: SDPA (FlashAttention-2 backend) inside
    torch.distributed.tensor.experimental.context_parallel, which shards the (b, h, s, d) buffers
    in place (head-tail balanced when causal, its default; its load balancer refuses a full mask,
    so it is off there) and runs its ring (its K/V rotate method left at its default).

    The peak leaves out the storage context_parallel keeps of the full-length buffers (it resizes
    them to the shard in place): a model's q, k, v are made from sharded inputs."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bufs = [t.transpose(1, 2).contiguous() for t in _inputs(tokens, h, d, dtype)]
    balance = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = causal
    try:
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4, no_restore_buffers=set(bufs)), \
                sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            q, k, v, dout = bufs
            assert q.shape[2] == tokens // mesh.size(), "context_parallel did not shard the buffers"
            extra = sum(t.untyped_storage().nbytes() - t.numel() * t.element_size() for t in bufs)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            torch.cuda.reset_peak_memory_stats()
            fwd = _ms(_step(_sdpa(causal), q, k, v, dout, False), reps, ranks=True)
            total = _ms(_step(_sdpa(causal), q, k, v, dout, True), reps, ranks=True)
            peak = _peak_gb(extra)
    finally:
        _cp_options.enable_load_balance = balance
    return fwd, total, peak


def _row(impl, world, tokens, causal, h, d, fwd, total, peak, base) -> dict:
    """One ring.json row: per-GPU TFLOP/s of the run and of its one-GPU kernel on the same work."""
    work = _flops(h, d, tokens * tokens / (2 if causal else 1)) / world  # per GPU, forward
    base_work = _flops(h, d, base["pairs"])
    fwd_tf, bwd_tf = work / fwd / 1e9, 2.5 * work / (total - fwd) / 1e9
    single_fwd, single_bwd = base_work / base["fwd_ms"] / 1e9, 2.5 * base_work / base["bwd_ms"] / 1e9
    return dict(impl=impl, world_size=world, backend="nccl", layout="zigzag" if impl == "flashtile" else "head-tail",
                total_tokens=tokens, causal=causal, nheads=h, headdim=d, fwd_ms=fwd, bwd_ms=total - fwd,
                fwd_tflops_per_gpu=fwd_tf, bwd_tflops_per_gpu=bwd_tf, single_fwd_tflops=single_fwd,
                single_bwd_tflops=single_bwd, single_fwd_ms=base["fwd_ms"], single_bwd_ms=base["bwd_ms"],
                fwd_efficiency=fwd_tf / single_fwd, bwd_efficiency=bwd_tf / single_bwd,
                efficiency=(3.5 * work / total) / (3.5 * base_work / (base["fwd_ms"] + base["bwd_ms"])),
                peak_gb_per_gpu=peak)


def _rank(rank: int, world: int, init: str, opts: dict, out_path: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600), device_id=torch.device("cuda", rank))
    dtype, h, d, reps = getattr(torch, opts["dtype"]), opts["nheads"], opts["headdim"], opts["reps"]
    mesh = None
    if opts["torch_cp"]:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (world,))
    rows, cp_error = [], None
    try:
        for tokens in opts["tokens"]:
            for causal in opts["causal"]:
                runs = {"flashtile": _time_ring(rank, world, tokens, causal, h, d, dtype, reps)}
                torch.cuda.empty_cache()
                if mesh is not None:
                    try:
                        runs["torch_cp"] = _time_torch_cp(mesh, tokens, causal, h, d, dtype, reps)
                    except Exception as e:  # noqa: BLE001 -- a prototype API: say why, keep the ring's rows
                        cp_error, mesh = f"{tokens} tokens, causal={causal}: {type(e).__name__}: {e}"[:600], None
                        print(f"rank {rank}: torch context_parallel failed ({cp_error}); its rows stop here",
                              flush=True)
                    torch.cuda.empty_cache()
                bases = {impl: _baseline(tokens, world, causal, h, d, dtype, reps, "sdpa" if impl == "torch_cp"
                                         else impl) for impl in runs} if rank == 0 else None
                dist.barrier()
                if rank:
                    continue
                new = [_row(impl, world, tokens, causal, h, d, *runs[impl], bases[impl]) for impl in runs]
                if len(new) == 2:  # the ring against torch's, fwd + bwd time
                    new[0]["speedup_vs_torch_cp"] = (new[1]["fwd_ms"] + new[1]["bwd_ms"]) / \
                        (new[0]["fwd_ms"] + new[0]["bwd_ms"])
                rows += new
                for row in new:
                    print(f"W={world} tokens={tokens:7d} {'causal' if causal else 'full  '} {row['impl']:9s} fwd "
                          f"{row['fwd_tflops_per_gpu']:6.1f} / {row['single_fwd_tflops']:6.1f} TFLOP/s per GPU / "
                          f"one GPU, bwd {row['bwd_tflops_per_gpu']:6.1f} / {row['single_bwd_tflops']:6.1f}, "
                          f"efficiency {row['efficiency']:.3f}, peak {row['peak_gb_per_gpu']:.1f} GB", flush=True)
                with open(out_path, "w") as f:
                    json.dump(dict(rows=rows, torch_cp_error=cp_error), f)
    finally:
        dist.destroy_process_group()


def _spawn(fn, world: int, opts: dict) -> list:
    """Run fn(rank, world, init, opts, out_path) on `world` processes; what rank 0 wrote to out_path."""
    if torch.cuda.device_count() < world:
        raise SystemExit(f"--nccl {world} needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    for name, value in NVLS_OFF.items():
        os.environ.setdefault(name, value)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.spawn(fn, (world, os.path.join(tmp, "init"), opts, out_path), nprocs=world)
        with open(out_path) as f:
            return json.load(f)


def _env() -> dict:
    env = harness.environment()
    env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    env["nvls_env"] = {name: os.environ[name] for name in NVLS_OFF}
    return env


def run(world: int, tokens: list, causal: list, nheads: int, headdim: int, dtype: str, reps: int,
        torch_cp: bool = True) -> dict:
    """The rows of every (tokens, causal) on `world` GPUs (flashtile's ring, and torch's context
    parallel unless torch_cp is False), with the environment."""
    opts = dict(tokens=tokens, causal=causal, nheads=nheads, headdim=headdim, dtype=dtype, reps=reps,
                torch_cp=torch_cp)
    result = _spawn(_rank, world, opts)
    return {"env": _env(), "complete": True, **result}


# --------------------------------------------------------------------------------------------
# --long: a sequence longer than one GPU holds
# --------------------------------------------------------------------------------------------

def _footprint(make, step) -> int:
    """Peak bytes a training step of attention holds: its inputs (make()) and everything the
    forward and backward allocate, gradients included."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    tensors = make()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # from the inputs on: not what making them took
    step(*tensors)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del tensors
    return peak


def _fit(points: list) -> tuple:
    """(bytes per token, fixed bytes) through two (tokens, bytes) points."""
    (n1, b1), (n2, b2) = points
    slope = (b2 - b1) / (n2 - n1)
    return slope, b1 - slope * n1


def _gqa_inputs(n, hq, hk, d, dtype, seed):
    gen = torch.Generator("cuda").manual_seed(seed)
    q, dout = (torch.randn(1, n, hq, d, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, n, hk, d, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def _ring_train_step(q, k, v, dout):
    from flashtile.distributed import ring_flash_attn_func

    out, lse, _ = ring_flash_attn_func(q, k, v, causal=True, layout="zigzag", return_attn_probs=True)
    out.backward(dout)
    return out.detach(), lse


def _shard_inputs(n, rank, world, hq, hk, d, dtype):
    """This rank's zigzag shards of a sequence of n tokens, made in place chunk by chunk (the
    whole sequence need not fit on a GPU): chunk c of the sequence comes from generator seed n + c."""
    from flashtile.distributed import shard_index

    idx = shard_index(n, rank, world, "zigzag")
    chunk, s = n // (2 * world), len(idx)
    q, dout = (torch.empty(1, s, hq, d, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.empty(1, s, hk, d, device="cuda", dtype=dtype) for _ in range(2))
    for c in range(0, s, chunk):
        gen = torch.Generator("cuda").manual_seed(n + int(idx[c]) // chunk)
        for t in (q, k, v, dout):
            t[:, c:c + chunk].normal_(generator=gen)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def _rows_attention(qi, doi, kg, vg, visible, scale: float, dtype):
    """out, LSE and dQ of query rows qi (rows, heads, d) over the keys kg, vg (n, d) of their K/V
    head, `visible` (rows, 1, n) of them, computed as reference.naive computes: float64 is the
    oracle; the inputs' dtype (matmuls in it, softmax in float32) is the 2x rule's baseline."""
    qi, doi, kg, vg = (t.to(dtype) for t in (qi, doi, kg, vg))
    s = torch.einsum("rgd,nd->rgn", qi, kg)
    s = (s if dtype == torch.float64 else s.float()) * scale
    s.masked_fill_(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("rgn,nd->rgd", p.to(dtype), vg)
    dp = torch.einsum("rgd,nd->rgn", doi, vg).to(p.dtype)
    ds = (p * (dp - (doi.to(p.dtype) * out.to(p.dtype)).sum(-1, keepdim=True))).to(dtype)
    return out, lse, scale * torch.einsum("rgn,nd->rgd", ds, kg)


def _check_rows(q, k, v, dout, out, lse, rank, world, rows) -> dict:
    """The ring's out, LSE and dQ at `rows` of this rank's shard against the float64 oracle over
    the whole sequence (K and V gathered: small under GQA), next to the error of the baseline
    (_rows_attention in the inputs' dtype): {name: [max error of the ring, of the baseline]}."""
    from flashtile.distributed import gather_sequence, shard_index

    n = q.shape[1] * world
    keys = [gather_sequence(t.detach(), layout="zigzag")[0] for t in (k, v)]  # (n, hk, d)
    pos = shard_index(n, rank, world, "zigzag").to(q.device)[rows]
    visible = torch.arange(n, device=q.device)[None, None, :] <= pos[:, None, None]
    hq, hk, d = q.shape[2], k.shape[2], q.shape[3]
    errs = {name: [0.0, 0.0] for name in ("out", "lse", "dq")}
    for g in range(hk):  # one K/V head and its group of query heads at a time
        heads = slice(g * (hq // hk), (g + 1) * (hq // hk))
        args = (q[0, rows, heads].detach(), dout[0, rows, heads], keys[0][:, g], keys[1][:, g], visible, d ** -0.5)
        oracle = _rows_attention(*args, torch.float64)
        baseline = _rows_attention(*args, q.dtype)
        got = (out[0, rows, heads], lse[0, heads][:, rows].T, q.grad[0, rows, heads])
        for i, name in enumerate(errs):
            for j, x in enumerate((got[i], baseline[i])):
                errs[name][j] = max(errs[name][j], float((x.double() - oracle[i]).abs().max()))
    return errs


def _long_rank(rank: int, world: int, init: str, opts: dict, out_path: str) -> None:
    from flashtile import flash_attn_func

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900), device_id=torch.device("cuda", rank))
    hq, hk, d, dtype = opts["nheads"], opts["kv_heads"], opts["headdim"], getattr(torch, opts["dtype"])
    try:
        # bytes per token of one GPU's step (flash_attn_func) and of the ring's, at two short lengths
        one = []
        if rank == 0:
            for n in opts["probe"]:
                def step(q, k, v, dout):
                    flash_attn_func(q, k, v, causal=True).backward(dout)
                one.append((n, _footprint(lambda: _gqa_inputs(n, hq, hk, d, dtype, 0), step)))
        ring = []
        for n in opts["probe"]:
            peak = torch.tensor([float(_footprint(lambda: _shard_inputs(n, rank, world, hq, hk, d, dtype),
                                                  _ring_train_step))], device="cuda")
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            ring.append((n, float(peak)))
        capacity = torch.cuda.mem_get_info()[1]
        unit = 2 * world * 1024
        decided = torch.zeros(1, dtype=torch.int64, device="cuda")
        note = None
        if rank == 0:
            (one_slope, one_fixed), (ring_slope, ring_fixed) = _fit(one), _fit(ring)
            longest = int((opts["fill"] * capacity - ring_fixed) / ring_slope) // unit * unit
            n = opts["tokens"] or longest
            if ring_fixed + ring_slope * n > 0.92 * capacity:  # an OOM minutes in helps no one
                note = f"{n} tokens asked: {(ring_fixed + ring_slope * n) / 1e9:.0f} GB per GPU by the probes"
                n = longest
            decided[0] = n
        dist.broadcast(decided, 0)
        n = int(decided)
        q, k, v, dout = _shard_inputs(n, rank, world, hq, hk, d, dtype)
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out, lse = _ring_train_step(q, k, v, dout)
        torch.cuda.synchronize()
        dist.barrier()
        seconds = time.perf_counter() - start
        peak = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()],
                            dtype=torch.float64, device="cuda")
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        s = q.shape[1]
        rows = torch.tensor([0, 1, s // 4, s // 2 - 1, s // 2, 3 * s // 4, s - 2, s - 1], device="cuda")
        errs = _check_rows(q, k, v, dout, out, lse, rank, world, rows)
        worst = torch.tensor(list(errs.values()), dtype=torch.float64, device="cuda")  # (3, 2)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if rank == 0:
            flops = 3.5 * _flops(hq, d, n * n / 2)  # forward + backward, causal
            result = dict(
                world_size=world, backend="nccl", layout="zigzag", causal=True, nheads=hq, kv_heads=hk, headdim=d,
                dtype=opts["dtype"], total_tokens=n, note=note, gpu_capacity_gb=capacity / 1e9,
                alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                one_gpu=dict(probe_tokens=[p[0] for p in one], peak_gb=[p[1] / 1e9 for p in one],
                             kb_per_token=one_slope / 1e3, need_gb_at_total_tokens=(one_fixed + one_slope * n) / 1e9,
                             max_tokens=int((capacity - one_fixed) / one_slope)),
                ring_probe=dict(probe_tokens=[p[0] for p in ring], peak_gb_per_gpu=[p[1] / 1e9 for p in ring],
                                kb_per_token_per_gpu=ring_slope / 1e3),
                ring_peak_allocated_gb_per_gpu=float(peak[0]) / 1e9, ring_peak_reserved_gb_per_gpu=float(peak[1]) / 1e9,
                fwd_bwd_seconds=seconds, tflops_per_gpu=flops / world / seconds / 1e12,
                check=dict(rows_per_rank=len(rows), **{
                    name: dict(max_err=float(e[0]), baseline_max_err=float(e[1]),
                               within_2x=bool(e[0] <= 2 * e[1] + 1e-5)) for name, e in zip(errs, worst)}))
            print(json.dumps(result, indent=1), flush=True)
            with open(out_path, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def long_run(world: int, nheads: int, kv_heads: int, headdim: int, dtype: str, tokens: int = 0,
             fill: float = 0.85) -> dict:
    """Ring attention (causal, zigzag) forward + backward, once, on a sequence longer than one GPU
    holds. Both footprints are measured at 32k and 64k tokens (their bytes per token); the length
    is the longest that fills `fill` of a GPU by the ring's (unless `tokens` is given). Rows of each
    rank are checked against float64 (_check_rows)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    opts = dict(nheads=nheads, kv_heads=kv_heads, headdim=headdim, dtype=dtype, tokens=tokens, fill=fill,
                probe=[32768, 65536])
    result = _spawn(_long_rank, world, opts)
    return {"env": _env(), **result}


def plot(json_path: str, out_dir: str) -> str:
    """ring.png: per-GPU TFLOP/s of the ring and of one GPU on the same work, forward and backward,
    against total tokens, labelled with the ring's efficiency; torch's context parallel's where
    ring.json has its rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    rows = data["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, causal in zip(axes, (False, True)):
        mine = sorted((r for r in rows if r["causal"] == causal and r.get("impl", "flashtile") == "flashtile"),
                      key=lambda r: r["total_tokens"])
        if not mine:
            continue
        x = [r["total_tokens"] // 1024 for r in mine]
        for key, label, style in (("fwd_tflops_per_gpu", "ring forward, per GPU", "o-"),
                                  ("single_fwd_tflops", "one GPU forward, same work", "o--"),
                                  ("bwd_tflops_per_gpu", "ring backward, per GPU", "s-"),
                                  ("single_bwd_tflops", "one GPU backward, same work", "s--")):
            ax.plot(x, [r[key] for r in mine], style, label=label)
        theirs = sorted((r for r in rows if r["causal"] == causal and r.get("impl") == "torch_cp"),
                        key=lambda r: r["total_tokens"])
        for key, label, style in (("fwd_tflops_per_gpu", "torch context_parallel (SDPA flash) forward", "^:"),
                                  ("bwd_tflops_per_gpu", "torch context_parallel (SDPA flash) backward", "v:")):
            if theirs:
                ax.plot([r["total_tokens"] // 1024 for r in theirs], [r[key] for r in theirs], style, label=label)
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
