"""Decoding API on CPU without kernels: argument errors, the num_splits heuristic, the reference path."""

import re

import pytest
import torch
from decode_check import check_kvcache

from flashtile import DecodePlan, _checks, api, flash_attn_with_kvcache, merge_attention_states
from flashtile.ops import configs, decode_sm90, decoding


def _call(**change):
    """A valid call (b=2, q heads 4, kv heads 2, d=32, cache 64, one new token) with `change` applied."""
    args = dict(q=torch.randn(2, 1, 4, 32).half(), k_cache=torch.randn(2, 64, 2, 32).half(),
                v_cache=torch.randn(2, 64, 2, 32).half(), k=torch.randn(2, 1, 2, 32).half(),
                v=torch.randn(2, 1, 2, 32).half(), cache_seqlens=torch.tensor([3, 5], dtype=torch.int32))
    args.update(change)
    return args


def _paged(**change):
    """8 pages of 16; sequence 0 owns pages 0, 1 (unused entries -1), sequence 1 pages 2..5."""
    paged = dict(k_cache=torch.randn(8, 16, 2, 32).half(), v_cache=torch.randn(8, 16, 2, 32).half(),
                 block_table=torch.tensor([[0, 1, -1, -1], [2, 3, 4, 5]], dtype=torch.int32))
    return _call(**{**paged, **change})


def _rotary(n=64, half=8):
    return dict(rotary_cos=torch.randn(n, half).half(), rotary_sin=torch.randn(n, half).half())


ERRORS = {
    "q-fp64": (_call(q=torch.randn(2, 1, 4, 32).double()), TypeError, "q must have dtype"),
    "q-3d": (_call(q=torch.randn(2, 4, 32).half()), ValueError, "q must have 4 dimensions"),
    "cache-dtype": (_call(k_cache=torch.randn(2, 64, 2, 32)), TypeError, "k_cache must have the dtype of q"),
    "cache-headdim": (_call(k_cache=torch.randn(2, 64, 2, 16).half()), ValueError, "head dim 32"),
    "v-cache-shape": (_call(v_cache=torch.randn(2, 63, 2, 32).half()), ValueError, "v_cache must have shape"),
    "heads": (_call(q=torch.randn(2, 1, 5, 32).half()), ValueError, "multiple of the number of key/value heads"),
    "k-without-v": (_call(v=None), ValueError, "k and v must be given together"),
    "k-heads": (_call(k=torch.randn(2, 1, 4, 32).half(), v=torch.randn(2, 1, 4, 32).half()),
                ValueError, "k must have shape"),
    "k-dtype": (_call(k=torch.randn(2, 1, 2, 32)), TypeError, "k must have the dtype of q"),
    "seqlens-int64": (_call(cache_seqlens=torch.tensor([3, 5])), TypeError, "cache_seqlens must be int32"),
    "seqlens-shape": (_call(cache_seqlens=torch.tensor([3, 5, 1], dtype=torch.int32)), ValueError,
                      "cache_seqlens must have shape (2,)"),
    "seqlens-none-append": (_call(cache_seqlens=None), ValueError, "cache_seqlens is required"),
    "seqlens-negative": (_call(cache_seqlens=torch.tensor([-1, 5], dtype=torch.int32)), ValueError, ">= 0"),
    "overflow": (_call(cache_seqlens=torch.tensor([3, 64], dtype=torch.int32)), ValueError,
                 "cache overflow: batch row 1 holds 64 tokens (cache_seqlens) and appends 1, but k_cache holds 64"),
    "overflow-int": (_call(cache_seqlens=64), ValueError, "cache overflow"),
    "overflow-append-2": (_call(k=torch.randn(2, 2, 2, 32).half(), v=torch.randn(2, 2, 2, 32).half(),
                                cache_seqlens=torch.tensor([3, 63], dtype=torch.int32)), ValueError,
                          "batch row 1 holds 63 tokens (cache_seqlens) and appends 2"),
    "overflow-no-append": (_call(k=None, v=None, cache_seqlens=torch.tensor([65, 3], dtype=torch.int32)), ValueError,
                           "batch row 0 holds 65 tokens (cache_seqlens) and appends 0, but k_cache holds 64"),
    "overflow-paged": (_paged(cache_seqlens=torch.tensor([3, 64], dtype=torch.int32)), ValueError,
                       "appends 1, but block_table reaches 64 (4 pages of 16)"),
    "overflow-paged-no-append": (_paged(k=None, v=None, cache_seqlens=torch.tensor([3, 65], dtype=torch.int32)),
                                 ValueError, "but block_table reaches 64"),
    "overflow-paged-batch-idx": (_call(cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32),
                                       cache_seqlens=torch.tensor([64, 0], dtype=torch.int32)),
                                 ValueError, "batch row 0 holds 64 tokens"),
    "overflow-leftpad": (_call(cache_leftpad=torch.tensor([2, 0], dtype=torch.int32),
                               cache_seqlens=torch.tensor([64, 3], dtype=torch.int32)), ValueError, "cache overflow"),
    "seqlens-int-negative": (_call(cache_seqlens=-1), ValueError, "cache_seqlens must be >= 0"),
    "page-size": (_paged(k_cache=torch.randn(8, 24, 2, 32).half(), v_cache=torch.randn(8, 24, 2, 32).half()),
                  ValueError, "multiple of 16"),
    "table-dtype": (_paged(block_table=torch.zeros(2, 4, dtype=torch.int64)), TypeError, "block_table must be int32"),
    "table-rows": (_paged(block_table=torch.zeros(3, 4, dtype=torch.int32)), ValueError, "block_table must have shape"),
    "table-bounds": (_paged(block_table=torch.tensor([[0, 1, -1, -1], [2, 8, 4, 5]], dtype=torch.int32),
                            cache_seqlens=torch.tensor([3, 20], dtype=torch.int32)),
                     ValueError, "block_table[1, 1] = 8 is not a page"),
    "table-unallocated": (_paged(cache_seqlens=torch.tensor([32, 5], dtype=torch.int32)), ValueError,
                          "block_table[0, 2] = -1"),
    "paged-batch-idx": (_paged(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32)), ValueError,
                        "cache_batch_idx cannot be combined with block_table"),
    "batch-idx-bounds": (_call(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)), ValueError,
                         "cache_batch_idx[1] = 2"),
    "batch-idx-negative": (_call(cache_batch_idx=torch.tensor([-1, 0], dtype=torch.int32)), ValueError,
                           "cache_batch_idx[0] = -1 is not a sequence of k_cache"),
    "batch-idx-same-sequence": (_call(cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32)), ValueError,
                                "batch rows 0 and 1 would both append into sequence 1 of k_cache"),
    "table-shared-write": (_paged(block_table=torch.tensor([[2, 1, -1, -1], [2, 3, 4, 5]], dtype=torch.int32),
                                  cache_seqlens=torch.tensor([5, 5], dtype=torch.int32)), ValueError,
                           "batch rows 0 and 1 would both append into row 5 of page 2 (block_table)"),
    "table-read-of-an-append": (_paged(block_table=torch.tensor([[2, 1, -1, -1], [2, 3, 4, 5]], dtype=torch.int32),
                                       cache_seqlens=torch.tensor([5, 9], dtype=torch.int32)), ValueError,
                                "batch row 0 would append into row 5 of page 2 (block_table), which batch row 1 reads"),
    "table-negative-read": (_paged(k=None, v=None, cache_seqlens=torch.tensor([33, 5], dtype=torch.int32)),
                            ValueError, "block_table[0, 2] = -1 is not a page of k_cache"),
    "leftpad-negative": (_call(cache_leftpad=torch.tensor([-1, 0], dtype=torch.int32)), ValueError,
                         "cache_leftpad[0] = -1"),
    "leftpad-paged": (_paged(cache_leftpad=torch.tensor([0, 6], dtype=torch.int32)), ValueError,
                      "cache_leftpad[1] = 6 must be in [0, cache_seqlens[1] = 5]"),
    "v-not-tensor": (_call(v=[1.0]), TypeError, "v must be a torch.Tensor"),
    "cache-too-few-seqs": (_call(k_cache=torch.randn(1, 64, 2, 32).half(), v_cache=torch.randn(1, 64, 2, 32).half()),
                           ValueError, "at least 2 sequences"),
    "leftpad": (_call(cache_leftpad=torch.tensor([4, 0], dtype=torch.int32)), ValueError, "cache_leftpad[0] = 4"),
    "rotary-without-k": (_call(k=None, v=None, **_rotary()), ValueError, "pass k and v"),
    "rotary-cos-only": (_call(rotary_cos=torch.randn(64, 8).half()), ValueError, "given together"),
    "rotary-dim": (_call(**_rotary(half=17)), ValueError, "rotary_dim"),
    "rotary-short": (_call(**_rotary(n=5)), ValueError, "reach position 5"),
    "num-splits": (_call(num_splits=-1), ValueError, "num_splits"),
    "num-splits-float": (_call(num_splits=2.0), TypeError, "num_splits must be an int"),
    "window": (_call(window_size=(-1, 0, 1)), ValueError, "window_size must be a pair"),
    "causal-str": (_call(causal="False"), TypeError, "causal must be a bool or 0 / 1, got str 'False'"),
    "rotary-interleaved-int": (_call(**_rotary(), rotary_interleaved=2), TypeError,
                               "rotary_interleaved must be a bool or 0 / 1"),
    "softcap": (_call(softcap=-1.0), ValueError, "softcap"),
    "alibi": (_call(alibi_slopes=torch.rand(3)), ValueError, "alibi_slopes must have shape"),
}


