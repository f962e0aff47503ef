"""The IO model: counted tiles equal the formulas exactly; the asymptotics the papers claim; the
seeds' numbers; block sizes and roofline times."""

import pytest
import torch
from reference_cases import Case

from flashtile import analysis
from flashtile.analysis import report
from flashtile.reference import decoding, fa1, fa2

E = 2  # count the float64 runs as the fp16 kernels they model


def _run(case):
    q, k, v, kwargs = case.inputs()
    return q, k, v, kwargs, case.b * case.h


def _assert_counted(counter, cost, bh):
    assert (counter.bytes_read, counter.bytes_written) == (bh * cost.bytes_read, bh * cost.bytes_written)


COUNT_CASES = [
    pytest.param(Case(2, 37, 37, 2, 2, 16), id="square-37"),
    pytest.param(Case(1, 13, 50, 4, 2, 8), id="sq13<sk50-gqa"),
    pytest.param(Case(1, 50, 13, 4, 1, 8), id="sq50>sk13-mqa"),
]
MASKS = [
    pytest.param({}, id="no-mask"),
    pytest.param({"causal": True}, id="causal"),
    pytest.param({"window_size": (9, 2)}, id="window-9-2"),
    pytest.param({"causal": True, "window_size": (4, -1)}, id="causal-window-4"),
]


@pytest.mark.parametrize("case", COUNT_CASES)
def test_fa1_counted_bytes_equal_the_formula(case):
    q, k, v, _, bh = _run(case)
    block_c = 7
    sram = 4 * case.d * q.element_size() * block_c
    io = analysis.IOCounter(E)
    out, l, m = fa1.forward(q, k, v, sram_bytes=sram, counter=io)
    _assert_counted(io, analysis.fa1(case.sq, case.sk, case.d, E, block_c), bh)
    io = analysis.IOCounter(E)
    fa1.backward(torch.randn_like(q), q, k, v, out, l, m, sram_bytes=sram, counter=io)
    _assert_counted(io, analysis.fa1_backward(case.sq, case.sk, case.d, E, block_c), bh)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("case", COUNT_CASES)
def test_fa2_counted_bytes_equal_the_formula(case, mask):
    q, k, v, _, bh = _run(case)
    blocks = {"block_m": 6, "block_n": 5}
    io = analysis.IOCounter(E)
    out, lse = fa2.forward(q, k, v, **mask, **blocks, counter=io)
    _assert_counted(io, analysis.fa2(case.sq, case.sk, case.d, E, **blocks, **mask), bh)
    io = analysis.IOCounter(E)
    fa2.backward(torch.randn_like(q), q, k, v, out, lse, **mask, **blocks, counter=io)
    _assert_counted(io, analysis.fa2_backward(case.sq, case.sk, case.d, E, **blocks, **mask), bh)


@pytest.mark.parametrize("num_splits", [1, 3, 8, 40], ids=lambda s: f"{s}-splits")
@pytest.mark.parametrize("case, mask", [
    pytest.param(Case(2, 1, 29, 4, 2, 16), {}, id="decode"),
    pytest.param(Case(1, 5, 29, 2, 1, 16), {"causal": True}, id="5-queries-causal"),
])
def test_decoding_counted_bytes_equal_the_formula(case, mask, num_splits):
    q, k, v, _, bh = _run(case)
    io = analysis.IOCounter(E)
    decoding.attention(q, k, v, num_splits, block_m=4, block_n=4, counter=io, **mask)
    _assert_counted(io, analysis.decoding(case.sq, case.sk, case.d, E, num_splits, 4, 4, **mask), bh)


