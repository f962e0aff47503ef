"""Decoding API on CPU without kernels: argument errors, the num_splits heuristic, the reference path."""

import re

import pytest
import torch

from decode_check import check_kvcache
from flashtile import api, flash_attn_with_kvcache, merge_attention_states
from flashtile.ops import configs


def _call(**change):
    """A valid call (b=2, q heads 4, kv heads 2, d=32, cache 64, one new token) with `change` applied."""
    args = dict(q=torch.randn(2, 1, 4, 32).half(), k_cache=torch.randn(2, 64, 2, 32).half(),
                v_cache=torch.randn(2, 64, 2, 32).half(), k=torch.randn(2, 1, 2, 32).half(),
                v=torch.randn(2, 1, 2, 32).half(), cache_seqlens=torch.tensor([3, 5], dtype=torch.int32))
    args.update(change)
    return args


def _paged(**change):
    """8 pages of 16; sequence 0 owns pages 0, 1 (unused entries -1), sequence 1 pages 2..5."""
    paged = dict(k_cache=torch.randn(8, 16, 2, 32).half(), v_cache=torch.randn(8, 16, 2, 32).half(),
                 block_table=torch.tensor([[0, 1, -1, -1], [2, 3, 4, 5]], dtype=torch.int32))
    return _call(**{**paged, **change})


def _rotary(n=64, half=8):
    return dict(rotary_cos=torch.randn(n, half).half(), rotary_sin=torch.randn(n, half).half())


ERRORS = {
    "q-fp64": (_call(q=torch.randn(2, 1, 4, 32).double()), TypeError, "q must have dtype"),
    "q-3d": (_call(q=torch.randn(2, 4, 32).half()), ValueError, "q must have 4 dimensions"),
    "cache-dtype": (_call(k_cache=torch.randn(2, 64, 2, 32)), TypeError, "k_cache must have the dtype of q"),
    "cache-headdim": (_call(k_cache=torch.randn(2, 64, 2, 16).half()), ValueError, "head dim 32"),
    "v-cache-shape": (_call(v_cache=torch.randn(2, 63, 2, 32).half()), ValueError, "v_cache must have shape"),
    "heads": (_call(q=torch.randn(2, 1, 5, 32).half()), ValueError, "multiple of the number of key/value heads"),
    "k-without-v": (_call(v=None), ValueError, "k and v must be given together"),
    "k-heads": (_call(k=torch.randn(2, 1, 4, 32).half(), v=torch.randn(2, 1, 4, 32).half()),
                ValueError, "k must have shape"),
    "k-dtype": (_call(k=torch.randn(2, 1, 2, 32)), TypeError, "k must have the dtype of q"),
    "seqlens-int64": (_call(cache_seqlens=torch.tensor([3, 5])), TypeError, "cache_seqlens must be int32"),
    "seqlens-shape": (_call(cache_seqlens=torch.tensor([3, 5, 1], dtype=torch.int32)), ValueError,
                      "cache_seqlens must have shape (2,)"),
    "seqlens-none-append": (_call(cache_seqlens=None), ValueError, "cache_seqlens is required"),
    "seqlens-negative": (_call(cache_seqlens=torch.tensor([-1, 5], dtype=torch.int32)), ValueError, ">= 0"),
    "overflow": (_call(cache_seqlens=torch.tensor([3, 64], dtype=torch.int32)), ValueError, "cache overflow"),
    "overflow-int": (_call(cache_seqlens=64), ValueError, "cache overflow"),
    "overflow-paged": (_paged(cache_seqlens=torch.tensor([3, 64], dtype=torch.int32)), ValueError, "cache overflow"),
    "page-size": (_paged(k_cache=torch.randn(8, 24, 2, 32).half(), v_cache=torch.randn(8, 24, 2, 32).half()),
                  ValueError, "multiple of 16"),
    "table-dtype": (_paged(block_table=torch.zeros(2, 4, dtype=torch.int64)), TypeError, "block_table must be int32"),
    "table-rows": (_paged(block_table=torch.zeros(3, 4, dtype=torch.int32)), ValueError, "block_table must have shape"),
    "table-bounds": (_paged(block_table=torch.tensor([[0, 1, -1, -1], [2, 8, 4, 5]], dtype=torch.int32),
                            cache_seqlens=torch.tensor([3, 20], dtype=torch.int32)),
                     ValueError, "block_table[1, 1] = 8 is not a page"),
    "table-unallocated": (_paged(cache_seqlens=torch.tensor([32, 5], dtype=torch.int32)), ValueError,
                          "block_table[0, 2] = -1"),
    "paged-batch-idx": (_paged(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32)), ValueError,
                        "cache_batch_idx cannot be combined with block_table"),
    "batch-idx-bounds": (_call(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)), ValueError,
                         "cache_batch_idx[1] = 2"),
    "cache-too-few-seqs": (_call(k_cache=torch.randn(1, 64, 2, 32).half(), v_cache=torch.randn(1, 64, 2, 32).half()),
                           ValueError, "at least 2 sequences"),
    "leftpad": (_call(cache_leftpad=torch.tensor([4, 0], dtype=torch.int32)), ValueError, "cache_leftpad[0] = 4"),
    "rotary-without-k": (_call(k=None, v=None, **_rotary()), ValueError, "pass k and v"),
    "rotary-cos-only": (_call(rotary_cos=torch.randn(64, 8).half()), ValueError, "given together"),
    "rotary-dim": (_call(**_rotary(half=17)), ValueError, "rotary_dim"),
    "rotary-short": (_call(**_rotary(n=5)), ValueError, "reach position 5"),
    "num-splits": (_call(num_splits=-1), ValueError, "num_splits"),
    "window": (_call(window_size=(-2, 0)), ValueError, "window_size"),
    "softcap": (_call(softcap=-1.0), ValueError, "softcap"),
    "alibi": (_call(alibi_slopes=torch.rand(3)), ValueError, "alibi_slopes must have shape"),
}