@pytest.mark.parametrize("args,error,message", ERRORS.values(), ids=ERRORS.keys())
def test_errors(args, error, message):
    before = [args[name].clone() for name in ("k_cache", "v_cache")]
    with pytest.raises(error, match=re.escape(message)):
        flash_attn_with_kvcache(**args)
    for name, was in zip(("k_cache", "v_cache"), before):
        assert torch.equal(args[name], was), f"a rejected call must not touch {name}"


@pytest.mark.parametrize("args,error,message", ERRORS.values(), ids=ERRORS.keys())
def test_errors_of_a_plan(args, error, message):
    """DecodePlan takes the same checks (one path): the same calls fail as the plan or its run."""
    args = dict(args)
    q, k_cache, v_cache, k, v = (args.pop(name, None) for name in ("q", "k_cache", "v_cache", "k", "v"))
    before = [t.clone() for t in (k_cache, v_cache)]
    with pytest.raises(error, match=re.escape(message)):
        plan = DecodePlan(q.shape[0], q.shape[2], k_cache.shape, args.pop("cache_seqlens", None), dtype=torch.float16,
                          device="cpu", seqlen_q=q.shape[1], seqlen_new=0 if not isinstance(k, torch.Tensor) else
                          k.shape[1], **args)
        plan.run(q, k_cache, v_cache, k, v)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


