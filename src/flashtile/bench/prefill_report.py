"""The report half of `flashtile bench prefill`: what it draws and tabulates from prefill.json.

plot() draws prefill.png (forward and backward TFLOP/s against seqlen, one row of panels per head
dim, causal and not) and prefill_memory.png (peak memory above the inputs, fwd + bwd, causal, d=128
when present) from the dense rows. summary() is prefill.md: flashtile's TFLOP/s beside each peer's,
flashtile / peer, flashtile / the faster of cuDNN and FA4 (when FA4 ran), peak memory against FA2,
then the varlen, sink, softcap, ALiBi and dropout sections. Both read only the json, so they run off the GPU
(`python -m flashtile.bench.prefill --out DIR --plot-only`); prefill.py measures and writes it.
"""

from __future__ import annotations

import json
import os

from flashtile.bench.prefill import PEERS


def dense_rows(data: dict) -> list:
    """The dense grid's rows (files written before the sections existed have only those)."""
    return [r for r in data["rows"] if r.get("section", "dense") == "dense" and "error" not in r]


# flashtile thick, the peers thin; a variant shares its family's colour, dashed
LINE_STYLE = {
    "flashtile": dict(color="C0", linewidth=2.5),
    "flashtile-det": dict(color="C0", linewidth=1.2, linestyle=":"),
    "flashtile-triton": dict(color="C0", linewidth=1.2, linestyle="--"),
    "sdpa-flash": dict(color="C1", linewidth=1.2),
    "cudnn": dict(color="C2", linewidth=1.2),
    "fa4": dict(color="C3", linewidth=1.2),
    "fa4-det": dict(color="C3", linewidth=1.2, linestyle="--"),
    "mem-efficient": dict(color="C4", linewidth=1.2),
    "flex": dict(color="C5", linewidth=1.2),
}


def plot(json_path: str, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    rows = dense_rows(data)
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
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=4, label=name,
                            **LINE_STYLE[name])
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
    env = data.get("envs", {}).get("dense", data["env"])  # the dense grid's run
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
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=4, label=name,
                    **LINE_STYLE[name])
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


SUMMARY_PEERS = {"sdpa-flash": "FA2", "cudnn": "cuDNN", "fa4": "FA4", "fa4-det": "FA4-det",
                 "flashtile-det": "flashtile-det", "flashtile-triton": "Triton"}  # summary's columns, in this
# order, when the file has rows
BEST_OF = ("cudnn", "fa4")  # "vs best of cuDNN, FA4": FA4 in its default (non-deterministic) mode


def best_peer(idx: dict, key: tuple, direction: str):
    """(name, TFLOP/s) of the faster of cuDNN and FA4 at key = (d, causal, seqlen), None if neither ran."""
    got = [(idx[(n, *key)][f"{direction}_tflops"], n) for n in BEST_OF if (n, *key) in idx]
    return max(got)[::-1] if got else None


def summary(json_path: str) -> str:
    """Markdown table from prefill.json: flashtile's TFLOP/s beside the peers' (SDPA-flash as FA2,
    cuDNN, FA4, FA4-det, flashtile with deterministic=True, the Triton-only flashtile: those the file
    has rows of), flashtile / peer for
    each, and, when FA4 ran, flashtile / the faster of cuDNN and FA4 at that shape ("-": no row)."""
    with open(json_path) as f:
        data = json.load(f)
    idx = {(r["impl"], r["d"], r["causal"], r["seqlen"]): r for r in dense_rows(data)}
    peers = [p for p in SUMMARY_PEERS if any(i[0] == p for i in idx)]
    has_best = "fa4" in peers
    names = " / ".join(["flashtile"] + [SUMMARY_PEERS[p] for p in peers])
    head = []
    for direction in ("fwd", "bwd"):
        head.append(f"{direction} {names}" + (" (TFLOP/s)" if direction == "fwd" else ""))
        head += [f"{direction} vs {SUMMARY_PEERS[p]}" for p in peers]
        if has_best:
            head.append(f"{direction} vs best of cuDNN, FA4")
    head.append("peak MB flashtile / FA2")
    lines = ["| d | causal | seqlen | " + " | ".join(head) + " |", "|---|---|---|" + "---|" * len(head)]
    for (impl, d, causal, seqlen), r in sorted(idx.items(), key=lambda kv: kv[0][1:]):
        if impl != "flashtile":
            continue
        key = (d, causal, seqlen)
        got = {p: idx.get((p, *key)) for p in peers}
        cells = [str(d), "yes" if causal else "no", str(seqlen)]
        for direction in ("fwd", "bwd"):
            tf = f"{direction}_tflops"
            cells.append(" / ".join([f"{r[tf]:.0f}"] + [f"{g[tf]:.0f}" if g else "-" for g in got.values()]))
            cells += [f"{r[tf] / g[tf]:.2f}x" if g else "-" for g in got.values()]
            if has_best:
                best = best_peer(idx, key, direction)
                cells.append(f"{r[tf] / best[1]:.2f}x ({SUMMARY_PEERS[best[0]]})" if best else "-")
        fa2 = idx.get(("sdpa-flash", *key))
        cells.append(f"{r['peak_mem_mb']:.0f} / " + (f"{fa2['peak_mem_mb']:.0f}" if fa2 else "-"))
        lines.append("| " + " | ".join(cells) + " |")
    lines += _section_summary(data)
    env = data.get("envs", {}).get("dense", data["env"])  # the dense grid's run
    lines.append(f"\n{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; "
                 f"`{env['command']}`; ceilings: copy {data['ceilings']['copy_GBps']:.0f} GB/s, "
                 f"bf16 matmul {data['ceilings']['matmul_bf16_TFLOPs']:.0f} TFLOP/s")
    return "\n".join(lines) + "\n"


