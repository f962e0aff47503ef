"""Varlen, paged varlen and dropout in the prefill kernels on the GPU."""

import math

import pytest
import torch
from prefill_check import check_prefill, make_qkv
from varlen_check import check_varlen, offsets

import flashtile
from flashtile.bench.harness import capture
from flashtile.reference.dropout import draw_rng

pytestmark = pytest.mark.cuda

HEADDIMS = [32, 59, 64, 96, 128, 256]
LENGTHS = {  # (lens_q, lens_k)
    "mixed": ([113, 0, 1, 700, 257, 64], [203, 9, 1, 700, 128, 0]),
    "long-short": ([1023, 17, 2048], [1024, 300, 2048]),
}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("d", HEADDIMS, ids=[f"d{d}" for d in HEADDIMS])
def test_varlen_grid(d, lengths, dtype, causal, heads):
    check_varlen(*lengths, *heads, d, dtype, "cuda", causal=causal)


def test_varlen_long_sequences():
    """8k-16k sequences in one packed batch (the float64 oracle of the 16k one is 4 GB per matrix)."""
    lens = [16384, 8192, 4096, 3000]
    check_varlen(lens, lens, 2, 1, 128, torch.bfloat16, "cuda", causal=True)


def test_varlen_32k():
    """A 32k sequence packed with shorter ones, forward and backward: the float64 oracle is the tiled
    FA2 reference (naive attention's float64 scores would take 8.6 GB a head)."""
    lens = [32768, 8192, 1500]
    check_varlen(lens, lens, 1, 1, 128, torch.bfloat16, "cuda", causal=True, tiled_oracle=True)


def test_varlen_many_short_sequences():
    """1000 sequences of 1-64 tokens."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 65, (1000,), generator=gen).tolist()
    check_varlen(lens, lens, 4, 2, 64, torch.bfloat16, "cuda", causal=True)


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("d", [64, 128])
def test_paged_varlen(page_size, d):
    check_varlen([128, 1, 500, 0, 77], [1000, 1, 700, 64, 2000], 8, 2, d, torch.bfloat16, "cuda", causal=True,
                 page_size=page_size)


def test_varlen_window_softcap_alibi_seqused():
    check_varlen([300, 50, 700], [400, 51, 900], 4, 2, 128, torch.bfloat16, "cuda", window=(100, 20), softcap=30.0,
                 alibi=True)
    check_varlen([300, 50, 700], [400, 51, 900], 4, 2, 128, torch.bfloat16, "cuda", causal=True,
                 seqused=[350, 0, 899])


DROPOUT_SEQLENS = [(113, 203), (1024, 1023), (2048, 2048)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("sq,sk", DROPOUT_SEQLENS, ids=[f"{a}x{b}" for a, b in DROPOUT_SEQLENS])
@pytest.mark.parametrize("d", HEADDIMS, ids=lambda d: f"d{d}")
def test_dropout_grid(d, sq, sk, dtype, causal):
    check_prefill(2, sq, sk, 4, 2, d, dtype, "cuda", causal=causal, dropout_p=0.17)


def test_dropout_varlen():
    check_varlen(*LENGTHS["mixed"], 4, 2, 128, torch.bfloat16, "cuda", causal=True, dropout_p=0.1)


def test_varlen_and_dropout_are_reproducible():
    """50 reruns of a large varlen forward + backward with deterministic=True, with and without
    dropout (the same seed tensor): out, LSE, dQ, dK, dV bitwise equal. (The default backward on
    Hopper sums dQ in a varying order, as flash-attn's: test_hopper_cuda.test_varlen_reruns.)"""
    from flashtile import _checks
    from flashtile.ops.prefill import attention_backward, attention_forward

    lens = [4096, 1000, 3000, 17, 8192]
    cu = offsets(lens, "cuda")
    q, k, v = (torch.randn(sum(lens), 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    varlen = _checks.check_varlen(q, k, v, cu, cu, max(lens), max(lens))
    for dropout in (None, (0.1, draw_rng("cuda"))):
        first = None
        for _ in range(50):
            out, lse = attention_forward(q, k, v, 128 ** -0.5, (None, 0), varlen=varlen, dropout=dropout)
            grads = attention_backward(dout, q, k, v, out, lse, 128 ** -0.5, (None, 0), varlen=varlen, dropout=dropout,
                                       deterministic=True)
            now = (out, lse, *grads)
            if first is None:
                first = [t.clone() for t in now]
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), now, first):
                assert torch.equal(a, b), (name, dropout is not None)


def test_dropout_is_unbiased():
    """z-test over 1000 seeds of a fixed projection of the output (|z| < 4.5)."""
    q, k, v = make_qkv(1, 256, 256, 4, 4, 64, torch.float32, "cuda")
    w = torch.randn_like(q)
    exact = float((flashtile.flash_attn_func(q, k, v, causal=True) * w).sum())
    samples = torch.stack([(flashtile.flash_attn_func(q, k, v, dropout_p=0.2, causal=True) * w).sum()
                           for _ in range(1000)]).double()
    z = (samples.mean() - exact) / (samples.std() / math.sqrt(len(samples)))
    assert abs(float(z)) < 4.5, float(z)


def test_dropout_cuda_graph():
    """flash_attn_func with dropout captured in a CUDA graph: each replay draws a fresh mask (the
    seed is drawn on the device, as torch's dropout), and the backward uses the replay's mask."""
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 512, 512, 4, 2, 64, torch.bfloat16, "cuda"))
    dout = torch.randn_like(q)

    def step():
        out = flashtile.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)
        return out, torch.autograd.grad(out, (q, k, v), dout)

    graph, (out, grads) = capture(step, warmup=2)
    results = []
    for _ in range(3):
        graph.replay()
        results.append([t.clone() for t in (out, *grads)])
    assert not torch.equal(results[0][0], results[1][0]) and not torch.equal(results[1][0], results[2][0])
    no_drop = flashtile.flash_attn_func(q, k, v, causal=True)
    for r in results:  # each replay is a valid dropout of the same attention: close on average
        assert (r[0].float() - no_drop.float()).abs().mean() < 0.5 * no_drop.float().abs().mean()
        assert all(torch.isfinite(g).all() for g in r)