@pytest.mark.parametrize("args,error,message", ERRORS.values(), ids=ERRORS.keys())
def test_errors(args, error, message):
    before = args["k_cache"].clone()
    with pytest.raises(error, match=re.escape(message)):
        flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before), "a rejected call must not touch the cache"


MERGE_ERRORS = {
    "lse-dtype": ((torch.randn(3, 4, 8), torch.randn(3, 4).half()), TypeError, "lse_partial must have dtype"),
    "lse-shape": ((torch.randn(3, 4, 8), torch.randn(3, 5)), ValueError, "lse_partial must have shape"),
    "no-splits": ((torch.randn(0, 4, 8), torch.randn(0, 4)), ValueError, "S >= 1"),
    "out-1d": ((torch.randn(8), torch.randn(())), ValueError, "S >= 1"),
    "out-int": ((torch.ones(3, 4, 8, dtype=torch.int32), torch.randn(3, 4)), TypeError, "out_partial must have dtype"),
}


@pytest.mark.parametrize("args,error,message", MERGE_ERRORS.values(), ids=MERGE_ERRORS.keys())
def test_merge_errors(args, error, message):
    with pytest.raises(error, match=re.escape(message)):
        merge_attention_states(*args)


# ---- the num_splits heuristic --------------------------------------------------------------------

# seed 004's table (16 q / 2 kv heads) and the Llama-3-8B shape (8 kv heads) on an H100, d=128 fp16:
# the counts the sweep measured best or within 3% (benchmarks/results/h100/decode_sweep.json)
SEED_SHAPES = {(256, 256, 2): 1, (128, 512, 2): 1, (16, 4096, 2): 8, (8, 8192, 2): 16, (2, 32768, 2): 64,
               (1, 65536, 2): 128, (1, 131072, 2): 256, (64, 8192, 8): 1}


@pytest.mark.parametrize("shape,want", SEED_SHAPES.items(), ids=[f"b{b}-ctx{c}-hk{k}" for b, c, k in SEED_SHAPES])
def test_num_splits_seed_shapes(shape, want):
    b, ctx, hk = shape
    block_n = configs.decode_config(8, 128, torch.float16, 0, torch.device("cuda")).block_n
    assert configs.decode_num_splits(b * hk, ctx, block_n, 132) == want


@pytest.mark.parametrize("num_sms", [16, 132])
def test_num_splits_invariants(num_sms):
    slots = configs.DECODE_PROGRAMS_PER_SM * num_sms
    for programs in (1, 2, 3, 7, 32, 100, 211, 212, 264, 1000):
        for keys in (0, 1, 63, 64, 255, 256, 1000, 4096, 131072, 10**6):
            n = configs.decode_num_splits(programs, keys, 64, num_sms)
            assert n >= 1
            if n > 1:  # splitting only to fill the GPU, and never into slivers
                assert programs * n <= configs.DECODE_ROUNDS * slots
                assert n * configs.DECODE_MIN_BLOCKS_PER_SPLIT * 64 < keys + configs.DECODE_MIN_BLOCKS_PER_SPLIT * 64
            if programs >= configs.DECODE_NO_SPLIT_FILL * slots:
                assert n == 1


@pytest.mark.parametrize("num_splits", [1, 2, 7, 133, 264, 512, 700])
@pytest.mark.parametrize("d", [16, 40, 128, 256])
def test_combine_config(num_splits, d):
    cfg = configs.combine_config(num_splits, d)
    assert cfg.block_s >= min(num_splits, 512)  # one load holds every split up to 512
    assert cfg.block_s * cfg.block_d <= 8192 and cfg.block_d >= 16


# ---- the reference path (CPU without the interpreter) ------------------------------------------

REFERENCE_CASES = {
    "contiguous": dict(),
    "paged16-causal": dict(page_size=16, causal=True),
    "rotary-leftpad": dict(rotary=(16, False), leftpad=True, causal=True),
    "window-alibi-softcap": dict(window=(10, 0), alibi="bh", softcap=3.0),
    "batch-idx": dict(batch_idx=True),
}


@pytest.mark.parametrize("case", REFERENCE_CASES.values(), ids=REFERENCE_CASES.keys())
def test_reference_backend(case):
    with api.use_backend("reference"):
        check_kvcache(2, 2, 4, 2, 32, 96, 2, torch.float16, "cpu", **case)


def test_reference_merge():
    out_partial = torch.randn(5, 3, 16)
    lse_partial = torch.randn(5, 3)
    lse_partial[1] = float("-inf")
    out_partial[1] = float("nan")
    with api.use_backend("reference"):
        out, lse = merge_attention_states(out_partial, lse_partial)
    w = torch.exp(lse_partial - lse).nan_to_num(0.0)
    torch.testing.assert_close(lse, torch.logsumexp(lse_partial, 0))
    torch.testing.assert_close(out, (w[..., None] * out_partial.nan_to_num(0.0)).sum(0))
