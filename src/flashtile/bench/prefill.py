"""`flashtile bench prefill`: forward and backward TFLOP/s against the peers, in one run.

Shapes are the FA2/FA3 papers' (BENCHMARKS.md): bf16, batch x seqlen = 16384 tokens,
nheads x headdim = 2048. Peers: SDPA's FlashAttention-2, cuDNN and memory-efficient backends and
FlexAttention (torch.compile'd, with a causal block mask). Each implementation's output is checked
against SDPA-flash before it is timed. FLOPs: forward 4*b*h*s*s*d (half when causal), backward 2.5x.

    python -m flashtile.bench.prefill --out benchmarks/results/h100
writes prefill.json there (rewritten after every row) and prefill.md; `--plot-only` redraws
prefill.png / prefill_memory.png from the json, `--no-plot` skips them.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from flashtile.bench import harness

PEERS = ("flashtile", "sdpa-flash", "cudnn", "mem-efficient", "flex")


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):  # BSHD in, BSHD out
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)

    return run


def _flex():
    import torch._functorch.config
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # the backward is timed repeatedly over one graph (retain_graph=True), which compiled graphs
    # with donated buffers refuse
    torch._functorch.config.donated_buffer = False
    # one static compile per shape: after a second shape torch.compile would otherwise switch to
    # dynamic shapes, and the later rows would time a kernel with symbolic sizes
    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def run(q, k, v, causal):
        block_mask = None
        if causal:
            key = (q.shape[1], k.shape[1])
            if key not in masks:
                masks[key] = create_block_mask(lambda b, h, i, j: i >= j, None, None, *key, device=q.device)
            block_mask = masks[key]
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask)
        return out.transpose(1, 2)

    return run


def implementations(names):
    from torch.nn.attention import SDPBackend

    import flashtile

    table = {
        "flashtile": lambda q, k, v, causal: flashtile.flash_attn_func(q, k, v, causal=causal),
        "sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
        "mem-efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }
    if "flex" in names:
        table["flex"] = _flex()
    return {n: table[n] for n in names}


def flops(batch, nheads, seqlen, d, causal):
    f = 4 * batch * nheads * seqlen * seqlen * d
    return f / 2 if causal else f


def measure(fn, batch, seqlen, nheads, d, causal, dtype, ref_out=None):
    """Time fn's forward and backward (ms, medians) and its peak memory above the inputs (MB)."""
    q, k, v = (torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=dtype)
    out = fn(q, k, v, causal)
    err = None
    if ref_out is not None:
        try:
            ref = ref_out(q, k, v, causal)
        except Exception:  # SDPA-flash has no kernel for this shape: time this row unchecked
            ref = None
        if ref is not None:
            err = float((out.float() - ref.float()).abs().max())
        del ref
    fwd = harness.bench_ms(lambda: fn(q, k, v, causal))
    bwd = harness.bench_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    del out
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(q, k, v, causal)
    torch.autograd.grad(out, (q, k, v), dout)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return fwd, bwd, peak, err


def run(args, path: str | None = None) -> dict:
    """Every (d, causal, seqlen, peer) row; with `path`, the result file is rewritten after each row
    ("complete": false until the end), so a run stopped by a time limit still leaves its rows."""
    dtype = getattr(torch, args.dtype)
    impls = implementations(args.peers)
    ref = impls.get("sdpa-flash")
    rows = []
    result = {"env": harness.environment(), "ceilings": harness.ceilings(), "dtype": args.dtype,
              "tokens": args.tokens, "complete": False, "rows": rows}
    for d in args.headdims:
        for causal in (False, True):
            for seqlen in args.seqlens:
                batch, nheads = args.tokens // seqlen, 2048 // d
                f = flops(batch, nheads, seqlen, d, causal)
                for name, fn in impls.items():
                    if name == "flex" and (d not in args.flex_headdims or seqlen not in args.flex_seqlens):
                        continue
                    try:
                        fwd, bwd, peak, err = measure(fn, batch, seqlen, nheads, d, causal, dtype,
                                                      None if name == "sdpa-flash" else ref)
                    except Exception as e:  # a peer without a kernel for this shape: record why
                        rows.append(dict(impl=name, d=d, causal=causal, seqlen=seqlen, error=repr(e)[:200]))
                        print(f"{name:14s} d={d} causal={causal} s={seqlen}: {repr(e)[:120]}")
                        if path:
                            harness.write_result(path, result, quiet=True)
                        continue
                    row = dict(impl=name, d=d, causal=causal, seqlen=seqlen, batch=batch, nheads=nheads,
                               fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=f / fwd * 1e-9,
                               bwd_tflops=2.5 * f / bwd * 1e-9, peak_mem_mb=peak, max_err_vs_sdpa_flash=err)
                    rows.append(row)
                    print(f"{name:14s} d={d:3d} causal={causal:d} s={seqlen:5d}  fwd {row['fwd_tflops']:6.1f}"
                          f"  bwd {row['bwd_tflops']:6.1f} TFLOP/s  mem {peak:8.1f} MB  err {err}")
                    if path:
                        harness.write_result(path, result, quiet=True)
    result["complete"] = True
    return result


