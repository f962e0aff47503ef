"""`flashtile bench decode`: Flash-Decoding against the peers, seed 004's table on this GPU.

Shapes (BENCHMARKS.md): fp16, 16 query / 2 KV heads, d=128, (batch, context) = (256, 256)
(128, 512) (16, 4096) (8, 8192) (2, 32768) (1, 65536) (1, 131072), and Llama-3-8B's 32 / 8 heads
at (64, 8192), one new query token per sequence. Implementations, in one process:
  read-floor         not attention: a Triton kernel that only reads the cache once (the floor)
  eager              PyTorch: expand the KV heads, matmul, softmax, matmul
  sdpa-gqa           scaled_dot_product_attention(enable_gqa=True): what a user gets today
  sdpa-expanded      the same after repeat_interleave of the KV heads (expansion timed too)
  flashtile-nosplit  flash_attn_with_kvcache(num_splits=1): FA2-style, one program per (batch, kv head)
  flashtile          Flash-Decoding, num_splits from configs.decode_num_splits
  flashtile-plan     the same through a DecodePlan made once per shape (a serving loop's per-layer call)
  flashtile-page16/64  the same cache as pages of 16 / 64 tokens handed out in a random order
  flashtile-append, flashtile-plan-append, flashtile-page16-append, sdpa-gqa-append
                     a decoding step that also writes the new token's K/V into the cache: the
                     cache holds context - 1 tokens and flash_attn_with_kvcache(k=, v=) (or a
                     plan's run(q, k_cache, v_cache, k, v)) appends the last one in the same
                     launch; SDPA's user writes it by slice assignment, then attends
  flashtile-sink     flashtile with an attention sink (learnable_sink, gpt-oss), checked against
                     flashtile's output and LSE without one, the sink folded in by hand
Then speculative decoding / chunked prefill: SQ query rows per sequence (GQA packing puts sq x 8
rows in one tile), causal to the cache's end, against SDPA with torch's bottom-right causal mask,
on SQ_SHAPES.
Every flashtile row is checked against SDPA (sq > 1: against the expanded heads with an explicit
mask) before it is timed. Every call reads one of several cache buffers in turn (>= 640 MB in
rotation against a 50 MB L2), so the times measure HBM; GB/s = KV bytes read / time, next to the
device-to-device copy ceiling of the same run. `us` is do_bench's median of one call;
`loop_us` ("eager") is wall time per call in a back-to-back loop of Python calls (host overhead
included; the best of five loops, the implementations of a shape taking turns);
`graph_us` ("device") is the device time per call from a CUDA graph of a call on every buffer,
replayed back to back (host overhead excluded; harness.replay_ms, no L2 flush between replays).

    python -m flashtile.bench.decode --out benchmarks/results/h100
writes decode.json (rewritten after every row); --plot-only redraws decode_latency.png,
decode_bandwidth.png and decode_sq.png from it, --no-plot skips them (scripts/gpu_check.sh: fewer
files back). --sq 2,4,8,16 picks the query lengths of the speculative rows ("" for none).
--sweep times tile / split alternatives per shape (device time, CUDA graphs) into decode_sweep.json:
_split_kernel's tiles, or with --sweep-kernel warps the Gluon split kernel's where it runs.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import re

import torch

from flashtile.bench import harness

SEED_SHAPES = ((256, 256), (128, 512), (16, 4096), (8, 8192), (2, 32768), (1, 65536), (1, 131072))
LLAMA_SHAPE = (64, 8192)
ISSUE_SHAPES = ((64, 1024, 16, 2), (1, 32768, 32, 8))  # issue 11's table: (batch, context, nheads, nheads_k)
SQ_SHAPES = ((16, 4096, 16, 2), (64, 8192, 32, 8))  # (batch, context, nheads, nheads_k) of the sq > 1 rows
SQ = (2, 4, 8, 16)
IMPLS = ("read-floor", "eager", "sdpa-gqa", "sdpa-expanded", "flashtile-nosplit", "flashtile", "flashtile-plan",
         "flashtile-page16", "flashtile-page64", "flashtile-sink", "sdpa-gqa-append", "flashtile-append",
         "flashtile-plan-append", "flashtile-page16-append")
SQ_IMPLS = ("sdpa-gqa", "flashtile", "flashtile-plan")  # the peers of the sq > 1 rows
ROTATION_BYTES = 640 * 2**20
HEADDIM = 128
DEVICE = "cuda"


def cases(quick: bool = False, sqs=SQ):
    """(batch, context, nheads, nheads_k, seqlen_q) of every benchmarked shape: one query row per
    sequence on the seed, Llama and issue-11 shapes, then each of sqs on SQ_SHAPES (the first only
    if quick)."""
    shapes = SEED_SHAPES[2:4] if quick else SEED_SHAPES
    rows = [(b, ctx, 16, 2, 1) for b, ctx in shapes] + [(*LLAMA_SHAPE, 32, 8, 1)]
    if not quick:
        rows += [(*shape, 1) for shape in ISSUE_SHAPES]
    return rows + [(*shape, sq) for shape in SQ_SHAPES[:1 if quick else None] for sq in sqs]


READ_BLOCK = 8192  # elements of K (and of V) one program of the read floor reads


@functools.lru_cache(maxsize=None)
def _read_floor_kernel():
    """A Triton kernel that reads K and V once and writes one float per program: the least any
    decoding kernel must do (its time is the floor of any kernel over this cache, launch included)."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_floor(K, V, Out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(K + offs, mask=ok, other=0.0).to(tl.float32) + tl.load(V + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(Out + tl.program_id(0), tl.sum(x, 0))

    return read_floor


