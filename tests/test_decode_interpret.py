"""Flash-Decoding kernels under the Triton interpreter (CPU, fp16 and fp32, small caches).

Each case checks out and LSE by the 2x rule against the float64 oracle, outputs and split partials
poisoned, and the cache changed exactly at the appended slots (tests/decode_check.py). The
interpreter config uses 32-key tiles, so a 300-token cache crosses ~10 tiles and every split
count below leaves some splits several tiles long and others empty.
"""

import pytest
import torch

from decode_check import check_kvcache
from flashtile import api
from flashtile.testing import assert_2x

pytestmark = pytest.mark.interpret

DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])

# (b, sq, h, hk, d, capacity, s_new)
SHAPES = {
    "decode-gqa4-d64": (3, 1, 8, 2, 64, 200, 1),
    "decode-mqa-d40": (2, 1, 4, 1, 40, 150, 1),
    "decode-mha-d16": (2, 1, 3, 3, 16, 77, 1),
    "spec3-gqa2-d32": (2, 3, 4, 2, 32, 120, 3),
    "chunk9-gqa8-d32": (1, 9, 16, 2, 32, 100, 9),  # 72 packed rows: two M blocks of 64
    "no-append-sq2-d80": (2, 2, 4, 2, 80, 300, 0),
}


@DTYPES
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_contiguous(shape, dtype):
    check_kvcache(*shape, dtype, "cpu")


@DTYPES
@pytest.mark.parametrize("page_size", [16, 48, 64])  # 16, 48: a page index per key; 64: per tile
@pytest.mark.parametrize("s_new", [1, 5])
def test_paged(page_size, s_new, dtype):
    check_kvcache(2, s_new, 8, 2, 32, 290, s_new, dtype, "cpu", page_size=page_size, causal=True)


LENGTHS = {
    "first-token": ([0, 0], 1),
    "one-cached": ([1, 1], 1),
    "fills-capacity": ([99, 96], 1),  # 99 + 1 = capacity
    "full-no-append": ([100, 100], 0),
    "empty-no-append": ([0, 37], 0),  # row 0 sees no key: zeros and lse -inf
    "append-fills": ([0, 93], 7),
}


@pytest.mark.parametrize("lengths,s_new", LENGTHS.values(), ids=LENGTHS.keys())
def test_lengths(lengths, s_new):
    check_kvcache(2, 1, 4, 2, 32, 100, s_new, torch.float16, "cpu", lengths=lengths, num_splits=3)


