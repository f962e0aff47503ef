"""The public prefill API on CPU: validation, dispatch, packed layouts, SDPA semantics, compile."""

import numpy as np
import pytest
import torch

import flashtile
from flashtile import api
from flashtile.reference import naive


def qkv(b=1, sq=20, sk=20, h=2, hk=2, d=16, dtype=torch.float32, requires_grad=False):
    return tuple(torch.randn(b, s, n, d, dtype=dtype).requires_grad_(requires_grad)
                 for s, n in ((sq, h), (sk, hk), (sk, hk)))


@pytest.mark.parametrize("args,match,exc", [
    (lambda q, k, v: (q[0], k, v), "q must have 4 dimensions", ValueError),
    (lambda q, k, v: (q.half(), k, v), "k must have the dtype of q", TypeError),
    (lambda q, k, v: (q.int(), k.int(), v.int()), "q must have dtype", TypeError),
    (lambda q, k, v: (q.double(), k.double(), v.double()), "float16, bfloat16 or float32", TypeError),
    (lambda q, k, v: (q, k[..., :8], v), "k must have head dim 16", ValueError),
    (lambda q, k, v: (q, k[:, :5], v), "v must have shape", ValueError),
    (lambda q, k, v: (torch.randn(1, 4, 3, 16), k, v), "multiple of the number of key/value heads", ValueError),
    (lambda q, k, v: (torch.randn(1, 4, 2, 300), torch.randn(1, 4, 2, 300), torch.randn(1, 4, 2, 300)),
     "head dim must be in 1..256", ValueError),
    (lambda q, k, v: (q, torch.randn(2, 20, 2, 16), torch.randn(2, 20, 2, 16)), "k must have batch size 1", ValueError),
    (lambda q, k, v: ([1.0], k, v), "q must be a torch.Tensor", TypeError),
], ids=["rank", "dtype-mix", "integer", "float64", "headdim-mismatch", "v-shape", "h%hk", "d>256",
        "batch", "not-a-tensor"])
def test_bad_inputs_name_the_argument(args, match, exc):
    with pytest.raises(exc, match=match):
        flashtile.flash_attn_func(*args(*qkv()))


@pytest.mark.parametrize("kwargs,match", [
    (dict(window_size=(0.5, 0)), "window_size left must be an int"),
    (dict(window_size=5), "window_size must be a pair"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("nan")), "softcap must be a finite number"),
    (dict(softcap=float("inf")), "softcap must be a finite number"),
    (dict(softcap="5"), "softcap must be a real number"),
    (dict(softmax_scale=float("nan")), "softmax_scale"),
    (dict(softmax_scale=1e300), "within float32's range"),
    (dict(softmax_scale=True), "softmax_scale must be a real number"),
    (dict(softmax_scale=torch.ones(2)), "softmax_scale must be a real number"),
    (dict(alibi_slopes=torch.ones(3)), "alibi_slopes must have shape"),
    (dict(dropout_p=1.5), "dropout_p must be in"),
    (dict(dropout_p="0.1"), "dropout_p must be a real number"),
    (dict(causal="False"), "causal must be a bool or 0 / 1, got str 'False'"),
    (dict(causal=2), "causal must be a bool or 0 / 1, got int 2"),
    (dict(causal=0.5), "causal must be a bool or 0 / 1, got float"),
    (dict(deterministic="no"), "deterministic must be a bool or 0 / 1, got str"),
])
def test_bad_options(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        flashtile.flash_attn_func(*qkv(), **kwargs)


def test_flash_attn_forms_of_flags_and_windows():
    """As flash-attn takes them: its flags 0 / 1 (its torch.library schemas accept ints) and a
    window side of any negative value, which its C++ reads as unbounded. Same results, bit for bit,
    as True / False and -1."""
    q, k, v = qkv(sq=24, sk=24)
    with api.use_backend("reference"):
        want = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=False)
        for causal, window, deterministic in ((1, (-1, -1), 0), (np.int64(1), (-5, -1), np.bool_(False)),
                                              (True, torch.tensor([-3, -7]), 0)):
            got = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window, deterministic=deterministic)
            assert torch.equal(got, want)
        local = flashtile.flash_attn_func(q, k, v, causal=0, window_size=[-2, 3])
        assert torch.equal(local, flashtile.flash_attn_func(q, k, v, causal=False, window_size=(-1, 3)))


