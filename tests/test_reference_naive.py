"""The oracle's written-out backward agrees with torch autograd through its own forward, in float64.

If these pass, `naive.attention_backward` is the gradient of `naive.attention` for every feature, so
the gradient tests of fa1, fa2 and the kernels rest on a checked oracle.
"""

import pytest
import torch
from reference_cases import CASES, Case

from flashtile import testing
from flashtile.reference import naive


def _autograd(q, k, v, dout, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, _ = naive.attention(q, k, v, compute_dtype=torch.float64, **kwargs)
    return torch.autograd.grad(out, (q, k, v), dout)


def _assert_close(got, want, name):
    err = testing.max_err(got, want)
    assert err < 1e-12, f"{name}: max error {err:.3g}"


DROPOUT = [
    pytest.param(Case(2, 21, 21, 2, 2, 16), id="dropout-plain"),
    pytest.param(Case(1, 9, 14, 4, 2, 16, {"causal": True}), id="dropout-causal-gqa"),
    pytest.param(Case(1, 14, 9, 4, 1, 16, {"causal": True, "softcap": 1.5}, alibi="bh"),
                 id="dropout-causal-sq>sk-mqa-softcap-alibi"),
]


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_autograd(case):
    q, k, v, kwargs = case.inputs()
    dout = torch.randn_like(q)
    grads = naive.attention_backward(dout, q, k, v, compute_dtype=torch.float64, **kwargs)
    for name, got, want in zip("dq dk dv".split(), grads, _autograd(q, k, v, dout, **kwargs)):
        assert got.shape == want.shape, name
        _assert_close(got, want, name)


# 1 / (1 - p) is exact in float32 for p = 0.5 but not for p = 0.3: p = 0.3 catches a keep factor
# built in float32 (a bool / float division) that would make float64 gradients drift by ~1e-7.
@pytest.mark.parametrize("dropout_p", [0.5, 0.3], ids=["p0.5", "p0.3"])
@pytest.mark.parametrize("case", DROPOUT)
def test_backward_with_dropout_mask_matches_autograd(case, dropout_p):
    q, k, v, kwargs = case.inputs()
    keep = torch.rand(case.b, case.h, case.sq, case.sk) > dropout_p  # (b, h, sq, sk) kept entries
    kwargs.update(dropout_p=dropout_p, dropout_mask=keep)
    dout = torch.randn_like(q)
    grads = naive.attention_backward(dout, q, k, v, compute_dtype=torch.float64, **kwargs)
    for name, got, want in zip("dq dk dv".split(), grads, _autograd(q, k, v, dout, **kwargs)):
        _assert_close(got, want, name)


def test_dropout_mask_changes_the_output():
    """The mask is applied (a test of the gradient alone would pass with the mask ignored twice)."""
    q, k, v, _ = Case(1, 8, 8, 2, 2, 16).inputs()
    keep = torch.rand(1, 2, 8, 8) > 0.5
    out, _ = naive.attention(q, k, v, dropout_p=0.5, dropout_mask=keep)
    manual = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / 4.0, -1) * keep / 0.5
    torch.testing.assert_close(out, torch.einsum("bhqk,bkhd->bqhd", manual, v))


@pytest.mark.parametrize("kwargs, match", [
    pytest.param({"dropout_p": 0.2}, "dropout_mask", id="dropout-without-mask"),
    pytest.param({"dropout_p": 0.2, "dropout_mask": torch.ones(1, 2, 3, 3, dtype=torch.bool)},
                 "dropout_mask must have shape", id="dropout-mask-shape"),
    pytest.param({"dropout_p": 1.0}, "dropout_p", id="dropout-p-1"),
    pytest.param({"window_size": (0.5, 0)}, "window_size left", id="window-float"),
    pytest.param({"softcap": -1.0}, "softcap", id="negative-softcap"),
    pytest.param({"alibi_slopes": torch.ones(3)}, "alibi_slopes", id="alibi-shape"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    q, k, v, _ = Case(1, 4, 4, 2, 2, 8).inputs()
    with pytest.raises((ValueError, TypeError), match=match):
        naive.attention(q, k, v, **kwargs)
