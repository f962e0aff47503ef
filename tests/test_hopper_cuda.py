"""The Gluon Hopper kernels on an H100. The forward (ops.forward_sm90._fwd_kernel_sm90): the prefill
grid against the float64 oracle with the 2x rule, forced on for every case (the dispatch gives every
length to it, but a capped causal d=64 to the Triton kernel), the layouts it takes and
the ones it leaves to the Triton kernel, and CUDA-graph replay; its determinism under 50 reruns is
test_prefill_cuda's test_backward_is_reproducible (d=128 takes this kernel there). The backward
(ops.backward_sm90._bwd_kernel_sm90), below: the grid, windows, layouts, the sink's delta, dQ added
into the caller's buffer, reruns and CUDA-graph replay."""

import pytest
import torch
from prefill_check import check_dq_accumulates, check_past_65535_heads, check_prefill, make_qkv
from varlen_check import check_varlen

from flashtile._checks import Varlen
from flashtile.bench.harness import capture
from flashtile.ops import _launch, backward_sm90, configs, forward_sm90, prefill
from flashtile.reference.dropout import DropoutMask, draw_rng

pytestmark = pytest.mark.cuda

SEQLENS = [(113, 203), (128, 217), (108, 256), (256, 512), (512, 256), (1023, 1024), (1024, 1023),
           (2048, 2048), (1, 300), (300, 1), (300, 17), (200, 113), (8192, 8192)]
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


@pytest.fixture
def hopper_launches(monkeypatch):
    """Forces the Hopper kernel wherever it can run, in the tiles the dispatch gives it, and counts
    its launches."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels need sm_90")
    monkeypatch.setattr(configs, "hopper_forward_config", lambda d, *a, **kw: configs.hopper_forward_tiles(d))
    return kernel_launches(monkeypatch, forward_sm90._fwd_kernel_sm90)


def kernel_launches(monkeypatch, kernel) -> list:
    """A list that grows by one at each launch of kernel (the launchers' plans launch through
    ops._launch.Prepared)."""
    calls = []
    real = _launch.Prepared.__call__

    def counting(self, *args, **kwargs):
        if self.kernel is kernel:
            calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(_launch.Prepared, "__call__", counting)
    return calls


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("sq,sk", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_grid(hopper_launches, d, sq, sk, dtype, causal, heads):
    h, hk = heads
    check_prefill(1 if sq * sk > 2**22 else 2, sq, sk, h, hk, d, dtype, "cuda", causal=causal, backward=False)
    assert hopper_launches


@pytest.mark.parametrize("lengths", [(700, 900), (900, 700)], ids=["sq<sk", "sq>sk"])
@pytest.mark.parametrize("window", [(100, 20), (256, 0), (0, 0), (-1, 64), (64, -1)])
@pytest.mark.parametrize("d,dtype", [(128, torch.bfloat16), (64, torch.float16)], ids=["d128-bf16", "d64-fp16"])
def test_window(hopper_launches, window, lengths, d, dtype):
    check_prefill(2, *lengths, 4, 2, d, dtype, "cuda", window=window, backward=False)
    assert hopper_launches


@pytest.mark.parametrize("case", [
    dict(lengths=(4096, 1024), causal=True),  # the first 24 of 32 row blocks see no key
    dict(lengths=(1024, 4096), causal=True),
    dict(lengths=(1500, 1500), window=(200, 0)),
    dict(lengths=(1000, 1300), causal=False),
    dict(lengths=(4096, 1024), causal=True, dropout_p=0.17),
    dict(lengths=(1000, 1300), causal=False, dropout_p=0.17),
], ids=["causal-sq>sk", "causal-sq<sk", "window", "full", "dropout-causal-sq>sk", "dropout-full"])
def test_few_programs_many_tiles(hopper_launches, monkeypatch, case):
    """The persistent grid with 3 programs: each walks tens of tiles of different lengths (empty
    ones included), carrying the K/V ring's and Q's barrier phases from tile to tile; the tile
    counter is back to 0 after each launch. With dropout too: the other tests' grids give each
    program at most a tile or two, so a state carried from tile to tile is only checked here."""
    monkeypatch.setattr(configs, "num_sms", lambda device: 3)
    for _ in range(2):
        check_prefill(2, *case["lengths"], 4, 2, 128, torch.bfloat16, "cuda", causal=case.get("causal", False),
                      window=case.get("window", (-1, -1)), dropout_p=case.get("dropout_p", 0.0), backward=False)
        assert forward_sm90.tile_counter(torch.device("cuda")).item() == 0
    assert hopper_launches


@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_forward_head_chunks(hopper_launches, monkeypatch, chunk, d):
    """The forward's tiles in chunks of query heads (configs.hopper_forward_head_chunk, chunked_order):
    3 x 10 = 30 heads in chunks of 4 (the last one partial), all in one chunk, and one head at a
    time, under a causal mask and a window's right side; every head's output and LSE against the
    oracle."""
    monkeypatch.setattr(configs, "hopper_forward_head_chunk", lambda *a: chunk)
    check_prefill(3, 700, 900, 10, 5, d, torch.bfloat16, "cuda", causal=True, backward=False)
    check_prefill(3, 700, 900, 10, 5, d, torch.bfloat16, "cuda", window=(300, 40), backward=False)
    assert hopper_launches


D64_CASES = {"causal": dict(), "dropout": dict(dropout_p=0.17), "softcap": dict(softcap=20.0),
             "alibi": dict(alibi=True), "sink": dict(sink=True), "window": dict(window=(300, 0)), "varlen": None}


@pytest.mark.parametrize("case", D64_CASES.values(), ids=D64_CASES.keys())
def test_d64_under_a_right_bound(hopper_launches, case):
    """d=64's three consumer warpgroups (192-row tiles, configs.hopper_forward_consumers) under a
    right bound beside each flag."""
    if case is None:
        check_varlen([300, 0, 17, 1024, 129], [250, 40, 17, 1024, 300], 4, 2, 64, torch.bfloat16, "cuda", causal=True,
                     backward=False)
    else:
        check_prefill(2, 700, 900, 4, 2, 64, torch.bfloat16, "cuda", causal="window" not in case, backward=False,
                      **case)
    assert hopper_launches


def test_strided_out(hopper_launches):
    """out a view into a wider buffer: the epilogue's pointer stores take its strides."""
    q, k, v = make_qkv(2, 600, 600, 4, 2, 128, torch.bfloat16, "cuda")
    wide = torch.full((2, 600, 4, 256), float("nan"), dtype=q.dtype, device="cuda")
    out, lse = prefill.attention_forward(q, k, v, 128 ** -0.5, (None, 0), out=wide[..., 64:192])
    ref, ref_lse = prefill.attention_forward(q, k, v, 128 ** -0.5, (None, 0))
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert wide[..., :64].isnan().all() and wide[..., 192:].isnan().all()