def plot(json_path: str, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    rows = [r for r in data["rows"] if "error" not in r]
    ds = sorted({r["d"] for r in rows})
    if not ds:  # every row failed (or none ran yet): nothing to draw
        return []
    impls = [p for p in PEERS if any(r["impl"] == p for r in rows)]
    fig, axes = plt.subplots(len(ds), 4, figsize=(18, 3.6 * len(ds)), squeeze=False)
    for i, d in enumerate(ds):
        for j, (causal, direction) in enumerate([(False, "fwd"), (True, "fwd"), (False, "bwd"), (True, "bwd")]):
            ax = axes[i][j]
            for name in impls:
                pts = sorted((r["seqlen"], r[f"{direction}_tflops"]) for r in rows
                             if r["impl"] == name and r["d"] == d and r["causal"] == causal)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                            linewidth=2.5 if name == "flashtile" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{direction}, d={d}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    handles = {}  # one legend for every panel: flex has rows at d=128 only
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    axes[0][0].legend(handles.values(), handles.keys())
    env = data["env"]
    fig.suptitle(f"Prefill attention, {data['dtype']}, batch x seqlen = {data['tokens']}, "
                 f"nheads x d = 2048 — {env['gpu']}, torch {env['torch']}, triton {env['triton']}")
    fig.tight_layout()
    paths = [os.path.join(out_dir, "prefill.png")]
    fig.savefig(paths[0], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    d_mem = 128 if 128 in ds else ds[0]
    for name in impls:
        pts = sorted((r["seqlen"], r["peak_mem_mb"]) for r in rows
                     if r["impl"] == name and r["d"] == d_mem and r["causal"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("seqlen")
    ax.set_ylabel("peak memory above inputs, fwd + bwd (MB)")
    ax.set_title(f"Peak memory, d={d_mem} causal, batch x seqlen = {data['tokens']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "prefill_memory.png"))
    fig.savefig(paths[1], dpi=90)
    plt.close(fig)
    return paths


def summary(json_path: str) -> str:
    """Markdown table from prefill.json: flashtile against SDPA-flash (FA2) and cuDNN, as ratios."""
    with open(json_path) as f:
        data = json.load(f)
    idx = {(r["impl"], r["d"], r["causal"], r["seqlen"]): r for r in data["rows"] if "error" not in r}
    lines = ["| d | causal | seqlen | fwd flashtile / FA2 / cuDNN (TFLOP/s) | fwd vs FA2 | fwd vs cuDNN "
             "| bwd flashtile / FA2 / cuDNN | bwd vs FA2 | bwd vs cuDNN | peak MB flashtile / FA2 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (impl, d, causal, seqlen), r in sorted(idx.items(), key=lambda kv: kv[0][1:]):
        fa2, cudnn = idx.get(("sdpa-flash", d, causal, seqlen)), idx.get(("cudnn", d, causal, seqlen))
        if impl != "flashtile" or fa2 is None or cudnn is None:
            continue
        cells = [str(d), "yes" if causal else "no", str(seqlen)]
        for direction in ("fwd", "bwd"):
            key = f"{direction}_tflops"
            cells += [f"{r[key]:.0f} / {fa2[key]:.0f} / {cudnn[key]:.0f}",
                      f"{r[key] / fa2[key]:.2f}x", f"{r[key] / cudnn[key]:.2f}x"]
        cells.append(f"{r['peak_mem_mb']:.0f} / {fa2['peak_mem_mb']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    env = data["env"]
    lines.append(f"\n{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; "
                 f"`{env['command']}`; ceilings: copy {data['ceilings']['copy_GBps']:.0f} GB/s, "
                 f"bf16 matmul {data['ceilings']['matmul_bf16_TFLOPs']:.0f} TFLOP/s")
    return "\n".join(lines) + "\n"


def _ints(s):
    return [int(x) for x in s.split(",")]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="flashtile bench prefill", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="result folder (default benchmarks/results/<gpu>)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--headdims", type=_ints, default=[64, 128, 256])
    p.add_argument("--seqlens", type=_ints, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen")
    p.add_argument("--peers", type=lambda s: s.split(","), default=list(PEERS))
    p.add_argument("--flex-headdims", type=_ints, default=[128],
                   help="FlexAttention compiles per shape; limit it to these head dims")
    p.add_argument("--flex-seqlens", type=_ints, default=[2048, 8192], help="... and these seqlens")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--no-plot", action="store_true",
                   help="write prefill.json and prefill.md only (redraw later with --plot-only)")
    args = p.parse_args(argv)
    out = args.out or os.path.join("benchmarks", "results", harness.gpu_slug())
    path = os.path.join(out, "prefill.json")
    if not args.plot_only:
        if not torch.cuda.is_available():
            raise SystemExit("flashtile bench prefill needs a CUDA GPU")
        unknown = set(args.peers) - set(PEERS)
        if unknown:
            p.error(f"--peers: unknown {sorted(unknown)}; choose from {PEERS}")
        harness.write_result(path, run(args, path))
    if not args.no_plot:
        for png in plot(path, out):
            print(f"wrote {png}")
    table = summary(path)
    with open(os.path.join(out, "prefill.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
