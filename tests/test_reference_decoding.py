"""reference.decoding: any way of splitting the keys gives the exact result; merge is exact, ignores
empty splits and takes any leading shape (it is the CPU path of merge_attention_states)."""

import pytest
import torch
from reference_cases import CASES, ORACLE_ATOL, Case

from flashtile import testing
from flashtile.reference import decoding, naive

SK = 23
SPLITS = [
    pytest.param({"num_splits": 1}, id="1-split"),
    pytest.param({"num_splits": 2}, id="2-splits"),
    pytest.param({"num_splits": 5}, id="5-splits-uneven"),
    pytest.param({"num_splits": SK}, id="one-key-per-split"),
    pytest.param({"num_splits": SK + 9}, id="more-splits-than-keys"),
    pytest.param({"bounds": [0, 0, 4, 4, 4, 17, SK, SK]}, id="empty-chunks-inside-and-at-ends"),
    pytest.param({"bounds": [0, SK]}, id="bounds-one-chunk"),
]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("case", [
    pytest.param(Case(2, 1, SK, 4, 2, 16, {"causal": True}), id="decode-gqa"),
    pytest.param(Case(1, 3, SK, 4, 1, 16, {"causal": True, "window_size": (6, -1)}), id="3-queries-window-mqa"),
    pytest.param(Case(1, 2, SK, 2, 2, 16, {"softcap": 1.0}, alibi="bh"), id="softcap-alibi"),
])
def test_any_split_gives_the_exact_result(case, split):
    q, k, v, kwargs = case.inputs()
    out_ref, lse_ref = naive.attention(q, k, v, compute_dtype=torch.float64, **kwargs)
    out, lse = decoding.attention(q, k, v, **split, block_n=4, **kwargs)
    assert testing.max_err(out, out_ref) < ORACLE_ATOL
    assert testing.max_err(lse, lse_ref) < ORACLE_ATOL


@pytest.mark.parametrize("case", CASES)
def test_prefill_cases_split_in_three(case):
    """The masks stay aligned to the whole key range inside each split, for sq > 1 as well."""
    q, k, v, kwargs = case.inputs()
    out_ref, lse_ref = naive.attention(q, k, v, compute_dtype=torch.float64, **kwargs)
    out, lse = decoding.attention(q, k, v, num_splits=3, block_m=8, block_n=8, **kwargs)
    assert testing.max_err(out, out_ref) < ORACLE_ATOL
    assert testing.max_err(lse, lse_ref) < ORACLE_ATOL


def test_split_partials_layout_and_empty_chunks():
    q, k, v, _ = Case(2, 1, 10, 4, 2, 8).inputs(torch.float16)
    out_p, lse_p = decoding.split_partials(q, k, v, bounds=[0, 6, 6, 10])
    assert out_p.shape == (3, 2, 1, 4, 8) and lse_p.shape == (3, 2, 1, 4)
    assert out_p.dtype == lse_p.dtype == torch.float32
    assert torch.equal(out_p[1], torch.zeros_like(out_p[1])) and torch.isneginf(lse_p[1]).all()
    # each partial is attention over its own chunk
    for s, (lo, hi) in enumerate([(0, 6), (6, 10)]):
        want, want_lse = naive.attention(q, k[:, lo:hi], v[:, lo:hi], compute_dtype=torch.float64)
        assert testing.max_err(out_p[2 * s], want) < 1e-3
        assert testing.max_err(lse_p[2 * s], want_lse.transpose(1, 2)) < 1e-5


def test_split_bounds():
    assert decoding.split_bounds(10, 3) == [0, 4, 8, 10]
    assert decoding.split_bounds(3, 5) == [0, 1, 2, 3, 3, 3]
    assert decoding.split_bounds(0, 2) == [0, 0, 0]


@pytest.mark.parametrize("lead", [(), (3,), (2, 5, 4)], ids=["no-lead", "lead-3", "lead-2x5x4"])
def test_merge_any_leading_shape_equals_one_softmax(lead):
    """Split one row of scores into S pieces by hand; merge must give the softmax over all of it."""
    S, n, d = 4, 9, 6
    scores = torch.randn(*lead, S, n, dtype=torch.float64)
    values = torch.randn(*lead, S, n, d, dtype=torch.float64)
    lse_p = torch.logsumexp(scores, -1).movedim(-1, 0)  # (S, *lead)
    out_p = (torch.softmax(scores, -1)[..., None] * values).sum(-2).movedim(-2, 0)  # (S, *lead, d)
    out, lse = decoding.merge(out_p, lse_p)
    flat_scores = scores.flatten(-2)  # (*lead, S * n)
    want = (torch.softmax(flat_scores, -1)[..., None] * values.flatten(-3, -2)).sum(-2)
    assert out.shape == (*lead, d) and lse.shape == lead
    assert testing.max_err(out, want) < ORACLE_ATOL
    assert testing.max_err(lse, torch.logsumexp(flat_scores, -1)) < ORACLE_ATOL


def test_merge_ignores_empty_splits_and_zeroes_all_empty_rows():
    out_p = torch.randn(3, 2, 4)
    lse_p = torch.tensor([[0.5, float("-inf")], [float("-inf"), float("-inf")], [1.5, float("-inf")]])
    out_p[1] = float("nan")  # an empty split may hold anything
    out, lse = decoding.merge(out_p, lse_p)
    w0, w2 = torch.softmax(torch.tensor([0.5, 1.5]), 0)
    torch.testing.assert_close(out[0], w0 * out_p[0, 0] + w2 * out_p[2, 0])
    torch.testing.assert_close(lse[0], torch.logsumexp(torch.tensor([0.5, 1.5]), 0))
    assert torch.equal(out[1], torch.zeros(4)) and torch.isneginf(lse[1])


def test_merge_single_split_is_identity():
    out_p, lse_p = torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5)
    out, lse = decoding.merge(out_p, lse_p)
    torch.testing.assert_close(out, out_p[0])
    torch.testing.assert_close(lse, lse_p[0])


@pytest.mark.parametrize("call, match", [
    pytest.param(lambda: decoding.merge([1.0], torch.zeros(1)), "out_partial must be a torch.Tensor",
                 id="out-not-tensor"),
    pytest.param(lambda: decoding.merge(torch.zeros(2, 3, 4), torch.zeros(2, 4)), "lse_partial must have shape",
                 id="lse-shape"),
    pytest.param(lambda: decoding.merge(torch.zeros(2, 3, 4), torch.zeros(2, 3, 1)),
                 "lse_partial must have 2 dimensions", id="lse-ndim"),
    pytest.param(lambda: decoding.merge(torch.zeros(0, 3, 4), torch.zeros(0, 3)), "S >= 1", id="no-splits"),
    pytest.param(lambda: decoding.merge(torch.zeros(2, 3, 4, dtype=torch.int32), torch.zeros(2, 3)),
                 "out_partial must have dtype", id="int-out"),
    pytest.param(lambda: decoding.split_bounds(8, 0), "num_splits", id="zero-splits"),
    pytest.param(lambda: decoding.attention(*Case(1, 1, 8, 2, 2, 4).inputs()[:3], bounds=[0, 5, 3, 8]),
                 "bounds must rise", id="bounds-falling"),
    pytest.param(lambda: decoding.attention(*Case(1, 1, 8, 2, 2, 4).inputs()[:3], bounds=[0, 7]),
                 "bounds must rise from 0 to seqlen_k=8", id="bounds-short"),
])
def test_bad_arguments_name_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
