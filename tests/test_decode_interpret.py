"""Flash-Decoding kernels under the Triton interpreter (CPU, fp16 and fp32, small caches).

Each case checks out and LSE by the 2x rule against the float64 oracle, outputs and split partials
poisoned, and the cache changed exactly at the appended slots (tests/decode_check.py). The
interpreter config uses 32-key tiles, so a 300-token cache crosses ~10 tiles and every split
count below leaves some splits several tiles long and others empty.
"""

import pytest
import torch
from decode_check import check_kvcache, make_cache, poisoned_empty

from flashtile import DecodePlan, _checks, api
from flashtile.ops import configs
from flashtile.reference.kvcache import attention_with_kvcache
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


# the splits merged by the split kernel's last program (fused) or by the combine kernel
COMBINE = pytest.mark.parametrize("combine", ["fused", "kernel"])


def use_combine(monkeypatch, combine):
    monkeypatch.setattr(configs, "DECODE_FUSED_MAX_SPLITS", 1 << 30 if combine == "fused" else 0)


@COMBINE
@pytest.mark.parametrize("lengths,s_new", LENGTHS.values(), ids=LENGTHS.keys())
def test_lengths(lengths, s_new, combine, monkeypatch):
    use_combine(monkeypatch, combine)
    check_kvcache(2, 1, 4, 2, 32, 100, s_new, torch.float16, "cpu", lengths=lengths, num_splits=3)


@COMBINE
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "page16"])
def test_append_spans_tiles_splits_and_m_blocks(page_size, combine, monkeypatch):
    """The launch that appends writes its new keys, each program those it reads: 40 new keys (a
    chunk of prefill) cross two 32-key tiles and, with 3 splits, two splits; their 80 packed query
    rows take two M blocks (both write what they read: the same bytes); row 0 has no cached keys."""
    use_combine(monkeypatch, combine)
    check_kvcache(2, 40, 4, 2, 32, 160, 40, torch.float16, "cpu", page_size=page_size, lengths=[0, 100],
                  causal=True, num_splits=3)


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "page16"])
def test_new_rows_no_query_sees_are_appended(page_size):
    """A left window narrower than the new rows hides the first of them from the only query: no
    split reads them, and they are written all the same (split 0's first M block writes every
    new row; the others write what they read)."""
    check_kvcache(2, 1, 4, 2, 32, 100, 5, torch.float16, "cpu", page_size=page_size, window=(2, 0), num_splits=3)


@COMBINE
@DTYPES
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "page16"])
def test_num_splits_agree(page_size, dtype, combine, monkeypatch):
    """1 split (no combine), several, more splits than tiles (empty ones), and the heuristic."""
    use_combine(monkeypatch, combine)
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


# ---- DecodePlan: the same kernels, planned once -----------------------------------------------

PLAN_CASES = {  # (b, sq, h, hk, d, capacity, s_new), options
    "gqa4-append": ((3, 1, 8, 2, 64, 200, 1), dict(num_splits=3)),
    "mqa-no-append-sq2": ((2, 2, 4, 1, 40, 150, 0), dict(causal=True)),
    "paged16-append": ((2, 1, 8, 2, 32, 160, 1), dict(page_size=16, causal=True)),
    "paged64-spec3": ((2, 3, 8, 2, 32, 200, 3), dict(page_size=64, causal=True, num_splits=2)),
    "batch-idx": ((3, 1, 4, 2, 32, 100, 1), dict(batch_idx=True, num_splits=2)),
    "leftpad-rotary": ((3, 2, 4, 2, 32, 150, 2), dict(leftpad=True, rotary=(32, True), causal=True)),
    "paged-leftpad-alibi": ((3, 1, 4, 2, 32, 160, 1), dict(leftpad=True, page_size=16, alibi="h")),
    "int-seqlens": ((2, 2, 6, 3, 32, 100, 2), dict(int_seqlens=True, window=(20, 0))),
}