def test_negative_scale_runs_the_triton_kernel(hopper_launches):
    """A negative softmax_scale (accepted by the API) would turn its raw-product row max into the
    row min: it goes to the Triton kernel, which scales before the max."""
    q, k, v = make_qkv(2, 300, 300, 4, 2, 128, torch.bfloat16, "cuda")
    out, lse = prefill.attention_forward(q, k, v, -0.1, (None, 0))
    assert not hopper_launches and torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_backward_from_its_lse(hopper_launches):
    """The backward kernels recompute P from this kernel's LSE: gradients by the 2x rule."""
    check_prefill(2, 1000, 1100, 8, 2, 64, torch.bfloat16, "cuda", causal=True)
    assert hopper_launches


@pytest.mark.parametrize("layout", ["bhsd", "packed"])
def test_strided_layouts(hopper_launches, layout):
    """(b, h, s, d) storage and one packed qkv buffer: TMA takes their strides as they are."""
    check_prefill(2, 1000, 1000, 8, 8, 128, torch.bfloat16, "cuda", causal=True, layout=layout, backward=False)
    assert hopper_launches


def test_what_tma_cannot_address_runs_the_triton_kernel(hopper_launches):
    """A tensor 2 bytes off 16-byte alignment and one expanded over the batch (stride 0)."""
    q, k, v = make_qkv(2, 512, 512, 4, 4, 128, torch.bfloat16, "cuda")
    base = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    shifted = base[1:].view(q.shape).copy_(q)
    out, lse = prefill.attention_forward(shifted, k, v, 128 ** -0.5, (None, 0))
    ref, ref_lse = prefill.attention_forward(q, k, v, 128 ** -0.5, (None, 0))
    assert len(hopper_launches) == 1  # the aligned call only
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=0)
    shared_k = k[:1].expand_as(k)
    out, lse = prefill.attention_forward(q, shared_k, v, 128 ** -0.5, (None, 0))
    ref, ref_lse = prefill.attention_forward(q, shared_k.contiguous(), v, 128 ** -0.5, (None, 0))
    assert len(hopper_launches) == 2  # the contiguous copy only
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=0)


def test_cuda_graph(hopper_launches):
    """Captured once, replayed on new inputs written into the captured buffers: bitwise equal to
    eager calls (the descriptors are kernel parameters, so the graph keeps the buffers' addresses)."""
    q, k, v = make_qkv(2, 2048, 2048, 8, 2, 128, torch.bfloat16, "cuda")
    graph, (out, lse) = capture(lambda: prefill.attention_forward(q, k, v, 128 ** -0.5, (None, 0)))
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        eager_out, eager_lse = prefill.attention_forward(q, k, v, 128 ** -0.5, (None, 0))
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


