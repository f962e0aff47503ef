"""Prefill kernels under the Triton interpreter (CPU, fp16 and fp32, small awkward shapes)."""

import pytest
import torch
from prefill_check import check_dq_accumulates, check_prefill

from flashtile.ops import configs

pytestmark = pytest.mark.interpret

# (b, sq, sk, h, hk, d)
SHAPES = {
    "one-token": (1, 1, 1, 1, 1, 8),
    "sq17-sk17-d40": (2, 17, 17, 2, 2, 40),
    "sq37-sk53-gqa-d40": (2, 37, 53, 4, 2, 40),
    "sq53-sk37-mqa-d64": (1, 53, 37, 2, 1, 64),
    "sq113-sk50-d111": (1, 113, 50, 2, 2, 111),
    "sq33-sk97-d80": (1, 33, 97, 2, 1, 80),
    "sq64-sk64-d96": (1, 64, 64, 3, 1, 96),
    "sq16-sk48-d3": (1, 16, 48, 1, 1, 3),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_forward_backward(shape, causal, dtype):
    check_prefill(*shape, dtype, "cpu", causal=causal)


LARGE_SCORES = {"sq40-sk50-d32": (1, 40, 50, 2, 2, 32, False), "sq33-d64-causal": (1, 33, 33, 1, 1, 64, True),
                "sq17-sk70-d16": (2, 17, 70, 2, 2, 16, False), "sq64-d64": (1, 64, 64, 2, 2, 64, False)}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", LARGE_SCORES.values(), ids=LARGE_SCORES.keys())
def test_fp32_backward_with_large_scores(shape, seed):
    """Inputs of std 3 (scores of 30-50: each row's softmax is nearly one-hot), fp32: the dK/dV
    programs recompute the scores as the forward rounded them, so P of a row's largest score is the
    forward's and dV keeps within 2x eager fp32's error (it reached 3-6x when they summed the
    transposed product)."""
    torch.manual_seed(seed)
    *dims, causal = shape
    check_prefill(*dims, torch.float32, "cpu", causal=causal, std=3.0)


@pytest.mark.parametrize("layout", ["bhsd", "packed"])
def test_strided_layouts(layout):
    check_prefill(2, 40, 40, 3, 3, 32, torch.float16, "cpu", causal=True, layout=layout)


@pytest.mark.parametrize("window", [(5, 3), (0, 0), (7, -1), (-1, 4)], ids=str)
def test_window(window):
    check_prefill(1, 45, 61, 2, 1, 32, torch.float32, "cpu", window=window)


def test_softcap_and_alibi():
    check_prefill(1, 33, 47, 4, 2, 48, torch.float32, "cpu", causal=True, softcap=1.5, alibi=True)
    check_prefill(1, 40, 29, 2, 2, 32, torch.float16, "cpu", softcap=4.0)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("fused", [False, True], ids=["two-launches", "one-launch"])
def test_backward_launch_modes(monkeypatch, fused, causal, tma):
    """dK/dV and dQ programs in one grid (after a delta launch) or in two launches (dQ, computing
    delta, then dK/dV), with tiles that differ between them (the dQ program index maps to (Q block,
    head of the group) behind the dK/dV programs), heads interleaved three (dK/dV) or two (dQ) at a
    time (4 and 3 (batch, kv head) pairs: partial last chunks), Q/dO and K/V read through pointers
    or TMA descriptors."""
    cfg = configs.BackwardConfig(configs.BlockConfig(16, 32, 4, 1), configs.BlockConfig(32, 16, 4, 1), fused,
                                 dkdv_tma=tma, dq_tma=tma, head_chunk=3, dq_head_chunk=2)
    monkeypatch.setattr(configs, "backward_config", lambda *args: cfg)
    check_prefill(2, 37, 75, 4, 2, 40, torch.float16, "cpu", causal=causal)
    check_prefill(3, 70, 33, 3, 1, 64, torch.float32, "cpu", causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_adds_dq_into_a_float32_buffer(causal, dtype):
    check_dq_accumulates(2, 37, 53, 4, 2, 40, dtype, "cpu", causal=causal)


def test_accumulate_dq_needs_a_float32_buffer_shaped_like_q():
    from flashtile.ops.prefill import attention_backward

    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match=r"accumulate_dq needs dq: a float32 tensor shaped like q \(1, 8, 2, 16\), "
                                         r"got \(torch.float16"):
        attention_backward(q, q, q, q, q, torch.zeros(1, 2, 8), 0.25, (None, None), dq=q.half(),
                           accumulate_dq=True)
