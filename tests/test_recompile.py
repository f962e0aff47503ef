"""No length compiles a kernel: after one call at a head dim, dtype and set of flags, calls at
other lengths (odd, prime, < 16, > 64k), batch sizes and packed batches (max_seqlen) launch only
kernels that Triton's JIT cache already holds.

On the CPU, compile_keys.recording computes the key each launch would be looked up by on an H100
(the dispatch believing it runs on one, so the Hopper kernels and the GPU's tiles are what gets
keyed) without running anything; the interpreter's own launches are keyed too. On the GPU,
test_prefill_cuda.py counts real compilations.
"""

import itertools

import pytest
import torch
from compile_keys import recording

import flashtile

# (batch, seqlen_q, seqlen_k): the first call, then the others
FIRST = (2, 4096, 4096)
OTHERS = [(1, 5123, 5123), (1, 3000, 3000), (3, 17, 17), (1, 1, 1), (2, 127, 300), (5, 7, 7), (1, 97, 13),
          (1, 65537, 65537), (4, 1024, 1024), (1, 300, 1)]


def _dense(d=128, h=4, hk=4, causal=True, layout="bshd", dtype=torch.float16, api="flash", **kw):
    def call(b, sq, sk):
        def make(n, heads):
            if layout == "bhsd":
                return torch.randn(b, heads, n, d, dtype=dtype).transpose(1, 2).requires_grad_()
            if layout == "qkv":
                return torch.randn(b, n, 3, heads, d, dtype=dtype).unbind(2)[0].detach().requires_grad_()
            return torch.randn(b, n, heads, d, dtype=dtype, requires_grad=True)

        q, k, v = make(sq, h), make(sk, hk), make(sk, hk)
        if api == "sdpa":
            out = flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=causal, enable_gqa=h != hk)
        else:
            out = flashtile.flash_attn_func(q, k, v, causal=causal, **kw)
        out.backward(torch.randn_like(out))

    return call


def _varlen(d=128, h=4, causal=True, **kw):
    def call(b, sq, sk):
        lengths_q = [sq] * b + [max(1, sq // 3), 0]
        lengths_k = [sk] * b + [max(1, sk // 2), 5]
        cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32) for n in (lengths_q, lengths_k))
        q = torch.randn(sum(lengths_q), h, d, dtype=torch.float16, requires_grad=True)
        k, v = (torch.randn(sum(lengths_k), h, d, dtype=torch.float16, requires_grad=True) for _ in range(2))
        out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                               **kw)
        out.backward(torch.randn_like(out))

    return call


CASES = {
    "d128-causal": _dense(),
    "d64-full": _dense(d=64, causal=False),
    "d256-causal-gqa": _dense(d=256, hk=2),
    "d40-causal": _dense(d=40, h=3, hk=3),  # strides that are not multiples of 16
    "d111-bhsd-mqa": _dense(d=111, h=3, hk=1, layout="bhsd"),
    "d96-qkvpacked": _dense(d=96, layout="qkv", causal=False),
    "d128-features": _dense(dropout_p=0.1, window_size=(100, 0), softcap=30.0, alibi_slopes=torch.rand(4),
                            learnable_sink=torch.randn(4)),
    "d128-deterministic": _dense(deterministic=True),
    "d64-deterministic-full": _dense(d=64, causal=False, deterministic=True),
    "d64-causal-softcap": _dense(d=64, softcap=20.0),
    "d32-fp32": _dense(d=32, dtype=torch.float32),
    "sdpa-causal": _dense(api="sdpa"),
    "varlen-d128": _varlen(),
    "varlen-d64-window": _varlen(d=64, window_size=(50, 20)),
}


@pytest.mark.interpret
@pytest.mark.parametrize("as_h100", [True, False], ids=["h100", "interpreter"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_lengths_compile_nothing(case, as_h100):
    with recording(as_h100=as_h100) as rec:
        case(*FIRST)
        first = rec.keys
        assert first, "nothing was launched: the test would pass whatever the kernels did"
        for shape in OTHERS:
            n = len(rec.launches)
            case(*shape)
            new = set(rec.launches[n:]) - first
            assert not new, f"{shape} compiles {len(new)} more kernel(s): {sorted(k[0] for k in new)}"


@pytest.mark.interpret
def test_the_recorder_sees_a_new_flag():
    """The keys do tell flags apart: a causal call after a non-causal one is another kernel."""
    with recording(as_h100=True) as rec:
        _dense(causal=False)(*FIRST)
        first = rec.keys
        _dense(causal=True)(*FIRST)
        assert rec.keys - first