@pytest.mark.parametrize("lengths_from", ["list", "tensor"])
@pytest.mark.parametrize("shape,options", PLAN_CASES.values(), ids=PLAN_CASES.keys())
def test_plan_matches_the_call_and_the_oracle(shape, options, lengths_from):
    """DecodePlan.run against the float64 oracle (2x rule) and bit for bit against
    flash_attn_with_kvcache (tests/decode_check.py, plan=...)."""
    check_kvcache(*shape, torch.float16, "cpu", plan=lengths_from, **options)


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "page16"])
def test_one_plan_runs_every_layer(page_size):
    """One plan, four layers with their own caches and inputs: every run equals flash_attn_with_kvcache
    on that layer's tensors (the split partials the plan owns carry nothing from one run to the
    next), and the appended keys land where the call puts them."""
    b, h, hk, d, capacity = 3, 8, 2, 32, 128
    lengths = [100, 0, 37]
    table = None if page_size is None else torch.randperm(b * capacity // page_size).view(b, -1).int()
    with poisoned_empty():
        plan = DecodePlan(b, h, (b if table is None else table.numel(), page_size or capacity, hk, d), lengths,
                          dtype=torch.float16, device="cpu", seqlen_new=1, block_table=table, causal=True,
                          num_splits=3)
    assert plan.num_splits == 3
    for layer in range(4):
        k_cache, v_cache, _ = make_cache(b, capacity, hk, d, torch.float16, "cpu", page_size, b)
        if table is not None:
            k_cache, v_cache = k_cache[:table.numel()], v_cache[:table.numel()]
        q = torch.randn(b, 1, h, d).half()
        k, v = torch.randn(b, 1, hk, d).half(), torch.randn(b, 1, hk, d).half()
        kc, vc = k_cache.clone(), v_cache.clone()
        out, lse = plan.run(q, k_cache, v_cache, k, v, return_softmax_lse=True)
        want, want_lse = api.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=torch.tensor(lengths).int(),
                                                     block_table=table, causal=True, num_splits=3,
                                                     return_softmax_lse=True)
        assert torch.equal(out, want) and torch.equal(lse, want_lse), f"layer {layer}"
        assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc), f"layer {layer}: appended keys"
    launch = plan._launch
    assert launch.fused and list(launch.scratch) == [None]  # CPU tensors: one stream, no handle
    # without the LSE asked for, the kernels write it where the plan keeps it, the same buffer each run
    k_cache, v_cache, _ = make_cache(b, capacity, hk, d, torch.float16, "cpu", page_size, b)
    if table is not None:
        k_cache, v_cache = k_cache[:table.numel()], v_cache[:table.numel()]
    q, k, v = torch.randn(b, 1, h, d).half(), torch.randn(b, 1, hk, d).half(), torch.randn(b, 1, hk, d).half()
    kc, vc = k_cache.clone(), v_cache.clone()
    want, _ = plan.run(q, kc, vc, k, v, return_softmax_lse=True)
    assert "lse" not in launch.unread
    assert torch.equal(plan.run(q, k_cache, v_cache, k, v), want)
    unread = launch.unread["lse"]
    assert torch.equal(plan.run(q, k_cache.clone(), v_cache.clone(), k, v), want) and launch.unread["lse"] is unread
    assert not launch.scratch[None][2].any(), "the fused merge leaves its arrival counters zeroed"


@pytest.mark.parametrize("sq,h,hk,num_splits", [(1, 8, 2, 5), (9, 16, 2, 2), (2, 4, 4, 7), (1, 8, 2, 37)],
                         ids=["gqa4", "two-m-blocks", "mha-sq2", "many-splits"])
def test_fused_merge_equals_the_combine_kernel(sq, h, hk, num_splits, monkeypatch):
    """The fused merge (online, one split at a time, in the split kernel's last program; of 37
    splits most are empty) and the combine kernel (every split of a row at once) agree to fp32
    rounding, rows with no keys included; the fused plan launches no combine."""
    b, d, capacity = 3, 32, 200
    cache = make_cache(b, capacity, hk, d, torch.float32, "cpu", None, b)[:2]
    q = torch.randn(b, sq, h, d)
    lengths = torch.tensor([150, 0, 199 - sq + 1], dtype=torch.int32)[:b]
    results = {}
    for combine in ("fused", "kernel"):
        use_combine(monkeypatch, combine)
        plan = DecodePlan(b, h, cache[0].shape, lengths.clone(), dtype=torch.float32, device="cpu", seqlen_q=sq,
                          causal=True, num_splits=num_splits)
        assert plan._launch.fused == (combine == "fused") and (plan._launch.combine is None) == plan._launch.fused
        with poisoned_empty():
            results[combine] = plan.run(q, *cache, return_softmax_lse=True)
    torch.testing.assert_close(results["fused"], results["kernel"], atol=1e-6, rtol=1e-5)
    assert torch.equal(results["fused"][0][1], torch.zeros(sq, h, d)), "a row with no keys outputs zeros"


# ---- indices the host cannot check (CUDA-graph capture): clamped, never out of bounds -------------

G = 16  # guard rows around every tensor the kernels index: NaN, so a read shows up as a NaN output


def _guarded(shape, dtype=torch.float16):
    """A random tensor of `shape` inside NaN guards: (view, the whole buffer, mask of the view)."""
    whole = torch.full((shape[0] + 2, shape[1] + 2 * G, *shape[2:]), float("nan"), dtype=dtype)
    inside = torch.zeros(whole.shape[:2], dtype=torch.bool)
    inside[1:-1, G:-G] = True
    view = whole[1:-1, G:-G]
    view.copy_(torch.randn(shape))
    return view, whole, inside