PLAN_ERRORS = {
    "cache-shape": (dict(cache_shape=(2, 64, 2)), {}, ValueError, "cache_shape must be k_cache's shape (4 ints)"),
    "dtype": (dict(dtype=torch.float64), {}, TypeError,
              "dtype must be torch.float16, torch.bfloat16 or torch.float32, got torch.float64"),
    "lengths-count": (dict(cache_seqlens=[3]), {}, ValueError, "cache_seqlens must hold 2 lengths (batch), got 1"),
    "lengths-floats": (dict(cache_seqlens=[3.0, 5.5]), {}, TypeError, "cache_seqlens must be a list of ints"),
    "lengths-int32": (dict(cache_seqlens=[3, 2**33]), {}, ValueError, "cache_seqlens must fit in int32"),
    "lengths-negative": (dict(cache_seqlens=[3, -2]), {}, ValueError, "cache_seqlens[1] = -2 must be >= 0"),
    "lengths-overflow": (dict(cache_seqlens=[3, 64]), {}, ValueError,
                         "batch row 1 holds 64 tokens (cache_seqlens) and appends 1"),
    "seqlen-q": (dict(seqlen_q=0), {}, ValueError, "seqlen_q must be >= 1, got 0"),
    "run-q-shape": ({}, dict(q=torch.randn(2, 2, 4, 32).half()), ValueError,
                    "q's shape is (2, 2, 4, 32), but the plan was made for (2, 1, 4, 32)"),
    "run-q-dtype": ({}, dict(q=torch.randn(2, 1, 4, 32), k_cache=torch.randn(2, 64, 2, 32),
                             v_cache=torch.randn(2, 64, 2, 32), k=torch.randn(2, 1, 2, 32), v=torch.randn(2, 1, 2, 32)),
                    ValueError, "q's dtype is torch.float32, but the plan was made for torch.float16"),
    "run-cache-shape": ({}, dict(k_cache=torch.randn(3, 64, 2, 32).half(), v_cache=torch.randn(3, 64, 2, 32).half()),
                        ValueError, "k_cache's shape is (3, 64, 2, 32), but the plan was made for (2, 64, 2, 32)"),
    "run-v-cache-dtype": ({}, dict(v_cache=torch.randn(2, 64, 2, 32)), TypeError, "v_cache must have the dtype of q"),
    "run-without-k": ({}, dict(k=None, v=None), ValueError,
                      "seqlen_new (k.shape[1]) is 0, but the plan was made for 1"),
    "run-k-without-v": ({}, dict(v=None), ValueError, "k and v must be given together"),
    "run-k-not-planned": (dict(seqlen_new=0), {}, ValueError,
                          "seqlen_new (k.shape[1]) is 1, but the plan was made for 0"),
    "run-q-not-tensor": ({}, dict(q="q"), TypeError, "q must be a torch.Tensor"),
}


@pytest.mark.parametrize("plan_change,run_change,error,message", PLAN_ERRORS.values(), ids=PLAN_ERRORS.keys())
def test_plan_errors(plan_change, run_change, error, message):
    tensors = _call(**run_change)
    plan_args = dict(batch=2, nheads=4, cache_shape=(2, 64, 2, 32), cache_seqlens=[3, 5], dtype=torch.float16,
                     device="cpu", seqlen_new=1)
    plan_args.update(plan_change)
    before = [tensors[name].clone() for name in ("k_cache", "v_cache")]
    with pytest.raises(error, match=re.escape(message)):
        DecodePlan(**plan_args).run(*(tensors[name] for name in ("q", "k_cache", "v_cache", "k", "v")))
    assert torch.equal(tensors["k_cache"], before[0]) and torch.equal(tensors["v_cache"], before[1])


def test_a_call_plans_once_per_version(monkeypatch):
    """flash_attn_with_kvcache keeps the plan of a call: the layers of a step (same index tensors,
    unchanged) plan and check once; writing an index tensor in place makes the next call check it
    again, and an overflow written that way is caught with the cache untouched."""
    made = []
    real = DecodePlan._plan
    monkeypatch.setattr(DecodePlan, "_plan", lambda self, *a, **kw: made.append(1) or real(self, *a, **kw))
    args = _paged()
    with api.use_backend("reference"):
        for _ in range(3):  # three layers of one step: other q, k, v and caches, the same index tensors
            flash_attn_with_kvcache(**{**args, **{n: torch.randn_like(args[n]) for n in ("q", "k", "v", "k_cache")}})
        assert len(made) == 1
        args["cache_seqlens"][1] = 64  # in place: 64 + 1 is past the 4 pages of sequence 1
        before = args["v_cache"].clone()
        with pytest.raises(ValueError, match="block_table reaches 64"):
            flash_attn_with_kvcache(**args)
        assert torch.equal(args["v_cache"], before) and len(made) == 2
        args["cache_seqlens"][1] = 6
        flash_attn_with_kvcache(**args)
        flash_attn_with_kvcache(**args)
        assert len(made) == 3
        flash_attn_with_kvcache(**args, window_size=[-1, -1])  # a list cannot be a key: planned alone
        assert len(made) == 4


def test_the_last_calls_plan_serves_only_calls_it_fits(monkeypatch):
    """A call with the last call's argument objects, unchanged, takes its plan without a key; one
    whose tensors the plan does not fit (other cache capacity, other dtype, a wrong v_cache) or
    made under another allow_tf32 does not take it: it plans for itself, or raises its own error."""
    made = []
    real = DecodePlan._plan
    monkeypatch.setattr(DecodePlan, "_plan", lambda self, *a, **kw: made.append(1) or real(self, *a, **kw))
    args = _call(k=None, v=None)
    wider = dict(k_cache=torch.randn(2, 96, 2, 32).half(), v_cache=torch.randn(2, 96, 2, 32).half())
    fp32 = {n: args[n].float() for n in ("q", "k_cache", "v_cache")}
    with api.use_backend("reference"):
        want = {name: flash_attn_with_kvcache(**{**args, **change})
                for name, change in (("same", {}), ("wider", wider), ("fp32", fp32))}
        api._recent_plans.clear()
        made.clear()
        for name, change, plans in (("same", {}, 1), ("same", {}, 1), ("wider", wider, 2), ("same", {}, 2),
                                    ("fp32", fp32, 3), ("fp32", fp32, 3)):
            got = flash_attn_with_kvcache(**{**args, **change})
            assert torch.equal(got, want[name]) and len(made) == plans, (name, len(made))
        old = torch.backends.cuda.matmul.allow_tf32
        try:  # float32 dots follow allow_tf32 as it was when the plan was made
            torch.backends.cuda.matmul.allow_tf32 = not old
            flash_attn_with_kvcache(**{**args, **fp32})
            assert len(made) == 4
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
        flash_attn_with_kvcache(**args)
        made.clear()
        with pytest.raises(ValueError, match=re.escape("v_cache must have shape (2, 64, 2, 32)")):
            flash_attn_with_kvcache(**{**args, "v_cache": wider["v_cache"]})


