"""reference.fa2: FA2's loop equals the float64 oracle, and works as the API's CPU path (half inputs,
O(N) memory, clear errors)."""

import pytest
import torch
from reference_cases import CASES, ORACLE_ATOL, Case
from torch.utils._python_dispatch import TorchDispatchMode

from flashtile import testing
from flashtile.reference import fa2, naive

BLOCKS = {"block_m": 8, "block_n": 16}  # no test length is a multiple of either


def _oracle(q, k, v, dout, kwargs):
    out, lse = naive.attention(q, k, v, compute_dtype=torch.float64, **kwargs)
    grads = naive.attention_backward(dout, q, k, v, compute_dtype=torch.float64, **kwargs)
    return out, lse, grads


@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_match_oracle_float64(case):
    q, k, v, kwargs = case.inputs()
    dout = torch.randn_like(q)
    out_ref, lse_ref, grads_ref = _oracle(q, k, v, dout, kwargs)
    out, lse = fa2.forward(q, k, v, **kwargs, **BLOCKS)
    assert out.dtype == lse.dtype == torch.float64
    assert testing.max_err(out, out_ref) < ORACLE_ATOL
    assert testing.max_err(lse, lse_ref) < ORACLE_ATOL  # -inf rows must match -inf exactly
    grads = fa2.backward(dout, q, k, v, out, lse, **kwargs, **BLOCKS)
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert got.shape == want.shape, name
        assert testing.max_err(got, want) < ORACLE_ATOL, name


@pytest.mark.parametrize("block_m, block_n", [(1, 1), (3, 5), (64, 7), (128, 128)],
                         ids=["1x1", "3x5", "64x7", "128x128-one-block"])
def test_any_block_size_gives_the_same_result(block_m, block_n):
    q, k, v, kwargs = Case(1, 21, 34, 4, 2, 8, {"causal": True, "window_size": (9, -1)}).inputs()
    out_ref, lse_ref = naive.attention(q, k, v, compute_dtype=torch.float64, **kwargs)
    out, lse = fa2.forward(q, k, v, block_m=block_m, block_n=block_n, **kwargs)
    assert testing.max_err(out, out_ref) < ORACLE_ATOL
    assert testing.max_err(lse, lse_ref) < ORACLE_ATOL


def test_fully_masked_rows_give_zero_and_minus_inf():
    """sq=6 > sk=3 under causal: query rows 0-2 sit before the first key and see nothing."""
    q, k, v, _ = Case(1, 6, 3, 2, 2, 8).inputs()
    out, lse = fa2.forward(q, k, v, causal=True, block_m=2, block_n=2)
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
    dq, dk, dv = fa2.backward(torch.randn_like(q), q, k, v, out, lse, causal=True, block_m=2, block_n=2)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert torch.equal(dq[:, :3], torch.zeros_like(dq[:, :3]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[9]])
def test_half_and_float_inputs_follow_the_2x_rule(case, dtype):
    """The API's CPU path: out in the input dtype, lse float32, errors within 2x plain torch's."""
    q, k, v, kwargs = case.inputs(dtype)
    dout = torch.randn_like(q)
    out_ref, lse_ref, grads_ref = _oracle(q, k, v, dout, kwargs)
    out_torch, _ = naive.attention(q, k, v, **kwargs)
    grads_torch = naive.attention_backward(dout, q, k, v, **kwargs)
    out, lse = fa2.forward(q, k, v, **kwargs, **BLOCKS)
    assert out.dtype == dtype and lse.dtype == torch.float32
    testing.assert_2x("out", out, out_ref, out_torch)
    assert testing.max_err(lse, lse_ref) < 1e-5
    grads = fa2.backward(dout, q, k, v, out, lse, **kwargs, **BLOCKS)
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, grads_ref, grads_torch):
        assert got.dtype == dtype, name
        testing.assert_2x(name, got, want, base)


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any torch op produces."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_extra_memory_is_linear_in_n():
    """No (N, N) tensor ever exists: the largest is an (N, d) operand or a (block_m, block_n) tile."""
    b, n, h, d = 1, 512, 2, 16
    q, k, v, _ = Case(b, n, n, h, h, d).inputs(torch.float32)
    with _LargestTensor() as seen:
        out, lse = fa2.forward(q, k, v, causal=True, block_m=64, block_n=64)
        fa2.backward(torch.randn_like(q), q, k, v, out, lse, causal=True, block_m=64, block_n=64)
    assert seen.numel <= b * h * max(n * d, 64 * 64) < b * h * n * n


@pytest.mark.parametrize("call, match", [
    pytest.param(lambda q, k, v: fa2.forward(q, k, v, block_m=0), "block_m", id="block_m-0"),
    pytest.param(lambda q, k, v: fa2.forward(q, k, v, block_n=2.5), "block_n", id="block_n-float"),
    pytest.param(lambda q, k, v: fa2.forward(q, k[:, :, :1], v), "v must have shape", id="k-v-mismatch"),
    pytest.param(lambda q, k, v: fa2.forward(q, k, v, window_size=(3,)), "window_size", id="window-1-tuple"),
    pytest.param(lambda q, k, v: fa2.forward(q.float(), k, v), "dtype of q", id="mixed-dtypes"),
    pytest.param(lambda q, k, v: fa2.backward(q, q, k, v, q, torch.zeros(1, 2, 3)), "lse must have shape",
                 id="lse-shape"),
    pytest.param(lambda q, k, v: fa2.backward(q.float(), q, k, v, q, torch.zeros(1, 2, 4)), "dout",
                 id="dout-dtype"),
    pytest.param(lambda q, k, v: fa2.backward(q, q, k, v, q[:, :2], torch.zeros(1, 2, 4)),
                 "out must have shape", id="out-shape"),
])
def test_bad_arguments_name_the_argument(call, match):
    q, k, v, _ = Case(1, 4, 5, 2, 2, 8).inputs()
    with pytest.raises((ValueError, TypeError), match=match):
        call(q, k, v)