def _read_floor(q, k, v):
    """Every byte of the cache read once (a sum per program), nothing else: the bandwidth floor."""
    n = k.numel()
    grid = -(-n // READ_BLOCK)
    out = torch.empty(grid, dtype=torch.float32, device=k.device)
    _read_floor_kernel()[(grid,)](k, v, out, n, BLOCK=READ_BLOCK, num_warps=8)
    return out


def _eager(q, k, v):
    """Attention as a PyTorch user writes it: BSHD in and out, KV heads expanded."""
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)  # (b, h, 1, d)
    kh = k.transpose(1, 2).repeat_interleave(group, 1)  # (b, h, s, d)
    vh = v.transpose(1, 2).repeat_interleave(group, 1)
    s = (qh @ kh.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (b, h, 1, s)
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return (p @ vh).transpose(1, 2)


def _sdpa_gqa(q, k, v):
    """SDPA with enable_gqa; with several query rows causal to the cache's end, as the flashtile
    rows (torch's CausalBias: its bottom-right variant dispatches to SDPA's flash kernel)."""
    mask = None
    if q.shape[1] > 1:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(q.shape[1], k.shape[1])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)


def _sdpa_expanded(q, k, v):
    group = q.shape[2] // k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(group, 1),
        v.transpose(1, 2).repeat_interleave(group, 1))
    return out.transpose(1, 2)


def _reference(q, k, v):
    """What every row is checked against: SDPA with enable_gqa for one query row; with several, SDPA
    over the expanded heads with the bottom-right causal mask spelled out (runs on any backend)."""
    sq, sk = q.shape[1], k.shape[1]
    if sq == 1:
        return _sdpa_gqa(q, k, v)
    group = q.shape[2] // k.shape[2]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)  # key j <= i + sk - sq
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(group, 1),
        v.transpose(1, 2).repeat_interleave(group, 1), attn_mask=mask)
    return out.transpose(1, 2)


