"""Ring attention (flashtile.distributed) on CPU: gloo process groups of 2 and 3 ranks
(torch.multiprocessing), the reference path and, under the interpreter, the Triton kernels.

Every case's gathered outputs, LSE and gradients are held to the float64 oracle on the whole
sequence by the 2x rule (ring_check.check). One spawn per group runs all its cases (a process
start costs seconds on the CI machine's two cores); the tests then read the saved shards. The
plan's geometry, the shard helpers and the errors that need no peer run in this process, the
latter on a one-rank group.
"""

import datetime
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ring_check import Case, check, worker

import flashtile
from flashtile import distributed
from flashtile.distributed import plan, ring

# global tokens: 16 = 2 x 2 chunks of 4 on 2 ranks; 24 = 3 x 2 chunks of 4 on 3 ranks
CASES_2 = {
    "full": Case(1, 16),
    "causal": Case(2, 16, causal=True),
    "causal-contiguous": Case(3, 16, causal=True, layout="contiguous"),
    "causal-fp32": Case(4, 16, dtype=torch.float32, causal=True),
    "mqa-causal": Case(5, 16, heads=(4, 1), causal=True),
    "window-3-2": Case(6, 32, window=(3, 2)),
    "window-5-causal": Case(7, 32, window=(5, 0), causal=True),
    "window-left-6": Case(8, 32, window=(6, -1), layout="contiguous"),
    "softcap-causal": Case(9, 16, causal=True, softcap=2.0),
    "sink-causal": Case(10, 16, causal=True, sink=True),
    "sink-window": Case(11, 32, window=(4, 0), causal=True, sink=True),
    "dropout-causal": Case(12, 16, causal=True, dropout_p=0.25),
    "varlen-causal": Case(13, None, causal=True, lengths=(8, 0, 20, 4)),
    "varlen-full-contiguous": Case(14, None, heads=(4, 1), layout="contiguous", lengths=(6, 2, 10)),
    "varlen-sink-causal": Case(15, None, causal=True, sink=True, lengths=(12, 4)),
}
CASES_3 = {
    "full-gqa": Case(21, 24),
    "causal": Case(22, 24, causal=True),
    "causal-contiguous": Case(23, 24, causal=True, layout="contiguous"),
    "window-7-causal": Case(24, 48, window=(7, 0), causal=True),
    "window-2-9": Case(25, 48, window=(2, 9), softcap=1.5),
    "sink-causal": Case(26, 24, causal=True, sink=True),
    "dropout-full": Case(27, 24, dropout_p=0.2, heads=(3, 1)),
    "varlen-causal": Case(28, None, causal=True, lengths=(12, 6, 0, 18)),
}
_SMALL = dict(heads=(2, 1), batch=1)
INTERPRET_2 = {
    "causal-fp16": Case(31, 32, dtype=torch.float16, causal=True, **_SMALL),
    "window-5-3-fp32": Case(32, 32, dtype=torch.float32, window=(5, 3), **_SMALL),
    "dropout-causal-fp32": Case(33, 32, dtype=torch.float32, causal=True, dropout_p=0.25, **_SMALL),
    "varlen-causal-fp16": Case(34, None, dtype=torch.float16, causal=True, lengths=(8, 0, 20, 4), heads=(2, 1)),
    "sink-causal-fp16": Case(35, 32, dtype=torch.float16, causal=True, sink=True, **_SMALL),
}
# cases whose every rank must raise; the ranks' agreement is checked on every call: a group's
# first, and the default group's after the cases above have used it (gloo aborted the process there)
ERRORS_2 = {
    "ranks-disagree-softcap": (Case(41, 16, rank1_options=dict(softcap=1.0), fresh_group=True),
                               r"the ranks disagree on softcap: \[0.0, 1.0\] by rank"),
    "ranks-disagree-tokens": (Case(42, 16, causal=True, rank1_drop=2, fresh_group=True),
                              r"the ranks disagree on tokens per rank \(q.shape\[1\]\): \[8, 6\] by rank"),
    "varlen-window": (Case(43, None, window=(3, 0), lengths=(8, 8)), "window_size must be"),
    "ranks-disagree-tokens-later": (Case(44, 16, causal=True, rank1_drop=2),
                                    r"the ranks disagree on tokens per rank \(q.shape\[1\]\): \[8, 6\] by rank"),
    "ranks-disagree-varlen-later": (Case(45, None, causal=True, lengths=(8, 8), rank1_options=dict(softcap=0.5)),
                                    r"the ranks disagree on softcap: \[0.0, 0.5\] by rank"),
}
BROKEN_2 = {"causal-last-step-skipped": Case(2, 16, causal=True, broken=True)}