# ---------------------------------------------------------------------------------------------
# The Gluon Hopper backward (ops.backward_sm90._bwd_kernel_sm90), forced on for every case it takes.
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def hopper_backward_launches(monkeypatch):
    """Forces the Hopper backward wherever it can run, and counts its launches."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels need sm_90")
    monkeypatch.setattr(configs, "hopper_backward_config",
                        lambda d, *a, dropout=False, softcap=False, **kw: configs.hopper_backward_tiles(d, dropout, softcap))
    return kernel_launches(monkeypatch, backward_sm90._bwd_kernel_sm90)


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("sq,sk", SEQLENS[:-1], ids=[f"{a}x{b}" for a, b in SEQLENS[:-1]])
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_backward_grid(hopper_backward_launches, d, sq, sk, dtype, causal, heads):
    """dQ, dK, dV against the float64 oracle with the 2x rule (outputs poisoned first)."""
    h, hk = heads
    check_prefill(2, sq, sk, h, hk, d, dtype, "cuda", causal=causal)
    assert hopper_backward_launches


@pytest.mark.parametrize("lengths", [(700, 900), (900, 700)], ids=["sq<sk", "sq>sk"])
@pytest.mark.parametrize("window", [(100, 20), (256, 0), (0, 0), (-1, 64), (64, -1)])
@pytest.mark.parametrize("d,dtype", [(128, torch.bfloat16), (64, torch.float16), (256, torch.bfloat16)],
                         ids=["d128-bf16", "d64-fp16", "d256-bf16"])
def test_backward_window(hopper_backward_launches, window, lengths, d, dtype):
    check_prefill(2, *lengths, 4, 2, d, dtype, "cuda", window=window)
    assert hopper_backward_launches


@pytest.mark.parametrize("d", [128, 256], ids=["d128", "d256"])
@pytest.mark.parametrize("layout", ["bhsd", "packed"])
def test_backward_strided_layouts(hopper_backward_launches, layout, d):
    """At d=256 dK and dV leave in column halves: boxes at column 128 of strided tensors."""
    check_prefill(2, 1000, 1000, 8, 8, d, torch.bfloat16, "cuda", causal=True, layout=layout)
    assert hopper_backward_launches


@pytest.mark.parametrize("d", [128, 256], ids=["d128", "d256"])
def test_backward_sink(hopper_backward_launches, d):
    """With an attention sink the caller takes delta (shaped like lse) for the sink's gradient."""
    check_prefill(2, 600, 700, 4, 2, d, torch.bfloat16, "cuda", causal=True, sink=True)
    assert hopper_backward_launches


@pytest.mark.parametrize("d", [128, 256], ids=["d128", "d256"])
def test_backward_long(hopper_backward_launches, d):
    """16k keys (one head pair): the oracle in float64 still fits; 2x rule."""
    check_prefill(1, 4096, 16384, 2, 1, d, torch.bfloat16, "cuda", causal=True)
    assert hopper_backward_launches


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_backward_head_chunks(hopper_backward_launches, monkeypatch, chunk):
    """The causal backward's programs launched in chunks of (batch, K/V head) rows
    (configs.hopper_backward_head_chunk, head_chunked_order): 3 x 5 = 15 rows in chunks of 4 (the
    last one partial), all in one chunk, and one row at a time (the 3D grid); every row's
    gradients against the oracle."""
    monkeypatch.setattr(configs, "hopper_backward_head_chunk", lambda *a: chunk)
    check_prefill(3, 700, 900, 10, 5, 128, torch.bfloat16, "cuda", causal=True)
    assert hopper_backward_launches


@pytest.mark.parametrize("dropout_p", [0.0, 0.17, 0.5], ids=["", "dropout", "dropout-half"])
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_adds_dq_into_a_float32_buffer(hopper_backward_launches, causal, d, dropout_p):
    """accumulate_dq (ring attention's dQ sum): the kernel's reduce-adds, scaled, go into the
    caller's float32 rows (a view of a longer buffer) instead of a buffer of its own; with dropout,
    whose dS the kernel leaves in units of backward_ds_unit (d=64 and 128), through one of its own
    added at that scale, except at p = 0.5, where the unit is 1."""
    kw = {"dropout": (dropout_p, draw_rng("cuda"))} if dropout_p else {}
    check_dq_accumulates(2, 700, 900, 8, 2, d, torch.bfloat16, "cuda", causal=causal, **kw)
    assert len(hopper_backward_launches) == 2


def _grads(q, k, v, dout, window, **kw):
    out, lse = prefill.attention_forward(q, k, v, q.shape[-1] ** -0.5, window)
    return prefill.attention_backward(dout, q, k, v, out, lse, q.shape[-1] ** -0.5, window, **kw)