def implementations(batch, context, h, hk, seqlens, dtype, sq=1, num_splits=None):
    """name -> (fn(q, k, v), check(q, k, v) -> max error) over contiguous buffers k, v (batch,
    context, hk, d) and q (batch, sq, h, d); causal when sq > 1.

    check compares fn with the reference on the logical cache behind k, v (_check). The paged rows
    view the same buffers as pages reached through a random page order, so their logical cache is a
    permutation of the buffer, gathered for the check. The sink row is checked against the no-sink
    call instead. The plan row makes its DecodePlan here, once: the calls time its run alone. The
    append rows write the new tokens' K/V (k_new, v_new, the same every call) at the cache's last
    sq positions before attending; they are checked against the reference on the cache as the call
    left it.
    """
    import flashtile

    auto = 0 if num_splits is None else num_splits
    causal = sq > 1

    k_new, v_new = (torch.randn(batch, sq, hk, HEADDIM, device=DEVICE, dtype=dtype) for _ in range(2))
    before = seqlens - sq  # the append rows' cache before the call

    def flash(splits, page_size=None, append=False):
        new = dict(k=k_new, v=v_new, cache_seqlens=before) if append else dict(cache_seqlens=seqlens)
        if page_size is None:
            return (lambda q, k, v: flashtile.flash_attn_with_kvcache(q, k, v, causal=causal, num_splits=splits,
                                                                     **new)), None
        n = context // page_size
        table = torch.randperm(batch * n, device=DEVICE).view(batch, n).int()
        views = {}  # a serving loop keeps its paged cache tensors: one view per rotating buffer, made once

        def pages(t):
            view = views.get(t.data_ptr())
            if view is None:
                view = views[t.data_ptr()] = t.view(-1, page_size, *t.shape[2:])
            return view

        def run(q, k, v):
            return flashtile.flash_attn_with_kvcache(q, pages(k), pages(v), block_table=table, causal=causal,
                                                     num_splits=splits, **new)

        return run, lambda t: pages(t)[table.long()].reshape(t.shape)

    def sdpa_append(q, k, v):
        k[:, context - sq:] = k_new
        v[:, context - sq:] = v_new
        return _sdpa_gqa(q, k, v)

    def planned(append=False):
        lengths, new = (before, (k_new, v_new)) if append else (seqlens, ())
        plan = flashtile.DecodePlan(batch, h, (batch, context, hk, HEADDIM), lengths, dtype=dtype, device=DEVICE,
                                    seqlen_q=sq, seqlen_new=sq if append else 0, causal=causal, num_splits=auto)
        return (lambda q, k, v: plan.run(q, k, v, *new)), None

    sink = torch.randn(h, device=DEVICE) + math.log(context)  # a real share of each row

    def with_sink(q, k, v):
        return flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=causal, num_splits=auto,
                                                 learnable_sink=sink)

    def sink_check(q, k, v) -> float:  # against the no-sink call with the sink folded in by hand
        out, lse = flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=causal,
                                                     num_splits=auto, return_softmax_lse=True)
        new = torch.logaddexp(lse, sink[:, None])
        want = out.float() * torch.exp(lse - new).transpose(1, 2)[..., None]
        return float((with_sink(q, k, v).float() - want).abs().max())

    rows = {"read-floor": (_read_floor, None), "eager": (_eager, None), "sdpa-gqa": (_sdpa_gqa, None),
            "sdpa-expanded": (_sdpa_expanded, None), "flashtile-nosplit": flash(1),
            "flashtile": flash(auto), "flashtile-plan": planned(), "flashtile-page16": flash(auto, 16),
            "flashtile-page64": flash(auto, 64)}
    table = {name: (fn, functools.partial(_check, fn, logical)) for name, (fn, logical) in rows.items()}
    table["flashtile-sink"] = (with_sink, sink_check)
    table["sdpa-gqa-append"] = (sdpa_append, None)
    for name, (fn, logical) in (("flashtile-append", flash(auto, None, True)), ("flashtile-plan-append", planned(True)),
                                ("flashtile-page16-append", flash(auto, 16, True))):
        table[name] = (fn, functools.partial(_check_after, fn, logical))
    return table


def _check(fn, logical, q, k, v) -> float:
    """max |fn - the reference| on the logical cache behind k, v: logical None (k, v as they are)
    or a gather (the paged rows)."""
    ref = _reference(q, k, v) if logical is None else _reference(q, logical(k), logical(v))
    return float((fn(q, k, v).float() - ref.float()).abs().max())


def _check_after(fn, logical, q, k, v) -> float:
    """_check for a call that writes the cache: the reference reads the cache as the call left it."""
    out = fn(q, k, v)
    ref = _reference(q, k, v) if logical is None else _reference(q, logical(k), logical(v))
    return float((out.float() - ref.float()).abs().max())