def _spawn(tmp_path_factory, world: int, cases: dict, interpret: bool = False) -> dict:
    """Run every case on a gloo group of `world` processes; {case: [each rank's saved result]}."""
    out = tmp_path_factory.mktemp(f"ring{world}")
    mp.spawn(worker, (world, str(out / "init"), cases, str(out), interpret), nprocs=world)
    return {name: [torch.load(out / f"{name}-{r}.pt") for r in range(world)] for name in cases}


@pytest.fixture(scope="module")
def results_2(tmp_path_factory):
    cases = {**CASES_2, **{n: c for n, (c, _) in ERRORS_2.items()}, **BROKEN_2}
    return _spawn(tmp_path_factory, 2, cases)


@pytest.fixture(scope="module")
def results_3(tmp_path_factory):
    return _spawn(tmp_path_factory, 3, CASES_3)


@pytest.fixture(scope="module")
def results_interpret(tmp_path_factory):
    return _spawn(tmp_path_factory, 2, INTERPRET_2, interpret=True)


@pytest.mark.parametrize("name", CASES_2)
def test_two_ranks(results_2, name):
    check(CASES_2[name], 2, results_2[name])


@pytest.mark.parametrize("name", CASES_3)
def test_three_ranks(results_3, name):
    check(CASES_3[name], 3, results_3[name])


@pytest.mark.interpret
@pytest.mark.parametrize("name", INTERPRET_2)
def test_two_ranks_triton(results_interpret, name):
    check(INTERPRET_2[name], 2, results_interpret[name])


@pytest.mark.parametrize("name", ERRORS_2)
def test_errors_on_every_rank(results_2, name):
    match = ERRORS_2[name][1]
    for rank, result in enumerate(results_2[name]):
        assert result.get("error") == "ArgumentError", f"rank {rank}: {result}"
        assert re.search(match, result["message"]), result["message"]


def test_a_ring_missing_a_step_fails_the_check(results_2):
    """The checks can fail: the same case with the last forward step skipped does."""
    with pytest.raises(AssertionError, match="out: max error"):
        check(BROKEN_2["causal-last-step-skipped"], 2, results_2["causal-last-step-skipped"])


# --------------------------------------------------------------------------------------------
# One rank in this process: the degenerate ring, and the errors that need no peer
# --------------------------------------------------------------------------------------------

@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_not_initialised_names_init_process_group():
    assert not dist.is_initialized()
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match=r"torch.distributed.init_process_group"):
        distributed.ring_flash_attn_func(q, q, q)
    with pytest.raises(RuntimeError, match=r"torch.distributed.init_process_group"):
        distributed.gather_sequence(q)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.interpret)])