@pytest.mark.parametrize("page_size", [None, 16, 32], ids=["contiguous", "page16", "page32"])
def test_unchecked_indices_stay_inside_the_tensors(page_size, monkeypatch):
    """As under capture (host_copy cannot read the values), one out-of-range index per batch row:
    an append past the capacity, cache_seqlens negative and past the capacity, cache_batch_idx or
    pages outside k_cache, cache_leftpad negative and past the length, positions past the rotary
    tables. Rows 0 and 1 are valid and must be right; a cache_batch_idx outside k_cache leaves its
    row with no keys (zeros, lse -inf); the others may be anything finite. Nothing outside the
    cache is written, no guard is read (a guard would turn an output NaN), and the cache changes
    exactly at the appended slots that lie inside it."""
    monkeypatch.setattr(_checks, "host_copy", lambda t: None)
    sq, h, hk, d, s_new = 2, 4, 2, 32, 2
    pages_per_seq = 3
    capacity = pages_per_seq * page_size if page_size else 48
    rotary_len = capacity - 4
    #                         valid  valid  append past  negative  past cap      bad index  bad index  leftpads
    lengths = torch.tensor([5, 30, capacity - 1, -1000, capacity + 7, 9, 20, 12, 12], dtype=torch.int32)
    leftpad = torch.tensor([1, 0, 0, 0, 0, 0, 0, -1000, 1000], dtype=torch.int32)
    b = lengths.numel()
    bad_rows = (5, 6)
    kw = dict(cache_seqlens=lengths, cache_leftpad=leftpad, causal=True, num_splits=2)
    if page_size:
        num_pages = b * pages_per_seq
        table = torch.randperm(num_pages).view(b, pages_per_seq).int()
        table[5, 0], table[6, 1] = -7, num_pages + 2  # pages outside k_cache
        kw["block_table"] = table
        shape = (num_pages, page_size, hk, d)
    else:
        shape = (b + 1, capacity, hk, d)
        kw["cache_batch_idx"] = torch.tensor([1, 0, 2, 3, 4, -1, b + 1, 5, 6], dtype=torch.int32)
    (k_cache, k_whole, inside), (v_cache, v_whole, _) = _guarded(shape), _guarded(shape)
    angle = 6.3 * torch.rand(rotary_len, 8)  # rotary tables shorter than the cache, NaN after them
    (cos, _, _), (sin, _, _) = _guarded((rotary_len, 8)), _guarded((rotary_len, 8))
    cos.copy_(angle.cos()), sin.copy_(angle.sin())
    q = torch.randn(b, sq, h, d).half()
    k, v = torch.randn(b, s_new, hk, d).half(), torch.randn(b, s_new, hk, d).half()
    k_before, v_before = k_whole.clone(), v_whole.clone()

    out, lse = api.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                           return_softmax_lse=True, **kw)

    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    for whole in (k_whole, v_whole):
        assert whole[~inside].isnan().all(), "a write outside the cache"
    if not page_size:
        for row in bad_rows:
            assert (out[row] == 0).all() and (lse[row] == float("-inf")).all(), f"row {row} of no sequence"
    # the rows the valid append slots write: positions in [0, capacity), pages / sequences of k_cache
    written = torch.zeros(shape[:2], dtype=torch.bool)
    for row in range(b):
        for pos in range(int(lengths[row]), int(lengths[row]) + s_new):
            if not 0 <= pos < capacity:
                continue
            seq = int(table[row, pos // page_size]) if page_size else int(kw["cache_batch_idx"][row])
            if 0 <= seq < shape[0]:
                written[seq, pos % page_size if page_size else pos] = True
    changed = (k_whole[1:-1, G:-G] != k_before[1:-1, G:-G]).flatten(2).any(-1)
    assert torch.equal(changed, written)

    # the valid rows, against the oracle on a copy of the cache before the call
    monkeypatch.undo()
    for row in (0, 1):
        sub = {n: x[row:row + 1] for n, x in kw.items() if isinstance(x, torch.Tensor)}
        k_ref, v_ref = k_before[1:-1, G:-G].clone(), v_before[1:-1, G:-G].clone()
        ref, _ = attention_with_kvcache(q[row:row + 1], k_ref, v_ref, k[row:row + 1], v[row:row + 1], cos, sin,
                                        causal=True, compute_dtype=torch.float64, **sub)
        torch.testing.assert_close(out[row:row + 1].double(), ref, atol=2e-2, rtol=0)
