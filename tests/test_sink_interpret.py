"""The attention sink (learnable_sink, gpt-oss) in every kernel under the interpreter, and its API.

Oracle: naive attention in float64 with the sink column appended to the softmax and dropped
(reference.naive), d(sink) from autograd through it; 2x rule. The kernels fold the sink into each
row once (the forward's epilogue, the decode merge), and its gradient is a reduction of delta
(autograd.sink_grad).
"""

import pytest
import torch
from decode_check import check_kvcache
from prefill_check import check_prefill, check_sink_grad, sink_logits
from varlen_check import check_varlen

import flashtile
from flashtile import api
from flashtile.autograd import sink_grad
from flashtile.ops import configs
from flashtile.reference import naive

interpret = pytest.mark.interpret


@interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", [
    dict(sq=67, sk=67, causal=True),
    dict(sq=80, sk=35, causal=True),  # the first 45 rows see no key: out 0, lse = the sink
    dict(sq=40, sk=97, window=(16, 0)),  # gpt-oss's sliding-window layers (128 there)
    dict(sq=50, sk=70, softcap=20.0, h=4, hk=1),
    dict(sq=33, sk=48, dropout_p=0.17),
], ids=["causal", "empty-rows", "window", "softcap-mqa", "dropout"])
def test_prefill(case, dtype):
    case = dict(case)
    h, hk = case.pop("h", 4), case.pop("hk", 2)
    check_prefill(2, case.pop("sq"), case.pop("sk"), h, hk, 32, dtype, "cpu", sink=True, **case)


@interpret
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_with_empty_sequences(causal):
    check_varlen([17, 0, 40, 5], [30, 12, 0, 21], 4, 2, 32, torch.float16, "cpu", causal=causal, sink=True)


@interpret
def test_varlen_paged():
    check_varlen([9, 30], [40, 70], 4, 2, 32, torch.float16, "cpu", causal=True, page_size=16, sink=True)


@interpret
@pytest.mark.parametrize("num_splits,combine", [(1, "fused"), (3, "fused"), (12, "fused"), (12, "kernel")],
                         ids=["one", "fused-merge", "fused-many-splits", "combine-kernel"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode(num_splits, combine, paged, monkeypatch):
    """The sink joins once: with one split in the epilogue, else as the merge's starting state
    (the fused merge's or the combine kernel's), not once per split."""
    monkeypatch.setattr(configs, "DECODE_FUSED_MAX_SPLITS", 1 << 30 if combine == "fused" else 0)
    check_kvcache(3, 1, 8, 2, 64, 96, 1, torch.float16, "cpu", page_size=16 if paged else None,
                  lengths=[0, 40, 90], num_splits=num_splits, causal=True, sink=True)


@interpret
@pytest.mark.parametrize("plan", ["list", "tensor"])
def test_decode_plan_and_speculative_rows(plan):
    """A DecodePlan run with a sink, several query rows (causal: some see fewer keys), window."""
    check_kvcache(2, 4, 8, 2, 32, 80, 4, torch.float32, "cpu", lengths=[5, 60], num_splits=2, causal=True,
                  window=(20, 0), plan=plan, sink=True)


@interpret
def test_plan_runs_with_and_without_sink():
    """One plan serves layers with and without a sink (the sink's variant is planned at its first
    run); a sink of -inf takes no share, so it equals no sink."""
    b, h, hk, d, cap = 2, 4, 2, 16, 64
    kc, vc = torch.randn(b, cap, hk, d), torch.randn(b, cap, hk, d)
    q = torch.randn(b, 1, h, d)
    plan = flashtile.DecodePlan(b, h, kc.shape, [20, 50], dtype=torch.float32, device="cpu", num_splits=3)
    plain, lse = plan.run(q, kc, vc, return_softmax_lse=True)
    t = sink_logits(h, 50, "cpu")
    out, lse_t = plan.run(q, kc, vc, return_softmax_lse=True, learnable_sink=t)
    assert not torch.allclose(out, plain)
    torch.testing.assert_close(lse_t, torch.logaddexp(lse, t[:, None]))
    torch.testing.assert_close(out, plain * torch.exp(lse - lse_t).transpose(1, 2)[..., None])
    none, _ = plan.run(q, kc, vc, return_softmax_lse=True, learnable_sink=torch.full((h,), float("-inf")))
    torch.testing.assert_close(none, plain)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=interpret)])