@pytest.mark.parametrize("case", ["float64", "value-head-dim", "head-dim-300", "key-batch-1", "query-batch-1",
                                  "query-heads-1", "3d-key"])
def test_sdpa_hands_what_the_kernels_do_not_take_to_torch(case):
    """flashtile's scaled_dot_product_attention keeps torch's semantics where its kernels have none:
    float64, a value head dim other than the query's, a head dim past 256, a batch (or query
    heads) of 1 that torch broadcasts and 3-D key / value beside a 4-D query run torch's."""
    q, k, v = (t.transpose(1, 2) for t in qkv(b=2, sq=7, sk=9, h=2, hk=2, d=16))
    if case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "value-head-dim":
        v = torch.randn(2, 2, 9, 8)
    elif case == "head-dim-300":
        q, k, v = torch.randn(1, 2, 5, 300), torch.randn(1, 2, 7, 300), torch.randn(1, 2, 7, 300)
    elif case == "key-batch-1":
        k, v = k[:1], v[:1]
    elif case == "query-batch-1":
        q = q[:1]
    elif case == "query-heads-1":
        q = q[:, :1]
    else:
        k, v = k[0], v[0]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(flashtile.scaled_dot_product_attention(q, k, v, is_causal=True), want)


def test_sdpa_mixed_dtypes_raise_torchs_error():
    q, k, v = (t.transpose(1, 2) for t in qkv(d=16))
    with pytest.raises(RuntimeError, match="query, key, and value"):
        flashtile.scaled_dot_product_attention(q, k.half(), v)


@pytest.mark.parametrize("hk,gqa", [(4, False), (1, False), (1, True), (2, True)],
                         ids=["mha", "mqa-bcast", "mqa", "gqa"])
def test_sdpa_runs_flashtile_on_what_the_kernels_take(monkeypatch, hk, gqa):
    """Equal heads, and key / value heads that divide query's with enable_gqa or are one (torch
    broadcasts a single head: multi-query attention), run the kernels and match torch."""
    q, k, v = (t.transpose(1, 2) for t in qkv(b=2, sq=5, sk=7, h=4, hk=hk, d=16))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **kw: pytest.fail("torch's"))
    torch.testing.assert_close(flashtile.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa), want,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,value", [("is_causal", "False"), ("is_causal", 1), ("enable_gqa", "no")])
def test_sdpa_flags_are_bools(name, value):
    q, k, v = (t.transpose(1, 2) for t in qkv(d=16))
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        flashtile.scaled_dot_product_attention(q, k, v, **{name: value})


@pytest.mark.interpret
def test_bfloat16_under_the_interpreter_raises():
    """Triton 3.6's interpreter computes bfloat16 wrongly (outputs ~1e9 here): CPU bf16 on the
    interpreter is an error naming the way out, never a wrong answer; the reference path takes it."""
    q, k, v = (t.bfloat16() for t in qkv())
    with pytest.raises(TypeError, match="bfloat16 inputs on the CPU under the Triton interpreter"):
        flashtile.flash_attn_func(q, k, v)
    with flashtile.use_backend("reference"):
        out = flashtile.flash_attn_func(q, k, v)
    torch.testing.assert_close(out.double(), naive.attention(q.double(), k.double(), v.double())[0], atol=2e-2,
                               rtol=2e-2)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.interpret), "reference"])
def test_dropout_is_applied_not_ignored(backend):
    """dropout_p > 0 drops probabilities (a different output from p = 0), never silently nothing."""
    q, k, v = qkv()
    with api.use_backend(backend):
        assert not torch.equal(flashtile.flash_attn_func(q, k, v, dropout_p=0.5), flashtile.flash_attn_func(q, k, v))