@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_backward_reruns(hopper_backward_launches, d):
    """20 reruns: dK and dV (summed in registers) bitwise equal; dQ (summed by TMA reductions in
    whatever order the programs finish) equal to the deterministic path's to fp32 rounding of the
    sum order, well inside the 2x rule."""
    q, k, v = make_qkv(2, 4096, 4096, 2048 // d, 4, d, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    first = _grads(q, k, v, dout, (None, 0))
    for _ in range(20):
        dq, dk, dv = _grads(q, k, v, dout, (None, 0))
        assert torch.equal(dk, first[1]) and torch.equal(dv, first[2])
        torch.testing.assert_close(dq, first[0], atol=2e-3, rtol=1e-2)
    launches = len(hopper_backward_launches)
    ref = _grads(q, k, v, dout, (None, 0), deterministic=True)  # this kernel in its fixed order (d <= 128)
    assert len(hopper_backward_launches) == launches + (d <= 128)
    for a, b in zip(first, ref):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.fixture
def deterministic_launches(hopper_backward_launches, monkeypatch):
    """As hopper_backward_launches, every launch asked for dQ's additions in their fixed order."""
    plan = backward_sm90.plan

    def ordered(env, cfg, softmax_scale, window, softcap, varlen, dropout, accumulate_dq, deterministic, zero_grads):
        return plan(env, cfg, softmax_scale, window, softcap, varlen, dropout, accumulate_dq, True, zero_grads)

    monkeypatch.setattr(backward_sm90, "plan", ordered)
    monkeypatch.setattr(prefill, "_backward_plans", {})  # no plan made before without the order
    return hopper_backward_launches


ORDERS = {"full": dict(), "causal": dict(causal=True), "window": dict(window=(100, 20)),
          "left": dict(window=(64, -1)), "right": dict(window=(-1, 64))}


@pytest.mark.parametrize("case", ORDERS.values(), ids=ORDERS.keys())
@pytest.mark.parametrize("sq,sk", [(700, 900), (900, 700), (1024, 1024)], ids=["700x900", "900x700", "1024x1024"])
@pytest.mark.parametrize("d", [64, 96, 128], ids=["d64", "d96", "d128"])
def test_deterministic_backward(deterministic_launches, d, sq, sk, case):
    """dQ's additions in the fixed order (dq_order; the turns themselves are checked against
    block_range's visitors in test_block_range_interpret): 2x rule against the float64 oracle,
    GQA, every side of the mask and sq != sk."""
    check_prefill(2, sq, sk, 4, 2, d, torch.bfloat16, "cuda", **case)
    assert deterministic_launches


@pytest.mark.parametrize("case", ["softcap", "alibi", "accumulate_dq", "seqused_k"])
def test_deterministic_backward_with(deterministic_launches, case):
    """The fixed order beside the kernel's other options: softcap and ALiBi (2x rule), dQ added into
    the caller's float32 rows (accumulate_dq, as ring attention does), a packed batch with
    seqused_k."""
    if case == "accumulate_dq":
        check_dq_accumulates(2, 700, 900, 8, 2, 128, torch.bfloat16, "cuda", causal=True)
    elif case == "seqused_k":
        check_varlen([300, 50, 700], [400, 51, 900], 4, 2, 128, torch.bfloat16, "cuda", causal=True,
                     seqused=[350, 0, 899])
    elif case == "softcap":
        check_prefill(2, 700, 900, 4, 2, 128, torch.bfloat16, "cuda", causal=True, softcap=20.0)
    else:
        check_prefill(2, 700, 900, 4, 2, 128, torch.bfloat16, "cuda", causal=True, alibi=True)
    assert deterministic_launches


@pytest.mark.parametrize("case", [dict(causal=True, dropout_p=0.1), dict(window=(300, 0)), dict()],
                         ids=["causal-dropout", "window", "full"])
def test_deterministic_backward_varlen(deterministic_launches, case):
    """A packed batch: the counters are per sequence (its rows from 0) and query head."""
    lens = [700, 1, 1300, 64, 2000]
    check_varlen(lens, lens[::-1], 4, 2, 128, torch.bfloat16, "cuda", **case)
    assert deterministic_launches


RERUNS = {"d128-causal-gqa": (128, (None, 0), (16, 4), 4096), "d128-gqa": (128, (None, None), (16, 4), 4096),
          "d64-causal": (64, (None, 0), (32, 32), 4096), "d96": (96, (None, None), (16, 16), 4096),
          "d128-window-sq<sk": (128, (300, 64), (16, 4), 3000), "d64-left-sq>sk": (64, (500, None), (16, 16), 5000)}


@pytest.mark.parametrize("d,window,heads,sq", RERUNS.values(), ids=RERUNS.keys())
def test_deterministic_backward_reruns(hopper_backward_launches, d, window, heads, sq):
    """deterministic=True takes the Hopper backward at d <= 128: 30 reruns, dQ, dK, dV bitwise equal
    (the any-order kernel's dQ differed between reruns of the first shape); 4096 keys, sq rows."""
    q, k, v = make_qkv(4, sq, 4096, *heads, d, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    first = _grads(q, k, v, dout, window, deterministic=True)
    for _ in range(30):
        for name, a, b in zip(("dq", "dk", "dv"), _grads(q, k, v, dout, window, deterministic=True), first):
            assert torch.equal(a, b), name
    assert len(hopper_backward_launches) == 31


@pytest.mark.parametrize("d,deterministic", [(64, False), (128, False), (256, False), (64, True), (128, True)],
                         ids=["d64", "d128", "d256", "d64-deterministic", "d128-deterministic"])
def test_backward_cuda_graph(hopper_backward_launches, d, deterministic):
    """Captured once, replayed on new inputs: dK, dV bitwise equal to eager calls, dQ to the sum
    order, or bitwise with deterministic (the fp32 dQ buffer and the order's counters are
    allocated and zeroed inside the graph)."""
    q, k, v = make_qkv(2, 2048, 2048, 8, 2, d, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    graph, captured = capture(lambda: _grads(q, k, v, dout, (None, 0), deterministic=deterministic))
    for _ in range(3):
        for t in (q, k, v, dout):
            t.copy_(torch.randn_like(t))
        graph.replay()
        dq, dk, dv = _grads(q, k, v, dout, (None, 0), deterministic=deterministic)
        assert torch.equal(captured[1], dk) and torch.equal(captured[2], dv)
        if deterministic:
            assert torch.equal(captured[0], dq)
        else:
            torch.testing.assert_close(captured[0], dq, atol=2e-3, rtol=1e-2)
    assert hopper_backward_launches


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_batch_times_heads_past_65535(hopper_launches, hopper_backward_launches, causal):
    """The Hopper forward and backward take batch and heads on two grid axes: 4100 x 16 heads."""
    check_past_65535_heads(128, 64, causal, exact=False)
    assert hopper_launches and hopper_backward_launches


DROPOUT_SEQLENS = [(113, 203), (256, 512), (1023, 1024), (1024, 1023), (300, 17), (2048, 2048)]


PADDED_DIMS = [40, 48, 72, 96, 120, 136, 160, 200, 248]


@pytest.mark.parametrize("heads", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(113, 203), (300, 17), (1023, 1024)], ids=["113x203", "300x17", "1023x1024"])
@pytest.mark.parametrize("d", PADDED_DIMS, ids=[f"d{d}" for d in PADDED_DIMS])
def test_padded_head_dims(hopper_launches, hopper_backward_launches, d, sq, sk, causal, heads):
    """Head dims between the kernels' 64 / 128 / 256 (configs.hopper_head_dim): boxes as wide as
    the kernel's head dim over the narrower tensors read zeros past d and clip the stores, so the
    output, LSE and dQ/dK/dV agree with the oracle (2x rule, outputs poisoned first). Nothing
    written past d: test_padded_head_dims_write_nothing_past_d. fp16 and bf16 alternate by d."""
    dtype = torch.bfloat16 if d % 16 else torch.float16
    check_prefill(2, sq, sk, *heads, d, dtype, "cuda", causal=causal)
    assert hopper_launches and hopper_backward_launches


@pytest.mark.parametrize("d", [40, 96, 160], ids=["d40", "d96", "d160"])
@pytest.mark.parametrize("case", [dict(dropout_p=0.17, causal=True), dict(window=(100, 20)), dict(softcap=20.0),
                                  dict(alibi=True, causal=True), dict(sink=True, causal=True),
                                  dict(layout="bhsd", causal=True)],
                         ids=["dropout", "window", "softcap", "alibi", "sink", "bhsd"])
def test_padded_head_dims_with(hopper_launches, hopper_backward_launches, d, case):
    """The padded head dims beside every flag of the Hopper kernels, and strided (BHSD) tensors,
    whose rows are not contiguous: a box's columns past d must not read the next head's."""
    check_prefill(2, 700, 900, 4, 2, d, torch.bfloat16, "cuda", **case)
    assert hopper_launches and hopper_backward_launches


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "varlen"])
@pytest.mark.parametrize("d", [40, 96, 160], ids=["d40", "d96", "d160"])
def test_padded_head_dims_write_nothing_past_d(hopper_launches, hopper_backward_launches, d, packed):
    """The output and dQ, dK, dV as views into NaN-filled buffers 24 columns wider (8 before, 16
    after; rows of 16-byte multiples, as TMA needs): the columns around them stay NaN, the views
    equal the calls into tensors of their own. A packed batch's dK and dV leave through pointer
    stores masked at HEAD_DIM, the others by TMA, clipped at d."""
    lens = [300, 0, 17, 700, 129]
    n_q, n_k = (sum(lens), sum(lens)) if packed else (700, 900)
    shape_q, shape_k = ((n_q, 4, d), (n_k, 2, d)) if packed else ((2, n_q, 4, d), (2, n_k, 2, d))
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for shape in (shape_q, shape_k, shape_k))
    dout = torch.randn_like(q)
    varlen = None
    if packed:
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        varlen = Varlen(cu, cu, max(lens), max(lens))
    scale, window = d ** -0.5, (None, 0)

    def wide_view(like):
        buf = torch.full((*like.shape[:-1], d + 24), float("nan"), dtype=like.dtype, device="cuda")
        return buf, buf[..., 8:8 + d]

    (out_buf, out), (dq_buf, dq), (dk_buf, dk), (dv_buf, dv) = map(wide_view, (q, q, k, v))
    out, lse = prefill.attention_forward(q, k, v, scale, window, out=out, varlen=varlen)
    prefill.attention_backward(dout, q, k, v, out, lse, scale, window, dq=dq, dk=dk, dv=dv, varlen=varlen)
    ref_out, ref_lse = prefill.attention_forward(q, k, v, scale, window, varlen=varlen)
    ref = prefill.attention_backward(dout, q, k, v, ref_out, ref_lse, scale, window, varlen=varlen)
    assert torch.equal(out, ref_out)
    for buf, view, r in ((dq_buf, dq, ref[0]), (dk_buf, dk, ref[1]), (dv_buf, dv, ref[2])):
        torch.testing.assert_close(view, r, atol=2e-3, rtol=1e-2)  # dQ: the sum order varies
    for buf in (out_buf, dq_buf, dk_buf, dv_buf):
        assert buf[..., :8].isnan().all() and buf[..., 8 + d:].isnan().all()
    assert hopper_launches and hopper_backward_launches