@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flash_attn_func_fills_the_sink_grad(backend, sink_dtype):
    """Through the public API and autograd: outputs, LSE and every gradient, the sink's included
    (in the sink's dtype), against autograd of the float64 oracle."""
    dtype = torch.float16 if backend == "triton" else torch.float32
    q = torch.randn(2, 37, 4, 32).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 29, 2, 32).to(dtype).requires_grad_() for _ in range(2))
    t = sink_logits(4, 29, "cpu").to(sink_dtype).requires_grad_()
    with api.use_backend(backend):
        out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=t)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert t.grad is not None and t.grad.dtype == sink_dtype
    ref = [x.detach().double().requires_grad_() for x in (q, k, v, t)]
    ref_out, ref_lse = naive.attention(*ref[:3], causal=True, learnable_sink=ref[3])
    ref_out.backward(dout.double())
    plain = dict(causal=True, learnable_sink=t.detach().float())
    base = naive.attention_backward(dout, q.detach(), k.detach(), v.detach(), **plain)
    base_out, base_lse = naive.attention(q.detach(), k.detach(), v.detach(), **plain)
    flashtile.testing.assert_2x("out", out.detach(), ref_out.detach(), base_out)
    flashtile.testing.assert_2x("lse", lse, ref_lse.detach(), base_lse)
    for name, got, r, bb in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref[:3], base):
        flashtile.testing.assert_2x(name, got, r.grad, bb)
    # d(sink) from this call's out and LSE: its terms by the 2x rule, its sum to the sink's dtype
    delta = (dout.float() * out.detach().float()).sum(-1).transpose(1, 2)
    check_sink_grad(t.detach().float(), lse, delta, dout, (ref_out.detach(), ref_lse.detach()), (base_out, base_lse))
    want = sink_grad(t.detach().float(), lse, delta)
    torch.testing.assert_close(t.grad.float(), want, rtol=2 ** -7 if sink_dtype == torch.bfloat16 else 1e-4,
                               atol=1e-4)


def test_written_out_backward_equals_autograd():
    """naive.attention_backward's written-out d(sink) (and dq, dk, dv) equal autograd's, float64."""
    q, k, v = (torch.randn(2, n, 4, 16, dtype=torch.float64, requires_grad=True) for n in (30, 20, 20))
    t = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out, _ = naive.attention(q, k, v, causal=True, window_size=(5, 0), learnable_sink=t)
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = naive.attention_backward(dout, q, k, v, causal=True, window_size=(5, 0), learnable_sink=t.detach())
    for got, x in zip(grads, (q, k, v, t)):
        torch.testing.assert_close(got, x.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=interpret)])
def test_varlen_api_and_compile(backend):
    """flash_attn_varlen_func with a sink equals flash_attn_func per sequence; torch.compile's
    custom op path gives the eager path's outputs and gradients."""
    lens = [7, 0, 12]
    cu = torch.tensor([0, 7, 7, 19], dtype=torch.int32)
    q, k, v = (torch.randn(19, 4, 16, requires_grad=True) for _ in range(3))
    t = torch.randn(4, requires_grad=True)

    def loss(q, k, v, t):
        return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True, learnable_sink=t).square().sum()

    with api.use_backend(backend):
        eager = loss(q, k, v, t)
        grads = torch.autograd.grad(eager, (q, k, v, t))
        compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v, t)
        cgrads = torch.autograd.grad(compiled, (q, k, v, t))
        start = 0
        for n in lens:
            if n:
                one = flashtile.flash_attn_func(q[None, start:start + n], k[None, start:start + n],
                                                v[None, start:start + n], causal=True, learnable_sink=t)
                piece = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True,
                                                         learnable_sink=t)[start:start + n]
                torch.testing.assert_close(piece, one[0])
            start += n
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(cgrads, grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=interpret)])
def test_merge_adds_the_sink_once(backend):
    """merge_attention_states(..., learnable_sink) = attention over all pieces with the sink, and
    a row whose pieces are all empty gets out 0 and lse = the sink."""
    q, k, v = torch.randn(1, 3, 4, 16), torch.randn(1, 40, 4, 16), torch.randn(1, 40, 4, 16)
    t = torch.randn(4)
    pieces = [naive.attention(q, k[:, a:b], v[:, a:b]) for a, b in ((0, 10), (10, 25), (25, 40))]
    out_p = torch.stack([p[0] for p in pieces])  # (S, b, sq, h, d)
    lse_p = torch.stack([p[1].transpose(1, 2) for p in pieces])  # (S, b, sq, h)
    lse_p[:, 0, 1, 2] = float("-inf")  # every piece of this row is empty
    out_p[:, 0, 1, 2] = float("nan")
    with api.use_backend(backend):
        out, lse = flashtile.merge_attention_states(out_p, lse_p, learnable_sink=t)
    want, want_lse = naive.attention(q, k, v, learnable_sink=t)
    mask = torch.ones_like(lse, dtype=torch.bool)
    mask[0, 1, 2] = False
    torch.testing.assert_close(out[mask], want[mask])
    torch.testing.assert_close(lse[mask], want_lse.transpose(1, 2)[mask])
    assert torch.equal(out[0, 1, 2], torch.zeros(16)) and lse[0, 1, 2] == t[2]


