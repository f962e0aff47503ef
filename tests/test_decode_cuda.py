"""Flash-Decoding kernels on the GPU: the interpreter cases at real sizes, bf16 too, 128k contexts.

Same check as the interpreter tests (tests/decode_check.py): 2x rule against the float64 oracle,
outputs and split partials poisoned, cache changed exactly at the appended slots.
"""

import pytest
import torch

from decode_check import check_kvcache
from flashtile import flash_attn_with_kvcache, merge_attention_states
from flashtile.reference.decoding import merge
from flashtile.testing import assert_2x

pytestmark = pytest.mark.cuda

DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                                 ids=["fp16", "bf16", "fp32"])

# (b, sq, h, hk, d, capacity, s_new)
SHAPES = {
    "seed-gqa8-d128": (4, 1, 16, 2, 128, 4096, 1),
    "llama-gqa4-d128": (8, 1, 32, 8, 128, 2048, 1),
    "mqa-d64": (3, 1, 8, 1, 64, 3000, 1),
    "mha-d80": (2, 1, 4, 4, 80, 1000, 1),
    "gqa2-d256": (2, 1, 4, 2, 256, 1500, 1),
    "spec4-gqa8-d128": (2, 4, 16, 2, 128, 2000, 4),
    "chunk64-gqa4-d64": (2, 64, 8, 2, 64, 1024, 64),  # 256 packed rows: four M blocks
    "odd-d40-no-append": (2, 3, 6, 3, 40, 777, 0),
}


@DTYPES
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_contiguous(shape, dtype):
    check_kvcache(*shape, dtype, "cuda")


@DTYPES
@pytest.mark.parametrize("page_size", [16, 48, 64, 256])
def test_paged(page_size, dtype):
    check_kvcache(4, 1, 16, 2, 128, 4096, 1, dtype, "cuda", page_size=page_size)
    check_kvcache(2, 3, 8, 2, 64, 1024, 3, dtype, "cuda", page_size=page_size, causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("page_size", [None, 16, 64], ids=["contiguous", "page16", "page64"])
def test_long_context_128k(page_size, dtype):
    """Seed 004's longest row: one sequence, 16 q / 2 kv heads, 131072 keys."""
    _, lse = check_kvcache(1, 1, 16, 2, 128, 131072, 1, dtype, "cuda", page_size=page_size,
                           lengths=[131071])  # the heuristic: 264 splits
    _, one_lse = check_kvcache(1, 1, 16, 2, 128, 131072, 1, dtype, "cuda", page_size=page_size,
                               lengths=[131071], num_splits=1)  # one program per kv head
    torch.testing.assert_close(lse, one_lse, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_num_splits_agree(dtype):
    results = [check_kvcache(3, 1, 16, 2, 128, 8192, 1, dtype, "cuda", lengths=[8191, 5000, 1],
                             num_splits=n) for n in (1, 2, 7, 64, 300, 0)]
    for out, lse in results[1:]:
        torch.testing.assert_close(out.float(), results[0][0].float(), atol=1e-2, rtol=0)
        torch.testing.assert_close(lse, results[0][1], atol=1e-4, rtol=0)


FEATURES = {
    "rotary-gptj-causal": dict(rotary=(128, True), causal=True),
    "rotary-neox-partial": dict(rotary=(64, False)),
    "window": dict(window=(100, 0), causal=True),
    "softcap": dict(softcap=30.0),
    "alibi-bh": dict(alibi="bh", causal=True),
    "leftpad": dict(leftpad=True, causal=True),
    "batch-idx": dict(batch_idx=True),
    "int-seqlens-strided-q": dict(int_seqlens=True, q_strided=True),
    "paged-leftpad-rotary": dict(page_size=16, leftpad=True, rotary=(32, True), causal=True),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", FEATURES.values(), ids=FEATURES.keys())
def test_features(case, dtype):
    check_kvcache(3, 2, 16, 2, 128, 2048, 2, dtype, "cuda", **case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("num_splits", [1, 3, 133, 600])
def test_merge(num_splits, dtype):
    out_partial = torch.randn(num_splits, 4, 32, 128, device="cuda").to(dtype)
    lse_partial = 3 * torch.randn(num_splits, 4, 32, device="cuda")
    empty = torch.rand(num_splits, 4, 32, device="cuda") < 0.3
    lse_partial[empty] = float("-inf")
    out_partial[empty] = float("nan")
    out, lse = merge_attention_states(out_partial, lse_partial)
    ref_out, ref_lse = merge(out_partial.double(), lse_partial.double())
    w = torch.exp(lse_partial - lse_partial.logsumexp(0).nan_to_num(neginf=0.0)).to(dtype)
    base = (w[..., None] * out_partial.nan_to_num(0.0)).sum(0)
    assert_2x("out", out, ref_out, base)
    assert_2x("lse", lse, ref_lse, lse_partial.logsumexp(0))


def test_kvcache_helpers_on_gpu():
    from flashtile import PagedKVCache

    cache = PagedKVCache(64, 16, 2, 2, 128, num_layers=1, dtype=torch.bfloat16, device="cuda")
    outs = []
    for step in range(3):
        q = torch.randn(2, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
        kv = [torch.randn(2, 1, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        outs.append(cache.attend(q, *kv, causal=True))
        cache.advance(1)
    assert cache.seqlens.tolist() == [3, 3] and torch.isfinite(outs[-1]).all()


def test_cuda_graph_capture():
    """With index tensors on the GPU nothing reads them on the host, so one decoding step can be
    captured in a CUDA graph and replayed (how decode loops hide Python's launch overhead)."""
    torch.manual_seed(0)
    q = torch.randn(4, 1, 16, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(4, 1, 2, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    k_cache, v_cache = (torch.randn(4, 4096, 2, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    seqlens = torch.tensor([4000, 17, 3000, 1], dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream: compiles the kernels
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
    q.copy_(torch.randn_like(q))
    graph.replay()
    want = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=seqlens)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