def _fwd_bwd(row: dict) -> float:
    return row["fwd_ms"] + row["bwd_ms"]


def _score_mod_summary(data: dict, section: str) -> list[str]:
    """Markdown lines for a score modifier's rows (section "softcap" or "alibi"): each peer's
    TFLOP/s with the modifier, flashtile against its Triton kernels and against itself without it."""
    def on(r):
        return r["softcap"] > 0 if section == "softcap" else r["alibi"]

    mod = {(r["impl"], on(r), r["d"], r["causal"], r["seqlen"]): r for r in data["rows"]
           if r.get("section") == section and "error" not in r}
    if not mod:
        return []
    modified = sorted(k for k in mod if k[1])
    impls = list(dict.fromkeys(k[0] for k in modified))
    lines = ["", f"| {section} | d | causal | seqlen | fwd {' / '.join(impls)} (TFLOP/s) | bwd {' / '.join(impls)} "
             f"| fwd + bwd flashtile vs Triton kernels | flashtile fwd + bwd vs no {section} |",
             "|---|---|---|---|---|---|---|---|"]
    for key in sorted({k[2:] for k in modified}):
        rows = [mod.get((impl, True, *key)) for impl in impls]
        cells = [" / ".join(f"{r[t]:.0f}" if r else "-" for r in rows) for t in ("fwd_tflops", "bwd_tflops")]
        ours, triton, plain = (mod.get(k) for k in (("flashtile", True, *key), ("flashtile-triton", True, *key),
                                                    ("flashtile", False, *key)))
        vs_triton = f"{_fwd_bwd(triton) / _fwd_bwd(ours):.2f}x faster" if ours and triton else "-"
        vs_plain = f"{_fwd_bwd(ours) / _fwd_bwd(plain):.3f}x" if ours and plain else "-"
        what = (ours["softcap"] if section == "softcap" else "yes") if ours else "-"
        lines.append(f"| {what} | {key[0]} | {'yes' if key[1] else 'no'} | {key[2]} | {cells[0]} | {cells[1]} | "
                     f"{vs_triton} | {vs_plain} |")
    return lines


def _section_summary(data: dict) -> list[str]:
    """Markdown lines for the varlen, sink, softcap, ALiBi and dropout rows."""
    lines = []
    for r in data["rows"]:
        if r.get("section") == "varlen" and r["impl"] == "flashtile-varlen":
            lines += ["", f"Varlen: {r['sequences']} sequences of {r['lengths']} tokens ({r['tokens']} in all, "
                      f"longest {r['longest']}), causal, d={r['d']}: fwd {r['fwd_tflops']:.0f} / bwd "
                      f"{r['bwd_tflops']:.0f} TFLOP/s of useful FLOPs; ideal (each sequence at the dense kernel's "
                      f"rate for its length) {r['ideal_fwd_tflops']:.0f} / {r['ideal_bwd_tflops']:.0f}: "
                      f"{r['fwd_vs_ideal']:.2f} / {r['bwd_vs_ideal']:.2f} of ideal. fwd + bwd against the "
                      f"padded batch run dense: {r['speedup_vs_flashtile_padded']:.2f}x flashtile, "
                      f"{r['speedup_vs_sdpa-flash_padded']:.2f}x SDPA-flash."]
    sink = [r for r in data["rows"] if r.get("section") == "sink" and "fwd_bwd_vs_no_sink" in r]
    if sink:
        lines += ["", "| sink | impl | d | seqlen | fwd TFLOP/s no sink / sink | bwd TFLOP/s no sink / sink "
                  "| fwd + bwd vs no sink |", "|---|---|---|---|---|---|---|"]
        for r in sink:
            lines.append(f"| causal | {r['impl']} | {r['d']} | {r['seqlen']} | {r['fwd_tflops_no_sink']:.0f} / "
                         f"{r['fwd_tflops_sink']:.0f} | {r['bwd_tflops_no_sink']:.0f} / {r['bwd_tflops_sink']:.0f} "
                         f"| {r['fwd_bwd_vs_no_sink']:.3f}x |")
    for section in ("softcap", "alibi"):
        lines += _score_mod_summary(data, section)
    from flashtile.bench import small

    lines += small.summary(data)
    drop = [r for r in data["rows"] if r.get("section") == "dropout" and "fwd_bwd_vs_no_dropout" in r]
    if drop:
        lines += ["", "| dropout p | impl | d | causal | seqlen | fwd + bwd vs p = 0 |", "|---|---|---|---|---|---|"]
        for r in drop:
            lines.append(f"| {r['dropout_p']} | {r['impl']} | {r['d']} | {'yes' if r['causal'] else 'no'} | "
                         f"{r['seqlen']} | {r['fwd_bwd_vs_no_dropout']:.3f}x |")
    return lines
