"""`flashtile bench prefill --sections small`: small training calls, where host time shows.

A forward at 8 x 1024 tokens takes ~90 us on an H100; a Python loop of such calls runs at the
speed of the host path when that path costs more. Each row times one implementation four ways, bf16:
`fwd_loop_us` / `fwd_bwd_loop_us`: an eager loop of LOOP calls (forward with inputs that require
grad, or forward + backward), synchronised once, per call; `fwd_graph_us` / `fwd_bwd_graph_us`:
the same call replayed from a CUDA graph (device time, no host). For flashtile also
`host_fwd_us` / `host_bwd_us`: the loop with every compiled launch replaced by a no-op (the host
path up to the driver's launch call: checks, allocations, torch's own small ops and launch
arguments, descriptors included), forward, and forward + backward less forward.

Peers: SDPA's FlashAttention-2 backend and FlashAttention-4 (when `flash_attn.cute` imports;
../shared/tools/fa4_peer.sh brings it to the GPU machine). Packed rows (`varlen`) run
flash_attn_varlen_func (and FA4's) over the same tokens as equal sequences, beside SDPA on the
dense batch. The targets (issue 72): flashtile's forward loop <= 1.1x its graph or <= SDPA's loop;
forward + backward loop <= FA4's and <= 1.25x SDPA-flash's.
"""

from __future__ import annotations

import contextlib
import itertools
import sys

import torch

from flashtile.bench import harness

LOOP = 200
# (batch, seqlen, nheads, headdim, causal): the shapes, and one where every call is host-bound
SHAPES = ((8, 1024, 16, 128, True), (64, 128, 16, 128, True), (32, 512, 12, 64, False), (4, 2048, 32, 128, True),
          (1, 128, 4, 128, True))
VARLEN_SHAPES = ((8, 1024, 16, 128, True), (64, 128, 16, 128, True))


@contextlib.contextmanager
def launches_stubbed():
    """Every launch flashtile has compiled and cached (ops._launch) a no-op while the block runs:
    what a call then costs is its host path. Run the calls once before, so that they are cached."""
    from flashtile.ops import _launch

    # every kernel module loaded (a kernel that launched is loaded), each kernel once however many
    # modules import it; a kernel's unaligned twin (for_strides) keeps its launches in the kernel's cache
    kernels = list({id(k): k for name, m in list(sys.modules.items()) if name.startswith("flashtile.ops.")
                    for k in vars(m).values() if hasattr(k, "_flashtile_launches")}.values())
    saved = [(k, dict(k._flashtile_launches)) for k in kernels]
    # the planned launches keep the last call's compiled launcher bound: unbind them, so that they
    # bind the stub (and, after, the launcher again)
    def unbind():
        for plans in _launch._plan_caches:
            for plan in plans.values():
                for p in [plan] if isinstance(plan, _launch.Plan) else plan.launches:
                    if p.launch is not None:
                        p.launch._bound = None

    noop = lambda *args: None  # noqa: E731
    for k, cache in saved:
        k._flashtile_launches.update({key: (noop, *hit[1:]) for key, hit in cache.items()})
    unbind()
    try:
        yield
    finally:
        for k, cache in saved:
            k._flashtile_launches.clear()
            k._flashtile_launches.update(cache)
        unbind()


def _loop_us(call) -> float:
    for _ in range(10):
        call()
    return harness.wall_us(call, LOOP)


def _graph_us(call) -> float:
    graph, _ = harness.capture(call, warmup=3)
    return harness.replay_ms(graph) * 1e3


def _calls(fn, inputs, dout):
    """(forward, forward + backward) of fn on inputs (q, k, v requiring grad, then the rest)."""
    leaves = inputs[:3]

    def fwd():
        return fn(*inputs)

    def fwd_bwd():
        return torch.autograd.grad(fn(*inputs), leaves, dout)

    return fwd, fwd_bwd


def implementations(varlen: bool, fa4):
    """{name: fn(q, k, v, ...) -> out} of the peers that run here (fa4: flash_attn.cute or None)."""
    from torch.nn.attention import SDPBackend

    import flashtile
    from flashtile.bench.prefill import sdpa_peer

    if varlen:
        table = {"flashtile": lambda q, k, v, cu, n, causal: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, n, n,
                                                                                              causal=causal)}
        if fa4 is not None:
            table["fa4"] = lambda q, k, v, cu, n, causal: fa4.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n, causal=causal)[0]
        return table
    table = {"flashtile": lambda q, k, v, causal: flashtile.flash_attn_func(q, k, v, causal=causal),
             "sdpa-flash": sdpa_peer(SDPBackend.FLASH_ATTENTION)}
    if fa4 is not None:
        table["fa4"] = lambda q, k, v, causal: fa4.flash_attn_func(q, k, v, causal=causal)[0]
    return table


