"""Dropout in the prefill kernels (Triton interpreter) and in the reference path."""

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from prefill_check import check_prefill
from varlen_check import check_varlen

import flashtile
from flashtile import _checks, api
from flashtile.ops.philox import dropout_keep, dropout_seed
from flashtile.ops.philox import philox2x32 as kernel_philox2x32
from flashtile.reference.dropout import DropoutMask, draw_rng, philox2x32

pytestmark = pytest.mark.interpret


@triton.jit
def _keep_kernel(Rng, Out, bh, row0, col0, threshold, R: tl.constexpr, C: tl.constexpr,
                 TRANSPOSED: tl.constexpr):
    keep = dropout_keep(dropout_seed(Rng), bh, row0, R, col0, C, threshold, TRANSPOSED)
    if TRANSPOSED:  # stored as (keys, rows)
        tl.store(Out + tl.arange(0, C)[:, None] * R + tl.arange(0, R)[None, :], keep.to(tl.int8))
    else:
        tl.store(Out + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :], keep.to(tl.int8))


@pytest.mark.parametrize("transposed", [False, True], ids=["rows-keys", "keys-rows"])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kernel_mask_equals_the_torch_philox(p, transposed):
    """ops.philox.dropout_keep (in the forward's and the dK/dV programs' orientation) and
    reference.dropout.DropoutMask give the same bits, for tiles at row offsets of any multiple of
    16 and key offsets of any multiple of 32 (16 for key blocks of 16), in any head."""
    rng = draw_rng("cpu")
    mask = DropoutMask(p, rng, nheads=3, sequences=[0, 1])
    threshold, _ = _checks.dropout_threshold(p)
    tiles = ((0, 0, 0, 16, 32), (4, 48, 64, 32, 32), (5, 1024, 96, 64, 64), (2, 16, 16, 16, 16), (1, 32, 48, 32, 16))
    for bh, row0, col0, rows, cols in tiles:
        out = torch.empty(rows * cols, dtype=torch.int8)
        _keep_kernel[(1,)](rng, out, bh, row0, col0, threshold, R=rows, C=cols, TRANSPOSED=transposed)
        got = out.view(cols, rows).T if transposed else out.view(rows, cols)
        want = mask.keep(row0, row0 + rows, col0, col0 + cols)[bh // 3, bh % 3]
        assert torch.equal(got.bool(), want), (bh, row0, col0)


# Random123's known-answer vectors of Philox2x32: counter, key, then the words after 7 and 10 rounds
PHILOX2X32_KAT = [
    ((0, 0), 0, (0x257A3673, 0xCD26BE2A), (0xFF1DAE59, 0x6CD10DF2)),
    ((0xFFFFFFFF, 0xFFFFFFFF), 0xFFFFFFFF, (0xAB302C4D, 0x3DC9D239), (0x2C3F628B, 0xAB4FD7AD)),
    ((0x243F6A88, 0x85A308D3), 0x13198A2E, (0xBEDBBE6B, 0xE4C770B3), (0xDD7CE038, 0xF62A4C12)),
]


@pytest.mark.parametrize("counter,key,want7,want10", PHILOX2X32_KAT, ids=["zeros", "ones", "pi"])
def test_philox2x32_known_answers(counter, key, want7, want10):
    """Philox2x32 against Random123's known-answer vectors: 7 rounds (what dropout draws) in torch
    and in the kernels, and 10 in torch (the round function at Random123's default count)."""
    assert tuple(int(x) for x in philox2x32(key, *counter)) == want7
    assert tuple(int(x) for x in philox2x32(key, *counter, rounds=10)) == want10
    out = torch.empty(2, dtype=torch.int64)
    _philox_kernel[(1,)](out, key, *counter)
    assert tuple(out.tolist()) == want7


@triton.jit
def _philox_kernel(Out, key, c0, c1):
    w0, w1 = kernel_philox2x32(key.to(tl.uint32), c0.to(tl.uint32), c1.to(tl.uint32))
    tl.store(Out, w0.to(tl.int64))
    tl.store(Out + 1, w1.to(tl.int64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_forward_backward_against_the_oracle(causal, dtype):
    """Output, LSE and gradients against naive attention with the same mask (2x rule)."""
    check_prefill(2, 37, 53, 4, 2, 40, dtype, "cpu", causal=causal, dropout_p=0.3)
    check_prefill(1, 64, 48, 2, 1, 64, dtype, "cpu", causal=causal, dropout_p=0.1)
    check_prefill(1, 29, 31, 2, 2, 59, dtype, "cpu", causal=causal, dropout_p=0.2)  # an odd head dim


def test_dropout_varlen_against_the_oracle():
    check_varlen([17, 0, 1, 40], [17, 5, 1, 33], 4, 2, 32, torch.float32, "cpu", causal=True, dropout_p=0.25)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_same_seed_same_output_and_gradients(backend):
    q, k, v = (torch.randn(2, 40, 4, 32, requires_grad=True) for _ in range(3))
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        with api.use_backend(backend):
            out = flashtile.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)
        runs.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)
    assert not torch.equal(runs[0][0], runs[2][0])  # another seed, another mask


def test_reference_path_and_kernels_draw_the_same_mask():
    """The CPU reference (fa2 with reference.dropout) and the interpreter agree: same seed, same
    output up to rounding, so the masks are identical."""
    q, k, v = (torch.randn(2, 33, 4, 16) for _ in range(3))
    outs = []
    for backend in ("triton", "reference"):
        torch.manual_seed(3)
        with api.use_backend(backend):
            outs.append(flashtile.flash_attn_func(q, k, v, dropout_p=0.4))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_dropout_is_unbiased():
    """z-test: over N seeds the mean of a fixed projection of the output equals the no-dropout
    value (|z| < 4.5: a false alarm once in ~150000 runs; forgetting the 1 / (1 - p) scale gives
    |z| in the hundreds)."""
    q, k, v = (torch.randn(1, 24, 2, 16) for _ in range(3))
    w = torch.randn(1, 24, 2, 16)
    exact = float((flashtile.flash_attn_func(q, k, v) * w).sum())
    samples = torch.tensor([float((flashtile.flash_attn_func(q, k, v, dropout_p=0.3) * w).sum()) for _ in range(200)])
    z = (samples.mean() - exact) / (samples.std() / math.sqrt(len(samples)))
    assert abs(z) < 4.5, (float(samples.mean()), exact, float(z))


def test_drop_rate_is_p():
    """The drawn mask drops a binomial fraction p of the scores (z-test on 2 x 4 x 128 x 512)."""
    p = 0.15
    keep = DropoutMask(p, draw_rng("cpu"), 4, [0, 1]).full(128, 512)
    n = keep.numel()
    threshold, _ = _checks.dropout_threshold(p)
    p_eff = threshold / 2**8
    z = (float((~keep).sum()) - n * p_eff) / math.sqrt(n * p_eff * (1 - p_eff))
    assert abs(z) < 4.5 and abs(p_eff - p) <= 2 ** -9


def test_sdpa_runs_dropout_in_flashtile():
    """scaled_dot_product_attention with dropout_p now runs flashtile's kernels (same mask as
    flash_attn_func under the same seed)."""
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    torch.manual_seed(1)
    a = flashtile.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(1)
    b = flashtile.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), dropout_p=0.3).transpose(1, 2)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("window", [torch.tensor([3, 2]), [3, 2], (3, 2), np.array([3, 2])],
                         ids=["tensor", "list", "tuple", "numpy"])
def test_window_size_forms(window):
    """flash-attn's tests pass window_size = torch.randint(0, seqlen_k, (2,)): every form gives
    the same result."""
    q, k, v = (torch.randn(1, 20, 2, 16) for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v, window_size=window)
    ref = flashtile.flash_attn_func(q, k, v, window_size=(3, 2))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("window,match,exc", [
    (torch.tensor([1, 2, 3]), "window_size must be a pair", ValueError),
    (torch.tensor([1.5, 2.0]), "window_size left must be an int", TypeError),
    ((0, 2.5), "window_size right must be an int", TypeError),
    (("a", 0), "window_size left must be an int", TypeError),
    (torch.tensor([3, 2], device="meta"), "window_size must hold values", ValueError),
    (np.array([1, 2, 3]), "window_size must be a pair", ValueError),
])
def test_window_size_bad_forms(window, match, exc):
    q, k, v = (torch.randn(1, 20, 2, 16) for _ in range(3))
    with pytest.raises(exc, match=match):
        flashtile.flash_attn_func(q, k, v, window_size=window)
