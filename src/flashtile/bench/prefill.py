"""`flashtile bench prefill`: forward and backward TFLOP/s against the peers, in one run.

Shapes are the FA2/FA3 papers' (BENCHMARKS.md): bf16, batch x seqlen = 16384 tokens,
nheads x headdim = 2048. Peers (`--peers`, default all): `flashtile` (flash-attn's default,
deterministic=False), `flashtile-det` (deterministic=True: the bitwise reproducible backward,
on the H100 the Hopper one with dQ in a fixed order where configs.hopper_backward_ordered takes it,
else the Triton programs), `flashtile-triton` (flashtile with its Hopper kernels switched off for the whole
measurement, the Triton kernels only: the A/B baseline of the Hopper kernels), SDPA's
FlashAttention-2 (`sdpa-flash`),
cuDNN and memory-efficient backends, FlashAttention-4 (`fa4`, its default non-deterministic
backward, like flashtile's, and `fa4-det`, deterministic=True, like flashtile-det;
both only when `flash_attn.cute` imports - ../shared/tools/fa4_peer.sh brings it to the GPU machine -
else skipped with one line) and FlexAttention (torch.compile'd, with a causal block mask). Each
implementation's output is checked against SDPA-flash before it is timed. FLOPs: forward
4*b*h*s*s*d (half when causal), backward 2.5x. prefill.md gives flashtile against each peer and
against the faster of cuDNN and FA4 at each shape.

    python -m flashtile.bench.prefill --out benchmarks/results/h100
writes prefill.json there (rewritten after every row) and prefill.md; `--plot-only` redraws
prefill.png / prefill_memory.png from the json, `--no-plot` skips them. This module measures;
prefill_report.py draws the plots and the table from the json.

Sections (`--sections`, default all): `dense` (the grid above), `varlen` (a packed batch of mixed
lengths against the same tokens padded and run dense, and against the ideal: each sequence at the
dense kernel's TFLOP/s for its length), `dropout` (p = 0.1 against p = 0, flashtile, SDPA-flash and cuDNN),
`sink` (an attention sink, learnable_sink, against none: flashtile, and FlashAttention-4 when
`flash_attn.cute` imports - ../shared/tools/fa4_peer.sh brings it to the GPU machine), `softcap`
(Gemma-2's capped logits, softcap * tanh(s / softcap): flashtile, flashtile's Triton kernels,
FA4 when it imports and FlexAttention with a tanh score_mod, and flashtile without a cap), `alibi`
(ALiBi's bias -slope |i - j|, slopes 2^(-8 (i + 1) / h): flashtile, its Triton kernels, SDPA with
the bias as a float attn_mask, as transformers' SDPA path gives ALiBi models, FlexAttention with
the bias as a score_mod, and flashtile without ALiBi), `small` (small training calls in an eager loop
against the same calls from a CUDA graph, flashtile's host time with its launches stubbed, SDPA-flash
and FA4 beside: bench/small.py). A run of some sections keeps the other
sections' rows of an existing prefill.json (with the environment they were measured in, under
"envs").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os

import torch

from flashtile.bench import harness

PEERS = ("flashtile", "flashtile-det", "flashtile-triton", "sdpa-flash", "cudnn", "fa4", "fa4-det", "mem-efficient",
         "flex")
FA4_PEERS = ("fa4", "fa4-det")  # run only when flash_attn.cute imports


def sdpa_peer(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):  # BSHD in, BSHD out
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)

    return run


def _flex(score_mod=None):
    """(q, k, v, causal) -> out of FlexAttention (compiled, a causal block mask per shape), with
    score_mod applied to the scores when given."""
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
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
                       block_mask=block_mask)
        return out.transpose(1, 2)

    return run


@contextlib.contextmanager
def _triton_only():
    """flashtile's Hopper kernels switched off while the block runs: configs.hopper_forward_config
    and hopper_backward_config answer None (the Triton kernels), and are restored after it, raised
    or not (the ops look them up at call time). Around a whole measurement, since the backward runs
    after the forward's call has returned."""
    from flashtile.ops import configs

    saved = configs.hopper_forward_config, configs.hopper_backward_config
    configs.hopper_forward_config = configs.hopper_backward_config = lambda *a, **kw: None
    try:
        yield
    finally:
        configs.hopper_forward_config, configs.hopper_backward_config = saved