@pytest.mark.parametrize("d", [40, 96, 160], ids=["d40", "d96", "d160"])
def test_padded_head_dims_varlen(hopper_launches, hopper_backward_launches, d):
    """A packed batch at a padded head dim: dK and dV leave through pointers there, masked at d."""
    check_varlen([300, 0, 17, 1024, 129], [250, 40, 17, 1024, 300], 4, 2, d, torch.bfloat16, "cuda", causal=True)
    check_varlen([300, 0, 17, 1024, 129], [250, 40, 17, 1024, 300], 4, 2, d, torch.bfloat16, "cuda", dropout_p=0.17)
    assert hopper_launches and hopper_backward_launches


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", DROPOUT_SEQLENS, ids=[f"{a}x{b}" for a, b in DROPOUT_SEQLENS])
@pytest.mark.parametrize("d,dtype", [(64, torch.float16), (128, torch.bfloat16), (256, torch.bfloat16)],
                         ids=["d64-fp16", "d128-bf16", "d256-bf16"])
def test_dropout(hopper_launches, hopper_backward_launches, d, sq, sk, dtype, causal):
    """Dropout in both Hopper kernels: output, LSE and dQ/dK/dV against the float64 oracle applying
    reference.dropout's mask (the Triton kernels' bit for bit), 2x rule, GQA; so the Hopper
    kernels draw the same mask as the Triton ones, in the forward's orientation and the backward's
    transposed one (d=64 and 128) or untransposed one (d=256)."""
    check_prefill(2, sq, sk, 4, 2, d, dtype, "cuda", causal=causal, dropout_p=0.17)
    assert hopper_launches and hopper_backward_launches


