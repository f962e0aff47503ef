"""Host time of one decoding step and one prefill call, piece by piece (GPU machine or CPU).

    PYTHONPATH=src python scripts/profile_host.py [OUT_FILE] [--decode-only]

A small cache (1 x 256 tokens, 16 q / 2 kv heads, d=128, fp16: a few µs of kernel) makes every
loop below host-bound, so wall time per call = the host cost of that piece: flash_attn_with_kvcache
and DecodePlan.run, contiguous and paged (16-token pages), with and without appending one token,
next to torch SDPA with enable_gqa; then the pieces (the call's checks, the plan of a call, the
value checks, a plan, the outputs' allocation, the launch key). On a GPU the launches are real:
also Triton's binder against the direct launch, the prefill API on a tiny shape, and (seqlen
512 / 1024, d=128, causal) do_bench against a CUDA-graph replay. Last, cProfile of the decoding
call, top entries by own time.

Without a GPU the kernels' launches are replaced by no-ops (under TRITON_INTERPRET=1 they would
run in numpy): the rows then time the Python host path up to the launch, and the launch key is
timed apart, on stand-in CUDA tensors with a cached stand-in kernel. SDPA runs on the CPU there,
in float32 over 16 keys (its compute is small, not nothing): compare ratios, not microseconds,
with the GPU machine's.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import os
import pstats
import sys
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():  # the triton path on CPU tensors, with the launches stubbed below
    os.environ.setdefault("TRITON_INTERPRET", "1")

import flashtile  # noqa: E402
from flashtile import _checks, api  # noqa: E402
from flashtile.bench import harness  # noqa: E402
from flashtile.ops import _launch, decode, decoding, prefill  # noqa: E402


def captured_launch(jit_kernel, call):
    """(args, kwargs) of jit_kernel's launch inside call(), caught by wrapping its run method."""
    seen = {}
    real = jit_kernel.run

    def spy(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, dict(kwargs)
        return real(*args, **kwargs)

    jit_kernel.run = spy
    try:
        call()
    finally:
        jit_kernel.run = real
    return seen["args"], seen["kwargs"]


def graph_ms(fn) -> float:
    """Median ms of fn replayed from a CUDA graph (no host time)."""
    return harness.bench_ms(harness.capture(fn)[0].replay)


def prefill_rows(row, lines):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtile.bench import harness

    x = [torch.randn(1, 128, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    do = torch.randn_like(x[0])
    row("prefill api forward, no grad (1 x 128, h16 d128)", lambda: flashtile.flash_attn_func(
        *(t.detach() for t in x), causal=True))
    row("prefill api forward, requires_grad", lambda: flashtile.flash_attn_func(*x, causal=True))
    row("prefill api forward + backward", lambda: torch.autograd.grad(
        flashtile.flash_attn_func(*x, causal=True), x, do))
    row("ops.prefill.attention_forward (launcher only)", lambda: prefill.attention_forward(
        *(t.detach() for t in x), 128 ** -0.5, (None, 0)))

    def sdpa(*t):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                *(u.transpose(1, 2) for u in t), is_causal=True).transpose(1, 2)

    row("sdpa-flash forward + backward (peer)", lambda: torch.autograd.grad(sdpa(*x), x, do))
    for seqlen in (512, 1024, 2048):
        b = 16384 // seqlen
        y = [torch.randn(b, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        for name, fn in (("flashtile", lambda: flashtile.flash_attn_func(*y, causal=True)),
                         ("sdpa-flash", lambda: sdpa(*y))):
            try:
                lines.append(f"forward d=128 causal s={seqlen} {name:10s}: do_bench "
                             f"{harness.bench_ms(fn) * 1e3:7.1f} us, graph {graph_ms(fn) * 1e3:7.1f} us")
            except Exception as e:
                lines.append(f"forward s={seqlen} {name}: failed {e!r}"[:300])
            print(lines[-1], flush=True)


@contextlib.contextmanager
def launches_stubbed(on: bool):
    """Every prepared launch a no-op while on (CPU: the host path without the kernels)."""
    real = _launch.Prepared.__call__
    if on:
        _launch.Prepared.__call__ = lambda self, tensors, scalars, stream=None, key=None: None
    try:
        yield
    finally:
        _launch.Prepared.__call__ = real


class StandIn:
    """What the launch key reads of a CUDA tensor: a pointer and a dtype."""

    is_cuda = True

    def __init__(self, t):
        self.dtype, self.ptr = t.dtype, t.data_ptr()

    def get_device(self):
        return 0

    def data_ptr(self):
        return self.ptr


def launch_key_rows(row, split: _launch.Prepared, tensors: tuple, scalars: tuple):
    """The split kernel's cached launch, up to the compiled kernel's run (a no-op here): with every
    argument the call's (the whole key every call) and through the plan's Prepared launch."""

    class Compiled(_launch.triton.compiler.CompiledKernel):
        def __init__(self):  # noqa: D401 - a stand-in: run does nothing
            self.function = self.packed_metadata = None

        def run(self, *args):
            pass

    class Kernel:  # Triton's path once (returns the compiled stand-in), then cached hits
        params = [SimpleNamespace(name=n) for n in split.kernel.arg_names]  # Triton's JITFunction and interpreter
        arg_names = split.kernel.arg_names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: Compiled()

    real_stream = _launch.current_stream
    _launch.current_stream = lambda device: 0
    try:
        kernel = Kernel()
        every = tuple(StandIn(t) if t is not None else None for t in tensors + split.tensors)
        whole = _launch.Prepared(kernel, split.grid, (), (), split.options["num_warps"], split.options["num_stages"],
                                 **split.constexprs)
        row("  every argument the call's: whole key built and hashed per call",
            lambda: whole(every, scalars + split.scalars))
        prepared = _launch.Prepared(kernel, split.grid, every[len(tensors):], split.scalars,
                                    split.options["num_warps"], split.options["num_stages"], **split.constexprs)
        row("  _launch.Prepared (the plan's): the call's part of the key", lambda: prepared(every[:len(tensors)], scalars))
    finally:
        _launch.current_stream = real_stream


def main(out=None, decode_only=False):
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    b, ctx, h, hk, d, page = 1, 256, 16, 2, 128, 16
    q = torch.randn(b, 1, h, d, device=dev, dtype=torch.float16)
    kc = torch.randn(b, ctx, hk, d, device=dev, dtype=torch.float16)
    vc = torch.randn_like(kc)
    k, v = torch.randn(b, 1, hk, d, device=dev, dtype=torch.float16), torch.randn(b, 1, hk, d, device=dev,
                                                                                dtype=torch.float16)
    kp, vp = kc.view(-1, page, hk, d), vc.view(-1, page, hk, d)  # the same cache as 16-token pages
    table = torch.arange(ctx // page, dtype=torch.int32, device=dev).view(b, -1)
    seqlens = torch.full((b,), ctx - 1, dtype=torch.int32, device=dev)
    where = torch.cuda.get_device_name() if cuda else "CPU (launches stubbed)"
    lines = [f"{where}, torch {torch.__version__}, shape b={b} ctx={ctx} h={h}/{hk} d={d}"]

    def row(name, fn):
        try:
            lines.append(f"{name:66s} {harness.wall_us(fn, 3000, warmup=50):8.1f} us/call")
        except Exception as e:  # one piece that cannot run alone: say so, time the others
            lines.append(f"{name:66s} failed: {e!r}"[:300])
        print(lines[-1], flush=True)

    if cuda:
        row("sdpa enable_gqa (peer)", lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), enable_gqa=True))
    else:
        qf, kf, vf = (t.float().transpose(1, 2) for t in (q, kc[:, :16], vc[:, :16]))
        row("sdpa enable_gqa (peer; CPU: float32, 16 keys)", lambda: torch.nn.functional.scaled_dot_product_attention(
            qf, kf, vf, enable_gqa=True))

    layouts = {"contiguous": (kc, vc, {}), "paged16": (kp, vp, dict(block_table=table))}
    plans = {}
    with launches_stubbed(not cuda), api.use_backend("triton"):
        for name, (k_cache, v_cache, paged) in layouts.items():
            for new in (False, True):
                kv = (k, v) if new else (None, None)
                label = f"{name}{', append 1' if new else ''}"
                row(f"flash_attn_with_kvcache, {label}", lambda: flashtile.flash_attn_with_kvcache(
                    q, k_cache, v_cache, *kv, cache_seqlens=seqlens, **paged))
                plan = plans[label] = flashtile.DecodePlan(b, h, k_cache.shape, seqlens, dtype=q.dtype, device=dev,
                                                           seqlen_new=int(new), **paged)
                row(f"DecodePlan.run, {label}", lambda: plan.run(q, k_cache, v_cache, *kv))
        row("flash_attn_with_kvcache, num_splits=1", lambda: flashtile.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=seqlens, num_splits=1))
        for splits in (4, 16):  # the merge fused into the split kernel (one launch), then the combine kernel
            plan = flashtile.DecodePlan(b, h, kc.shape, seqlens, dtype=q.dtype, device=dev, num_splits=splits)
            merge = "fused merge" if plan._launch.fused else "combine kernel"
            row(f"DecodePlan.run, num_splits={splits} ({merge})", lambda: plan.run(q, kc, vc))
            row(f"flash_attn_with_kvcache, num_splits={splits} ({merge})", lambda: flashtile.flash_attn_with_kvcache(
                q, kc, vc, cache_seqlens=seqlens, num_splits=splits))
        row("flash_attn_with_kvcache, int cache_seqlens", lambda: flashtile.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=ctx))
        lines.append("pieces:")
        row("  _check_tensors (the call's tensors)", lambda: api._check_tensors(q, kc, vc, k, v))
        args = (seqlens, None, None, None, None, False, (-1, -1), 0.0, None, None, None, True, 0)
        row("  _plan_of_call (key of a call, plan found)", lambda: api._plan_of_call(q, kc, vc, k, v, args))
        row("  _last_plan (the last call's arguments again)", lambda: api._last_plan(args, q, kc, vc, k, v))
        row("  DecodePlan(...), contiguous, append 1 (once per step)", lambda: flashtile.DecodePlan(
            b, h, kc.shape, seqlens, dtype=q.dtype, device=dev, seqlen_new=1))
        row("  DecodePlan(...), paged16, append 1", lambda: flashtile.DecodePlan(
            b, h, kp.shape, seqlens, dtype=q.dtype, device=dev, seqlen_new=1, block_table=table))
        host_table, host_lengths = _checks.host_copy(table), _checks.host_copy(seqlens)
        row("  check_cache_values, paged16, append 1", lambda: _checks.check_cache_values(
            host_lengths, b, 1, ctx, kp.shape[0], table=host_table, page_size=page))
        big = torch.randint(0, 4000, (256,), dtype=torch.int32)
        big_table = torch.randperm(256 * 256).view(256, 256).int()
        row("  check_cache_values, 256 sequences x 256 pages, append 1", lambda: _checks.check_cache_values(
            big, 256, 1, 4096, 256 * 256, table=big_table, page_size=16))
        row("  decoding.decode_attention (outputs + launch)", lambda: decoding.decode_attention(
            plans["contiguous"]._launch, q, kc, vc))
        launch = plans["contiguous, append 1"]._launch
        row("  decoding.decode_attention, append 1 (outputs + launch)", lambda: decoding.decode_attention(
            launch, q, kc, vc, k, v))
    row("  2 x torch.empty (out, lse)", lambda: (torch.empty((b, 1, h, d), dtype=q.dtype, device=dev),
                                                 torch.empty((b, h, 1), dtype=torch.float32, device=dev)))
    outputs = (torch.empty(b, 1, h, d, dtype=q.dtype, device=dev), torch.empty(b, h, 1, dtype=torch.float32, device=dev))
    launch_key_rows(row, launch.split, (q, kc, vc, k, v, *outputs, None, None, None, None),
                    (*q.stride(), *kc.stride(), *vc.stride(), *k.stride(), *v.stride()))

    if cuda:
        row("  torch.cuda.device(q.device) enter/exit", lambda: api._device_guard(q).__enter__() and None)

        def binder_rows():  # the split kernel's launch alone: Triton's path, then the compiled kernel direct
            kernel = decode._split_kernel
            kernel.__dict__.pop("_flashtile_launches", None)  # the next call misses ops._launch's cache
            args, kwargs = captured_launch(kernel, lambda: plans["contiguous"].run(q, kc, vc))
            grid = kwargs.pop("grid")
            kwargs.pop("warmup")
            row(f"  _split_kernel[grid] ({len(args)} args): Triton's binder", lambda: kernel[grid](*args, **kwargs))
            compiled = kernel[grid](*args, **kwargs)
            bound = list(args) + [kwargs[p.name] for p in kernel.params[len(args):]]
            stream = torch.cuda.current_stream().cuda_stream
            g = tuple(grid) + (1,) * (3 - len(grid))
            row("  CompiledKernel.run direct (a cached launch's hit)", lambda: compiled.run(
                g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *bound))
            pointers = _launch._pointers(bound)
            row("  CompiledKernel.run direct, tensors passed as addresses", lambda: compiled.run(
                g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *pointers))

        try:
            binder_rows()
        except Exception as e:
            lines.append(f"binder rows failed: {e!r}"[:300])
        if not decode_only:
            prefill_rows(row, lines)

    prof = cProfile.Profile()
    with launches_stubbed(not cuda), api.use_backend("triton"):
        prof.enable()
        for _ in range(500):
            flashtile.flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=seqlens, block_table=table)
        harness.synchronize()
        prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    lines.append("cProfile, 500 calls of flash_attn_with_kvcache (paged16, append 1), by own time:")
    lines.append(s.getvalue())
    if cuda and not decode_only:  # the prefill API's host path: forward + backward of a tiny causal call
        x = [torch.randn(1, 128, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        do = torch.randn_like(x[0])
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            torch.autograd.grad(flashtile.flash_attn_func(*x, causal=True), x, do)
        harness.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
        lines.append("cProfile, 200 calls of flash_attn_func forward + backward (1 x 128, h16 d128, causal), "
                     "by own time:")
        lines.append(s.getvalue())
    text = "\n".join(lines)
    print(text[text.index("cProfile"):])
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    paths = [a for a in sys.argv[1:] if a != "--decode-only"]
    main(paths[0] if paths else None, "--decode-only" in sys.argv[1:])