def test_a_window_of_tensors_written_in_place_is_planned_again():
    """window_size as a pair holding a one-element tensor (flash-attn's tests pass such): writing
    the tensor in place makes the next call, with the same tuple or a new one, plan again."""
    q = torch.randn(2, 1, 4, 16)
    k_cache, v_cache = torch.randn(2, 32, 2, 16), torch.randn(2, 32, 2, 16)
    lengths = torch.tensor([20, 25], dtype=torch.int32)
    left = torch.tensor(2)
    window = (left, 0)
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, window_size=window)
    left.fill_(10)
    with api.use_backend("reference"):
        want = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, window_size=(10, 0))
    for w in (window, (left, 0)):  # the last call's tuple (its fast path), and a new one
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, window_size=w)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # the plan keeps the tensors of its key alive: a freed one's id cannot come back for another
    assert any(t is left for _, tensors in api._recent_plans.values() for t in tensors)


def test_a_cached_plan_does_not_lift_the_type_checks():
    """Plain values are keyed with their types: causal=2 (or num_splits=2.0) is refused after a
    call with causal=True (num_splits=2) planned, as it is on a cold cache."""
    args = _call(k=None, v=None)
    with api.use_backend("reference"):
        flash_attn_with_kvcache(**args, causal=True, num_splits=2, window_size=(3, 0))
        with pytest.raises(TypeError, match="causal must be a bool or 0 / 1, got int 2"):
            flash_attn_with_kvcache(**args, causal=2, num_splits=2, window_size=(3, 0))
        with pytest.raises(TypeError, match="num_splits must be an int, got float"):
            flash_attn_with_kvcache(**args, causal=True, num_splits=2.0, window_size=(3, 0))
        with pytest.raises(TypeError, match="window_size left must be an int, got float"):
            flash_attn_with_kvcache(**args, causal=True, num_splits=2, window_size=(3.0, 0))


def test_inference_tensors_are_checked_every_call(monkeypatch):
    """Index tensors made under inference_mode have no version counter: no plan is kept for them,
    so every call reads and checks their values (an overflow written in place is caught)."""
    made = []
    real = DecodePlan._plan
    monkeypatch.setattr(DecodePlan, "_plan", lambda self, *a, **kw: made.append(1) or real(self, *a, **kw))
    with torch.inference_mode(), api.use_backend("reference"):
        args = _paged()
        flash_attn_with_kvcache(**args)
        flash_attn_with_kvcache(**args)
        assert len(made) == 2
        args["cache_seqlens"][0] = 64
        with pytest.raises(ValueError, match="block_table reaches 64"):
            flash_attn_with_kvcache(**args)


def test_values_unread_under_capture_are_not_checked(monkeypatch):
    """Where the host cannot read the index values (CUDA-graph capture: host_copy returns None),
    the call is planned without value checks, and such a plan is never reused."""
    monkeypatch.setattr(_checks, "host_copy", lambda t: None)
    args = _call(cache_seqlens=torch.tensor([3, 99], dtype=torch.int32))
    plan = api._plan_of_call(*(args[n] for n in ("q", "k_cache", "v_cache", "k", "v")), (
        args["cache_seqlens"], None, None, None, None, False, (-1, -1), 0.0, None, None, None, True, 0))
    assert not plan._checked and not any(p is plan for p in api._recent_plans.values())
    with pytest.raises(ValueError, match="cache overflow"):
        flash_attn_with_kvcache(**_call(cache_seqlens=64))  # an int is a host value: always checked


VALUE_CASES = {  # check_cache_values: (kwargs, the longest key range)
    "contiguous": (dict(lengths=[3, 10, 0], seqlen_new=2), 12),
    "leftpad": (dict(lengths=[3, 10, 0], seqlen_new=2, leftpad=[1, 9, 0]), 4),
    "paged": (dict(lengths=[20, 0, 31], seqlen_new=1, table=[[0, 1], [2, -1], [3, 4]], page_size=16), 32),
    "paged-leftpad-skips-pages": (dict(lengths=[20, 0, 31], seqlen_new=1, table=[[-1, 1], [2, -1], [3, 4]],
                                       leftpad=[16, 0, 0], page_size=16), 32),
    "shared-read-pages": (dict(lengths=[16, 16], seqlen_new=1, table=[[0, 1], [0, 2]], page_size=16), 17),
    "rotary": (dict(lengths=[3, 10, 0], seqlen_new=2, rotary_len=12, rotary_reach=2), 12),
    "int": (dict(lengths=10, seqlen_new=2, rotary_len=12, rotary_reach=2), 12),
    "int-leftpad": (dict(lengths=10, seqlen_new=2, leftpad=[2, 9, 4]), 10),
    "int-paged": (dict(lengths=20, seqlen_new=1, table=[[0, 1], [2, 3], [4, 5]], page_size=16), 21),
}