@pytest.mark.parametrize("paged", [False, True], ids=["KVCache", "PagedKVCache"])
def test_cache_attend_takes_a_sink(paged):
    """Two steps through a cache helper, a sink per layer: each equals the oracle over the tokens so far."""
    if paged:
        cache = flashtile.PagedKVCache(8, 16, 2, 2, 16, num_layers=2, dtype=torch.float32, device="cpu")
    else:
        cache = flashtile.KVCache(2, 32, 2, 16, num_layers=2, dtype=torch.float32, device="cpu")
    keys, values = torch.empty(2, 0, 2, 16), torch.empty(2, 0, 2, 16)
    sinks = torch.randn(2, 4)
    for n in (3, 1):
        q, k, v = torch.randn(2, n, 4, 16), torch.randn(2, n, 2, 16), torch.randn(2, n, 2, 16)
        keys, values = torch.cat([keys, k], 1), torch.cat([values, v], 1)
        for layer in (0, 1):
            out = cache.attend(q, k, v, layer=layer, causal=True, learnable_sink=sinks[layer])
            want, _ = naive.attention(q, keys, values, causal=True, learnable_sink=sinks[layer])
            torch.testing.assert_close(out, want)
        cache.advance(n)


@pytest.mark.parametrize("sink,match,exc", [
    (lambda h: [0.0] * h, "learnable_sink must be a torch.Tensor", TypeError),
    (lambda h: torch.zeros(h, dtype=torch.float64), "learnable_sink must be float32, bfloat16 or float16", TypeError),
    (lambda h: torch.zeros(h + 1), r"learnable_sink must have shape \(4,\)", ValueError),
    (lambda h: torch.zeros(1, h), r"learnable_sink must have shape \(4,\)", ValueError),
    (lambda h: torch.zeros(h, device="meta"), "learnable_sink must be on cpu", ValueError),
], ids=["list", "float64", "length", "rank", "device"])
def test_bad_sinks_name_the_argument(sink, match, exc):
    q, k, v = torch.randn(1, 5, 4, 16), torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 16)
    with pytest.raises(exc, match=match):
        flashtile.flash_attn_func(q, k, v, learnable_sink=sink(4))
    with pytest.raises(exc, match=match):
        flashtile.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=3, learnable_sink=sink(4))


@pytest.mark.parametrize("sink", [torch.zeros(3, 1), torch.zeros(5, 4, 1), torch.zeros(4, dtype=torch.int32)],
                         ids=["mismatch", "grows-the-rows", "integer"])
def test_merge_refuses_sinks_that_do_not_fit_the_rows(sink):
    with pytest.raises((ValueError, TypeError), match="learnable_sink must"):
        flashtile.merge_attention_states(torch.randn(2, 1, 5, 4, 16), torch.randn(2, 1, 5, 4), learnable_sink=sink)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=interpret)])
@pytest.mark.parametrize("needs_grad", ["q", "k", "sink"])
def test_decoding_refuses_to_drop_gradients(backend, needs_grad):
    """The decoding functions have no backward: an input that requires grad (with grad enabled) is
    an error on both backends, never an output cut from the graph; under no_grad it runs."""
    q, k, v = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    t = torch.randn(4)
    {"q": q, "k": k, "sink": t}[needs_grad].requires_grad_()
    kc, vc = torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    with api.use_backend(backend):
        with pytest.raises(RuntimeError, match="no backward"):
            flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, learnable_sink=t)
        with torch.no_grad():
            flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, learnable_sink=t)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=interpret)])
@pytest.mark.parametrize("grad_mode", ["enabled", "no_grad"])
@pytest.mark.parametrize("cache", ["k_cache", "v_cache"])
def test_append_into_a_cache_that_requires_grad_raises(backend, cache, grad_mode):
    """An append into a k_cache or v_cache that requires grad is an error naming it, in either grad
    mode, and writes nothing (the kernel path wrote into the leaf; the reference path raised
    torch's in-place message after writing the other cache). Reading such a cache with gradients
    enabled is the no-backward error."""
    q, k, v = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    caches = {"k_cache": torch.randn(2, 8, 2, 16), "v_cache": torch.randn(2, 8, 2, 16)}
    caches[cache].requires_grad_()
    before = [c.detach().clone() for c in caches.values()]
    with api.use_backend(backend), torch.set_grad_enabled(grad_mode == "enabled"):
        with pytest.raises(RuntimeError, match=f"{cache} requires grad: appending"):
            flashtile.flash_attn_with_kvcache(q, *caches.values(), k, v, cache_seqlens=3)
        with pytest.raises(RuntimeError, match=f"{cache} requires grad: appending"):
            flashtile.DecodePlan(2, 4, (2, 8, 2, 16), [3, 3], dtype=torch.float32, device="cpu",
                                 seqlen_new=1).run(q, *caches.values(), k, v)
        if grad_mode == "enabled":
            with pytest.raises(RuntimeError, match="no backward"):
                flashtile.flash_attn_with_kvcache(q, *caches.values(), cache_seqlens=3)
    assert all(torch.equal(c.detach(), b) for c, b in zip(caches.values(), before))


