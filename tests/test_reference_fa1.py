"""reference.fa1: Algorithm 1 and Algorithm 4 equal the float64 oracle; block sizes follow line 1;
the state written back to HBM after outer step j is what seed 001's induction proof says."""

import pytest
import torch
from reference_cases import CASES, ORACLE_ATOL, Case, HBMWrites

from flashtile import testing
from flashtile.reference import fa1, naive


def _sram_for(block_c: int, d: int, element_size: int = 8) -> int:
    """The M (bytes) for which line 1 gives B_c = block_c."""
    return 4 * d * element_size * block_c


@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_match_oracle_float64(case):
    q, k, v, kwargs = case.inputs()
    sram = _sram_for(13, case.d)  # B_c = 13, B_r = min(13, d): no length here is a multiple of 13
    dout = torch.randn_like(q)
    out_ref, lse_ref = naive.attention(q, k, v, compute_dtype=torch.float64, **kwargs)
    out, l, m = fa1.forward(q, k, v, sram_bytes=sram, **kwargs)
    assert testing.max_err(out, out_ref) < ORACLE_ATOL
    assert testing.max_err(m + torch.log(l), lse_ref) < ORACLE_ATOL
    grads = fa1.backward(dout, q, k, v, out, l, m, sram_bytes=sram, **kwargs)
    grads_ref = naive.attention_backward(dout, q, k, v, compute_dtype=torch.float64, **kwargs)
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert got.shape == want.shape, name
        assert testing.max_err(got, want) < ORACLE_ATOL, name


@pytest.mark.parametrize("sram, d, e, want", [
    pytest.param(192 * 1024, 512, 1, (96, 96), id="seed000-M192KB-d512-counted-in-elements"),
    pytest.param(192 * 1024, 64, 2, (64, 384), id="A100-fp16-d64"),
    pytest.param(192 * 1024, 128, 4, (96, 96), id="A100-fp32-d128"),
    pytest.param(1000, 3, 8, (3, 11), id="ceil-1000/96"),
])
def test_block_sizes_follow_algorithm_1_line_1(sram, d, e, want):
    assert fa1.block_sizes(sram, d, e) == want


@pytest.mark.parametrize("args, match", [
    pytest.param((0, 64, 2), "sram_bytes", id="sram-0"),
    pytest.param((1024, -1, 2), "headdim", id="headdim-negative"),
    pytest.param((1024, 64, 0), "element_size", id="element-size-0"),
])
def test_block_sizes_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        fa1.block_sizes(*args)


def test_hbm_state_after_outer_step_j_is_softmax_of_the_first_j_blocks():
    """Seed 001, 1.4.2: after step j, m = rowmax(S_:j), l = rowsum(exp(S_:j - m)), O = softmax(S_:j) V_:j."""
    b, n, h, d = 1, 11, 2, 4
    q, k, v, _ = Case(b, n, n, h, h, d).inputs()
    block_c = 3
    rec = HBMWrites()
    fa1.forward(q, k, v, softmax_scale=1.0, sram_bytes=_sram_for(block_c, d), counter=rec)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)  # (b, h, N, N)
    # with B_r = min(3, d) = 3 there are 4 Q blocks; writes: the zero init, then 4 per outer step
    for j, c1 in enumerate(range(block_c, n + block_c, block_c)):
        c1 = min(c1, n)
        step = rec.writes[1 + 4 * j: 1 + 4 * (j + 1)]
        O = torch.cat([w[0] for w in step], dim=2)  # (b, h, N, d)
        l = torch.cat([w[1] for w in step], dim=2)  # (b, h, N)
        m = torch.cat([w[2] for w in step], dim=2)
        s_j = s[..., :c1]
        torch.testing.assert_close(m, s_j.amax(-1), rtol=0, atol=1e-14)
        torch.testing.assert_close(l, torch.exp(s_j - m[..., None]).sum(-1), rtol=0, atol=1e-12)
        want = torch.softmax(s_j, -1) @ v[:, :c1].transpose(1, 2)
        torch.testing.assert_close(O, want, rtol=0, atol=1e-12)


def test_backward_rejects_stats_of_the_wrong_shape():
    q, k, v, _ = Case(1, 5, 5, 2, 2, 8).inputs()
    out, l, m = fa1.forward(q, k, v)
    with pytest.raises(ValueError, match="m must have shape"):
        fa1.backward(torch.randn_like(q), q, k, v, out, l, m[:, :, :2])
