"""KVCache and PagedKVCache: a generate loop checked step by step against the float64 oracle."""

import subprocess
import sys

import pytest
import torch

from flashtile import DecodePlan, KVCache, PagedKVCache
from flashtile.reference import naive
from flashtile.testing import assert_2x

B, H, HK, D = 3, 4, 2, 32


def _caches(dtype=torch.float16):
    return {
        "contiguous": KVCache(B, 64, HK, D, num_layers=2, dtype=dtype),
        "paged16": PagedKVCache(3 * 4 + 1, 16, B, HK, D, max_seq_len=64, num_layers=2, dtype=dtype),
    }


def _check_step(cache, history, layer, sq, causal=True):
    """Append sq random tokens to every sequence of `layer`, attend, and compare each sequence with
    naive attention over its own history (float64 oracle, input-dtype baseline)."""
    dtype = cache.k.dtype
    q = torch.randn(B, sq, H, D).to(dtype)
    k = torch.randn(B, sq, HK, D).to(dtype)
    v = torch.randn(B, sq, HK, D).to(dtype)
    out, lse = cache.attend(q, k, v, layer=layer, causal=causal, return_softmax_lse=True)
    for b in range(B):
        hk, hv = history[layer][b]
        keys, values = torch.cat([hk, k[b]])[None], torch.cat([hv, v[b]])[None]
        ref, ref_lse = naive.attention(q[b:b + 1], keys, values, causal=causal, compute_dtype=torch.float64)
        base, base_lse = naive.attention(q[b:b + 1], keys, values, causal=causal)
        assert_2x(f"out[{b}]", out[b:b + 1], ref, base)
        assert_2x(f"lse[{b}]", lse[b:b + 1], ref_lse, base_lse)
    return k, v


def _keep(history, layer, k, v, counts):
    for b, n in enumerate(counts):
        hk, hv = history[layer][b]
        history[layer][b] = (torch.cat([hk, k[b, :n]]), torch.cat([hv, v[b, :n]]))


def _empty_history(layers=2):
    return [[(torch.zeros(0, HK, D, dtype=torch.float16),) * 2 for _ in range(B)] for _ in range(layers)]


@pytest.mark.interpret
@pytest.mark.parametrize("kind", ["contiguous", "paged16"])
def test_generate_loop(kind, monkeypatch):
    """Prefill 5 tokens (ragged: sequences keep 5, 2 and 4), then decode; sequence 1 restarts.
    Each step plans once (its first layer) and every layer runs that plan."""
    plans = []
    real = DecodePlan.__init__
    monkeypatch.setattr(DecodePlan, "__init__", lambda self, *a, **kw: plans.append(self) or real(self, *a, **kw))
    cache = _caches()[kind]
    history = _empty_history()
    steps = [(5, [5, 2, 4]), (1, 1), (3, 3), (1, 1), (1, 1)]
    for step, (sq, advance) in enumerate(steps):
        if step == 3:
            cache.reset(1)
            history[0][1] = history[1][1] = _empty_history(1)[0][0]
        for layer in range(2):
            k, v = _check_step(cache, history, layer, sq)
            _keep(history, layer, k, v, advance if isinstance(advance, list) else [advance] * B)
            assert len(plans) == step + 1 and cache._plan is plans[-1]
        cache.advance(advance)
        assert cache._plan is None
    assert cache.lengths == [len(history[0][b][0]) for b in range(B)]
    assert cache.seqlens.tolist() == cache.lengths


@pytest.mark.interpret
def test_paged_pages_follow_the_lengths():
    cache = PagedKVCache(10, 16, B, HK, D, max_seq_len=64)
    history = _empty_history(1)
    k, v = _check_step(cache, history, 0, 17)  # 17 tokens: two pages per sequence
    assert cache.pages_free == 10 - 2 * B
    assert sorted(cache.block_table[:, :2].flatten().tolist()) == list(range(2 * B))
    assert (cache.block_table[:, 2:] == -1).all()
    cache.advance(17)
    cache.reset(0)
    assert cache.pages_free == 10 - 2 * (B - 1) and (cache.block_table[0] == -1).all()
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.attend(*(torch.randn(B, 40, h, D).half() for h in (H, HK, HK)))