def test_varlen_cuda_graph_skips_host_checks():
    """Under capture the cu_seqlens values cannot be read: the call is captured without a sync and
    replays correctly; eagerly, the same tensors are read once (cached by tensor and version)."""
    lens = [100, 300, 7]
    cu = offsets(lens, "cuda")
    q, k, v = (torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    eager = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, causal=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, causal=True)
    graph.replay()
    assert torch.equal(captured, eager)
    bad = torch.tensor([0, 100, 50, 407], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="non-decreasing"):
        flashtile.flash_attn_varlen_func(q, k, v, bad, cu, 300, 300)


def test_varlen_autograd_end_to_end():
    """flash_attn_varlen_func through autograd with dropout, GQA and a paged K/V needing
    gradients (the pages are gathered)."""
    lens = [300, 1, 1000]
    cu = offsets(lens, "cuda")
    q = torch.randn(sum(lens), 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(sum(lens), 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out, lse, probs = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 1000, 1000, dropout_p=0.1, causal=True,
                                                       return_attn_probs=True)
    assert probs is None and lse.shape == (8, sum(lens))
    out.backward(torch.randn_like(out))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_varlen_inference_mode():
    """Serving code builds cu_seqlens under torch.inference_mode(): such tensors have no version
    counter, so their values are read every call instead of cached."""
    with torch.inference_mode():
        lens = [100, 0, 37]
        cu = offsets(lens, "cuda")
        q, k, v = (torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 100, 100, causal=True)
        ref = torch.cat([flashtile.flash_attn_func(q[None, a:b], k[None, a:b], v[None, a:b], causal=True)[0]
                         for a, b in zip([0, 100, 100], [100, 100, 137])])
        torch.testing.assert_close(out, ref)
