"""Host time of one decoding step and one prefill call, piece by piece (GPU machine).

    PYTHONPATH=src python scripts/profile_host.py [OUT_FILE]

A small cache (1 x 256 tokens, 16 q / 2 kv heads, d=128, fp16: a few µs of kernel) makes every
loop below host-bound, so wall time per call = the host cost of that piece. Then the prefill API
on a tiny shape (host-bound too) and, at seqlen 512 / 1024 (d=128, causal), do_bench against a
CUDA-graph replay: the difference is host time do_bench's cache flush does not hide. Last, cProfile
of the decoding API call, top entries by own time.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys

import torch

import flashtile
from flashtile import api
from flashtile.bench import harness
from flashtile.ops import decode


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
    from flashtile.bench import harness

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return harness.bench_ms(graph.replay)


def prefill_rows(row, lines):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtile.bench import harness
    from flashtile.ops import forward

    x = [torch.randn(1, 128, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    do = torch.randn_like(x[0])
    row("prefill api forward, no grad (1 x 128, h16 d128)", lambda: flashtile.flash_attn_func(
        *(t.detach() for t in x), causal=True))
    row("prefill api forward, requires_grad", lambda: flashtile.flash_attn_func(*x, causal=True))
    row("prefill api forward + backward", lambda: torch.autograd.grad(
        flashtile.flash_attn_func(*x, causal=True), x, do))
    row("ops.forward.attention_forward (launcher only)", lambda: forward.attention_forward(
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


def main(out=None):
    dev = torch.device("cuda")
    b, ctx, h, hk, d = 1, 256, 16, 2, 128
    q = torch.randn(b, 1, h, d, device=dev, dtype=torch.float16)
    kc = torch.randn(b, ctx, hk, d, device=dev, dtype=torch.float16)
    vc = torch.randn_like(kc)
    seqlens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, shape b={b} ctx={ctx} h={h}/{hk} d={d}"]

    def row(name, fn):
        try:
            lines.append(f"{name:58s} {harness.wall_us(fn, 3000, warmup=50):8.1f} us/call")
        except Exception as e:  # one piece that cannot run alone: say so, time the others
            lines.append(f"{name:58s} failed: {e!r}"[:300])
        print(lines[-1], flush=True)

    api_auto = lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    api_one = lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=1)
    row("sdpa enable_gqa (peer)", lambda: torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), enable_gqa=True))
    row("api, num_splits=0 (auto: split + combine)", api_auto)
    row("api, num_splits=1 (one launch)", api_one)
    row("api, int cache_seqlens, num_splits=1", lambda: flashtile.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=ctx, num_splits=1))
    row("checks only (_check_kvcache)", lambda: api._check_kvcache(
        q, kc, vc, None, None, None, None, seqlens, None, None, None, None, False, (-1, -1), 0.0, None, 1))
    row("decode.decode_attention, num_splits=1", lambda: decode.decode_attention(
        q, kc, vc, seqlens, softmax_scale=d ** -0.5, num_splits=1))
    row("torch.cuda.device(q.device) enter/exit", lambda: api._device_guard(q).__enter__() and None)
    row("2 x torch.empty (out, lse)", lambda: (torch.empty((b, 1, h, d), dtype=q.dtype, device=dev),
                                               torch.empty((b, h, 1), dtype=torch.float32, device=dev)))

    def launch_rows():  # the split kernel's launch alone: Triton's path, then the compiled kernel direct
        kernel = decode._split_kernel
        kernel.__dict__.pop("_flashtile_launches", None)  # the next call misses ops._launch's cache
        args, kwargs = captured_launch(kernel, api_one)
        grid = kwargs.pop("grid")
        kwargs.pop("warmup")
        row(f"_split_kernel[grid] ({len(args)} args): Triton's binder", lambda: kernel[grid](*args, **kwargs))
        compiled = kernel[grid](*args, **kwargs)
        bound = list(args) + [kwargs[p.name] for p in kernel.params[len(args):]]
        stream = torch.cuda.current_stream().cuda_stream
        g = tuple(grid) + (1,) * (3 - len(grid))
        row("CompiledKernel.run direct (ops._launch on a hit)", lambda: compiled.run(
            g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *bound))

    try:
        launch_rows()
    except Exception as e:
        lines.append(f"launch rows failed: {e!r}"[:300])

    prefill_rows(row, lines)

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        api_auto()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    lines.append("cProfile, 500 calls of the api with num_splits=0, by own time:")
    lines.append(s.getvalue())
    text = "\n".join(lines)
    print(text[text.index("cProfile"):])
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