# what a peer runs under, for its whole measurement
PEER_CONTEXTS = {"flashtile-triton": _triton_only}


def _fa4_peer(fa4, deterministic: bool):
    """(q, k, v, causal) -> out of FlashAttention-4 (BSHD in and out; it returns (out, lse))."""
    kwargs = {"deterministic": True} if deterministic else {}  # else FA4's default backward

    def run(q, k, v, causal):
        return fa4(q, k, v, causal=causal, **kwargs)[0]

    return run


def available_peers(names, fa4=None) -> list:
    """names without fa4 and fa4-det when FlashAttention-4 (`fa4`, default _fa4()) does not import,
    saying so in one line; names unchanged when neither is asked for (nothing is imported then)."""
    asked = [n for n in names if n in FA4_PEERS]
    if not asked:
        return list(names)
    if (fa4 or _fa4()) is not None:
        return list(names)
    print(f"dense: flash_attn.cute does not import; {', '.join(asked)} skipped")
    return [n for n in names if n not in FA4_PEERS]


def implementations(names):
    """{name: (q, k, v, causal) -> out} for names, BSHD tensors in and out (fa4 and fa4-det need
    flash_attn.cute: pass names through available_peers first)."""
    from torch.nn.attention import SDPBackend

    import flashtile

    def tile(q, k, v, causal, deterministic=False):
        return flashtile.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)

    table = {
        "flashtile": tile,
        "flashtile-det": lambda q, k, v, causal: tile(q, k, v, causal, deterministic=True),
        "flashtile-triton": tile,  # under _triton_only (PEER_CONTEXTS)
        "sdpa-flash": sdpa_peer(SDPBackend.FLASH_ATTENTION),
        "cudnn": sdpa_peer(SDPBackend.CUDNN_ATTENTION),
        "mem-efficient": sdpa_peer(SDPBackend.EFFICIENT_ATTENTION),
    }
    if any(n in FA4_PEERS for n in names):
        fa4 = _fa4()
        table.update({n: _fa4_peer(fa4, n == "fa4-det") for n in FA4_PEERS})
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


