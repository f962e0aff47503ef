"""`flashtile bench ring`: the compute side of ring attention on one GPU, and its load balance.

Ring attention over W GPUs runs, on each rank, its query shard against every K/V shard in turn:
per step the kernels of that step's pieces plus a log-sum-exp merge (forward), or the backward
kernels plus the dQ / dK / dV accumulation (backward). This benchmark runs that schedule for every
one of W simulated ranks, one after the other, in one process: the same loops as
ring_flash_attn_func (distributed.ring.forward_pass / backward_pass), with the K/V arriving from a
list instead of a peer (comm.SimulatedRing). No communication is timed, so the numbers bound what
any number of GPUs can reach.

    efficiency          = kernel time / schedule time, on equal FLOPs: one flash-attention call
                          over the whole sequence against the W ranks' schedules added up
    kernels_efficiency  = the same with only the schedules' kernel calls timed (no merge, no
                          accumulation): the loss from shorter blocks; the rest of the gap to
                          `efficiency` is the merges and accumulations
    parallel_efficiency = kernel time / (W x the slowest rank's time): what W GPUs reach at best,
                          the slowest rank setting the pace (load balance included)

Per rank: FLOPs (4 d h x the (query, key) pairs it sees, from the plan) and forward / backward
milliseconds, under zigzag and contiguous shards (causal rows; without a mask both layouts give
every rank the same work, so those rows run zigzag, the default). Shapes (the issue's): batch 1,
bf16, d = 128, nheads x d = 2048, total tokens 32k-256k, W = 2, 4, 8. Each row checks the
schedules' gathered output against the one call's before timing.

    python -m flashtile.bench.ring --out benchmarks/results/h100
writes ring_1gpu.json there (rewritten after every row; --append keeps the rows of other
shapes already in it, so the grid can be run in parts: --tokens, --worlds, --masks) and
ring_1gpu.png / ring_1gpu.md from it; --plot-only redraws them. --device cpu runs it on the CPU
(tiny shapes: the CPU smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from flashtile import api, autograd
from flashtile.bench import harness
from flashtile.distributed import comm, plan, ring, shard_sequence, unshard_sequence

LAYOUTS_CAUSAL = ("zigzag", "contiguous")


def _time_ms(fn, reps: int) -> float:
    """Median wall milliseconds of fn() over reps runs after one untimed run, the device drained
    around each (host time included, as a rank's schedule pays it). A call here is a whole
    schedule, up to seconds at 256k tokens, so a few runs give a stable median where do_bench
    would spend minutes on its estimate runs."""
    fn()
    harness.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        harness.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def flops(nheads: int, seqlen: int, d: int, causal: bool) -> float:
    """The papers' forward FLOPs of one sequence (halved when causal); the backward is 2.5x."""
    f = 4 * nheads * seqlen * seqlen * d
    return f / 2 if causal else f


class Problem:
    """One (tokens, causal) problem: the global inputs and one kernel call over them (the baseline)."""

    def __init__(self, tokens, nheads, d, causal, dtype, device):
        gen = torch.Generator(device).manual_seed(tokens)
        self.q, self.k, self.v, self.dout = (torch.randn(1, tokens, nheads, d, generator=gen, device=device,
                                                         dtype=dtype) for _ in range(4))
        self.causal, self.scale = causal, d ** -0.5
        self.backend = api.backend_for(self.q)
        self.out, self.lse = self.forward()

    def forward(self):
        """(out, lse) of the kernels over the whole sequence (flash_attn_func's call, no autograd)."""
        right = 0 if self.causal else None
        return autograd._forward(self.q, self.k, self.v, self.scale, None, right, 0.0, None, 0.0, None,
                                 None, None, 0, 0, None, None, self.backend)

    def backward(self):
        """(dq, dk, dv) of the kernels over the whole sequence."""
        right = 0 if self.causal else None
        return autograd._backward_impl(self.dout, self.q, self.k, self.v, self.out, self.lse, self.scale, None, right,
                                       0.0, None, 0.0, None, None, None, 0, 0, None, self.backend)[:3]


class Schedule:
    """Every simulated rank's schedule of one (world, layout) over a Problem."""

    def __init__(self, problem: Problem, world: int, layout: str):
        self.p, self.world, self.layout = problem, world, layout
        self.window = (-1, 0 if problem.causal else -1)
        self.s_local = problem.q.shape[1] // world
        self.q, self.dout = ([shard_sequence(t, r, world, layout=layout) for r in range(world)]
                             for t in (problem.q, problem.dout))
        self.kv = [tuple(shard_sequence(t, r, world, layout=layout) for t in (problem.k, problem.v))
                   for r in range(world)]
        self.rings = [ring.Ring(r, world, ring.dense_steps(r, world, layout, self.s_local, self.window), problem.scale,
                                0.0, 0.0, problem.backend) for r in range(world)]
        # one per rank, kept: its stand-in dK/dV partials are allocated once, not in every timed call
        self.transports = [comm.SimulatedRing(r, self.kv) for r in range(world)]
        self.outs = [None] * world
        # where kernels_backward's kernels add their dQ (the ring's float32 accumulator of a rank)
        self.dq_sink = torch.zeros(self.q[0].shape, dtype=torch.float32, device=problem.q.device)

    def forward(self, r: int) -> None:
        """Rank r's forward as ring_flash_attn_func runs it: the loop, then the cast to q's dtype."""
        out, lse = ring.forward_pass(self.rings[r], self.q[r], *self.kv[r], self.transports[r])
        self.outs[r] = (out.to(self.q[r].dtype), lse)

    def backward(self, r: int) -> None:
        """Rank r's backward from its forward's out and lse, the gradients cast as the ring casts them."""
        grads = ring.backward_pass(self.rings[r], self.dout[r], self.q[r], *self.kv[r], *self.outs[r],
                                   self.transports[r])
        for g, like in zip(grads, (self.q[r], *self.kv[r])):
            g.to(like.dtype)

    def kernels_forward(self, r: int) -> None:
        """Rank r's forward kernel calls alone: the same pieces, nothing merged."""
        rg = self.rings[r]
        for step, calls in enumerate(rg.steps):
            for call in calls:
                ring.attend(rg, step, call, self.q[r], *self.kv[(r - step) % self.world])

    def kernels_backward(self, r: int) -> None:
        """Rank r's backward kernel calls alone: the same pieces, dK/dV not accumulated (dQ is added
        by the kernels themselves, into dq_sink)."""
        rg = self.rings[r]
        for step, calls in enumerate(rg.steps):
            for call in calls:
                ring.attend_backward(rg, step, call, self.dout[r], self.q[r], *self.kv[(r - step) % self.world],
                                     *self.outs[r], self.dq_sink)

    def rank_flops(self, r: int) -> float:
        """Forward FLOPs of rank r: 4 d h per (query, key) pair its pieces see."""
        chunk = self.s_local // len(plan.chunks_of(r, self.world, self.layout))
        cells = sum(p.cells for t in range(self.world)
                    for p in plan.pieces(r, (r - t) % self.world, self.world, self.layout, chunk, *self.window))
        return 4.0 * self.p.q.shape[2] * self.p.q.shape[3] * cells

    def max_err(self) -> float:
        """Max |the ranks' gathered output - the one call's| (every rank's forward must have run)."""
        out = unshard_sequence([o for o, _ in self.outs], layout=self.layout)
        return float((out.float() - self.p.out.float()).abs().max())


def measure(problem: Problem, kernel_ms: tuple, world: int, layout: str, reps: int, breakdown: bool) -> dict:
    """One row: every simulated rank's forward and backward schedule timed against the one call."""
    s = Schedule(problem, world, layout)
    for r in range(world):
        s.forward(r)
    err = s.max_err()
    # both round float32 sums once to the output dtype: allow a few units in the last place of the
    # largest output (a schedule that loses a step is off by a share of every row it touches)
    tol = 4 * torch.finfo(problem.q.dtype).eps * float(problem.out.float().abs().max())
    if not err <= tol:
        raise AssertionError(f"world {world} {layout}: the schedules' output is {err:.3g} from the kernel's "
                             f"(tolerance {tol:.3g})")
    ranks = range(world)
    fwd = [_time_ms(lambda: s.forward(r), reps) for r in ranks]
    bwd = [_time_ms(lambda: s.backward(r), reps) for r in ranks]
    p = problem
    b, tokens, h, d = p.q.shape
    f = flops(h, tokens, d, p.causal)
    kf, kb = kernel_ms
    row = dict(world_size=world, total_tokens=tokens, causal=p.causal, layout=layout, batch=b, nheads=h, headdim=d,
               dtype=str(p.q.dtype).replace("torch.", ""), max_err_vs_kernel=err,
               kernel_fwd_ms=kf, kernel_bwd_ms=kb, kernel_fwd_tflops=f / kf * 1e-9,
               kernel_bwd_tflops=2.5 * f / kb * 1e-9,
               rank_flops=[s.rank_flops(r) for r in ranks], rank_fwd_ms=fwd, rank_bwd_ms=bwd,
               fwd_ms=sum(fwd), bwd_ms=sum(bwd), fwd_tflops=f / sum(fwd) * 1e-9, bwd_tflops=2.5 * f / sum(bwd) * 1e-9,
               fwd_efficiency=kf / sum(fwd), bwd_efficiency=kb / sum(bwd), efficiency=(kf + kb) / (sum(fwd) + sum(bwd)))
    total = [a + c for a, c in zip(fwd, bwd)]
    row.update(parallel_efficiency=(kf + kb) / (world * max(total)), time_imbalance=max(total) / statistics.mean(total),
               flops_imbalance=max(row["rank_flops"]) / statistics.mean(row["rank_flops"]))
    if breakdown:
        kfwd = [_time_ms(lambda: s.kernels_forward(r), reps) for r in ranks]
        kbwd = [_time_ms(lambda: s.kernels_backward(r), reps) for r in ranks]
        row.update(rank_kernels_fwd_ms=kfwd, rank_kernels_bwd_ms=kbwd,
                   kernels_efficiency=(kf + kb) / (sum(kfwd) + sum(kbwd)),
                   merge_share=1 - (sum(kfwd) + sum(kbwd)) / (sum(fwd) + sum(bwd)))
    return row


def _key(row: dict) -> tuple:
    return row["world_size"], row["total_tokens"], row["causal"], row["layout"]


def run(args, path: str | None = None) -> dict:
    """Every (tokens, causal, world, layout) row; with `path` the result file is rewritten after each
    row ("complete": false until the end). With args.append, rows of other shapes already in the
    file are kept."""
    dtype = getattr(torch, args.dtype)
    kept = []
    if args.append and path and os.path.exists(path):
        with open(path) as f:
            kept = json.load(f)["rows"]
    rows = []
    result = {"env": harness.environment(), "device": args.device, "complete": False, "rows": rows}
    for tokens in args.tokens:
        for causal in [m == "causal" for m in args.masks]:
            problem = Problem(tokens, args.nheads, args.headdim, causal, dtype, args.device)
            kernel_ms = (_time_ms(problem.forward, args.reps), _time_ms(problem.backward, args.reps))
            for world in args.worlds:
                for layout in LAYOUTS_CAUSAL if causal else LAYOUTS_CAUSAL[:1]:
                    row = measure(problem, kernel_ms, world, layout, args.reps, not args.no_breakdown)
                    rows.append(row)
                    print(f"W={world} tokens={tokens:7d} {'causal' if causal else 'full  '} {layout:10s} "
                          f"efficiency {row['efficiency']:.3f} (fwd {row['fwd_efficiency']:.3f} bwd "
                          f"{row['bwd_efficiency']:.3f}) parallel {row['parallel_efficiency']:.3f} "
                          f"rank time max/mean {row['time_imbalance']:.2f}")
                    if path:
                        mine = {_key(r) for r in rows}
                        result["rows"] = [r for r in kept if _key(r) not in mine] + rows
                        harness.write_result(path, result, quiet=True)
            del problem
    mine = {_key(r) for r in rows}
    result["rows"] = [r for r in kept if _key(r) not in mine] + rows
    result["complete"] = True
    return result


def plot(json_path: str, out_dir: str) -> list[str]:
    """ring_1gpu.png: efficiency against tokens per world (all, and the kernels alone), and the
    per-rank times of the largest causal run under zigzag and contiguous shards."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    rows = data["rows"]
    if not rows:
        return []
    worlds = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    for ax, key, title in ((axes[0], "efficiency", "kernel time / schedule time (fwd + bwd)"),
                           (axes[1], "kernels_efficiency", "the same, schedule's kernels alone (no merges)")):
        for i, world in enumerate(worlds):
            for causal, layout, style in ((False, "zigzag", "--"), (True, "zigzag", "-")):
                pts = sorted((r["total_tokens"], r[key]) for r in rows if key in r and r["world_size"] == world
                             and r["causal"] == causal and r["layout"] == layout)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=f"C{i}",
                            label=f"W={world} {'causal zigzag' if causal else 'no mask'}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("total tokens")
        ax.set_ylabel("efficiency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    causal_rows = [r for r in rows if r["causal"]]
    if causal_rows:
        top = max(causal_rows, key=lambda r: (r["world_size"], r["total_tokens"]))
        ax = axes[2]
        width = 0.4
        for j, layout in enumerate(LAYOUTS_CAUSAL):
            match = [r for r in causal_rows if (r["world_size"], r["total_tokens"], r["layout"]) ==
                     (top["world_size"], top["total_tokens"], layout)]
            if match:
                times = [a + b for a, b in zip(match[0]["rank_fwd_ms"], match[0]["rank_bwd_ms"])]
                ax.bar([x + (j - 0.5) * width for x in range(len(times))], times, width, label=layout)
        imbalance = ", ".join(f"{r['layout']} {r['flops_imbalance']:.2f}" for r in causal_rows
                              if (r["world_size"], r["total_tokens"]) == (top["world_size"], top["total_tokens"]))
        ax.set_xticks(range(top["world_size"]))
        ax.set_xlabel(f"simulated rank (FLOPs max / mean: {imbalance})")
        ax.set_ylabel("fwd + bwd ms")
        ax.set_title(f"load balance: causal, W={top['world_size']}, {top['total_tokens']} tokens")
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    env = data["env"]
    fig.suptitle(f"Ring attention's compute on one GPU ({rows[0]['dtype']}, d={rows[0]['headdim']}, "
                 f"nheads={rows[0]['nheads']}, batch 1) - {env['gpu']}, torch {env['torch']}, triton {env['triton']}")
    fig.tight_layout()
    path = os.path.join(out_dir, "ring_1gpu.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def summary(json_path: str) -> str:
    """Markdown table of ring_1gpu.json."""
    with open(json_path) as f:
        data = json.load(f)
    lines = ["| W | tokens | mask | layout | efficiency (fwd / bwd) | kernels alone | parallel | fwd / bwd TFLOP/s "
             "(one call) | rank time max / mean |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(data["rows"], key=lambda r: (r["causal"], r["world_size"], r["total_tokens"], r["layout"])):
        kernels = f"{r['kernels_efficiency']:.3f}" if "kernels_efficiency" in r else "-"
        lines.append(f"| {r['world_size']} | {r['total_tokens']} | {'causal' if r['causal'] else 'none'} | "
                     f"{r['layout']} | {r['efficiency']:.3f} ({r['fwd_efficiency']:.3f} / {r['bwd_efficiency']:.3f}) | "
                     f"{kernels} | {r['parallel_efficiency']:.3f} | {r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f} "
                     f"({r['kernel_fwd_tflops']:.0f} / {r['kernel_bwd_tflops']:.0f}) | {r['time_imbalance']:.2f} |")
    env = data["env"]
    lines.append(f"\n{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; `{env['command']}`")
    return "\n".join(lines) + "\n"


def _ints(s):
    return [int(x) for x in s.split(",")]


def _main_nccl(args, out: str) -> None:
    """--nccl W: the ring on W GPUs (ring_nccl), rows into out/ring.json and its plot; with --long
    the sequence longer than one GPU holds, into out/long.json."""
    from flashtile.bench import ring_nccl

    if args.long:
        path = os.path.join(out, "long.json")
        harness.write_result(path, ring_nccl.long_run(args.nccl, args.nheads, args.kv_heads or args.nheads,
                                                      args.headdim, args.dtype, args.long_tokens))
        return
    path = os.path.join(out, "ring.json")
    if not args.plot_only:
        harness.write_result(path, ring_nccl.run(args.nccl, args.tokens, [m == "causal" for m in args.masks],
                                                 args.nheads, args.headdim, args.dtype, args.reps,
                                                 torch_cp=not args.no_torch_cp))
    if not args.no_plot:
        print(f"wrote {ring_nccl.plot(path, out)}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="flashtile bench ring", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="result folder (default benchmarks/results/<gpu>)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny shapes: a smoke test)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokens", type=_ints, default=[32768, 65536, 131072, 262144], help="total tokens (batch 1)")
    p.add_argument("--worlds", type=_ints, default=[2, 4, 8], help="simulated ranks")
    p.add_argument("--nheads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--masks", type=lambda s: s.split(","), default=["none", "causal"],
                   help="none,causal (default both): the causal rows run zigzag and contiguous shards")
    p.add_argument("--reps", type=int, default=3, help="timed runs per median (after one untimed run)")
    p.add_argument("--no-breakdown", action="store_true", help="skip timing the schedules' kernels alone")
    p.add_argument("--append", action="store_true", help="keep the rows of other shapes already in the file")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--no-plot", action="store_true", help="write ring_1gpu.json and ring_1gpu.md only")
    p.add_argument("--nccl", type=int, default=0, metavar="W",
                   help="run the ring on W GPUs of this host instead (NCCL; bench/ring_nccl.py): ring.json, ring.png")
    p.add_argument("--no-torch-cp", action="store_true", help="--nccl: skip torch's context_parallel rows")
    p.add_argument("--long", action="store_true",
                   help="--nccl: one causal training step on a sequence longer than one GPU holds (long.json)")
    p.add_argument("--kv-heads", type=int, default=0, help="--long: K/V heads (default: --nheads)")
    p.add_argument("--long-tokens", type=int, default=0,
                   help="--long: the length (default: the longest that fills 85%% of a GPU by the ring's footprint)")
    args = p.parse_args(argv)
    out = args.out or os.path.join("benchmarks", "results", harness.gpu_slug())
    if args.nccl:
        _main_nccl(args, out)
        return
    path = os.path.join(out, "ring_1gpu.json")
    if not args.plot_only:
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit("flashtile bench ring needs a CUDA GPU (or --device cpu for a smoke run)")
        if not args.masks or set(args.masks) - {"none", "causal"}:
            p.error(f"--masks: a comma list of none and causal, got {','.join(args.masks)!r}")
        harness.write_result(path, run(args, path))
    if not args.no_plot:
        for png in plot(path, out):
            print(f"wrote {png}")
    table = summary(path)
    with open(os.path.join(out, "ring_1gpu.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