def test_closed_forms():
    n, d = 1000, 64
    assert analysis.standard(n, n, d, E).hbm_bytes == E * (4 * n * n + 4 * n * d)
    assert analysis.standard(n, n, d, E, kernels=2).hbm_bytes == E * (2 * n * n + 4 * n * d)
    t_r = -(-n // 128)
    fa2_cost = analysis.fa2(n, n, d, E, 128, 64)
    assert fa2_cost.bytes_read == E * (n * d + 2 * t_r * n * d)
    assert fa2_cost.bytes_written == E * (n * d + n)
    nk, s = 5000, 8
    dec = analysis.decoding(1, nk, d, E, s, 128, 64)
    assert dec.bytes_read == E * (s * d + 2 * nk * d + s * (d + 1))
    assert dec.bytes_written == E * (s * (d + 1) + d + 1)
    assert all(c.flops == 4 * n * n * d for c in (analysis.standard(n, n, d, E), analysis.fa1(n, n, d, E, 96), fa2_cost))


def test_causal_skips_the_blocks_above_the_diagonal():
    """With equal blocks, causal FA2 visits T(T+1)/2 of the T^2 blocks: reads and FLOPs follow."""
    n, d, bsz = 1024, 64, 64
    t = n // bsz
    visited = t * (t + 1) // 2
    cost = analysis.fa2(n, n, d, E, bsz, bsz, causal=True)
    assert cost.bytes_read == E * (n * d + visited * 2 * bsz * d)
    assert cost.flops == 4 * d * bsz * bsz * visited
    assert cost.flops / analysis.fa2(n, n, d, E, bsz, bsz).flops == pytest.approx(0.53, abs=0.01)


def test_fa1_traffic_is_theta_n2_d2_over_m():
    d = 64
    m = 192 * 1024

    def fa1_bytes(n, sram):
        return analysis.fa1(n, n, d, E, analysis.fa1_block_sizes(sram, d, E)[1]).hbm_bytes

    n = 16384
    assert 3.9 < fa1_bytes(2 * n, m) / fa1_bytes(n, m) <= 4.0  # 2N -> ~4x
    assert 0.5 <= fa1_bytes(n, 2 * m) / fa1_bytes(n, m) < 0.56  # 2M -> ~1/2
    # bytes ~ e (3 N d) T_c with T_c = ceil(4 d e N / M): 12 e^2 N^2 d^2 / M, plus the rounding up of
    # T_c and the O(N d) terms, so the ratio stays between two constants over N, d and M
    for n, d_, sram in [(8192, 64, m), (16384, 128, m), (32768, 64, 4 * m), (65536, 32, m)]:
        ratio = analysis.fa1(n, n, d_, E, analysis.fa1_block_sizes(sram, d_, E)[1]).hbm_bytes \
            / (E * E * n * n * d_ * d_ / sram)
        assert 12 <= ratio < 14


def test_standard_traffic_is_theta_n2_plus_nd_and_ignores_sram():
    d = 64
    for n in (256, 4096, 65536):
        assert analysis.standard(n, n, d, E).hbm_bytes / (E * (n * n + n * d)) == pytest.approx(4)
    assert analysis.standard(65536, 65536, d, E).hbm_bytes / analysis.standard(32768, 32768, d, E).hbm_bytes \
        == pytest.approx(4, rel=0.01)


# --- the seeds' numbers ---------------------------------------------------------------------

def test_seed000_attention_matrices_take_8_gb():
    """N=4096 fp16: one S is 32 MB; 32 heads x batch 8 of them is 8 GB (binary units)."""
    one = analysis.attention_matrix_bytes(4096, 4096, 2)
    assert one == 32 * 2**20
    assert 32 * 8 * one == 8 * 2**30


def test_seed001_mac_counts_reads_of_qkv_but_not_the_output_write():
    """Seed 001: MAC = 4N^2 + 3Nd. Ours is 4N^2 + 4Nd: the same plus writing O (N d)."""
    n, d = 2048, 64
    ours = analysis.standard(n, n, d, 1)
    assert ours.hbm_bytes - n * d == 4 * n * n + 3 * n * d
    assert ours.bytes_read == 2 * n * n + 3 * n * d  # 5 reads: Q, K, S, P, V
    assert ours.bytes_written == 2 * n * n + n * d  # 3 writes: S, P, O


def test_seed003_table_and_arithmetic_intensity():
    """L=2048, d=128, fp32: S is 16.78 MB, Q and V 1.05 MB; AI -> (dk + dv) / 4 for L >> d, L / 6 at L = d."""
    assert analysis.attention_matrix_bytes(2048, 2048, 4) / 1e6 == pytest.approx(16.78, abs=0.005)
    assert 2048 * 128 * 4 / 1e6 == pytest.approx(1.05, abs=0.005)
    d = 128
    long = analysis.standard(2**20, 2**20, d, 4, kernels=2)  # seed 003 counts S written and read once
    assert long.intensity == pytest.approx((d + d) / 4, rel=0.001)
    assert analysis.standard(d, d, d, 4, kernels=2).intensity == pytest.approx(d / 6)
    # with P's round trip counted too (our default, three kernels) the long-sequence limit halves
    assert analysis.standard(2**20, 2**20, d, 4).intensity == pytest.approx((d + d) / 8, rel=0.001)


def test_seed004_merge_moves_kilobytes():
    """8 splits x d=128 x fp16 of partial outputs per (batch, head, query): 2 KB, plus 8 LSEs."""
    d, s = 128, 8
    with_merge = analysis.decoding(1, 65536, d, 2, s, 128, 64)
    partial_writes = with_merge.bytes_written - 2 * (d + 1)
    assert partial_writes == s * d * 2 + s * 2 == 2048 + 16
    assert with_merge.scratch_bytes == partial_writes


# --- block sizes, GPUs, roofline --------------------------------------------------------------

def test_roofline_picks_the_binding_roof():
    h100 = analysis.get_gpu("h100")
    standard = analysis.standard(8192, 8192, 128, 2)
    seconds, bound = analysis.roofline(standard, h100, "float16")
    assert bound == "memory" and seconds == pytest.approx(standard.hbm_bytes / 3.35e12)
    tiny = analysis.Cost(flops=10**12, bytes_read=1, bytes_written=1, scratch_bytes=0)
    assert analysis.roofline(tiny, h100, "bfloat16") == (pytest.approx(1 / 989), "compute")
    assert analysis.roofline(tiny, h100, "float32") == (pytest.approx(1 / 67), "compute")


def test_gpu_table():
    assert (analysis.GPUS["h100"].tflops_16bit, analysis.GPUS["h100"].hbm_tbps) == (989, 3.35)
    assert (analysis.GPUS["a100"].tflops_16bit, analysis.GPUS["a100"].hbm_tbps) == (312, 2.039)
    assert (analysis.GPUS["h200"].tflops_16bit, analysis.GPUS["h200"].hbm_tbps) == (989, 4.8)
    measured = analysis.GPUS["h100-measured"]
    assert (measured.tflops_16bit, measured.hbm_tbps) == (687, 3.003)
    with pytest.raises(ValueError, match="no float32 compute ceiling"):
        measured.peak_flops("float32")


def test_summary_has_every_algorithm():
    s = report.summary(4096, 64, "float16", 192 * 1024, "a100")
    for name in report.ALGORITHMS:
        assert {"flops", "hbm_bytes", "arithmetic_intensity", "roofline_s"} <= set(s[name])
    assert s["fa1"]["block_c"] == 384 and s["fa1"]["block_r"] == 64
    # HBM only: FA2's 128-row Q blocks re-read K/V 32 times, FA1's 384-key blocks stream Q, O 11 times
    assert s["fa1"]["hbm_bytes"] < s["fa2"]["hbm_bytes"] < s["standard"]["hbm_bytes"]


@pytest.mark.parametrize("call, match", [
    pytest.param(lambda: analysis.standard(0, 4, 4, 2), "seqlen_q", id="seqlen-0"),
    pytest.param(lambda: analysis.standard(4, 4, 4, 2, kernels=4), "kernels", id="kernels-4"),
    pytest.param(lambda: analysis.fa1(4, 4, 4, 2, block_c=0), "block_c", id="block_c-0"),
    pytest.param(lambda: analysis.fa2(4, 4, 4, 0, 16, 16), "element_size", id="element-size-0"),
    pytest.param(lambda: analysis.fa2(4, 4, 4, 2, 16, -1), "block_n", id="block_n-negative"),
    pytest.param(lambda: analysis.decoding(1, 4, 4, 2, 0, 16, 16), "num_splits", id="splits-0"),
    pytest.param(lambda: analysis.IOCounter(0), "element_size", id="counter-element-size"),
    pytest.param(lambda: analysis.get_gpu("v100"), "gpu must be one of", id="unknown-gpu"),
    pytest.param(lambda: analysis.element_size("int8"), "dtype must be one of", id="unknown-dtype"),
])
def test_bad_arguments_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