@pytest.mark.parametrize("p", [1 / 256, 0.17, 127 / 256, 0.5, 0.6, 255 / 256])
@pytest.mark.parametrize("d,dtype", [(64, torch.float16), (128, torch.bfloat16), (256, torch.bfloat16)],
                         ids=["d64-fp16", "d128-bf16", "d256-bf16"])
def test_dropout_mask_at_every_threshold(hopper_launches, d, dtype, p):
    """The Hopper forward's keep-mask is reference.dropout's bit for bit at thresholds 1, 44, 127,
    128, 154 and 255: the kernel compares four bytes at a time (dropout_keep_bits_sm90), one way
    below 128 and another from 128 on. q = k = 0 makes every score 1 / sk before dropout and V the
    identity makes the output the dropped probabilities: out[.., i, j] = keep(i, j) / (sk (1 - p'))."""
    b, h, hk, sq, sk = 2, 4, 2, 384, d
    q = torch.zeros(b, sq, h, d, dtype=dtype, device="cuda")
    k = torch.zeros(b, sk, hk, d, dtype=dtype, device="cuda")
    v = torch.eye(sk, d, dtype=dtype, device="cuda").expand(b, hk, sk, d).transpose(1, 2).contiguous()
    rng = draw_rng("cuda")
    out, _ = prefill.attention_forward(q, k, v, d ** -0.5, (None, None), dropout=(p, rng))
    assert hopper_launches
    mask = DropoutMask(p, rng, h, range(b))
    keep = mask.keep(0, sq, 0, sk, "cuda").transpose(1, 2)  # (b, sq, h, sk)
    torch.testing.assert_close(out.float(), keep.float() * (mask.scale / sk), atol=0, rtol=1e-2)


def test_dropout_threshold_of_one(hopper_launches, hopper_backward_launches):
    """p < 1.5 / 256 makes the threshold 1, an int argument Triton would compile as a constant
    unless told not to (do_not_specialize): both Hopper kernels against the oracle there."""
    check_prefill(2, 256, 512, 4, 2, 128, torch.bfloat16, "cuda", dropout_p=1 / 256)
    assert hopper_launches and hopper_backward_launches


@pytest.mark.parametrize("window", [(100, 20), (-1, 64)])
def test_dropout_window(hopper_launches, hopper_backward_launches, window):
    check_prefill(2, 700, 900, 4, 2, 128, torch.bfloat16, "cuda", window=window, dropout_p=0.3)
    assert hopper_launches and hopper_backward_launches