def test_one_rank_is_one_call(one_rank, backend):
    """A group of one is flash_attn_func (one piece, one merge into an empty state): bitwise."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 12, 4, 16, generator=gen).to(torch.float16) for _ in range(4))
    results = []
    with flashtile.use_backend(backend):
        for fn in (distributed.ring_flash_attn_func, flashtile.flash_attn_func):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out, lse, _ = fn(*leaves, causal=True, window_size=(5, 0), softcap=3.0, return_attn_probs=True)
            results.append([out, lse, *torch.autograd.grad(out, leaves, dout)])
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), name


def test_one_rank_second_order_gradients_raise(one_rank):
    """As flash_attn_func: gradients under create_graph=True, and a clear error past them."""
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    with flashtile.use_backend("reference"):
        out = distributed.ring_flash_attn_func(q, q, q, causal=True)
        (g,) = torch.autograd.grad(out.sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="second-order gradients through attention are not supported"):
        torch.autograd.grad(g.sum(), (q,))


def test_one_rank_sink_and_layouts(one_rank):
    """With one rank zigzag and contiguous shards are the whole sequence, in order."""
    q = torch.randn(1, 8, 2, 16)
    t = torch.randn(2)
    with flashtile.use_backend("reference"):
        a = distributed.ring_flash_attn_func(q, q, q, causal=True, learnable_sink=t)
        b = distributed.ring_flash_attn_func(q, q, q, causal=True, learnable_sink=t, layout="contiguous")
    assert torch.equal(a, b)
    assert torch.equal(distributed.shard_sequence(q, 0, 1), q)


@pytest.mark.parametrize("call, match", [
    pytest.param(lambda q: distributed.ring_flash_attn_func(q[:, :7], q[:, :7], q[:, :7]),
                 r"q.shape\[1\] \(tokens per rank\) must be even with layout='zigzag'", id="zigzag-odd"),
    pytest.param(lambda q: distributed.ring_flash_attn_func(q, q[:, :6], q[:, :6]),
                 "k must hold as many tokens as q", id="k-shorter"),
    pytest.param(lambda q: distributed.ring_flash_attn_func(q, q, q, layout="striped"),
                 "layout must be one of", id="layout"),
    pytest.param(lambda q: distributed.ring_flash_attn_func(q, q, q, learnable_sink=torch.zeros(3)),
                 r"learnable_sink must have shape \(2,\)", id="sink-shape"),
    pytest.param(lambda q: distributed.ring_flash_attn_func(q, q, q, group="world"),
                 "group must be a torch.distributed ProcessGroup", id="group-type"),
    pytest.param(lambda q: distributed.ring_flash_attn_func(q.long(), q.long(), q.long()),
                 "q must have dtype", id="dtype"),
    pytest.param(lambda q: distributed.ring_flash_attn_varlen_func(
        q[0], q[0], q[0], torch.tensor([0, 3, 8], dtype=torch.int32), 5),
        "sequence 0 of cu_seqlens has 3 tokens, not a multiple of 2", id="varlen-uneven"),
    pytest.param(lambda q: distributed.ring_flash_attn_varlen_func(
        q[0], q[0], q[0], torch.tensor([0, 4, 8], dtype=torch.int32), 3),
        r"max_seqlen \(3\) is smaller than the longest sequence", id="varlen-max-seqlen"),
    pytest.param(lambda q: distributed.ring_flash_attn_varlen_func(
        q[0], q[0], q[0], torch.tensor([0, 4, 6], dtype=torch.int32), 5),
        r"cu_seqlens\[-1\] must equal the number of packed rows \(8\)", id="varlen-total"),
])
def test_errors(one_rank, call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(torch.randn(1, 8, 2, 16))


# --------------------------------------------------------------------------------------------
# The plan, the shard helpers and the dropout streams, without processes
# --------------------------------------------------------------------------------------------

def _kernel_mask(sq, sk, left, right):
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    ok = np.ones((sq, sk), bool)
    if left is not None:
        ok &= j >= i + sk - sq - left
    if right is not None:
        ok &= j <= i + sk - sq + right
    return ok


@pytest.mark.parametrize("layout", plan.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (0, 0), (2, 0), (3, -1), (-1, 4), (7, 2), (9, 0)], ids=str)
def test_pieces_cover_the_global_mask_exactly(layout, world, window):
    """Every piece's bottom-right kernel mask, placed at its rows and keys, adds up to the global
    mask between rank's queries and src's keys: each visible pair exactly once, nothing else.
    The kernels' windows are never negative (the reference path reads -1 as unbounded)."""
    for chunk in (1, 3, 5):
        s = plan.num_chunks(world, layout) * chunk
        i, j = np.arange(s)[:, None], np.arange(s)[None, :]
        full = np.ones((s, s), bool)
        if window[0] >= 0:
            full &= j - i >= -window[0]
        if window[1] >= 0:
            full &= j - i <= window[1]
        for rank in range(world):
            for src in range(world):
                want = full[np.ix_(plan.positions(s, rank, world, layout), plan.positions(s, src, world, layout))]
                got = np.zeros(want.shape, int)
                for p in plan.pieces(rank, src, world, layout, chunk, *window):
                    assert (p.left is None or p.left >= 0) and (p.right is None or p.right >= 0), p
                    mask = _kernel_mask(p.q1 - p.q0, p.k1 - p.k0, p.left, p.right)
                    assert mask.sum() == p.cells
                    got[p.q0:p.q1, p.k0:p.k1] += mask
                np.testing.assert_array_equal(got, want.astype(int), err_msg=f"rank {rank} src {src} chunk {chunk}")


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_balances_causal_work_in_one_call_per_step(world):
    """Zigzag: every rank sees the same number of causal cells, one kernel call per step (its
    first step's three chunk pairs fuse into one causal call over the shard). Contiguous: the last
    rank works 2 * world - 1 times as long as the first."""
    chunk = 64

    def work(rank, layout):
        steps = [plan.pieces(rank, (rank - t) % world, world, layout, chunk, -1, 0) for t in range(world)]
        return sum(p.cells for step in steps for p in step), max(len(step) for step in steps)

    zigzag = [work(r, "zigzag") for r in range(world)]
    assert {w for w, _ in zigzag} == {zigzag[0][0]} and {n for _, n in zigzag} == {1}
    assert plan.pieces(0, 0, world, "zigzag", chunk, -1, 0) == (plan.Piece(0, 2 * chunk, 0, 2 * chunk, None, 0,
                                                                           chunk * (2 * chunk + 1)),)
    contiguous = [work(r, "contiguous")[0] for r in range(world)]
    assert contiguous[-1] / contiguous[0] == pytest.approx(2 * world - 1, rel=2 / chunk)


