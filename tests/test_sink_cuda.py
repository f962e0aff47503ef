"""The attention sink on the GPU: the prefill grid (every head dim and length pair, causal and not,
fp16 and bf16) with a sink, varlen, decoding with one, fused and kernel-merged splits, paged, a
DecodePlan in a CUDA graph, and gradients through the API. Oracle and rule: tests/prefill_check.py."""

import pytest
import torch
from decode_check import check_kvcache, make_cache
from prefill_check import check_prefill, sink_logits
from test_prefill_cuda import HEADDIMS, SEQLENS
from varlen_check import check_varlen

import flashtile
from flashtile.bench.harness import capture
from flashtile.ops import configs

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("sq,sk", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("d", HEADDIMS, ids=[f"d{d}" for d in HEADDIMS])
def test_prefill_grid(d, sq, sk, dtype, causal):
    check_prefill(2, sq, sk, 4, 2, d, dtype, "cuda", causal=causal, sink=True)


@pytest.mark.parametrize("case", [dict(window=(128, 0)), dict(softcap=30.0, alibi=True), dict(dropout_p=0.1)],
                         ids=["gpt-oss-window", "softcap-alibi", "dropout"])
def test_prefill_features(case):
    check_prefill(2, 700, 900, 8, 1, 64, torch.bfloat16, "cuda", sink=True, **case)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen(causal):
    check_varlen([113, 0, 1, 700, 257, 64], [203, 9, 1, 700, 128, 0], 8, 2, 64, torch.bfloat16, "cuda",
                 causal=causal, sink=True)


def test_varlen_paged():
    check_varlen([300, 17], [900, 2048], 8, 2, 128, torch.bfloat16, "cuda", causal=True, page_size=64, sink=True)


@pytest.mark.parametrize("num_splits,combine", [(1, "fused"), (3, "fused"), (64, "fused"), (64, "kernel"), (0, None)],
                         ids=["one", "fused", "fused-many-splits", "combine-kernel", "heuristic"])
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode(num_splits, combine, page_size, dtype, monkeypatch):
    if combine is not None:
        monkeypatch.setattr(configs, "DECODE_FUSED_MAX_SPLITS", 1 << 30 if combine == "fused" else 0)
    check_kvcache(4, 1, 16, 2, 128, 4096, 1, dtype, "cuda", page_size=page_size, lengths=[4000, 17, 0, 2500],
                  num_splits=num_splits, causal=True, sink=True)


def test_decode_plan_speculative_rows():
    check_kvcache(2, 4, 32, 8, 128, 2048, 4, torch.bfloat16, "cuda", num_splits=0, causal=True, window=(128, 0),
                  plan="tensor", sink=True)


def test_plan_with_sink_in_a_cuda_graph():
    """A plan run with a sink captured once and replayed on new inputs equals eager runs."""
    torch.manual_seed(0)
    b, h, hk, d, capacity = 4, 16, 2, 128, 4096
    k_cache, v_cache, _ = make_cache(b, capacity, hk, d, torch.bfloat16, "cuda")
    plan = flashtile.DecodePlan(b, h, k_cache.shape, [4000, 17, 3000, 0], dtype=torch.bfloat16, device="cuda",
                                seqlen_new=1, causal=True)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, 1, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sink = sink_logits(h, 4000, "cuda")
    graph, out = capture(lambda: plan.run(q, k_cache, v_cache, k, v, learnable_sink=sink))
    for _ in range(3):
        for t in (q, k, v, k_cache, v_cache, sink):
            t.copy_(torch.randn_like(t) + (8.0 if t is sink else 0.0))
        k_eager, v_eager = k_cache.clone(), v_cache.clone()
        graph.replay()
        want = plan.run(q, k_eager, v_eager, k, v, learnable_sink=sink)
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def test_gradients_through_the_api():
    """bf16 training step with a bf16 sink: bitwise reproducible, and the sink's gradient is the
    reduction of this call's own out and LSE (their accuracy: the grid above)."""
    q = torch.randn(2, 1000, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 1000, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    sink = sink_logits(8, 1000, "cuda").to(torch.bfloat16).requires_grad_()
    dout = torch.randn_like(q)
    grads = []
    for _ in range(2):
        out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(128, 0), learnable_sink=sink,
                                                return_attn_probs=True)
        grads.append(torch.autograd.grad(out, (q, k, v, sink), dout))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    delta = (dout.double() * out.detach().double()).sum(-1).transpose(1, 2)
    want = -(torch.exp(sink.detach().double()[:, None] - lse.double()) * delta).sum((0, 2))
    torch.testing.assert_close(grads[0][3].double(), want, rtol=2 ** -7, atol=1e-3)