@pytest.mark.parametrize("p", [0.2, 0.6])
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_dropout_across_kernels(hopper_launches, hopper_backward_launches, monkeypatch, d, p):
    """The Hopper backward and the Triton one (the Hopper backward switched off) regenerate the same
    mask: their gradients of one Hopper forward agree (a mask differing in 1 of 5 scores would not);
    at p = 0.6 the threshold is past 128, the other branch of the four-bytes-at-a-time compare."""
    q, k, v = make_qkv(2, 1000, 1100, 4, 2, d, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    dropout = (p, draw_rng("cuda"))
    scale = d ** -0.5
    out, lse = prefill.attention_forward(q, k, v, scale, (None, 0), dropout=dropout)
    assert hopper_launches
    with monkeypatch.context() as m:
        m.setattr(configs, "hopper_backward_config", lambda *a, **kw: None)
        triton_grads = prefill.attention_backward(dout, q, k, v, out, lse, scale, (None, 0), dropout=dropout)
    assert not hopper_backward_launches
    hopper_grads = prefill.attention_backward(dout, q, k, v, out, lse, scale, (None, 0), dropout=dropout)
    assert hopper_backward_launches
    for a, b in zip(hopper_grads, triton_grads):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


SOFTCAP_SEQLENS = [(113, 203), (256, 512), (1023, 1024), (1024, 1023), (300, 17), (2048, 2048)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", SOFTCAP_SEQLENS, ids=[f"{a}x{b}" for a, b in SOFTCAP_SEQLENS])
@pytest.mark.parametrize("d,dtype", [(64, torch.float16), (128, torch.bfloat16), (256, torch.bfloat16),
                                     (128, torch.float16)], ids=["d64-fp16", "d128-bf16", "d256-bf16", "d128-fp16"])
def test_softcap(hopper_launches, hopper_backward_launches, d, sq, sk, dtype, causal):
    """Softcap (Gemma-2, Grok) in both Hopper kernels: scores softcap * tanh(S / softcap) before the
    max, dS through the cap's derivative; output, LSE and dQ/dK/dV against the float64 oracle, 2x
    rule, GQA. A cap of 5 bends every score (scale * |q.k| reaches ~4 here), 30 only the large."""
    for softcap in (5.0, 30.0):
        check_prefill(2, sq, sk, 4, 2, d, dtype, "cuda", causal=causal, softcap=softcap)
    assert hopper_launches and hopper_backward_launches


@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
@pytest.mark.parametrize("case", [dict(dropout_p=0.2), dict(window=(100, 20)), dict(sink=True)],
                         ids=["dropout", "window", "sink"])
def test_softcap_with(hopper_launches, hopper_backward_launches, d, case):
    """Softcap beside the other flags: dropout (whose dS and the cap's derivative meet), a window
    and an attention sink."""
    check_prefill(2, 700, 900, 4, 2, d, torch.bfloat16, "cuda", causal="window" not in case, softcap=20.0, **case)
    assert hopper_launches and hopper_backward_launches


@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_softcap_varlen(hopper_launches, hopper_backward_launches, d):
    check_varlen([300, 0, 17, 1024, 129], [250, 40, 17, 1024, 300], 4, 2, d, torch.bfloat16, "cuda", causal=True,
                 softcap=10.0)
    assert hopper_launches and hopper_backward_launches


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", SOFTCAP_SEQLENS, ids=[f"{a}x{b}" for a, b in SOFTCAP_SEQLENS])
@pytest.mark.parametrize("d,dtype", [(64, torch.float16), (128, torch.bfloat16), (256, torch.bfloat16),
                                     (128, torch.float16)], ids=["d64-fp16", "d128-bf16", "d256-bf16", "d128-fp16"])
def test_alibi(hopper_launches, hopper_backward_launches, d, sq, sk, dtype, causal):
    """ALiBi in both Hopper kernels: -slope |i + sk - sq - j| added to the scaled scores before the
    max and in the backward's recomputed P; output, LSE and dQ/dK/dV against the float64 oracle,
    2x rule, GQA; slopes in [0, 1) per head, then per (batch, head)."""
    for alibi in (True, "batch"):
        check_prefill(2, sq, sk, 4, 2, d, dtype, "cuda", causal=causal, alibi=alibi)
    assert hopper_launches and hopper_backward_launches


@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
@pytest.mark.parametrize("case", [dict(softcap=20.0), dict(dropout_p=0.2), dict(window=(100, 20)), dict(sink=True)],
                         ids=["softcap", "dropout", "window", "sink"])
def test_alibi_with(hopper_launches, hopper_backward_launches, d, case):
    """ALiBi beside the other flags: after the cap (flash-attn's order), with dropout, a window and
    an attention sink."""
    check_prefill(2, 700, 900, 4, 2, d, torch.bfloat16, "cuda", causal="window" not in case, alibi=True, **case)
    assert hopper_launches and hopper_backward_launches


@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_row_sums_of_4m_keys(hopper_launches, monkeypatch, d):
    """Rows that see 4M keys: the LSE within 1e-4 of the Triton kernel's (fp32 sums in registers).
    At d=64 the row sums are tensor-core products; accumulated across blocks by the tensor cores
    they came out 2.4% low here (LSE 2.4e-2 below), so each block's product starts from zero and
    is added in registers."""
    q, k, v = make_qkv(1, 128, 2 ** 22, 2, 1, d, torch.bfloat16, "cuda")
    out, lse = prefill.attention_forward(q, k, v, 0.1, (None, 0))
    assert hopper_launches
    monkeypatch.setattr(configs, "hopper_forward_config", lambda *a, **kw: None)
    ref_out, ref_lse = prefill.attention_forward(q, k, v, 0.1, (None, 0))
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=1e-3, rtol=0)


def test_alibi_longest_keys(hopper_launches, hopper_backward_launches, monkeypatch):
    """The longest key range whose ALiBi the Hopper kernels take (positions below 2^22, made floats
    by an integer add): output, LSE and gradients against the Triton kernels' (exact integer
    positions to 2^24), slopes small enough that the farthest keys still count; one key more and
    both calls keep the Triton kernels."""
    from flashtile.ops.mods import ALIBI_MAX_POSITION

    slopes = torch.tensor([1e-6, 3e-6], device="cuda")
    for sk, hopper in ((ALIBI_MAX_POSITION - 256, True), (ALIBI_MAX_POSITION - 255, False)):
        q, k, v = make_qkv(1, 128, sk, 2, 1, 128, torch.bfloat16, "cuda")
        dout = torch.randn_like(q)
        launches = len(hopper_launches), len(hopper_backward_launches)
        out, lse = prefill.attention_forward(q, k, v, 0.1, (None, 0), alibi_slopes=slopes)
        grads = prefill.attention_backward(dout, q, k, v, out, lse, 0.1, (None, 0), alibi_slopes=slopes)
        assert (len(hopper_launches) > launches[0], len(hopper_backward_launches) > launches[1]) == (hopper, hopper)
        if hopper:
            with monkeypatch.context() as m:
                m.setattr(configs, "hopper_forward_config", lambda *a, **kw: None)
                m.setattr(configs, "hopper_backward_config", lambda *a, **kw: None)
                ref_out, ref_lse = prefill.attention_forward(q, k, v, 0.1, (None, 0), alibi_slopes=slopes)
                ref_grads = prefill.attention_backward(dout, q, k, v, ref_out, ref_lse, 0.1, (None, 0),
                                                        alibi_slopes=slopes)
            torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=0)
            torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
            for a, b in zip(grads, ref_grads):
                torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        del q, k, v, grads