def test_plan_follows_the_step():
    """cache.plan: one plan for the layers of a step; a new one when the lengths, the query's shape or
    the options change; the plan's lengths are the cache's (host and device agree)."""
    cache = PagedKVCache(16, 16, B, HK, D, max_seq_len=64)
    q = torch.randn(B, 1, H, D).half()
    plan = cache.plan(q, 1, causal=True)
    assert cache.plan(q, 1, causal=True) is plan
    assert cache.plan(q, 1, causal=False) is not plan  # other options
    plan = cache.plan(q, 1, causal=True)
    assert cache.plan(torch.randn(B, 2, H, D).half(), 2, causal=True) is not plan  # another step shape
    slopes = torch.rand(H)
    plan = cache.plan(q, 1, alibi_slopes=slopes)
    assert cache.plan(q, 1, alibi_slopes=slopes) is plan
    assert cache.plan(q, 1, alibi_slopes=slopes.clone()) is not plan  # tensors by identity
    cache.plan(q, 1, causal=True, window_size=(3, 0))
    with pytest.raises(TypeError, match="causal must be a bool or 0 / 1, got float"):  # keyed by type too
        cache.plan(q, 1, causal=1.0, window_size=(3, 0))
    with pytest.raises(TypeError, match="window_size left must be an int"):
        cache.plan(q, 1, causal=True, window_size=(3.0, 0))
    cache.advance([3, 0, 17])
    plan = cache.plan(q, 1)
    assert plan._args["cache_seqlens"] is cache.seqlens and cache.seqlens.tolist() == [3, 0, 17]
    assert plan.num_splits >= 1 and cache.pages_free == 16 - 1 - 1 - 2  # pages for 4, 1 and 18 tokens


def test_rejected_steps_change_nothing():
    """advance past the capacity, or running out of pages, leaves lengths, tables and caches as they
    were; pages handed out before running out are on the device table too."""
    cache = PagedKVCache(3, 16, B, HK, D, max_seq_len=64)
    cache.advance([10, 0, 0])
    with pytest.raises(ValueError, match="advance past the capacity"):
        cache.advance([1, 70, 0])
    assert cache.lengths == [10, 0, 0] and cache.seqlens.tolist() == [10, 0, 0]
    q, k, v = (torch.randn(B, 20, n, D).half() for n in (H, HK, HK))
    before = cache.k.clone()
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.attend(q, k, v)
    assert torch.equal(cache.k, before) and cache.pages_free == 0
    assert torch.equal(cache.block_table, cache._host_table)
    assert (cache.block_table >= 0).sum() == 3


@pytest.mark.interpret
def test_negative_advance_rolls_back():
    """Speculative decoding: 4 draft tokens appended, 3 rejected by advance(-3) (an int, then per
    sequence); the next step attends over the kept tokens only and overwrites the rejected slots.
    Rolling back below 0 is refused and changes nothing."""
    cache = KVCache(B, 64, HK, D, num_layers=1)
    history = _empty_history(layers=1)
    k, v = _check_step(cache, history, 0, 4)
    _keep(history, 0, k, v, [1] * B)
    cache.advance(4)
    cache.advance(-3)
    assert cache.lengths == [1] * B and cache.seqlens.tolist() == [1] * B
    k, v = _check_step(cache, history, 0, 2)
    _keep(history, 0, k, v, [2, 1, 0])
    cache.advance(2)
    cache.advance([0, -1, -2])
    _check_step(cache, history, 0, 1)
    with pytest.raises(ValueError, match="below 0"):
        cache.advance(-4)
    assert cache.lengths == [3, 2, 1] and cache.seqlens.tolist() == [3, 2, 1]


def test_made_in_inference_mode():
    """A cache made inside inference_mode keeps tensors with a version counter, so the checks know
    its lengths from the host (on a GPU: no device read per step)."""
    with torch.inference_mode():
        cache = PagedKVCache(8, 16, B, HK, D, max_seq_len=64)
        cache.advance(2)
    assert not cache.seqlens.is_inference() and not cache.block_table.is_inference()
    assert cache.seqlens.tolist() == [2, 2, 2]