@DTYPES
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "page16"])
def test_num_splits_agree(page_size, dtype):
    """1 split (no combine), several, more splits than tiles (empty ones), and the heuristic."""
    results = [check_kvcache(2, 1, 8, 2, 32, 300, 1, dtype, "cpu", page_size=page_size,
                             lengths=[299, 170], num_splits=n) for n in (1, 3, 16, 0)]
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # fp32 partials; fp16 output rounding
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], atol=tol, rtol=0)
        torch.testing.assert_close(lse, results[0][1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("rotary_dim", [32, 16], ids=["full-rotary", "half-rotary"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rotary(interleaved, rotary_dim, causal):
    check_kvcache(2, 3, 4, 2, 32, 100, 3, torch.float16, "cpu", rotary=(rotary_dim, interleaved),
                  causal=causal, num_splits=2)


def test_rotary_paged_fp32():
    check_kvcache(2, 2, 4, 1, 64, 160, 2, torch.float32, "cpu", page_size=16, rotary=(48, False),
                  causal=True)


@pytest.mark.parametrize("window", [(20, 0), (5, 2), (0, 0), (-1, 1), (40, -1)], ids=str)
def test_window(window):
    check_kvcache(2, 4, 4, 2, 32, 200, 4, torch.float32, "cpu", window=window, num_splits=3)


@DTYPES
def test_softcap(dtype):
    check_kvcache(2, 1, 4, 2, 32, 150, 1, dtype, "cpu", softcap=2.0, num_splits=2)


@pytest.mark.parametrize("alibi", ["h", "bh"])
def test_alibi(alibi):
    check_kvcache(2, 2, 4, 2, 32, 150, 2, torch.float32, "cpu", alibi=alibi, causal=True, num_splits=2)


def test_leftpad_contiguous():
    check_kvcache(3, 2, 4, 2, 32, 150, 2, torch.float16, "cpu", leftpad=True, causal=True, num_splits=2)


def test_leftpad_paged_alibi():
    check_kvcache(3, 1, 4, 2, 32, 160, 1, torch.float32, "cpu", leftpad=True, page_size=16, alibi="h")


def test_cache_batch_idx():
    check_kvcache(3, 1, 4, 2, 32, 100, 1, torch.float16, "cpu", batch_idx=True, num_splits=2)


def test_int_seqlens_and_strided_q():
    check_kvcache(2, 2, 6, 3, 32, 100, 2, torch.float16, "cpu", int_seqlens=True, q_strided=True)


def test_cache_seqlens_none_reads_the_whole_cache():
    k_cache = torch.randn(2, 70, 2, 32).half()
    v_cache = torch.randn(2, 70, 2, 32).half()
    q = torch.randn(2, 1, 4, 32).half()
    out = api.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=2)
    want = api.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=70, num_splits=1)
    torch.testing.assert_close(out, want, atol=2e-3, rtol=0)


def test_empty_batch():
    k_cache = torch.randn(0, 64, 2, 32).half()
    out, lse = api.flash_attn_with_kvcache(torch.randn(0, 1, 4, 32).half(), k_cache, k_cache.clone(),
                                           cache_seqlens=torch.zeros(0, dtype=torch.int32),
                                           return_softmax_lse=True)
    assert out.shape == (0, 1, 4, 32) and lse.shape == (0, 4, 1)


# ---- merge_attention_states -------------------------------------------------------------------

def _merge_inputs(num_splits, rows, d, dtype):
    """Partials with some empty splits (lse -inf, out NaN) and one row where every split is empty."""
    out = torch.randn(num_splits, rows, d).to(dtype)
    lse = 3 * torch.randn(num_splits, rows)
    empty = torch.rand(num_splits, rows) < 0.3
    empty[:, 0] = True
    lse[empty] = float("-inf")
    out[empty] = float("nan")
    return out.view(num_splits, 2, rows // 2, d), lse.view(num_splits, 2, rows // 2)


def _merge_naive(out_partial, lse_partial, dtype):
    """The formula in plain torch: float64 gives the oracle, the input dtype the 2x-rule baseline
    (weights and LSE in float32 there, as a careful user would)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    lse = torch.logsumexp(lse_partial.to(wide), 0)
    w = torch.exp(lse_partial.to(wide) - lse.nan_to_num(neginf=0.0)).to(dtype)  # (S, *), 0 if empty
    out = (w[..., None] * out_partial.to(dtype).nan_to_num(0.0)).sum(0)
    return out, lse


@DTYPES
@pytest.mark.parametrize("num_splits", [1, 2, 7, 133])
def test_merge(num_splits, dtype):
    out_partial, lse_partial = _merge_inputs(num_splits, 12, 40, dtype)
    out, lse = api.merge_attention_states(out_partial, lse_partial)
    ref_out, ref_lse = _merge_naive(out_partial, lse_partial, torch.float64)
    base_out, base_lse = _merge_naive(out_partial, lse_partial, dtype)
    assert out.shape == (2, 6, 40) and out.dtype == dtype and lse.dtype == torch.float32
    assert_2x("out", out, ref_out, base_out)
    assert_2x("lse", lse, ref_lse, base_lse)
    assert torch.equal(out[0, 0], torch.zeros(40, dtype=dtype)) and lse[0, 0] == float("-inf")


def test_merge_strided_input():
    out_partial, lse_partial = _merge_inputs(5, 8, 16, torch.float32)
    out, lse = api.merge_attention_states(out_partial.transpose(1, 2), lse_partial.transpose(1, 2))
    want, want_lse = api.merge_attention_states(out_partial, lse_partial)
    torch.testing.assert_close(out, want.transpose(0, 1))
    torch.testing.assert_close(lse, want_lse.transpose(0, 1))