def test_dispatch_rule(monkeypatch):
    t = torch.zeros(1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert api.backend_for(t) == "triton"
    with api.use_backend("reference"):
        assert api.backend_for(t) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert api.backend_for(t) == "reference"
    with api.use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        api.backend_for(t)
    with pytest.raises(ValueError, match="backend must be one of"):
        with api.use_backend("cuda"):
            pass


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.interpret), "reference"])
def test_flash_attn_func_forward_backward(backend):
    q, k, v = qkv(2, 23, 31, 4, 2, 24, requires_grad=True)
    slopes = torch.rand(2, 4)
    kw = dict(causal=True, softcap=2.0, alibi_slopes=slopes)
    with api.use_backend(backend):
        out, lse, probs = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert probs is None
    ref_out, ref_lse = naive.attention(q, k, v, **kw, compute_dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = naive.attention_backward(dout, q, k, v, **kw, compute_dtype=torch.float64)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("call", ["func", "varlen", "sink"])
@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.interpret), "reference"])
def test_second_order_gradients_raise(backend, call):
    """Gradients taken with create_graph=True are right, and differentiating them again raises one
    clear error on every path (the reference path returned wrong second-order gradients; the
    kernel path raised torch's 'does not require grad')."""
    q, k, v = qkv(1, 13, 17, 2, 1, 16, requires_grad=True)
    sink = torch.randn(2, requires_grad=True) if call == "sink" else None
    with api.use_backend(backend):
        if call == "varlen":
            cu = torch.tensor([0, 13], dtype=torch.int32), torch.tensor([0, 17], dtype=torch.int32)
            out = flashtile.flash_attn_varlen_func(q[0], k[0], v[0], *cu, 13, 17, causal=True)[None]
        else:
            out = flashtile.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
        leaves = (q, k, v) if sink is None else (q, k, v, sink)
        grads = torch.autograd.grad(out.square().sum(), leaves, create_graph=True)
    ref = torch.autograd.grad(flashtile.reference.naive.attention(q, k, v, causal=True, learnable_sink=sink)[0]
                              .square().sum(), leaves)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
    assert all(g.requires_grad for g in grads)
    with pytest.raises(RuntimeError, match="second-order gradients through attention are not supported"):
        torch.autograd.grad(grads[0].square().sum(), leaves)


@pytest.mark.interpret
def test_packed_variants_equal_unpacked():
    qkv_ = torch.randn(2, 19, 3, 2, 32, dtype=torch.float16)
    out = flashtile.flash_attn_qkvpacked_func(qkv_, causal=True)
    ref = flashtile.flash_attn_func(qkv_[:, :, 0], qkv_[:, :, 1], qkv_[:, :, 2], causal=True)
    assert torch.equal(out, ref)
    q = torch.randn(2, 7, 4, 32, dtype=torch.float16)
    kv = torch.randn(2, 19, 2, 2, 32, dtype=torch.float16)
    out = flashtile.flash_attn_kvpacked_func(q, kv, window_size=(3, 2))
    assert torch.equal(out, flashtile.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], window_size=(3, 2)))
    with pytest.raises(ValueError, match="qkv must have shape"):
        flashtile.flash_attn_qkvpacked_func(torch.randn(2, 19, 2, 2, 32))


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.interpret), "reference"])
@pytest.mark.parametrize("sq,sk", [(9, 25), (24, 25), (25, 9), (16, 16)], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_semantics_match_torch(sq, sk, is_causal, backend):
    """torch's layout (B, H, L, E) and top-left causal; enable_gqa with fewer key/value heads."""
    q = torch.randn(2, 4, sq, 16)
    k, v = torch.randn(2, 2, sk, 16), torch.randn(2, 2, sk, 16)
    with api.use_backend(backend):
        ours = flashtile.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                           is_causal=is_causal, enable_gqa=True)
    torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="enable_gqa"):
        flashtile.scaled_dot_product_attention(q, k, v)


def test_sdpa_attn_mask_falls_back_to_torch():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    mask = torch.rand(8, 8) > 0.3
    mask[:, 0] = True
    ours = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(ours, ref)