def _buffers(batch, context, hk, dtype):
    """Enough (k, v) cache buffers that one round of calls reads >= ROTATION_BYTES."""
    kv_bytes = 2 * batch * context * hk * HEADDIM * dtype.itemsize
    n = max(2, -(-ROTATION_BYTES // kv_bytes))
    return [tuple(torch.randn(batch, context, hk, HEADDIM, device=DEVICE, dtype=dtype) for _ in range(2))
            for _ in range(n)], kv_bytes


def _rotating(fn, q, buffers):
    order = itertools.cycle(buffers)
    return lambda: fn(q, *next(order))


EAGER_ROUNDS = 5


def _eager_rounds(calls: dict) -> dict:
    """name -> wall time per call of back-to-back Python calls (host time included): the best of
    EAGER_ROUNDS loops of 100 calls after 10 untimed ones, the implementations taking turns within
    each round, so the host's drift (up to 2x within a run on the H100 machine) reaches them alike.
    (One loop each, one implementation after the other, made rows of the same code differ by 2x.)"""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(EAGER_ROUNDS):
        for name, call in calls.items():
            best[name] = min(best[name], harness.wall_us(call, 100, warmup=10))
    return best


def _graph_us(fn, q, buffers, rep: float = 100.0) -> float:
    """Device time per call without host overhead: one CUDA graph holding a call on every rotating
    buffer, replayed back to back (harness.replay_ms: no cache flush, which the rotation makes
    needless and whose dirty lines cost the first calls of a replay; `us`, through do_bench, has
    the flush, and hides only ~90 µs of host time behind it, so a call with more host work than
    that includes part of it there; `graph_us` does not)."""
    graph, _ = harness.capture(lambda: [fn(q, k, v) for k, v in buffers])
    return harness.replay_ms(graph, rep) * 1e3 / len(buffers)


def chosen_splits(batch, context, h, hk, dtype, page_size=0, sq=1) -> int:
    """The num_splits flashtile's heuristic picks for this shape (recorded with each row), as
    ops.decoding.plan picks it: configs.decode_warp_tiles' where the Gluon split kernel runs."""
    from flashtile.ops import configs

    device = torch.device(DEVICE)
    warps = configs.decode_warp_tiles(sq * h // hk, HEADDIM, dtype, device, batch * hk, context, 0)
    if warps is not None:
        return warps[1]
    return configs.decode_tiles(sq * h // hk, HEADDIM, dtype, page_size, device, batch * hk, context)[1]


def run(args, path: str | None = None) -> dict:
    """Every (shape, implementation) row; an implementation that raises on a shape gets a row with
    its error and the run goes on. With `path`, the result file is rewritten after each row
    ("complete": false until the end), so a run stopped by a time limit still leaves its rows."""
    dtype = getattr(torch, args.dtype)
    rows, failed = [], []
    result = {"env": harness.environment(), "ceilings": harness.ceilings(), "dtype": args.dtype,
              "headdim": HEADDIM, "rotation_mb": ROTATION_BYTES / 2**20, "complete": False,
              "rows": rows, "failed": failed}
    print(f"copy ceiling {result['ceilings']['copy_GBps']:.0f} GB/s")
    shapes = getattr(args, "shapes", None)  # --shapes: these, one query row each, instead of cases()
    todo = [(*shape, 1) for shape in _sweep_shapes(shapes)] if shapes else cases(args.quick, args.sq)
    for batch, context, h, hk, sq in todo:
        buffers, kv_bytes = _buffers(batch, context, hk, dtype)
        q = torch.randn(batch, sq, h, HEADDIM, device=DEVICE, dtype=dtype)
        seqlens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
        shape = dict(batch=batch, context=context, nheads=h, nheads_k=hk, sq=sq, kv_mb=kv_bytes / 1e6)
        sdpa_us, calls = None, {}
        for name, (fn, check) in implementations(batch, context, h, hk, seqlens, dtype, sq).items():
            if name not in args.impls or (sq > 1 and name not in SQ_IMPLS):
                continue
            row = dict(impl=name, **shape)
            rows.append(row)
            try:
                if name.startswith("flashtile"):
                    page = int(re.search(r"page(\d+)", name).group(1)) if "page" in name else 0
                    row["num_splits"] = 1 if name == "flashtile-nosplit" else chosen_splits(
                        batch, context, h, hk, dtype, page, sq)
                    err = check(q, *buffers[0])
                    row["max_err_vs_sdpa"] = err
                    if not err <= args.tolerance:
                        failed.append(f"{name} b={batch} ctx={context}: max error {err:.3g} vs SDPA")
                        print(f"FAILED {failed[-1]}")
                        continue
                call = _rotating(fn, q, buffers)
                us = harness.bench_ms(call) * 1e3
                row.update(us=us, GBps=kv_bytes / us * 1e-3)
                try:
                    row["graph_us"] = _graph_us(fn, q, buffers)
                    row["graph_GBps"] = kv_bytes / row["graph_us"] * 1e-3
                except Exception as e:  # a peer that cannot be captured keeps its other columns
                    row["graph_error"] = repr(e)[:200]
                if name == "sdpa-gqa":
                    sdpa_us = us
                if sdpa_us is not None:
                    row["speedup_vs_sdpa_gqa"] = sdpa_us / us
                calls[name] = (row, call)
            except Exception as e:  # e.g. out of memory for one peer on one shape: record, go on
                row["error"] = repr(e)[:200]
                if name.startswith("flashtile"):
                    failed.append(f"{name} b={batch} ctx={context}: {row['error']}")
                print(f"{name:18s} b={batch:3d} ctx={context:6d}: {row['error'][:120]}")
        for name, us in _eager_rounds({name: call for name, (_, call) in calls.items()}).items():
            row = calls[name][0]
            row["loop_us"] = us
            print(f"{name:18s} b={batch:3d} ctx={context:6d} h={h}/{hk} sq={sq:2d} {kv_bytes / 1e6:7.1f} MB "
                  f"{row['us']:8.1f} us {row['GBps']:7.0f} GB/s  loop {us:7.1f} us"
                  f"  graph {row.get('graph_us', float('nan')):7.1f} us"
                  + (f"  splits {row['num_splits']}" if "num_splits" in row else ""))
        if path:
            harness.write_result(path, result, quiet=True)
        del buffers
        torch.cuda.empty_cache()
    result["complete"] = True
    return result


SWEEP_SHAPES = "256x256,16x4096,1x65536,1x131072,64x8192x32x8"  # batch x context [x nheads x nheads_k]
SWEEP_TILES = "32,64,128x4,8x2,3,4"  # block_n values x warps x stages, each a comma list; "" = shipped tiles


def _sweep_shapes(spec: str):
    """'256x256,64x8192x32x8' -> ((256, 256, 16, 2), (64, 8192, 32, 8)): 16 / 2 heads by default."""
    shapes = []
    for item in filter(None, spec.split(",")):
        n = [int(x) for x in item.split("x")]
        shapes.append(tuple(n) if len(n) == 4 else (*n, 16, 2))
    return shapes


def _sweep_tiles(spec: str):
    """'32,64x4x2,3' -> [(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3)]; '' -> [None] (shipped)."""
    if not spec:
        return [None]
    axes = [[int(v) for v in axis.split(",")] for axis in spec.split("x")]
    return list(itertools.product(*axes))


def _warp_tiles_as(real, tile):
    """configs.decode_warp_tiles with its tiles replaced by tile = (keys a warp, warps, stages), its
    split count and its choice of kernel kept; tile None: the shipped one."""
    from flashtile.ops import configs

    def tiles(rows, d, dtype, device, kv_rows, max_keys, num_splits):
        chosen = real(rows, d, dtype, device, kv_rows, max_keys, num_splits)
        if chosen is None or tile is None:
            return chosen
        keys, warps, stages = tile
        return configs.BlockConfig(chosen[0].block_m, keys * warps, warps, stages), chosen[1]
    return tiles


def sweep(args) -> dict:
    """Device time (graph_us) of flashtile's contiguous and paged paths per shape under alternative
    tiles, split counts (the heuristic's count x factor) and merges (the combine fused into the split
    kernel, a combine kernel, or auto: the shipped rule): configs.decode_config (or, with --sweep-kernel
    warps, configs.decode_warp_tiles) and DECODE_FUSED_MAX_SPLITS replaced for the call. With
    --sweep-kernel triton the tiles are _split_kernel's (BLOCK_N x warps x stages) and the Gluon split
    kernel is off meanwhile; with warps they are _split_kernel_warps' (keys a warp x warps x stages)
    where configs.decode_warp_tiles takes the shape, and the shapes it does not take are skipped."""
    from flashtile.ops import configs

    dtype = getattr(torch, args.dtype)
    real, real_fused, real_warps = configs.decode_config, configs.DECODE_FUSED_MAX_SPLITS, configs.decode_warp_tiles
    gluon = args.sweep_kernel == "warps"
    if not gluon:
        configs.decode_warp_tiles = lambda *args, **kwargs: None
    pages = [int(p) for p in args.sweep_pages.split(",")]
    factors = [float(f) for f in args.sweep_factors.split(",")]
    rows = []
    try:
        for batch, context, h, hk in _sweep_shapes(args.sweep_shapes):
            buffers, kv_bytes = _buffers(batch, context, hk, dtype)
            q = torch.randn(batch, 1, h, HEADDIM, device=DEVICE, dtype=dtype)
            seqlens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
            for page, tile, factor, combine in itertools.product(pages, _sweep_tiles(args.sweep_tiles), factors,
                                                                 args.sweep_combine.split(",")):
                if gluon:
                    configs.decode_warp_tiles = _warp_tiles_as(real_warps, tile)
                elif tile is None:
                    configs.decode_config = real
                else:
                    configs.decode_config = (lambda r, d, dt, p, dev, split=False, one_round=False, t=tile:
                                             configs.BlockConfig(real(r, d, dt, p, dev).block_m, *t))
                configs.DECODE_FUSED_MAX_SPLITS = {"fused": 1 << 30, "kernel": 0}.get(combine, real_fused)
                base = chosen_splits(batch, context, h, hk, dtype, page)
                splits = max(1, round(base * factor))
                # the tiles the launch takes (decode_warp_tiles' or decode_tiles': split or one-round
                # tiles where they apply)
                device = torch.device(DEVICE)
                warp_cfg = configs.decode_warp_tiles(h // hk, HEADDIM, dtype, device, batch * hk, context, splits)
                if gluon and warp_cfg is None:
                    print(f"b={batch:3d} ctx={context:6d}: not the Gluon kernel's shape, skipped", flush=True)
                    break
                cfg = warp_cfg[0] if gluon else configs.decode_tiles(h // hk, HEADDIM, dtype, page, device,
                                                                     batch * hk, context, num_splits=splits)[0]
                if combine == "auto":
                    combine = "fused" if configs.decode_fuse_combine(splits) else "kernel"
                # a new lengths tensor per variant: flash_attn_with_kvcache keeps its recent plans by the
                # identity of the index tensors, and each variant's plan has other tiles
                fn, check = implementations(batch, context, h, hk, seqlens.clone(), dtype, num_splits=splits)[
                    f"flashtile-page{page}" if page else "flashtile"]
                row = dict(batch=batch, context=context, nheads=h, page=page, block_n=cfg.block_n,
                           warps=cfg.num_warps, stages=cfg.num_stages, splits=splits,
                           combine="none" if splits == 1 else combine)
                rows.append(row)
                try:
                    row["max_err_vs_sdpa"] = check(q, *buffers[0])
                    row["graph_us"] = _graph_us(fn, q, buffers, rep=40)
                    row["GBps"] = kv_bytes / row["graph_us"] * 1e-3
                    print(f"b={batch:3d} ctx={context:6d} page={page:2d} BLOCK_N {cfg.block_n:3d} warps "
                          f"{cfg.num_warps} stages {cfg.num_stages} splits {splits:3d} {row['combine']:6s} "
                          f"{row['graph_us']:7.1f} us {row['GBps']:6.0f} GB/s", flush=True)
                except Exception as e:  # out of shared memory for big tiles x stages: record, go on
                    row["error"] = repr(e)[:160]
            for page in pages:
                mine = [r for r in rows if r["batch"] == batch and r["context"] == context
                        and r["page"] == page and "graph_us" in r]
                if not mine:
                    continue
                best = min(mine, key=lambda r: r["graph_us"])
                print(f"b={batch:3d} ctx={context:6d} page={page:2d} best {best['graph_us']:7.1f} us "
                      f"{best['GBps']:6.0f} GB/s: BLOCK_N {best['block_n']} warps {best['warps']} "
                      f"stages {best['stages']} splits {best['splits']} {best['combine']}", flush=True)
            del buffers
            torch.cuda.empty_cache()
    finally:
        configs.decode_config, configs.DECODE_FUSED_MAX_SPLITS = real, real_fused
        configs.decode_warp_tiles = real_warps
    return {"env": harness.environment(), "dtype": args.dtype, "rows": rows}


EAGER_LINES = ("flashtile", "flashtile-plan", "sdpa-gqa", "flashtile-append", "sdpa-gqa-append")  # + eager time
ZOOM = ("read-floor", "sdpa-gqa", "flashtile", "flashtile-plan", "flashtile-page16", "flashtile-page64",
        "sdpa-gqa-append", "flashtile-append", "flashtile-page16-append")  # the right panel of decode_latency.png


def plot(json_path: str, out_dir: str) -> list[str]:
    """decode_latency.png (microseconds vs context, seed shapes: device time of every implementation,
    then ZOOM's with eager time for EAGER_LINES), decode_bandwidth.png (GB/s per shape against the copy ceiling) and decode_sq.png
    (device and eager time against query rows per sequence), from decode.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    every = [r for r in data["rows"] if "us" in r]
    rows = [r for r in every if r.get("sq", 1) == 1]
    # device time (graph replay) where the row has it: the kernels without the host's Python
    dev = {id(r): r.get("graph_us", r["us"]) for r in every}
    impls = [name for name in IMPLS if any(r["impl"] == name for r in rows)]
    env, copy = data["env"], data["ceilings"]["copy_GBps"]
    title = f"{data['dtype']}, d={data['headdim']} — {env['gpu']}, torch {env['torch']}, triton {env['triton']}"

    colors = {name: plt.get_cmap("tab20")(i % 20) for i, name in enumerate(IMPLS)}
    batches = sorted({(r["context"], r["batch"]) for r in rows if r["nheads"] == 16})
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(14, 5.5))
    for name in impls:
        mine = [r for r in rows if r["impl"] == name and r["nheads"] == 16]
        pts = sorted((r["context"], dev[id(r)]) for r in mine)
        wide = 2.5 if name == "flashtile" else 1.2
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, color=colors[name], linewidth=wide)
        if name not in ZOOM:
            continue
        zoom.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, color=colors[name], linewidth=wide)
        if name in EAGER_LINES:  # the same calls back to back from Python: host time included
            pts = sorted((r["context"], r["loop_us"]) for r in mine if "loop_us" in r)
            zoom.plot([p[0] for p in pts], [p[1] for p in pts], linestyle="--", linewidth=1, color=colors[name],
                      label=f"{name} eager (Python loop)")
    for a in (ax, zoom):
        a.set_xscale("log", base=2)
        a.set_xticks([c for c, _ in batches], [f"{c}\nb={b}" for c, b in batches], fontsize=7)
        a.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        a.set_xlabel("context length (batch)")
        a.grid(alpha=0.3, which="both")
    ax.set_yscale("log")
    ax.set_ylabel("µs per decoding step (device time from CUDA graphs, median)")
    ax.set_title("every implementation", fontsize=9)
    ax.legend(fontsize=7)
    zoom.set_ylabel("µs per decoding step: device time; dashed: eager (best Python loop)")
    zoom.set_title("the peers a serving loop picks from, device and eager", fontsize=9)
    zoom.legend(fontsize=7, ncol=2)
    fig.suptitle(f"Decoding, 16 q / 2 kv heads — {title}", fontsize=9)
    fig.tight_layout()
    paths = [os.path.join(out_dir, "decode_latency.png")]
    fig.savefig(paths[0], dpi=90)
    plt.close(fig)

    shapes = sorted({(r["nheads"], r["nheads_k"], r["context"], r["batch"]) for r in rows})
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / max(len(impls), 1)
    for i, name in enumerate(impls):
        gbps = {(r["nheads"], r["nheads_k"], r["context"], r["batch"]): r["kv_mb"] * 1e3 / dev[id(r)]
                for r in rows if r["impl"] == name}
        ax.bar([j + i * width for j in range(len(shapes))], [gbps.get(s, 0) for s in shapes], width, label=name)
    ax.axhline(copy, color="k", linestyle="--", linewidth=1, label=f"copy ceiling {copy:.0f} GB/s")
    ax.axhline(0.85 * copy, color="k", linestyle=":", linewidth=1, label="85% of copy")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))],
                  [f"{h}/{hk} heads\nb={b} ctx={c}" for h, hk, c, b in shapes], fontsize=7)
    ax.set_ylabel("KV bytes read / device time (GB/s)")
    ax.set_title(f"Decoding bandwidth\n{title}", fontsize=9)
    ax.legend(fontsize=7, ncol=3)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "decode_bandwidth.png"))
    fig.savefig(paths[1], dpi=90)
    plt.close(fig)

    spec = [r for r in every if r.get("sq", 1) > 1]
    if spec:
        shapes = sorted({(r["batch"], r["context"], r["nheads"], r["nheads_k"]) for r in spec})
        fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.5), squeeze=False)
        for ax, (b, ctx, h, hk) in zip(axes[0], shapes):
            for name in SQ_IMPLS:
                mine = sorted((r for r in spec if r["impl"] == name and (r["batch"], r["context"], r["nheads"],
                                                                          r["nheads_k"]) == (b, ctx, h, hk)),
                              key=lambda r: r["sq"])
                if not mine:
                    continue
                line, = ax.plot([r["sq"] for r in mine], [dev[id(r)] for r in mine], marker="o", label=name)
                eager = [(r["sq"], r["loop_us"]) for r in mine if "loop_us" in r]
                ax.plot([p[0] for p in eager], [p[1] for p in eager], linestyle="--", linewidth=1,
                        color=line.get_color(), label=f"{name} eager")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["sq"] for r in spec}), [str(n) for n in sorted({r["sq"] for r in spec})])
            ax.set_xlabel("query rows per sequence (causal to the cache's end)")
            ax.set_ylabel("µs per step: device time; dashed: eager")
            ax.set_title(f"b={b} ctx={ctx} {h} q / {hk} kv heads", fontsize=9)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
        fig.suptitle(f"Speculative decoding / chunked prefill\n{title}", fontsize=9)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "decode_sq.png"))
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)
    return paths


def main(argv=None) -> None:
    global HEADDIM
    p = argparse.ArgumentParser(prog="flashtile bench decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="result folder (default benchmarks/results/<gpu>)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--headdim", type=int, default=HEADDIM, help=f"head dim of every shape (default {HEADDIM})")
    p.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS))
    p.add_argument("--tolerance", type=float, default=None,
                   help="max |flashtile - SDPA| before timing (default 4e-3 fp16, 3e-2 bf16: ~16 ulps)")
    p.add_argument("--quick", action="store_true", help="two seed shapes, the Llama shape, one sq shape only")
    p.add_argument("--sq", type=lambda s: [int(x) for x in s.split(",") if x], default=list(SQ),
                   help="query rows per sequence of the speculative-decoding rows (default 2,4,8,16; '' for none)")
    p.add_argument("--shapes", default=None, help="batch x context [x h x hk], comma list, one query row each: "
                   "these shapes instead of the seed, Llama and sq > 1 ones")
    p.add_argument("--sweep", action="store_true", help="tile / split / merge sweep into decode_sweep.json")
    p.add_argument("--sweep-shapes", default=SWEEP_SHAPES, help=f"batch x context [x h x hk], comma list "
                   f"(default {SWEEP_SHAPES})")
    p.add_argument("--sweep-pages", default="0,16", help="page sizes, 0 = contiguous (default 0,16)")
    p.add_argument("--sweep-tiles", default=SWEEP_TILES,
                   help=f"block_n x warps x stages lists ('' = the shipped tiles; default {SWEEP_TILES})")
    p.add_argument("--sweep-factors", default="0.5,1,2,4", help="split counts: the heuristic's x these")
    p.add_argument("--sweep-combine", default="fused,kernel",
                   help="merges: fused (in the split kernel), kernel, auto (the shipped rule)")
    p.add_argument("--sweep-kernel", default="triton", choices=["triton", "warps"],
                   help="whose tiles --sweep-tiles lists: _split_kernel's (BLOCK_N x warps x stages; the Gluon "
                   "kernel off) or the Gluon _split_kernel_warps' (keys a warp x warps x stages, on its shapes)")
    p.add_argument("--sweep-out", default="decode_sweep.json", help="sweep result file name")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--no-plot", action="store_true", help="write decode.json only (redraw later with --plot-only)")
    args = p.parse_args(argv)
    HEADDIM = args.headdim  # every shape's
    if args.tolerance is None:
        args.tolerance = 4e-3 if args.dtype == "float16" else 3e-2
    out = args.out or os.path.join("benchmarks", "results", harness.gpu_slug())
    if not args.plot_only:
        if not torch.cuda.is_available():
            raise SystemExit("flashtile bench decode needs a CUDA GPU")
        unknown = set(args.impls) - set(IMPLS)
        if unknown:
            p.error(f"--impls: unknown {sorted(unknown)}; choose from {IMPLS}")
        if args.sweep:
            harness.write_result(os.path.join(out, args.sweep_out), sweep(args))
            return
        path = os.path.join(out, "decode.json")
        result = run(args, path)
        harness.write_result(path, result)
    if not args.no_plot:
        for png in plot(os.path.join(out, "decode.json"), out):
            print(f"wrote {png}")
    if not args.plot_only and result["failed"]:
        raise SystemExit("flashtile disagreed with SDPA: " + "; ".join(result["failed"]))


if __name__ == "__main__":
    main()