@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_alibi_varlen(hopper_launches, hopper_backward_launches, d):
    """A packed batch: each sequence's bias from its own diagonal (sk_i - sq_i), slopes (b, h)."""
    check_varlen([300, 0, 17, 1024, 129], [250, 40, 17, 1024, 300], 4, 2, d, torch.bfloat16, "cuda", causal=True,
                 alibi=True)
    check_varlen([300, 1, 700], [500, 64, 600], 4, 1, d, torch.float16, "cuda", alibi=True)
    assert len(hopper_launches) == 2 and len(hopper_backward_launches) == 2


@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_sink(hopper_launches, hopper_backward_launches, d):
    """The attention sink in the Hopper forward (folded into each row's sum before the epilogue):
    output, LSE, gradients and the sink's gradient against the float64 oracle; causal and not, sq
    != sk, fp16 and bf16, dropout, and a packed batch."""
    check_prefill(2, 1023, 1024, 4, 2, d, torch.bfloat16, "cuda", causal=True, sink=True)
    check_prefill(2, 300, 700, 4, 2, d, torch.float16, "cuda", sink=True)
    check_prefill(2, 700, 300, 4, 1, d, torch.bfloat16, "cuda", sink=True, dropout_p=0.1)
    check_varlen([300, 50, 0, 700], [400, 51, 9, 900], 4, 2, d, torch.bfloat16, "cuda", causal=True, sink=True)
    assert len(hopper_launches) == 4 and len(hopper_backward_launches) == 4


# ---------------------------------------------------------------------------------------------
# Packed (varlen) batches in both Hopper kernels: sequences of 0, 1 and odd lengths, sq_i != sk_i,
# key and row blocks that run into the next sequence (its rows must not be touched: the outputs
# and gradients are poisoned first, the oracle runs each sequence alone).
# ---------------------------------------------------------------------------------------------

VARLEN = {  # (lens_q, lens_k)
    "mixed": ([113, 0, 1, 700, 257, 64], [203, 9, 1, 700, 128, 0]),
    "long-short": ([1023, 17, 2048], [1024, 300, 2048]),
    "short": ([1, 5, 17, 129, 3], [3, 5, 300, 129, 1]),
}


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("lengths", VARLEN.values(), ids=VARLEN.keys())
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_varlen(hopper_launches, hopper_backward_launches, d, lengths, dtype, causal, heads):
    check_varlen(*lengths, *heads, d, dtype, "cuda", causal=causal)
    assert hopper_launches and hopper_backward_launches


@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_varlen_window_seqused_dropout(hopper_launches, hopper_backward_launches, d):
    """A window, seqused_k (keys past it get zero gradients) and dropout (the mask of each
    sequence's own rows and keys, as the Triton kernels draw it) on packed batches."""
    check_varlen([300, 50, 700], [400, 51, 900], 4, 2, d, torch.bfloat16, "cuda", window=(100, 20))
    check_varlen([300, 50, 700], [400, 51, 900], 4, 2, d, torch.bfloat16, "cuda", causal=True,
                 seqused=[350, 0, 899])
    check_varlen([113, 0, 1, 700, 257], [203, 9, 1, 700, 128], 4, 2, d, torch.bfloat16, "cuda", causal=True,
                 dropout_p=0.17)
    assert len(hopper_launches) == 3 and len(hopper_backward_launches) == 3


def test_varlen_sink_delta(hopper_backward_launches):
    """The attention sink's gradient on a packed batch reads delta in the LSE's (h, total_q) layout,
    which the Hopper backward's delta launch writes (the forward with a sink is the Triton one)."""
    check_varlen([300, 50, 700], [400, 51, 900], 4, 2, 128, torch.bfloat16, "cuda", causal=True, sink=True)
    assert hopper_backward_launches


def test_varlen_long_and_many_short(hopper_launches, hopper_backward_launches):
    """8k-16k sequences in one packed batch, and 1000 sequences of 1-64 tokens."""
    lens = [16384, 8192, 4096, 3000]
    check_varlen(lens, lens, 2, 1, 128, torch.bfloat16, "cuda", causal=True)
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 65, (1000,), generator=gen).tolist()
    check_varlen(lens, lens, 4, 2, 64, torch.bfloat16, "cuda", causal=True)
    assert len(hopper_launches) == 2 and len(hopper_backward_launches) == 2


def test_varlen_reruns(hopper_launches, hopper_backward_launches):
    """A packed batch with dropout, 10 reruns of the Hopper kernels (one seed): out, dK and dV
    bitwise equal, dQ (TMA reductions in the order programs finish) to fp32 rounding; with
    deterministic=True (the same kernel, dQ in its fixed order) all bitwise equal over 5 reruns
    and equal to the first up to rounding."""
    from flashtile import flash_attn_varlen_func

    lens = [700, 1, 1300, 64, 4000]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lens), 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def run(deterministic=False):
        torch.manual_seed(5)
        out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), dropout_p=0.1, causal=True,
                                     deterministic=deterministic)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    first = run()
    for _ in range(10):
        out, dq, dk, dv = run()
        assert torch.equal(out, first[0]) and torch.equal(dk, first[2]) and torch.equal(dv, first[3])
        torch.testing.assert_close(dq, first[1], atol=2e-3, rtol=1e-2)
    assert len(hopper_backward_launches) == 11
    ordered = run(deterministic=True)
    for a, b in zip(first, ordered):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    for _ in range(5):
        assert all(torch.equal(a, b) for a, b in zip(run(deterministic=True), ordered))
    assert len(hopper_backward_launches) == 17