@pytest.mark.parametrize("kw,want", VALUE_CASES.values(), ids=VALUE_CASES.keys())
def test_check_cache_values(kw, want):
    kw = {n: torch.tensor(x, dtype=torch.int32) if isinstance(x, list) else x for n, x in kw.items()}
    paged = "table" in kw
    assert _checks.check_cache_values(kw.pop("lengths"), 3, kw.pop("seqlen_new"), 32 if paged else 20,
                                      6 if paged else 3, **kw) == want
    for lengths in (torch.tensor([3, 10, 0]), 10):  # a length per row, or one for every row
        with pytest.raises(ValueError, match="rotary_cos/rotary_sin have 11 positions.*reach position 11"):
            _checks.check_cache_values(lengths, 3, 2, 20, 3, rotary_len=11, rotary_reach=2)
        with pytest.raises(ValueError, match=r"cache overflow: batch row 1 holds 10 tokens \(cache_seqlens\) and "
                                             r"appends 11, but k_cache holds 20"):
            _checks.check_cache_values(lengths if isinstance(lengths, torch.Tensor) else torch.tensor([0, 10, 0]),
                                       3, 11, 20, 3)
    with pytest.raises(ValueError, match=r"cache overflow: batch row 0 holds 10 tokens .* appends 23, but "
                                         r"block_table reaches 32 \(2 pages of 16\)"):
        _checks.check_cache_values(10, 3, 23, 32, 6, table=torch.arange(6, dtype=torch.int32).view(3, 2),
                                   page_size=16)
    with pytest.raises(ValueError, match=r"cache overflow: batch row 0 holds 10 tokens .* appends 11, but "
                                         r"k_cache holds 20"):
        _checks.check_cache_values(10, 3, 11, 20, 3)


SHARED_PAGE_CASES = {  # (lengths, leftpad, table, s_new): a page that one row appends to and another reads
    "reads-the-slot": ([5, 7], None, [[0, 1], [0, 2]], 1, "batch row 0 would append into row 5 of page 0"),
    "appends-past-the-other": ([7, 5], None, [[0, 1], [0, 2]], 2, "batch row 1 would append into row 5 of page 0"),
    "second-page": ([20, 30], None, [[3, 1], [0, 1]], 1, "batch row 0 would append into row 4 of page 1"),
}


@pytest.mark.parametrize("lengths,leftpad,table,s_new,message", SHARED_PAGE_CASES.values(),
                         ids=SHARED_PAGE_CASES.keys())
def test_an_appended_slot_that_another_row_reads(lengths, leftpad, table, s_new, message):
    """The kernel that appends reads its own new keys from k/v: another row reading the slot would
    race the write, so the plan refuses it. Rows whose reads and writes miss each other's slots
    (here the second starts after the first's slot: leftpad) share the page safely."""
    as_tensor = lambda x: None if x is None else torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match=message + r" \(block_table\), which batch row \d reads"):
        _checks.check_cache_values(as_tensor(lengths), 2, s_new, 32, 4, table=as_tensor(table), page_size=16,
                                   leftpad=as_tensor(leftpad))
    assert _checks.check_cache_values(as_tensor([5, 12]), 2, 1, 32, 4, table=as_tensor([[0, 1], [0, 2]]),
                                      page_size=16, leftpad=as_tensor([0, 6])) == 7


def test_an_append_through_a_page_listed_twice_in_one_row():
    """A row whose block_table names one page in two columns would overwrite, through the later
    column, keys it reads through the earlier one: refused, the cache untouched."""
    kp, vp = torch.randn(2, 16, 2, 16).half(), torch.randn(2, 16, 2, 16).half()
    before = kp.clone()
    with pytest.raises(ValueError, match=r"batch row 0 lists page 1 in columns 0 and 1 of block_table"):
        flash_attn_with_kvcache(torch.randn(1, 1, 2, 16).half(), kp, vp, torch.randn(1, 12, 2, 16).half(),
                                torch.randn(1, 12, 2, 16).half(), cache_seqlens=torch.tensor([10], dtype=torch.int32),
                                block_table=torch.tensor([[1, 1]], dtype=torch.int32))
    assert torch.equal(kp, before)


def test_an_append_into_an_expanded_cache():
    """An expand()ed cache holds one memory row for several cache rows: appending into it raises
    (one write would land in every row) and writes nothing; reading it is fine."""
    base = torch.randn(1, 32, 2, 16).half()
    kc, vc = base.expand(2, 32, 2, 16), torch.randn(1, 32, 2, 16).half().expand(2, 32, 2, 16)
    before = base.clone()
    q, lengths = torch.randn(2, 1, 4, 16).half(), torch.tensor([5, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"k_cache has stride 0 in a dimension of size > 1"):
        flash_attn_with_kvcache(q, kc, vc, torch.randn(2, 1, 2, 16).half(), torch.randn(2, 1, 2, 16).half(),
                                cache_seqlens=lengths)
    assert torch.equal(base, before)
    assert flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths).shape == q.shape


def test_a_plan_on_a_cpu_device_with_an_index():
    plan = DecodePlan(2, 4, (2, 32, 2, 16), [5, 20], dtype=torch.float16, device="cpu:0")
    assert plan.device == torch.device("cpu")
    q = torch.randn(2, 1, 4, 16).half()
    assert plan.run(q, torch.randn(2, 32, 2, 16).half(), torch.randn(2, 32, 2, 16).half()).shape == q.shape


MERGE_ERRORS = {
    "lse-dtype": ((torch.randn(3, 4, 8), torch.randn(3, 4).half()), TypeError, "lse_partial must have dtype"),
    "lse-shape": ((torch.randn(3, 4, 8), torch.randn(3, 5)), ValueError, "lse_partial must have shape"),
    "no-splits": ((torch.randn(0, 4, 8), torch.randn(0, 4)), ValueError, "S >= 1"),
    "out-1d": ((torch.randn(8), torch.randn(())), ValueError, "S >= 1"),
    "out-int": ((torch.ones(3, 4, 8, dtype=torch.int32), torch.randn(3, 4)), TypeError, "out_partial must have dtype"),
}


@pytest.mark.parametrize("args,error,message", MERGE_ERRORS.values(), ids=MERGE_ERRORS.keys())
def test_merge_errors(args, error, message):
    with pytest.raises(error, match=re.escape(message)):
        merge_attention_states(*args)


# ---- the num_splits heuristic --------------------------------------------------------------------

