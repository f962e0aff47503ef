"""What `flashtile analyze` prints and plots: the four algorithms side by side for one (batch, head).

standard, fa1 and fa2 are a forward of seqlen queries over seqlen keys; decoding is one new query over
seqlen cached keys (Flash-Decoding's workload), so compare it with the others per query, not per call.
"""

from __future__ import annotations

from flashtile.analysis import io_model
from flashtile.analysis.gpus import element_size, get_gpu, roofline
from flashtile.reference.fa1 import block_sizes

ALGORITHMS = ("standard", "fa1", "fa2", "decoding")
BLOCK_M = 128  # flash-attn 2's forward tile for d <= 128 (128 query rows x 64 keys)
BLOCK_N = 64
NUM_SPLITS = 8  # seed 004: 16 heads x 8 splits = 128 programs fill an A100's 108 SMs
PLOT_SEQLENS = tuple(2**p for p in range(7, 18))  # 128 ... 131072


def costs(seqlen: int, headdim: int, dtype: str, sram_bytes: int, block_m: int = BLOCK_M,
          block_n: int = BLOCK_N, num_splits: int = NUM_SPLITS) -> dict[str, tuple[io_model.Cost, dict]]:
    """{algorithm: (Cost, its parameters)} for one (batch, head)."""
    e = element_size(dtype)
    block_r, block_c = block_sizes(sram_bytes, headdim, e)
    return {
        "standard": (io_model.standard(seqlen, seqlen, headdim, e), {"kernels": 3}),
        "fa1": (io_model.fa1(seqlen, seqlen, headdim, e, block_c), {"block_r": block_r, "block_c": block_c}),
        "fa2": (io_model.fa2(seqlen, seqlen, headdim, e, block_m, block_n),
                {"block_m": block_m, "block_n": block_n,
                 "fits_sram": (block_m + 2 * block_n) * headdim * e <= sram_bytes}),
        "decoding": (io_model.decoding(1, seqlen, headdim, e, num_splits, block_m, block_n),
                     {"seqlen_q": 1, "num_splits": num_splits, "block_n": block_n}),
    }


def summary(seqlen: int, headdim: int, dtype: str, sram_bytes: int, gpu: str = "h100",
            block_m: int = BLOCK_M, block_n: int = BLOCK_N, num_splits: int = NUM_SPLITS) -> dict:
    """A JSON-ready dict: the inputs, then one entry per algorithm with flops, hbm_bytes (per batch x
    head), bytes_read, bytes_written, scratch_bytes, arithmetic_intensity (FLOP/byte), roofline_s,
    bound ("compute" or "memory") and the algorithm's block sizes."""
    g = get_gpu(gpu)
    out = {
        "inputs": {"seqlen": seqlen, "headdim": headdim, "dtype": dtype,
                   "element_size": element_size(dtype), "sram_bytes": sram_bytes,
                   "gpu": {"key": gpu, "name": g.name, "tflops": g.peak_flops(dtype) / 1e12,
                           "hbm_TBps": g.hbm_tbps, "source": g.source}},
        "per": "one (batch, head); decoding: one query over seqlen keys",
    }
    rows = costs(seqlen, headdim, dtype, sram_bytes, block_m, block_n, num_splits)
    for name, (cost, params) in rows.items():
        seconds, bound = roofline(cost, g, dtype)
        out[name] = {"flops": cost.flops, "hbm_bytes": cost.hbm_bytes, "bytes_read": cost.bytes_read,
                     "bytes_written": cost.bytes_written, "scratch_bytes": cost.scratch_bytes,
                     "arithmetic_intensity": cost.intensity, "roofline_s": seconds, "bound": bound,
                     **params}
    return out


def text(summary: dict) -> str:
    """The summary as a table for people."""
    inp, g = summary["inputs"], summary["inputs"]["gpu"]
    lines = [
        f"Attention forward per (batch, head): N={inp['seqlen']}, d={inp['headdim']}, {inp['dtype']} "
        f"({inp['element_size']} B/element), SRAM {inp['sram_bytes']} B",
        f"roofline on {g['name']}: {g['tflops']:g} TFLOP/s, {g['hbm_TBps']:g} TB/s ({g['source']}); "
        "HBM only, L2 not modelled",
        f"{'algorithm':<10} {'tiles':<18} {'GFLOP':>10} {'HBM MB':>12} {'FLOP/B':>8} "
        f"{'roofline us':>12}  bound",
    ]
    tiles = {"standard": lambda r: f"{r['kernels']} kernels",
             "fa1": lambda r: f"B_r={r['block_r']} B_c={r['block_c']}",
             "fa2": lambda r: f"{r['block_m']}x{r['block_n']}" + ("" if r["fits_sram"] else " > SRAM"),
             "decoding": lambda r: f"1 query, {r['num_splits']} splits"}
    for name in ALGORITHMS:
        r = summary[name]
        lines.append(f"{name:<10} {tiles[name](r):<18} {r['flops'] / 1e9:>10.4g} "
                     f"{r['hbm_bytes'] / 1e6:>12.4f} "
                     f"{r['arithmetic_intensity']:>8.1f} {r['roofline_s'] * 1e6:>12.4g}  {r['bound']}")
    return "\n".join(lines)


def plot(path: str, headdim: int, dtype: str, sram_bytes: int, gpu: str = "h100",
         seqlens=PLOT_SEQLENS, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
         num_splits: int = NUM_SPLITS) -> None:
    """Two log-log panels against seqlen: HBM bytes and roofline time, per (batch, head).

    Draws on a bare `Figure` (rendered by Agg), so pyplot's global state and backend stay untouched.
    """
    from matplotlib.figure import Figure

    g = get_gpu(gpu)
    rows = [costs(n, headdim, dtype, sram_bytes, block_m, block_n, num_splits) for n in seqlens]
    labels = {"standard": "standard (S, P in HBM)", "fa1": "FA1 (Algorithm 1)", "fa2": "FA2",
              "decoding": f"Flash-Decoding (1 query, {num_splits} splits)"}
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    ax_bytes, ax_time = fig.subplots(1, 2)
    for name in ALGORITHMS:
        hbm = [r[name][0].hbm_bytes for r in rows]
        secs = [roofline(r[name][0], g, dtype)[0] * 1e6 for r in rows]
        style = "--" if name == "decoding" else "-"
        ax_bytes.plot(seqlens, hbm, style, marker="o", ms=3, label=labels[name])
        ax_time.plot(seqlens, secs, style, marker="o", ms=3, label=labels[name])
    compute_us = [r["fa2"][0].flops / g.peak_flops(dtype) * 1e6 for r in rows]
    ax_time.plot(seqlens, compute_us, ":", color="black", label="compute roof alone (prefill FLOPs / peak)")
    ax_bytes.set(yscale="log", xlabel="sequence length N", ylabel="HBM bytes per (batch, head)",
                 title="HBM traffic (L2 not modelled)")
    ax_time.set(yscale="log", xlabel="sequence length N", ylabel="roofline time per (batch, head) [µs]",
                title=f"Roofline on {g.name} ({g.peak_flops(dtype) / 1e12:g} TFLOP/s, {g.hbm_tbps:g} TB/s)")
    for ax in (ax_bytes, ax_time):
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    block_r, block_c = block_sizes(sram_bytes, headdim, element_size(dtype))
    fig.suptitle(f"Attention forward, d={headdim}, {dtype}; SRAM {sram_bytes} B -> FA1 blocks "
                 f"{block_r}x{block_c}; FA2 blocks {block_m}x{block_n}")
    fig.savefig(path, dpi=120)