def test_capacity_errors():
    cache = KVCache(B, 8, HK, D)
    with pytest.raises(ValueError, match="cache overflow"):
        cache.attend(*(torch.randn(B, 9, h, D).half() for h in (H, HK, HK)))
    with pytest.raises(ValueError, match="advance past the capacity"):
        cache.advance(9)
    with pytest.raises(ValueError, match="one count per sequence"):
        KVCache(B, 8, HK, D).advance([1, 2])
    with pytest.raises(ValueError, match="multiple of 16"):
        PagedKVCache(4, 24, B, HK, D)


def _step():
    """q, k, v of one decoding step."""
    return tuple(torch.randn(B, 1, h, D).half() for h in (H, HK, HK))


BAD_CACHES = {
    "page-size-0": (lambda: PagedKVCache(4, 0, B, HK, D), ValueError, "page_size must be >= 16, got 0"),
    "no-pages": (lambda: PagedKVCache(0, 16, B, HK, D), ValueError, "num_pages must be >= 1"),
    "negative-capacity": (lambda: KVCache(B, -1, HK, D), ValueError, "capacity must be >= 0"),
    "negative-batch": (lambda: KVCache(-1, 8, HK, D), ValueError, "batch must be >= 0"),
    "no-heads": (lambda: KVCache(B, 8, 0, D), ValueError, "kv_heads must be >= 1"),
    "float-size": (lambda: KVCache(B, 8.0, HK, D), TypeError, "capacity must be an int"),
    "int-dtype": (lambda: KVCache(B, 8, HK, D, dtype=torch.int32), TypeError, "dtype must be torch.float16"),
    "str-dtype": (lambda: KVCache(B, 8, HK, D, dtype="float32"), TypeError, "got 'float32'"),
    "advance-float": (lambda: KVCache(B, 8, HK, D).advance([1.7, 2, 0]), TypeError, "advance.s count must be an int"),
    "advance-bool": (lambda: KVCache(B, 8, HK, D).advance(True), TypeError, "advance.s count must be an int"),
    "reset-past-batch": (lambda: KVCache(B, 8, HK, D).reset(B), ValueError, r"seq must be an int in \[0, 3\)"),
    "reset-negative": (lambda: PagedKVCache(4, 16, B, HK, D).reset(-1), ValueError, "seq must be an int in"),
    "layer-past-num-layers": (lambda: KVCache(B, 8, HK, D).attend(*_step(), layer=1), ValueError,
                              r"layer must be an int in \[0, 1\)"),
    "attend-without-k": (lambda: KVCache(B, 8, HK, D).attend(_step()[0], None, None), ValueError,
                         "attend appends k and v"),
}


@pytest.mark.parametrize("make,error,message", BAD_CACHES.values(), ids=BAD_CACHES.keys())
def test_bad_cache_arguments_name_themselves(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_advance_takes_integer_scalars_and_arrays():
    cache = KVCache(B, 8, HK, D)
    cache.advance(torch.tensor(2))
    cache.advance(torch.tensor([1, 0, 2]))
    assert cache.lengths == [3, 2, 4] and cache.seqlens.tolist() == [3, 2, 4]


def test_views():
    paged = PagedKVCache(8, 16, B, HK, D, max_seq_len=40, num_layers=3)
    views = paged.views(2)
    assert views["k_cache"].shape == (8, 16, HK, D) and views["block_table"].shape == (B, 3)
    assert views["k_cache"].data_ptr() == paged.k[2].data_ptr()
    assert paged.capacity == 48
    contiguous = KVCache(B, 40, HK, D).views()
    assert contiguous["k_cache"].shape == (B, 40, HK, D) and contiguous["cache_seqlens"].dtype == torch.int32


def test_import_stays_light():
    """`import flashtile` (helpers included) must not import triton; kernels load on first use."""
    code = "import sys, flashtile; flashtile.KVCache; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