def run_small(args, dtype, result, path) -> None:
    """The rows of the module docstring into result["rows"] (section "small")."""
    fa4 = harness.fa4_module()
    if fa4 is None:
        print("small: flash_attn.cute does not import; FlashAttention-4 rows skipped")
    for varlen, (b, n, h, d, causal) in itertools.chain(((False, s) for s in SHAPES),
                                                        ((True, s) for s in VARLEN_SHAPES)):
        def rand(*shape, grad=True):
            return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=grad)

        if varlen:
            q, k, v = (rand(b * n, h, d) for _ in range(3))
            cu = torch.arange(0, (b + 1) * n, n, device="cuda", dtype=torch.int32)
            extra = (cu, n, causal)
        else:
            q, k, v = (rand(b, n, h, d) for _ in range(3))
            extra = (causal,)
        dout = torch.randn_like(q)
        for name, fn in implementations(varlen, fa4).items():
            row = dict(section="small", impl=name, varlen=varlen, batch=b, seqlen=n, nheads=h, d=d, causal=causal)
            try:
                fwd, fwd_bwd = _calls(fn, (q, k, v, *extra), dout)
                row.update(fwd_loop_us=_loop_us(fwd), fwd_bwd_loop_us=_loop_us(fwd_bwd), fwd_graph_us=_graph_us(fwd),
                           fwd_bwd_graph_us=_graph_us(fwd_bwd))
                if name == "flashtile":
                    with launches_stubbed():
                        host_fwd, host_fwd_bwd = _loop_us(fwd), _loop_us(fwd_bwd)
                    row.update(host_fwd_us=host_fwd, host_bwd_us=host_fwd_bwd - host_fwd)
            except Exception as e:  # a peer without a kernel (or a graph) for this case: record why
                row["error"] = repr(e)[:200]
            result["rows"].append(row)
            print(_line(row), flush=True)
            if path:
                harness.write_result(path, result, quiet=True)
        del q, k, v, dout
        torch.cuda.empty_cache()


def _line(row: dict) -> str:
    shape = f"{'varlen ' if row['varlen'] else ''}{row['batch']} x {row['seqlen']} x {row['nheads']} x {row['d']}" \
            f"{' causal' if row['causal'] else ''}"
    if "error" in row:
        return f"small {row['impl']:10s} {shape}: {row['error']}"
    host = f"  host fwd {row['host_fwd_us']:.1f} bwd {row['host_bwd_us']:.1f} us" if "host_fwd_us" in row else ""
    return (f"small {row['impl']:10s} {shape:32s} fwd loop / graph {row['fwd_loop_us']:7.1f} / "
            f"{row['fwd_graph_us']:7.1f} us, fwd+bwd loop / graph {row['fwd_bwd_loop_us']:7.1f} / "
            f"{row['fwd_bwd_graph_us']:7.1f} us{host}")


def summary(data: dict) -> list[str]:
    """Markdown lines: the small-call table, flashtile against the targets."""
    rows = [r for r in data["rows"] if r.get("section") == "small" and "error" not in r]
    if not rows:
        return []
    by = {(r["impl"], r["varlen"], r["batch"], r["seqlen"], r["nheads"], r["d"], r["causal"]): r for r in rows}
    lines = ["", f"Small calls (bf16; loop: {LOOP} eager calls synchronised once; graph: CUDA-graph replay; us "
             "per call). Targets: flashtile fwd loop <= 1.1x its graph or <= SDPA's loop; fwd + bwd loop <= FA4's "
             "and <= 1.25x SDPA-flash's.", "",
             "| shape (b, n, h, d) | flashtile fwd loop / graph | FA4 fwd loop / graph | SDPA fwd loop / graph | "
             "flashtile fwd+bwd loop / graph | FA4 fwd+bwd loop | SDPA fwd+bwd loop | flashtile host fwd / bwd | "
             "fwd target | fwd+bwd target |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, ours in by.items():
        if key[0] != "flashtile":
            continue
        fa4, sdpa = by.get(("fa4",) + key[1:]), by.get(("sdpa-flash", False) + key[2:])

        def pair(r, a, b=None):
            if r is None:
                return "-"
            return f"{r[a]:.0f}" if b is None else f"{r[a]:.0f} / {r[b]:.0f}"

        fwd_ok = ours["fwd_loop_us"] <= 1.1 * ours["fwd_graph_us"] or (
            sdpa is not None and ours["fwd_loop_us"] <= sdpa["fwd_loop_us"])
        both_ok = (fa4 is None or ours["fwd_bwd_loop_us"] <= fa4["fwd_bwd_loop_us"]) and (
            sdpa is None or ours["fwd_bwd_loop_us"] <= 1.25 * sdpa["fwd_bwd_loop_us"])
        shape = f"{'varlen ' if key[1] else ''}{key[2]}, {key[3]}, {key[4]}, {key[5]}{'' if key[6] else ' (full)'}"
        lines.append(f"| {shape} | {pair(ours, 'fwd_loop_us', 'fwd_graph_us')} | "
                     f"{pair(fa4, 'fwd_loop_us', 'fwd_graph_us')} | {pair(sdpa, 'fwd_loop_us', 'fwd_graph_us')} | "
                     f"{pair(ours, 'fwd_bwd_loop_us', 'fwd_bwd_graph_us')} | {pair(fa4, 'fwd_bwd_loop_us')} | "
                     f"{pair(sdpa, 'fwd_bwd_loop_us')} | "
                     f"{ours.get('host_fwd_us', float('nan')):.0f} / {ours.get('host_bwd_us', float('nan')):.0f} | "
                     f"{'met' if fwd_ok else 'missed'} | {'met' if both_ok else 'missed'} |")
    return lines