def varlen_lengths(tokens: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """Sequence lengths drawn uniformly from [lo, hi] (seeded) until they sum to `tokens`; the last
    one takes what is left."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(int(torch.randint(lo, hi + 1, (1,), generator=gen)), tokens - sum(lengths)))
    return lengths


def _interp_log2(points: dict, x: float) -> float:
    """Piecewise-linear interpolation of {length: value} in log2(length), clamped at the ends."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if x <= b:
            t = (math.log2(x) - math.log2(a)) / (math.log2(b) - math.log2(a))
            return points[a] + t * (points[b] - points[a])
    return points[xs[-1]]


def run_varlen(args, dtype, result, path):
    """A packed batch (args.tokens tokens, lengths from args.varlen_lengths, causal, d=128) through
    flash_attn_varlen_func, against (a) the same sequences padded to the longest and run dense by
    flashtile and SDPA-flash, (b) the ideal: every sequence at the dense kernel's TFLOP/s for its
    length (measured at powers of two, interpolated in log2(length)). TFLOP/s count useful FLOPs."""
    import flashtile

    impls = implementations(["flashtile", "sdpa-flash"])
    d, causal = 128, True
    h = 2048 // d
    lo, hi = args.varlen_lengths
    lengths = varlen_lengths(args.tokens, lo, hi)
    total, n, longest = sum(lengths), len(lengths), max(lengths)
    useful = sum(flops(1, h, L, d, causal) for L in lengths)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(total, h, d, device="cuda", dtype=dtype)

    def varlen():
        return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)

    out = varlen()
    fwd = harness.bench_ms(varlen)
    bwd = harness.bench_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    base = dict(section="varlen", d=d, causal=causal, tokens=total, sequences=n, longest=longest,
                lengths=f"{lo}-{hi}", useful_tflop=useful * 1e-12)
    row = dict(base, impl="flashtile-varlen", fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=useful / fwd * 1e-9,
               bwd_tflops=2.5 * useful / bwd * 1e-9)
    del out
    for name, fn in impls.items():  # the same sequences padded to the longest, dense
        f_fwd, f_bwd, peak, _ = measure(fn, n, longest, h, d, causal, dtype)
        result["rows"].append(dict(base, impl=f"{name}-padded", fwd_ms=f_fwd, bwd_ms=f_bwd,
                                   fwd_tflops=useful / f_fwd * 1e-9, bwd_tflops=2.5 * useful / f_bwd * 1e-9,
                                   peak_mem_mb=peak))
        row[f"speedup_vs_{name}_padded"] = (f_fwd + f_bwd) / (fwd + bwd)
        print(f"{name}-padded: fwd {f_fwd:.3f} ms bwd {f_bwd:.3f} ms")
    dense = {}  # length -> (fwd, bwd) TFLOP/s of the dense kernel, args.tokens tokens per call
    L = lo
    while True:
        L2 = min(L, hi)
        f_fwd, f_bwd, _, _ = measure(impls["flashtile"], max(1, args.tokens // L2), L2, h, d, causal, dtype)
        f = flops(max(1, args.tokens // L2), h, L2, d, causal)
        dense[L2] = (f / f_fwd * 1e-9, 2.5 * f / f_bwd * 1e-9)
        if L2 >= hi:
            break
        L *= 2
    ideal_fwd = sum(flops(1, h, x, d, causal) / (_interp_log2({a: b[0] for a, b in dense.items()}, x) * 1e9)
                    for x in lengths)
    ideal_bwd = sum(2.5 * flops(1, h, x, d, causal) / (_interp_log2({a: b[1] for a, b in dense.items()}, x) * 1e9)
                    for x in lengths)
    row.update(ideal_fwd_tflops=useful / ideal_fwd * 1e-9, ideal_bwd_tflops=2.5 * useful / ideal_bwd * 1e-9,
               fwd_vs_ideal=ideal_fwd / fwd, bwd_vs_ideal=ideal_bwd / bwd,
               dense_tflops_by_length={str(a): b for a, b in dense.items()})
    result["rows"].append(row)
    print(f"varlen: {n} sequences, fwd {row['fwd_tflops']:.0f} TFLOP/s ({row['fwd_vs_ideal']:.2f} of ideal), "
          f"bwd {row['bwd_tflops']:.0f} ({row['bwd_vs_ideal']:.2f}), "
          f"{row['speedup_vs_sdpa-flash_padded']:.2f}x SDPA-flash padded")
    if path:
        harness.write_result(path, result, quiet=True)


DROPOUT_PEERS = ("flashtile", "sdpa-flash", "cudnn")


def _with_dropout(name: str, p: float):
    """(q, k, v, causal) -> out of flashtile, SDPA-flash or SDPA-cuDNN with dropout_p = p."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtile

    if name == "flashtile":
        return lambda q, k, v, causal: flashtile.flash_attn_func(q, k, v, dropout_p=p, causal=causal)
    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, dropout_p=p)
        return out.transpose(1, 2)

    return run


def run_dropout(args, dtype, result, path):
    """flashtile, SDPA-flash and SDPA-cuDNN with dropout_p = args.dropout_p and 0 at
    args.dropout_seqlens (a peer that fails, e.g. a backend without dropout, is reported and left
    out of that row)."""
    for d in args.headdims:
        if d > 128:
            continue
        for causal in (False, True):
            for seqlen in args.dropout_seqlens:
                batch, nheads = args.tokens // seqlen, 2048 // d
                f = flops(batch, nheads, seqlen, d, causal)
                for name in DROPOUT_PEERS:
                    times = {}
                    for p in (0.0, args.dropout_p):
                        try:
                            fwd, bwd, peak, _ = measure(_with_dropout(name, p), batch, seqlen, nheads, d, causal,
                                                        dtype)
                        except Exception as e:  # noqa: BLE001 - a peer's failure is a result, not a crash
                            if name == "flashtile":
                                raise
                            print(f"dropout {name} d={d} causal={causal:d} s={seqlen} p={p}: failed {e!r}"[:300])
                            break
                        times[p] = fwd + bwd
                        result["rows"].append(dict(section="dropout", impl=name, dropout_p=p, d=d, causal=causal,
                                                   seqlen=seqlen, batch=batch, nheads=nheads, fwd_ms=fwd,
                                                   bwd_ms=bwd, fwd_tflops=f / fwd * 1e-9,
                                                   bwd_tflops=2.5 * f / bwd * 1e-9, peak_mem_mb=peak))
                    if len(times) < 2:
                        continue
                    result["rows"][-1]["fwd_bwd_vs_no_dropout"] = times[args.dropout_p] / times[0.0]
                    print(f"dropout {name:10s} d={d} causal={causal:d} s={seqlen}: fwd+bwd "
                          f"{times[0.0]:.3f} -> {times[args.dropout_p]:.3f} ms "
                          f"({times[args.dropout_p] / times[0.0]:.3f}x)")
                    if path:
                        harness.write_result(path, result, quiet=True)


def _with_softcap(name: str, cap: float, fa4=None):
    """(q, k, v, causal) -> out of a peer with its logits capped: cap * tanh(s / cap) (cap 0: none)."""
    import flashtile

    if name in ("flashtile", "flashtile-triton"):  # the second under _triton_only (PEER_CONTEXTS)
        return lambda q, k, v, causal: flashtile.flash_attn_func(q, k, v, causal=causal, softcap=cap)
    if name == "fa4":
        return lambda q, k, v, causal: fa4(q, k, v, causal=causal, softcap=cap)[0]

    def capped(score, b, h, i, j):
        return cap * torch.tanh(score / cap)

    return _flex(capped)


def alibi_slopes(nheads: int, device) -> torch.Tensor:
    """ALiBi's slopes (Press et al.), float32: 2^(-8 (i + 1) / nheads) for head i."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / nheads) for i in range(nheads)], device=device)


def _with_alibi(name: str, on: bool):
    """(q, k, v, causal) -> out of a peer with ALiBi's bias (on) or without it (flashtile only).
    The slopes (and SDPA's bias) are made once per shape, outside the timed calls: a model makes
    them once, and a tensor built from a list on every call would time a host-to-device copy. The
    bias (h, sq, sk) exists before `measure` takes its memory baseline: sdpa-bias's peak memory
    leaves it out."""
    import flashtile

    slopes = {}

    def slopes_of(q):
        key = (q.shape[2], q.device)
        if key not in slopes:
            slopes[key] = alibi_slopes(*key)
        return slopes[key]

    if name in ("flashtile", "flashtile-triton"):  # the second under _triton_only (PEER_CONTEXTS)
        return lambda q, k, v, causal: flashtile.flash_attn_func(q, k, v, causal=causal,
                                                                 alibi_slopes=slopes_of(q) if on else None)
    if name == "sdpa-bias":
        biases = {}  # one (h, sq, sk) bias per shape, made outside the timed calls (a model makes it once per step)

        def run(q, k, v, causal):
            key = (q.shape[1:3], k.shape[1], causal, q.dtype)
            if key not in biases:
                sq, sk = q.shape[1], k.shape[1]
                i = torch.arange(sq, device=q.device)[:, None] + sk - sq
                j = torch.arange(sk, device=q.device)[None, :]
                dist = (i - j).abs().float()
                bias = torch.empty(q.shape[2], sq, sk, dtype=q.dtype, device=q.device)
                for head, slope in enumerate(slopes_of(q).tolist()):  # fp32 products, one head's at a time
                    bias[head] = dist * -slope
                if causal:
                    bias.masked_fill_(j > i, float("-inf"))
                biases[key] = bias
            out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                   v.transpose(1, 2), attn_mask=biases[key])
            return out.transpose(1, 2)

        return run
    current = {}

    def biased(score, b, h, i, j):  # the bench's sq == sk
        return score - current["slopes"][h] * (i - j).abs()

    flex = _flex(biased)

    def run(q, k, v, causal):
        current["slopes"] = slopes_of(q)
        return flex(q, k, v, causal)

    return run


def run_score_mod(section: str, args, dtype, result, path):
    """Forward and backward with a score modifier, section "softcap" (softcap = args.softcap) or
    "alibi", at args.<section>_headdims x args.<section>_seqlens, causal and not: flashtile, its
    Triton kernels (flashtile-triton, the path the modifier took before the Hopper kernels had it),
    the peers (softcap: FA4 when it imports; alibi: SDPA with the bias as attn_mask), FlexAttention
    (at args.flex_headdims); then flashtile without the modifier, for its cost. Each modified output
    is checked against the Triton kernels'."""
    if section == "softcap":
        fa4 = _fa4()
        names = ["flashtile", "flashtile-triton"] + (["fa4"] if fa4 is not None else []) + ["flex"]
        if fa4 is None:
            print("softcap: flash_attn.cute does not import; FlashAttention-4 rows skipped")

        def make(name, on):
            return _with_softcap(name, args.softcap if on else 0.0, fa4)

        def label(on):
            return dict(softcap=args.softcap if on else 0.0)
    else:
        names = ["flashtile", "flashtile-triton", "sdpa-bias", "flex"]
        make = _with_alibi

        def label(on):
            return dict(alibi=on)

    def triton_ref(q, k, v, causal):
        with _triton_only():
            return make("flashtile", True)(q, k, v, causal)

    for d in getattr(args, f"{section}_headdims"):
        for causal in (False, True):
            for seqlen in getattr(args, f"{section}_seqlens"):
                batch, nheads = args.tokens // seqlen, 2048 // d
                f = flops(batch, nheads, seqlen, d, causal)
                for name, on in [(n, True) for n in names] + [("flashtile", False)]:
                    if name == "flex" and d not in args.flex_headdims:  # a compile per shape: as the dense grid
                        continue
                    row = dict(section=section, impl=name, **label(on), d=d, causal=causal, seqlen=seqlen,
                               batch=batch, nheads=nheads)
                    try:
                        with PEER_CONTEXTS.get(name, contextlib.nullcontext)():
                            fwd, bwd, peak, err = measure(make(name, on), batch, seqlen, nheads, d, causal, dtype,
                                                          triton_ref if on else None)
                    except Exception as e:  # a peer without a kernel for this case: record why
                        row["error"] = repr(e)[:200]
                        print(f"{section} {name} d={d} causal={causal} s={seqlen}: {row['error'][:120]}")
                    else:
                        row.update(fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=f / fwd * 1e-9, bwd_tflops=2.5 * f / bwd * 1e-9,
                                   peak_mem_mb=peak, max_err_vs_triton=err)
                        print(f"{section} {'on ' if on else 'off'} {name:16s} d={d:3d} causal={causal:d} "
                              f"s={seqlen:5d}  fwd {row['fwd_tflops']:6.1f}  bwd {row['bwd_tflops']:6.1f} TFLOP/s  "
                              f"err {err}")
                    result["rows"].append(row)
                    if path:
                        harness.write_result(path, result, quiet=True)


def _kept(path: str | None, sections) -> tuple[list, dict]:
    """(rows, envs) of an existing result file's other sections: rows from the sections not run
    now, and the environment each of those sections was measured in."""
    if not path or not os.path.exists(path):
        return [], {}
    with open(path) as f:
        old = json.load(f)
    rows = [r for r in old["rows"] if r.get("section", "dense") not in sections]
    envs = {sec: env for sec, env in old.get("envs", {}).items() if sec not in sections}
    for r in rows:
        envs.setdefault(r.get("section", "dense"), old["env"])
    return rows, envs


def run(args, path: str | None = None) -> dict:
    """Every (d, causal, seqlen, peer) row of the sections asked for; with `path`, the result file
    is rewritten after every row ("complete": false until the end), so a run stopped by a time limit
    still leaves its rows."""
    dtype = getattr(torch, args.dtype)
    rows, envs = _kept(path, args.sections)
    env = harness.environment()
    envs.update({sec: env for sec in args.sections})
    result = {"env": env, "envs": envs, "ceilings": harness.ceilings(), "dtype": args.dtype,
              "tokens": args.tokens, "complete": False, "rows": rows}
    if "varlen" in args.sections:
        run_varlen(args, dtype, result, path)
    if "dropout" in args.sections:
        run_dropout(args, dtype, result, path)
    if "sink" in args.sections:
        run_sink(args, dtype, result, path)
    for section in ("softcap", "alibi"):
        if section in args.sections:
            run_score_mod(section, args, dtype, result, path)
    if "small" in args.sections:
        from flashtile.bench.small import run_small

        run_small(args, dtype, result, path)
    if "dense" in args.sections:
        run_dense(args, dtype, result, path)
    result["complete"] = True
    return result


def _fa4():
    """FlashAttention-4's flash_attn_func (CuTe DSL) or None when it does not import."""
    fa4 = harness.fa4_module()
    return None if fa4 is None else fa4.flash_attn_func


def run_sink(args, dtype, result, path):
    """Forward and backward with an attention sink (learnable_sink (h,), its gradient included)
    against none, causal, at args.sink_headdims x args.sink_seqlens: flashtile, and FlashAttention-4
    with its bf16 learnable_sink when it imports. flashtile's sink output is checked against its
    no-sink output and LSE with the sink folded in by hand (out * exp(lse - logaddexp(lse, t)))."""
    import flashtile

    fa4 = _fa4()
    impls = {"flashtile": lambda q, k, v, t: flashtile.flash_attn_func(q, k, v, causal=True, learnable_sink=t)}
    if fa4 is not None:
        impls["fa4"] = lambda q, k, v, t: fa4(q, k, v, causal=True, learnable_sink=t)[0]
    else:
        print("sink: flash_attn.cute does not import; FlashAttention-4 rows skipped")
    for d in args.sink_headdims:
        for seqlen in args.sink_seqlens:
            batch, nheads = args.tokens // seqlen, 2048 // d
            f = flops(batch, nheads, seqlen, d, True)
            q, k, v = (torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=dtype, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn_like(q)
            sink = (torch.randn(nheads, device="cuda") + math.log(seqlen)).to(dtype).requires_grad_()
            for name, fn in impls.items():
                row = dict(section="sink", impl=name, d=d, causal=True, seqlen=seqlen, batch=batch, nheads=nheads)
                try:
                    for tag, t in (("no_sink", None), ("sink", sink)):
                        inputs = (q, k, v) if t is None else (q, k, v, t)
                        out = fn(q, k, v, t)
                        fwd = harness.bench_ms(lambda: fn(q, k, v, t))
                        bwd = harness.bench_ms(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True))
                        row.update({f"fwd_ms_{tag}": fwd, f"bwd_ms_{tag}": bwd, f"fwd_tflops_{tag}": f / fwd * 1e-9,
                                    f"bwd_tflops_{tag}": 2.5 * f / bwd * 1e-9})
                        del out
                except Exception as e:  # FA4 without a kernel for this case: record why
                    row["error"] = repr(e)[:200]
                    print(f"sink {name} d={d} s={seqlen}: {row['error']}")
                    result["rows"].append(row)
                    continue
                if name == "flashtile":
                    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
                    new = torch.logaddexp(lse, sink.detach().float()[:, None])
                    want = out.float() * torch.exp(lse - new).transpose(1, 2)[..., None]
                    row["max_err_vs_folded"] = float((fn(q, k, v, sink).float() - want).abs().max())
                row["fwd_vs_no_sink"] = row["fwd_ms_sink"] / row["fwd_ms_no_sink"]
                row["bwd_vs_no_sink"] = row["bwd_ms_sink"] / row["bwd_ms_no_sink"]
                row["fwd_bwd_vs_no_sink"] = ((row["fwd_ms_sink"] + row["bwd_ms_sink"])
                                             / (row["fwd_ms_no_sink"] + row["bwd_ms_no_sink"]))
                result["rows"].append(row)
                print(f"sink {name:9s} d={d:3d} s={seqlen:5d}: fwd {row['fwd_tflops_no_sink']:.0f} -> "
                      f"{row['fwd_tflops_sink']:.0f}, bwd {row['bwd_tflops_no_sink']:.0f} -> "
                      f"{row['bwd_tflops_sink']:.0f} TFLOP/s; fwd + bwd {row['fwd_bwd_vs_no_sink']:.3f}x")
                if path:
                    harness.write_result(path, result, quiet=True)
            del q, k, v, dout, sink
            torch.cuda.empty_cache()


def run_dense(args, dtype, result, path):
    """The (d, causal, seqlen, peer) grid of the module docstring."""
    impls = implementations(available_peers(args.peers))
    ref = impls.get("sdpa-flash")
    rows = result["rows"]
    for d in args.headdims:
        for causal in (False, True):
            for seqlen in args.seqlens:
                batch, nheads = args.tokens // seqlen, 2048 // d
                f = flops(batch, nheads, seqlen, d, causal)
                for name, fn in impls.items():
                    if name == "flex" and (d not in args.flex_headdims or seqlen not in args.flex_seqlens):
                        continue
                    try:
                        with PEER_CONTEXTS.get(name, contextlib.nullcontext)():
                            fwd, bwd, peak, err = measure(fn, batch, seqlen, nheads, d, causal, dtype,
                                                          None if name == "sdpa-flash" else ref)
                    except Exception as e:  # a peer without a kernel for this shape: record why
                        rows.append(dict(impl=name, d=d, causal=causal, seqlen=seqlen, error=repr(e)[:200]))
                        print(f"{name:16s} d={d} causal={causal} s={seqlen}: {repr(e)[:120]}")
                        if path:
                            harness.write_result(path, result, quiet=True)
                        continue
                    row = dict(impl=name, d=d, causal=causal, seqlen=seqlen, batch=batch, nheads=nheads,
                               fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=f / fwd * 1e-9,
                               bwd_tflops=2.5 * f / bwd * 1e-9, peak_mem_mb=peak, max_err_vs_sdpa_flash=err)
                    rows.append(row)
                    print(f"{name:16s} d={d:3d} causal={causal:d} s={seqlen:5d}  fwd {row['fwd_tflops']:6.1f}"
                          f"  bwd {row['bwd_tflops']:6.1f} TFLOP/s  mem {peak:8.1f} MB  err {err}")
                    if path:
                        harness.write_result(path, result, quiet=True)


def _ints(s):
    return [int(x) for x in s.split(",")]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="flashtile bench prefill", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="result folder (default benchmarks/results/<gpu>)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--headdims", type=_ints, default=[64, 128, 256])
    p.add_argument("--seqlens", type=_ints, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen")
    p.add_argument("--peers", type=lambda s: s.split(","), default=list(PEERS),
                   help=f"dense section, comma-separated from {','.join(PEERS)} (default all; fa4 and "
                        "fa4-det are skipped when flash_attn.cute does not import)")
    p.add_argument("--flex-headdims", type=_ints, default=[128],
                   help="FlexAttention compiles per shape; limit it to these head dims")
    p.add_argument("--flex-seqlens", type=_ints, default=[2048, 8192], help="... and these seqlens")
    p.add_argument("--sections", type=lambda s: s.split(","),
                   default=["small", "dense", "varlen", "dropout", "sink", "softcap", "alibi"])
    p.add_argument("--varlen-lengths", type=_ints, default=[128, 4096], help="lo,hi of the varlen section's lengths")
    p.add_argument("--dropout-p", type=float, default=0.1)
    p.add_argument("--dropout-seqlens", type=_ints, default=[4096])
    p.add_argument("--sink-headdims", type=_ints, default=[64, 128])
    p.add_argument("--sink-seqlens", type=_ints, default=[4096, 16384])
    p.add_argument("--softcap", type=float, default=50.0, help="the softcap section's cap (Gemma-2's)")
    p.add_argument("--softcap-headdims", type=_ints, default=[128, 256])
    p.add_argument("--softcap-seqlens", type=_ints, default=[4096])
    p.add_argument("--alibi-headdims", type=_ints, default=[64, 128, 256])
    p.add_argument("--alibi-seqlens", type=_ints, default=[4096])
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
    from flashtile.bench import prefill_report  # here, not at the top: it imports PEERS from this module

    if not args.no_plot:
        for png in prefill_report.plot(path, out):
            print(f"wrote {png}")
    table = prefill_report.summary(path)
    with open(os.path.join(out, "prefill.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