@pytest.mark.parametrize("backend,device", [("reference", "cpu"), pytest.param("triton", "cpu", marks=interpret),
                                            pytest.param("triton", "cuda", marks=pytest.mark.cuda)],
                         ids=["reference", "triton", "cuda"])
def test_infinite_sink_takes_every_row(backend, device):
    """learnable_sink = +inf: every row's weight goes to the sink, so the output is 0, the LSE +inf
    and no gradient reaches q, k, v or the sink (whose P is 1 and delta 0), on every path: prefill
    forward and backward, a packed batch, decoding (split and not) and the merge. (The reference
    path returned 0 / +inf, the kernels NaN; decoding's reference returned the keys' output.)
    A finite head beside it is unchanged."""
    inf = float("inf")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(2, 9, 2, 16, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    sink = torch.tensor([inf, 0.3], device=device, requires_grad=True)
    with api.use_backend(backend):
        out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v, sink), dout)
        cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
        packed = flashtile.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, learnable_sink=sink)
        k_cache, v_cache = (torch.randn(3, 40, 2, 16, device=device, dtype=dtype) for _ in range(2))
        decoded = [flashtile.flash_attn_with_kvcache(q.detach()[:1, :1].expand(3, 1, 2, 16), k_cache, v_cache,
                                                     cache_seqlens=torch.tensor([40, 3, 0], dtype=torch.int32,
                                                                                device=device),
                                                     learnable_sink=sink.detach(), num_splits=n, return_softmax_lse=True)
                   for n in (1, 3)]
        pieces = torch.randn(2, 2, 3, 16, device=device), torch.randn(2, 2, 3, device=device)
        merged = flashtile.merge_attention_states(*pieces, learnable_sink=sink.detach()[:, None])
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0])) and bool((lse[:, 0] == inf).all())
    ref_out, ref_lse = naive.attention(q.double(), k.double(), v.double(), causal=True, learnable_sink=sink.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:, :, 1].double(), ref_out[:, :, 1], atol=tol, rtol=tol)
    dq, dk, dv, dsink = grads
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert float(dsink[0]) == 0.0 and bool((dq[:, :, 0] == 0).all())
    ref = naive.attention_backward(dout.double(), q.double(), k.double(), v.double(), causal=True,
                                   learnable_sink=sink.double())
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.double(), r, atol=1e-4 if dtype == torch.float32 else 5e-2,
                                   rtol=1e-4 if dtype == torch.float32 else 5e-2)
    assert bool((packed[:, 0] == 0).all())
    for o, l in decoded:
        assert bool((o[:, :, 0] == 0).all()) and bool((l[:, 0] == inf).all()) and bool(torch.isfinite(o).all())
    assert bool((merged[0][0] == 0).all()) and bool((merged[1][0] == inf).all())
    assert bool(torch.isfinite(merged[0]).all())


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=interpret)])
def test_merge_of_pieces_whose_lse_is_infinite(backend):
    """A piece with lse = +inf takes all the weight (out its out, lse +inf); several share it
    equally (out their mean); -inf pieces still drop out. (Both paths gave NaN.)"""
    inf = float("inf")
    out = torch.randn(3, 3, 8)
    lse = torch.tensor([[0.5, inf, -inf], [inf, 1.0, 2.0], [0.1, inf, -inf]])
    with api.use_backend(backend):
        merged, merged_lse = flashtile.merge_attention_states(out, lse)
        with_sink = flashtile.merge_attention_states(out, lse, learnable_sink=torch.tensor([0.0, inf, 1.0]))
    torch.testing.assert_close(merged[0], out[1, 0])
    torch.testing.assert_close(merged[1], (out[0, 1] + out[2, 1]) / 2)
    want = naive_merge(out[:, 2:], lse[:, 2:])
    torch.testing.assert_close(merged[2:], want[0], atol=1e-5, rtol=1e-5)
    assert merged_lse[:2].tolist() == [inf, inf]
    torch.testing.assert_close(with_sink[0][1], (out[0, 1] + out[2, 1]) / 3)  # the sink's share holds 0
    assert with_sink[1].tolist()[:2] == [inf, inf]


def naive_merge(out, lse):
    w = torch.softmax(lse.double(), 0)
    return (w[..., None] * out.double()).sum(0).float(), torch.logsumexp(lse.double(), 0).float()