@pytest.mark.parametrize("layout", plan.LAYOUTS)
def test_shard_unshard_round_trip(layout):
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    shards = [distributed.shard_sequence(x, r, 3, layout=layout) for r in range(3)]
    assert torch.equal(distributed.unshard_sequence(shards, layout=layout), x)
    cu = torch.tensor([0, 6, 6, 18], dtype=torch.int32)
    packed = torch.arange(18 * 2).view(18, 2)
    shards = [distributed.shard_sequence(packed, r, 3, dim=0, layout=layout, cu_seqlens=cu) for r in range(3)]
    assert torch.equal(distributed.unshard_sequence(shards, dim=0, layout=layout, cu_seqlens=cu), packed)
    with pytest.raises(ValueError, match=r"dim must name a dimension of x \(shape \(2, 24, 3\)\), got 5"):
        distributed.shard_sequence(x, 0, 3, dim=5, layout=layout)
    with pytest.raises(ValueError, match=r"dim must name a dimension of the shards \(shape \(6, 2\)\), got 2"):
        distributed.unshard_sequence(shards, dim=2, layout=layout, cu_seqlens=cu)


def test_zigzag_shards():
    """Rank 0 of 2 holds chunks 0 and 3, rank 1 chunks 1 and 2; a packed batch per sequence."""
    x = torch.arange(8)
    assert distributed.shard_sequence(x, 0, 2, dim=0).tolist() == [0, 1, 6, 7]
    assert distributed.shard_sequence(x, 1, 2, dim=0).tolist() == [2, 3, 4, 5]
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    assert distributed.shard_sequence(torch.arange(12), 0, 2, dim=0, cu_seqlens=cu).tolist() == [0, 3, 4, 5, 10, 11]
    with pytest.raises(ValueError, match="the sequence has 10 tokens, not a multiple of 4"):
        distributed.shard_sequence(torch.arange(10), 0, 2, dim=0)
    with pytest.raises(ValueError, match="rank must be in 0..1, got 2"):
        distributed.shard_sequence(x, 2, 2, dim=0)


def test_piece_rngs_are_distinct_and_reproducible():
    rng = torch.tensor([123456789012345, 987654321], dtype=torch.int64)
    rngs = [ring.piece_rngs(rng, r, 4, 4) for r in range(4)]  # (world, pieces, 2) per rank
    every = torch.cat([x.view(-1, 2) for x in rngs])
    assert len({tuple(x) for x in every.tolist()}) == every.shape[0] == 64
    assert bool((every >= 0).all())
    assert torch.equal(ring.piece_rngs(rng, 2, 4, 4), rngs[2])