@pytest.mark.interpret
def test_torch_compile_fullgraph_with_gradients():
    q, k, v = qkv(1, 20, 20, 2, 1, 16, requires_grad=True)

    def loss_fn(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True).square().sum()

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_loss = loss_fn(q, k, v)
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    torch.testing.assert_close(loss, ref_loss)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_custom_ops_pass_opcheck():
    """torch.library.opcheck: schema, fake impl and autograd registration agree (reference backend)."""
    from flashtile import autograd

    q, k, v = qkv(1, 12, 15, 2, 1, 8, requires_grad=True)
    none_varlen = (None, None, 0, 0, None, None)
    torch.library.opcheck(autograd.attention_fwd, (q, k, v, 0.3, None, 0, 0.0, None, 0.0, None, *none_varlen,
                                                   "reference", None, False))
    rng = torch.tensor([123, 456])  # dropout: the same seed tensor gives the same mask every call
    torch.library.opcheck(autograd.attention_fwd, (q, k, v, 0.3, None, 0, 0.0, None, 0.2, rng, *none_varlen,
                                                   "reference", None, False))
    sink = torch.randn(2, requires_grad=True)
    torch.library.opcheck(autograd.attention_fwd, (q, k, v, 0.3, None, 0, 0.0, None, 0.0, None, *none_varlen,
                                                   "reference", sink, True))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    qp, kp, vp = (t.detach()[0, :12].clone().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(autograd.attention_fwd, (qp, kp, vp, 0.3, None, 0, 0.0, None, 0.0, None, cu, cu, 7, 7,
                                                   None, None, "reference", None, False))


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.interpret)])
def test_eager_function_matches_custom_op(backend):
    """Eager calls take autograd._Attention, torch.compile the custom op: same outputs and
    gradients, bitwise (the same functions run underneath; dropout with one seed tensor; a
    deterministic backward)."""
    from flashtile import autograd

    q, k, v = qkv(1, 20, 23, 2, 1, 16, dtype=torch.float16 if backend == "triton" else torch.float32,
                  requires_grad=True)
    dout = torch.randn(1, 20, 2, 16, dtype=q.dtype)
    args = (q, k, v, 0.25, None, 0, 0.0, None)
    rng = torch.tensor([5, 6])
    results = []
    sink = torch.randn(2, requires_grad=True)
    for out, lse in (autograd._Attention.apply(*args, (0.3, rng, autograd._NO_EXTRA[2]), backend, sink, True),
                     autograd.attention_fwd(*args, 0.3, rng, None, None, 0, 0, None, None, backend, sink, True)):
        results.append((out, lse, *torch.autograd.grad(out, (q, k, v, sink), dout)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_messages_name_the_callers_argument():
    """scaled_dot_product_attention's scale is `scale` in its errors (it said softmax_scale), and a
    dtype list names each dtype once (a float64 rotary table was told 'float32, float32')."""
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"^scale must be a finite non-zero number"):
        flashtile.scaled_dot_product_attention(q, q, q, scale=0)
    cos = torch.randn(32, 8, dtype=torch.float64)
    new = torch.randn(1, 1, 2, 16)
    with pytest.raises(TypeError, match=r"rotary_cos must have dtype in \(float32\), got torch.float64"):
        flashtile.flash_attn_with_kvcache(new, torch.randn(1, 32, 2, 16), torch.randn(1, 32, 2, 16), new, new,
                                          rotary_cos=cos, rotary_sin=cos, cache_seqlens=3)


def test_backward_allocates_no_gradient_for_lse():
    """lse is an output without a gradient: the autograd engine must not allocate and zero a tensor
    for it on every backward (on the GPU an allocation and a memset launch of host time a call)."""
    q, k, v = (torch.randn(1, 64, 2, 32, requires_grad=True) for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    dout = torch.ones_like(out)
    with torch.profiler.profile() as prof:
        out.backward(dout)
    assert not [e.name for e in prof.events() if e.name in ("aten::zeros", "aten::zeros_like")]
    assert q.grad is not None and k.grad is not None and v.grad is not None