# seed 004's table (16 q / 2 kv heads) and the Llama-3-8B shape (8 kv heads) on an H100, d=128 fp16:
# the counts the sweeps measured best or within 3% (benchmarks/results/h100/decode_sweep.json,
# sweep_rounds.json), contiguous and with 16-token pages
SEED_SHAPES = {(256, 256, 2): 1, (128, 512, 2): 1, (16, 4096, 2): 8, (8, 8192, 2): 16, (2, 32768, 2): 64,
               (1, 65536, 2): 128, (1, 131072, 2): 132, (64, 8192, 8): 1}
PAGED_SHAPES = {(1, 131072, 2): 256, (1, 65536, 2): 128, (2, 65536, 8): 33, (1, 32768, 8): 64}


@pytest.mark.parametrize("shape,want", SEED_SHAPES.items(), ids=[f"b{b}-ctx{c}-hk{k}" for b, c, k in SEED_SHAPES])
def test_num_splits_seed_shapes(shape, want):
    b, ctx, hk = shape
    block_n = configs.decode_config(8, 128, torch.float16, 0, torch.device("cuda")).block_n
    assert configs.decode_num_splits(b * hk, ctx, block_n, 132) == want


@pytest.mark.parametrize("shape,want", PAGED_SHAPES.items(), ids=[f"b{b}-ctx{c}-hk{k}" for b, c, k in PAGED_SHAPES])
def test_num_splits_paged(shape, want):
    """16-token pages split twice as finely where the grid decides: their gathers measured faster
    with two rounds of programs, contiguous caches with one (sweep_rounds.json)."""
    b, ctx, hk = shape
    block_n = configs.decode_config(8, 128, torch.float16, 16, torch.device("cuda")).block_n
    assert configs.decode_num_splits(b * hk, ctx, block_n, 132, paged=True) == want


# 16-token pages, (tiles' keys, splits) of the seed and Llama shapes on an H100: a launch that
# splits reads a page a tile (16 keys, 3 stages) with the splits those tiles make; an unsplit one
# keeps the 64-key gather tiles, or takes 128-key ones when its programs fit the 264 slots at once
# (benchmarks/results/h100/sweep_page16_small_tiles.json, sweep_page16_small.json)
PAGE16_TILES = {(256, 256, 2): (64, 1), (128, 512, 2): (128, 1), (64, 512, 2): (128, 1), (132, 512, 2): (128, 1),
                (133, 512, 2): (64, 1), (16, 4096, 2): (16, 16), (8, 8192, 2): (16, 33),
                (2, 32768, 2): (16, 132), (1, 65536, 2): (16, 264), (1, 131072, 2): (16, 264), (64, 8192, 8): (64, 1)}


@pytest.mark.parametrize("shape,want", PAGE16_TILES.items(), ids=[f"b{b}-ctx{c}-hk{k}" for b, c, k in PAGE16_TILES])
def test_tiles_of_16_token_pages(monkeypatch, shape, want):
    monkeypatch.setattr(configs, "num_sms", lambda device: 132)
    b, ctx, hk = shape
    cuda = torch.device("cuda")
    cfg, splits = configs.decode_tiles(8, 128, torch.float16, 16, cuda, b * hk, ctx)
    assert (cfg.block_n, splits) == want
    # 3 stages but in the 128-key tiles of one round: a paged loop reads its page indices a tile ahead
    assert cfg.num_stages == (2 if cfg.block_n == 128 else 3)
    # contiguous caches and 64-token pages keep their tiles and counts; pages take 3 stages
    for page in (0, 64):
        cfg, splits = configs.decode_tiles(8, 128, torch.float16, page, cuda, b * hk, ctx)
        assert (cfg.block_n, cfg.num_stages) == (64, 3 if page else 2)
        assert splits == configs.decode_num_splits(b * hk, ctx, 64, 132, page > 0)


