"""One check of flash_attn_with_kvcache against the float64 oracle, shared by interpret and cuda tests.

The call runs on one copy of a random cache with every torch.empty poisoned (outputs and split
partials alike), the oracle (reference.kvcache in float64) on a second copy and the baseline (the
same code in the input dtype) on a third. Then: out and lse by the 2x rule; the kernel's cache
equals the oracle's; and it differs from the original cache exactly at the appended slots.
"""

from __future__ import annotations

import contextlib

import torch

from flashtile import api
from flashtile.reference.kvcache import attention_with_kvcache
from flashtile.testing import assert_2x

# relative size of one rounding step of the cache dtype (the rotary products of the kernel (fp32)
# and the oracle (fp64) may round to neighbouring values)
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -22}


@contextlib.contextmanager
def poisoned_empty():
    """Every floating torch.empty inside returns NaNs, so an element nobody writes fails the check."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def make_cache(b_cache, capacity, hk, d, dtype, device, page_size=None, b=None):
    """(k_cache, v_cache, block_table). Contiguous: (b_cache, capacity, hk, d), block_table None.
    Paged: pages (n, page_size, hk, d) with 3 spare pages, handed to the b sequences of
    block_table (b, capacity / page_size) in a random order."""
    if page_size is None:
        shape, table = (b_cache, capacity, hk, d), None
    else:
        per_seq = -(-capacity // page_size)
        num_pages = b * per_seq + 3
        shape = (num_pages, page_size, hk, d)
        table = torch.randperm(num_pages, device=device)[: b * per_seq].view(b, per_seq).int()
    k_cache = torch.randn(shape, device=device).to(dtype)
    v_cache = torch.randn(shape, device=device).to(dtype)
    return k_cache, v_cache, table


def _written(shape, lengths, s_new, block_table, batch_idx, device):
    """Boolean (cache.shape[0], cache.shape[1]): the cache rows the append must write."""
    mask = torch.zeros(shape[:2], dtype=torch.bool, device=device)
    for row, n in enumerate(lengths):
        pos = torch.arange(n, n + s_new, device=device)
        if block_table is not None:
            mask[block_table[row].long()[pos // shape[1]], pos % shape[1]] = True
        else:
            mask[row if batch_idx is None else int(batch_idx[row]), pos] = True
    return mask


def check_kvcache(b, sq, h, hk, d, capacity, s_new, dtype, device, *, page_size=None, lengths=None,
                  num_splits=0, rotary=None, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
                  leftpad=False, batch_idx=False, int_seqlens=False, q_strided=False, plan=None, sink=False,
                  cache_strided=False):
    """Run one case; returns the kernel's (out, lse) for comparisons across num_splits.

    lengths: tokens already cached per sequence (random in [0, capacity - s_new] when None).
    rotary: (rotary_dim, interleaved). alibi: None, "h" or "bh". leftpad / batch_idx: random ones.
    int_seqlens: pass cache_seqlens as a Python int (all lengths equal). q_strided: q is a view
    of (b, h, sq, d) storage. plan: run a DecodePlan instead of flash_attn_with_kvcache, made
    from the lengths as a host list ("list") or from the index tensor ("tensor"); the call is
    then also made through flash_attn_with_kvcache on a fourth copy of the cache, and both must
    agree bit for bit (one code path: the same kernels with the same arguments). sink: with an
    attention sink (h,) (prefill_check.sink_logits), passed to run() with a plan. cache_strided:
    k_cache and v_cache with their head dim not contiguous (a (..., d, hk) storage transposed).
    """
    torch.manual_seed(0)  # the same inputs for the same case, whatever num_splits
    gen = torch.Generator().manual_seed(0)
    if lengths is None:
        lengths = torch.randint(0, capacity - s_new + 1, (b,), generator=gen).tolist()
    if int_seqlens:
        lengths = [lengths[0]] * b
    b_cache = b + 2 if batch_idx else b
    k_cache, v_cache, table = make_cache(b_cache, capacity, hk, d, dtype, device, page_size, b)
    if cache_strided:
        k_cache, v_cache = (c.transpose(-1, -2).contiguous().transpose(-1, -2) for c in (k_cache, v_cache))
    if q_strided:
        q = torch.randn(b, h, sq, d, device=device).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(b, sq, h, d, device=device).to(dtype)
    k = v = None
    if s_new:
        k = torch.randn(b, s_new, hk, d, device=device).to(dtype)
        v = torch.randn(b, s_new, hk, d, device=device).to(dtype)
    kw = dict(cache_seqlens=lengths[0] if int_seqlens else torch.tensor(lengths, dtype=torch.int32, device=device),
              block_table=table, causal=causal, window_size=window, softcap=softcap)
    if rotary is not None:
        rotary_dim, kw["rotary_interleaved"] = rotary
        angle = 6.3 * torch.rand(capacity + sq, rotary_dim // 2, device=device)
        kw["rotary_cos"], kw["rotary_sin"] = angle.cos().to(dtype), angle.sin().to(dtype)
    if alibi is not None:
        kw["alibi_slopes"] = torch.rand(h if alibi == "h" else (b, h), device=device)
    if leftpad:
        kw["cache_leftpad"] = torch.tensor([int(torch.randint(0, n + 1, (1,), generator=gen)) for n in lengths],
                                           dtype=torch.int32, device=device)
    if batch_idx:
        kw["cache_batch_idx"] = torch.randperm(b_cache, generator=gen)[:b].int().to(device)
    if sink:
        from prefill_check import sink_logits

        kw["learnable_sink"] = sink_logits(h, max(lengths) + s_new, device)

    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(4 if plan else 3)]
    with poisoned_empty():
        if plan is None:
            out, lse = api.flash_attn_with_kvcache(q, *caches[0], k, v, **kw, num_splits=num_splits,
                                                   return_softmax_lse=True)
        else:
            options = {name: x for name, x in kw.items() if name not in ("cache_seqlens", "learnable_sink")}
            seqlens = lengths if plan == "list" and not int_seqlens else kw["cache_seqlens"]
            decode_plan = api.DecodePlan(b, h, k_cache.shape, seqlens, dtype=dtype, device=device, seqlen_q=sq,
                                         seqlen_new=s_new, num_splits=num_splits, **options)
            out, lse = decode_plan.run(q, *caches[0], k, v, return_softmax_lse=True,
                                       learnable_sink=kw.get("learnable_sink"))
            want, want_lse = api.flash_attn_with_kvcache(q, *caches[3], k, v, **kw, num_splits=num_splits,
                                                         return_softmax_lse=True)
            assert torch.equal(out, want) and torch.equal(lse, want_lse), "DecodePlan.run != flash_attn_with_kvcache"
            assert torch.equal(caches[0][0], caches[3][0]) and torch.equal(caches[0][1], caches[3][1])
    ref_out, ref_lse = attention_with_kvcache(q, *caches[1], k, v, **kw, compute_dtype=torch.float64)
    base_out, base_lse = attention_with_kvcache(q, *caches[2], k, v, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_2x("out", out, ref_out, base_out)
    assert_2x("lse", lse, ref_lse, base_lse)

    written = _written(k_cache.shape, lengths, s_new, table, kw.get("cache_batch_idx"), device)
    for name, got, want, orig in (("k_cache", caches[0][0], caches[1][0], k_cache),
                                  ("v_cache", caches[0][1], caches[1][1], v_cache)):
        changed = (got != orig).flatten(2).any(-1)
        assert torch.equal(changed, written), f"{name}: written rows differ from the append slots"
        if rotary is not None and name == "k_cache":
            torch.testing.assert_close(got, want, rtol=ULP[dtype], atol=ULP[dtype])
        else:
            assert torch.equal(got, want), f"{name}: appended values differ from the oracle's"
    return out, lse