def test_tiles_with_a_given_split_count(monkeypatch):
    """num_splits given: kept as it is; more than one takes the split tiles."""
    monkeypatch.setattr(configs, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert configs.decode_tiles(8, 128, torch.float16, 16, cuda, 16, 8192, num_splits=4)[0].block_n == 16
    assert configs.decode_tiles(8, 128, torch.float16, 16, cuda, 16, 8192, num_splits=4)[1] == 4
    assert configs.decode_tiles(8, 128, torch.float16, 16, cuda, 2, 65536, num_splits=1)[0].block_n == 128  # one round
    assert configs.decode_tiles(8, 128, torch.float16, 16, cuda, 512, 8192, num_splits=1)[0].block_n == 64
    # unsplit one-round launches of other page sizes and packed row counts keep their tiles
    for rows, page in ((8, 32), (8, 64), (32, 16)):
        assert configs.decode_tiles(rows, 128, torch.float16, page, cuda, 256, 512)[0] == \
            configs.decode_config(rows, 128, torch.float16, page, cuda)
    # head dims, packed query rows and page sizes the one-page tiles were not measured at keep theirs
    for rows, d, page in ((8, 64, 16), (64, 128, 16), (8, 128, 32)):
        assert configs.decode_tiles(rows, d, torch.float16, page, cuda, 16, 8192)[0] == \
            configs.decode_config(rows, d, torch.float16, page, cuda)
    # float32 and the interpreter have tiles of their own
    assert configs.decode_tiles(8, 128, torch.float32, 16, cuda, 16, 8192)[0] == \
        configs.decode_config(8, 128, torch.float32, 16, cuda)
    cpu = torch.device("cpu")
    assert configs.decode_tiles(8, 128, torch.float16, 16, cpu, 16, 8192)[0] == \
        configs.decode_config(8, 128, torch.float16, 16, cpu)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_sms", [16, 132])
def test_num_splits_invariants(num_sms, paged):
    slots = configs.DECODE_PROGRAMS_PER_SM * num_sms
    rounds = configs.DECODE_ROUNDS_PAGED if paged else configs.DECODE_ROUNDS
    for programs in (1, 2, 3, 7, 32, 100, 211, 212, 264, 1000):
        for keys in (0, 1, 63, 64, 255, 256, 1000, 4096, 131072, 10**6):
            n = configs.decode_num_splits(programs, keys, 64, num_sms, paged)
            assert n >= 1
            if n > 1:  # splitting only to fill the GPU, and never into slivers
                assert programs * n <= rounds * slots
                assert n * configs.DECODE_MIN_BLOCKS_PER_SPLIT * 64 < keys + configs.DECODE_MIN_BLOCKS_PER_SPLIT * 64
            if programs >= configs.DECODE_NO_SPLIT_FILL * slots:
                assert n == 1


@pytest.mark.parametrize("num_splits", [1, 2, 7, 133, 264, 512, 700])
@pytest.mark.parametrize("d", [16, 40, 128, 256])
def test_combine_config(num_splits, d):
    cfg = configs.combine_config(num_splits, d)
    assert cfg.block_s >= min(num_splits, 512)  # one load holds every split up to 512
    assert cfg.block_s * cfg.block_d <= 8192 and cfg.block_d >= 16


# ---- the reference path (CPU without the interpreter) ------------------------------------------

REFERENCE_CASES = {
    "contiguous": dict(),
    "paged16-causal": dict(page_size=16, causal=True),
    "rotary-leftpad": dict(rotary=(16, False), leftpad=True, causal=True),
    "window-alibi-softcap": dict(window=(10, 0), alibi="bh", softcap=3.0),
    "batch-idx": dict(batch_idx=True),
}


@pytest.mark.parametrize("case", REFERENCE_CASES.values(), ids=REFERENCE_CASES.keys())
def test_reference_backend(case):
    with api.use_backend("reference"):
        check_kvcache(2, 2, 4, 2, 32, 96, 2, torch.float16, "cpu", **case)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_merge_keeps_the_graph(backend):
    """With gradients wanted the merge runs as torch operations (its kernel has no backward), on
    every backend: no output comes back detached; the gradients are the float64 merge's."""
    out_partial = torch.randn(3, 2, 4, 16, requires_grad=True)
    lse_partial = torch.randn(3, 2, 4, requires_grad=True)
    with api.use_backend(backend):
        out, lse = merge_attention_states(out_partial, lse_partial)
    assert out.requires_grad and lse.requires_grad
    w = torch.arange(16.0)
    ((out * w).sum() + lse.sum()).backward()
    o64, l64 = (t.detach().double().requires_grad_() for t in (out_partial, lse_partial))
    p = torch.softmax(l64, 0)
    (((p[..., None] * o64).sum(0) * w.double()).sum() + torch.logsumexp(l64, 0).sum()).backward()
    torch.testing.assert_close(out_partial.grad.double(), o64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_partial.grad.double(), l64.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_merge_gradients_are_finite_where_every_piece_is_empty(backend):
    """A row whose pieces all saw no key (lse -inf): its merged lse is -inf and every gradient is
    finite, with a sink (whose fold reads the lse) and through a second merge."""
    out_partial = torch.randn(3, 4, 8)
    lse_partial = torch.randn(3, 4)
    lse_partial[:, 1] = float("-inf")
    out_partial, lse_partial = out_partial.requires_grad_(), lse_partial.requires_grad_()
    with api.use_backend(backend):
        out, lse = merge_attention_states(out_partial, lse_partial, learnable_sink=torch.zeros(4))
        again, lse2 = merge_attention_states(torch.stack([out, torch.ones_like(out)]),
                                             torch.stack([lse, torch.zeros_like(lse)]))
    (again.sum() + lse2.sum()).backward()
    assert torch.isfinite(out_partial.grad).all() and torch.isfinite(lse_partial.grad).all()
    assert torch.equal(out_partial.grad[:, 1], torch.zeros(3, 8))
    assert torch.equal(lse_partial.grad[:, 1], torch.zeros(3))


def test_merge_of_pieces_without_lse_gradients_raises():
    """flash_attn_func's softmax_lse carries no gradient: merging such pieces for training would
    drop the LSE's part of the gradient, so it is refused; detached pieces merge."""
    out_partial = torch.randn(2, 3, 8, requires_grad=True)
    lse_partial = torch.randn(2, 3)
    with pytest.raises(RuntimeError, match="out_partial requires grad and lse_partial does not"):
        merge_attention_states(out_partial, lse_partial)
    out, _ = merge_attention_states(out_partial.detach(), lse_partial)
    assert not out.requires_grad


def test_reference_merge():
    out_partial = torch.randn(5, 3, 16)
    lse_partial = torch.randn(5, 3)
    lse_partial[1] = float("-inf")
    out_partial[1] = float("nan")
    with api.use_backend("reference"):
        out, lse = merge_attention_states(out_partial, lse_partial)
    w = torch.exp(lse_partial - lse).nan_to_num(0.0)
    torch.testing.assert_close(lse, torch.logsumexp(lse_partial, 0))
    torch.testing.assert_close(out, (w[..., None] * out_partial.nan_to_num(0.0)).sum(0))


def test_warp_kernel_dispatch(monkeypatch):
    """configs.decode_warp_tiles: the Gluon split kernel on an sm_90 GPU for 16-bit d=64/128 caches, at
    most 16 query rows a KV head, and at most one program an SM before splitting (which then fills
    the SMs once at >= 8 tiles a split) or rows of >= 8 tiles (not split); None (the Triton kernel)
    otherwise."""
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "num_sms", lambda device: 132)
    gpu, fp16 = torch.device("cuda", 0), torch.float16

    def tiles(rows=8, d=128, dtype=fp16, kv_rows=128, keys=1024, splits=0):
        return configs.decode_warp_tiles(rows, d, dtype, gpu, kv_rows, keys, splits)

    assert tiles() == (configs.BlockConfig(8, 64, 4, 3), 1)  # 64 x 1024, 16 / 2 heads: one program an SM
    assert tiles(kv_rows=32, keys=4096)[1] == 4  # 16 x 4096
    assert tiles(kv_rows=2, keys=65536)[1] == 66  # 1 x 65536
    assert tiles(kv_rows=2, keys=1000)[1] == 2  # >= 8 tiles of 64 keys a split
    assert tiles(kv_rows=2, keys=65536, splits=5)[1] == 5  # a given count is kept
    assert tiles(rows=16, dtype=torch.bfloat16)[0].block_m == 16
    assert tiles(d=64, kv_rows=32, keys=4096) == (configs.BlockConfig(8, 128, 4, 3), 4)  # 32 KB tiles
    assert tiles(kv_rows=256, keys=512)[1] == 1  # 128 x 512: two rounds of 8-tile rows
    assert tiles(kv_rows=512, keys=8192, rows=4)[1] == 1  # Llama-3-8B's 64 x 8192, 32 / 8 heads
    assert tiles(kv_rows=512, keys=1024, d=64)[1] == 1  # 8 tiles of 128 keys
    for other in (dict(kv_rows=512, keys=256), dict(kv_rows=133, keys=511), dict(kv_rows=133, keys=1023, d=64),
                  dict(kv_rows=0), dict(rows=17), dict(d=256), dict(d=80), dict(dtype=torch.float32)):
        assert tiles(**other) is None, other
    monkeypatch.setattr(configs, "capability", lambda device: (8, 0))
    assert tiles() is None
    assert configs.decode_warp_tiles(8, 128, fp16, torch.device("cpu"), 128, 1024, 0) is None


def test_warp_kernel_plan_keeps_a_triton_launch_for_strided_caches(monkeypatch):
    """A plan on _split_kernel_warps prepares _split_kernel with the same grid and splits at its
    first call with a cache the Gluon kernel cannot copy (decode_attention asks _whole_rows), once;
    a plan on _split_kernel has no second launch."""
    from flashtile.ops import decode

    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "num_sms", lambda device: 132)
    args = dict(page_size=0, capacity=4096, cache_rows=4, seqlen_new=0, cache_seqlens=1000, cache_batch_idx=None,
                cache_leftpad=None, block_table=None, alibi_slopes=None, rotary_cos=None, rotary_sin=None,
                rotary_interleaved=False, softmax_scale=0.1, window=(-1, -1), softcap=0.0, num_splits=0,
                max_keys=None)
    p = decoding.plan(4, 1, 16, 2, 128, torch.float16, torch.device("cuda", 0), **args)
    assert p.split.kernel is decode_sm90._split_kernel_warps and p.num_splits == 8  # >= 8 tiles of 64 keys a split
    fallback = p.split_any()
    assert fallback is p.split_any() and fallback.kernel is decode._split_kernel
    assert fallback.grid == p.split.grid and fallback.scalars == p.split.scalars
    p = decoding.plan(4, 1, 16, 2, 80, torch.float16, torch.device("cuda", 0), **args)
    assert p.split.kernel is decode._split_kernel and p.split_any is None
    strided = torch.empty(2, 8, 128, 2).transpose(-1, -2)
    assert decoding._whole_rows(torch.empty(2, 8, 2, 128)) and not decoding._whole_rows(strided)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.interpret)])
def test_empty_batch_returns_empty_outputs(backend):
    """Batch 0 through flash_attn_with_kvcache (with and without an append), DecodePlan.run and
    KVCache.attend: empty outputs shaped (0, seqlen_q, nheads, headdim) and LSE (0, nheads,
    seqlen_q) on every path (the reference path raised torch.cat's error)."""
    from flashtile import KVCache

    q = torch.randn(0, 1, 4, 32).half()
    k_cache, v_cache = torch.randn(0, 64, 2, 32).half(), torch.randn(0, 64, 2, 32).half()
    new = torch.randn(0, 1, 2, 32).half()
    empty_lengths = torch.zeros(0, dtype=torch.int32)
    with api.use_backend(backend):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=empty_lengths, return_softmax_lse=True)
        appended = flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=empty_lengths)
        planned = DecodePlan(0, 4, k_cache.shape, [], dtype=torch.float16, device="cpu", seqlen_new=1).run(
            q, k_cache, v_cache, new, new)
        cache = KVCache(0, 64, 2, 32, dtype=torch.float16, device="cpu")
        attended = cache.attend(q, new, new)
    assert out.shape == appended.shape == planned.shape == attended.shape == (0, 1, 4, 32)
    assert lse.shape == (0, 4, 1) and lse.dtype == torch.float32 and out.dtype == torch.float16


@pytest.mark.parametrize("case", ["page-index", "pages-overflow", "cache-overflow"])
def test_overflow_errors_are_runtime_errors_too(case):
    """flash-attn raises RuntimeError for a cache or block_table overflow (its own test does
    pytest.raises(RuntimeError, match="block_table")); flashtile's argument errors are ValueErrors
    and RuntimeErrors both (_checks.ArgumentError), so code written against either catches them."""
    import flashtile

    q, k = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16)
    pages = torch.randn(6, 16, 2, 16)
    if case == "cache-overflow":
        call = lambda: flash_attn_with_kvcache(q, torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16), k, k,
                                               cache_seqlens=8)
        match = "cache overflow"
    else:
        table = [[0, 7], [2, 3]] if case == "page-index" else [[0, 1], [2, 3]]
        call = lambda: flash_attn_with_kvcache(q, pages, pages.clone(), k, k, cache_seqlens=20 if case == "page-index"
                                               else 32, block_table=torch.tensor(table, dtype=torch.int32))
        match = "block_table"
    for kind in (RuntimeError, ValueError, flashtile.ArgumentError):
        with pytest.raises(kind, match=match):
            call()
