"""Packed (varlen) and paged batches through the prefill kernels under the Triton interpreter."""

import pytest
import torch
from varlen_check import check_varlen, offsets, oracle, paged_copy

import flashtile
from flashtile import api
from flashtile.ops import configs

pytestmark = pytest.mark.interpret

# (lens_q, lens_k): empty sequences on either side, one-token ones, sq_i > sk_i and sq_i < sk_i
LENGTHS = {
    "mixed-0-1-17-129": ([17, 0, 1, 129, 40], [17, 5, 1, 129, 0]),
    "sq>sk-and-sq<sk": ([33, 7, 60], [20, 45, 60]),
    "single": ([50], [50]),
}
HEADS = {"mha": (2, 2), "gqa": (4, 2), "mqa": (3, 1)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])


@DTYPES
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_varlen(lengths, causal, dtype):
    check_varlen(*lengths, 4, 2, 40, dtype, "cpu", causal=causal)


@DTYPES
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_varlen_heads(heads, dtype):
    check_varlen([9, 31, 0, 16], [40, 31, 3, 16], *heads, 64, dtype, "cpu", causal=True)


@DTYPES
@pytest.mark.parametrize("window", [(5, 3), (0, 0), (7, -1), (-1, 4)], ids=str)
def test_varlen_window(window, dtype):
    check_varlen([20, 45, 1], [37, 30, 9], 2, 1, 32, dtype, "cpu", window=window)


@DTYPES
def test_varlen_softcap_alibi(dtype):
    check_varlen([23, 40, 5], [23, 51, 0], 4, 2, 48, dtype, "cpu", causal=True, softcap=1.5, alibi=True)


@pytest.mark.parametrize("page_size,block_n", [(16, 16), (16, 32), (64, 16)],
                         ids=["page16-tile16", "page16-tile32", "page64-tile16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@DTYPES
def test_paged_varlen(monkeypatch, page_size, block_n, causal, dtype):
    """Chunked prefill over a paged cache: queries are the last tokens of their sequence's keys,
    pages permuted, unused table slots -1. A tile inside one page reads one page index; a tile
    wider than the page (32 keys over 16-key pages) reads one per key."""
    monkeypatch.setattr(configs, "forward_config", lambda *a, **kw: configs.BlockConfig(16, block_n, 4, 1))
    check_varlen([16, 3, 50, 0], [70, 3, 130, 20], 4, 2, 64, dtype, "cpu", causal=causal, page_size=page_size)


def test_tiled_oracle_is_the_oracle():
    """The tiled FA2 reference that checks the 32k sequences on the GPU (varlen_check's tiled oracle)
    gives the naive float64 oracle's outputs, LSE and gradients, masks, softcap, ALiBi and GQA
    included, with sequences longer than its tile."""
    lens_q, lens_k = [1100, 0, 7], [1300, 5, 7]
    q, k, v = torch.randn(sum(lens_q), 4, 16), torch.randn(sum(lens_k), 2, 16), torch.randn(sum(lens_k), 2, 16)
    dout = torch.randn_like(q)
    kw = dict(softmax_scale=0.3, window_size=(600, 0), softcap=2.0, alibi_slopes=torch.rand(3, 4))
    naive_ = oracle(q, k, v, lens_q, lens_k, lens_k, dout, **kw)
    tiled = oracle(q, k, v, lens_q, lens_k, lens_k, dout, tiled=True, **kw)
    for got, want in zip((tiled[0], tiled[1], *tiled[2]), (naive_[0], naive_[1], *naive_[2])):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@DTYPES
def test_seqused_k(dtype):
    """Keys past seqused_k[b] are not attended and get zero gradients."""
    check_varlen([12, 30, 7], [40, 30, 9], 4, 2, 32, dtype, "cpu", causal=True, seqused=[25, 30, 0])


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.interpret), "reference"])
def test_paged_gradients_through_the_api(backend):
    """flash_attn_varlen_func with a block_table and gradients: the pages are gathered (a
    differentiable index), so the gradient reaches the pages; it equals the contiguous call's."""
    lens = [20, 35]
    h, hk, d = 4, 2, 32
    cu = offsets(lens, "cpu")
    q = torch.randn(sum(lens), h, d, requires_grad=True)
    k, v = torch.randn(sum(lens), hk, d), torch.randn(sum(lens), hk, d)
    pages_k, table = paged_copy(k, lens, 16, 8, torch.Generator().manual_seed(1))
    pages_v = torch.randn_like(pages_k)
    from varlen_check import fill_pages
    fill_pages(pages_k, pages_v, k, v, lens, table)
    pages_k.requires_grad_()
    pages_v.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    with api.use_backend(backend):
        out_p = flashtile.flash_attn_varlen_func(q, pages_k, pages_v, cu, cu, 35, 35, causal=True, block_table=table)
        out_c = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 35, 35, causal=True)
    torch.testing.assert_close(out_p, out_c)
    dout = torch.randn_like(out_p)
    gp = torch.autograd.grad(out_p, (q, pages_k, pages_v), dout)
    gc = torch.autograd.grad(out_c, (q, k, v), dout)
    torch.testing.assert_close(gp[0], gc[0])
    start = 0
    for b, n in enumerate(lens):  # each key's gradient sits in its page row; the other rows get 0
        for j in range(n):
            page, row = int(table[b, j // 16]), j % 16
            torch.testing.assert_close(gp[1][page, row], gc[1][start + j])
            torch.testing.assert_close(gp[2][page, row], gc[2][start + j])
        start += n
    used = {(int(table[b, j // 16]), j % 16) for b, n in enumerate(lens) for j in range(n)}
    unused = torch.ones(pages_k.shape[:2], dtype=torch.bool)
    for page, row in used:
        unused[page, row] = False
    assert gp[1][unused].abs().max() == 0 and gp[2][unused].abs().max() == 0


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.interpret), "reference"])
def test_unpad_varlen_pad_equals_dense(padding, backend):
    """unpad -> varlen -> pad gives the dense padded call's rows where the mask is 1 (causal: each
    sequence's own corner) and zeros on padding; gradients flow back through both helpers."""
    b, s, h, d = 3, 24, 2, 16
    lengths = [24, 9, 17]
    mask = torch.zeros(b, s, dtype=torch.bool)
    for i, n in enumerate(lengths):
        if padding == "right":
            mask[i, :n] = True
        else:
            mask[i, s - n:] = True
    x = torch.randn(b, s, 3, h, d, requires_grad=True)
    packed, indices, cu, max_len, used = flashtile.unpad_input(x, mask)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 24, 33, 50] and max_len == 24
    assert used.tolist() == lengths
    with api.use_backend(backend):
        out = flashtile.flash_attn_varlen_qkvpacked_func(packed, cu, max_len, causal=True)
        padded = flashtile.pad_input(out, indices, b, s)
        for i, n in enumerate(lengths):
            rows = mask[i].nonzero().flatten()
            q, k, v = x[i:i + 1, rows].unbind(2)
            dense = flashtile.flash_attn_func(q, k, v, causal=True)
            torch.testing.assert_close(padded[i, rows], dense[0])
            assert padded[i, ~mask[i]].abs().max() == 0 if n < s else True
    padded.sum().backward()
    assert x.grad[~mask].abs().max() == 0  # padding rows get no gradient
    assert x.grad[mask].abs().max() > 0


def test_unpad_unused_mask():
    """flash-attn >= 2.7's unused_mask: kept in the packed rows, counted out of seqused."""
    x = torch.randn(2, 6, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 0, 1, 0, 0], [0, 0, 1, 1, 1, 0]])
    packed, indices, cu, max_len, used = flashtile.unpad_input(x, mask, unused)
    assert cu.tolist() == [0, 4, 9] and max_len == 5 and used.tolist() == [3, 2]
    assert torch.equal(packed, x.flatten(0, 1)[indices])


def test_pad_input_takes_int32_indices_and_checks_its_arguments():
    """flash-attn's pad_input indexes with int32 indices too; bad arguments name themselves."""
    x = torch.randn(2, 6, 4)
    packed, indices, *_ = flashtile.unpad_input(x, torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]]))
    assert torch.equal(flashtile.pad_input(packed, indices.int(), 2, 6), flashtile.pad_input(packed, indices, 2, 6))
    with pytest.raises(TypeError, match="indices must be an int32 or int64 tensor, got list"):
        flashtile.pad_input(packed, indices.tolist(), 2, 6)
    with pytest.raises(TypeError, match="indices must be an int32 or int64 tensor, got torch.float32"):
        flashtile.pad_input(packed, indices.float(), 2, 6)
    with pytest.raises(ValueError, match="batch must be >= 0, got -1"):
        flashtile.pad_input(packed, indices, -1, 6)
    with pytest.raises(TypeError, match="hidden_states must be a tensor"):
        flashtile.pad_input(packed.tolist(), indices, 2, 6)
    with pytest.raises(ValueError, match=r"indices must name rows of the batch \* seqlen = 6 padded positions"):
        flashtile.pad_input(packed, indices, 2, 3)  # the second sequence's rows are 6 and 7
    with pytest.raises(ValueError, match=r"got values in \[-1, "):
        flashtile.pad_input(packed, torch.cat([indices[:-1], indices.new_tensor([-1])]), 2, 6)
    with pytest.raises(ValueError, match=r"hidden_states must be a tensor \(batch, seqlen, ...\), got \(12,\)"):
        flashtile.unpad_input(x.flatten()[:12], torch.ones(2, 6))
    with pytest.raises(TypeError, match="hidden_states must be a tensor .* got list"):
        flashtile.unpad_input(x.tolist(), torch.ones(2, 6))


def varlen_args(lens=(5, 9), h=2, hk=2, d=16, dtype=torch.float32):
    total = sum(lens)
    return (torch.randn(total, h, d, dtype=dtype), torch.randn(total, hk, d, dtype=dtype),
            torch.randn(total, hk, d, dtype=dtype), offsets(lens, "cpu"), offsets(lens, "cpu"), max(lens), max(lens))


@pytest.mark.parametrize("change,match,exc", [
    (lambda a: {3: a[3].long()}, "cu_seqlens_q must be int32", TypeError),
    (lambda a: {3: a[3][:, None]}, r"cu_seqlens_q must have shape \(n,\)", ValueError),
    (lambda a: {4: a[4][:2]}, r"cu_seqlens_k must have shape \(3,\)", ValueError),
    (lambda a: {3: torch.tensor([0, 9, 5], dtype=torch.int32)}, "cu_seqlens_q must be non-decreasing", ValueError),
    (lambda a: {3: torch.tensor([1, 5, 14], dtype=torch.int32)}, r"cu_seqlens_q\[0\] must be 0", ValueError),
    (lambda a: {4: torch.tensor([0, 5, 13], dtype=torch.int32)}, r"cu_seqlens_k\[-1\] must equal", ValueError),
    (lambda a: {5: 8}, r"max_seqlen_q \(8\) is smaller than sequence 1's length 9", ValueError),
    (lambda a: {6: 4}, r"max_seqlen_k \(4\) is smaller", ValueError),
    (lambda a: {6: 2.5}, "max_seqlen_k must be an int", TypeError),
    (lambda a: {0: a[0][None]}, "q must have 3 dimensions", ValueError),
    (lambda a: {1: a[1][:, :, :8]}, "k must have head dim 16", ValueError),
    (lambda a: {0: torch.randn(14, 3, 16)}, "multiple of the number of key/value heads", ValueError),
], ids=["cu-dtype", "cu-rank", "cu-k-length", "decreasing", "not-from-0", "last-entry", "max-q-small",
        "max-k-small", "max-float", "q-rank", "headdim", "h%hk"])
def test_varlen_bad_inputs_name_the_argument(change, match, exc):
    args = list(varlen_args())
    for i, t in change(args).items():
        args[i] = t
    with pytest.raises(exc, match=match):
        flashtile.flash_attn_varlen_func(*args)


def test_varlen_bad_options_and_pages():
    q, k, v, cu_q, cu_k, mq, mk = varlen_args()
    with pytest.raises(ValueError, match="dropout_p must be in"):
        flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, dropout_p=1.0)
    pages = torch.randn(4, 16, 2, 16)
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="page size .* multiple of 16"):
        flashtile.flash_attn_varlen_func(q, pages[:, :12], pages[:, :12], cu_q, cu_k, mq, mk, block_table=table)
    with pytest.raises(TypeError, match="block_table must be int32"):
        flashtile.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, mq, mk, block_table=table.long())
    with pytest.raises(ValueError, match=r"block_table must have shape \(2, n\)"):
        flashtile.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, mq, mk, block_table=table[:1])
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 7 is not a page of k"):
        flashtile.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, mq, mk,
                                         block_table=torch.tensor([[0], [7]], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table reaches 16"):
        flashtile.flash_attn_varlen_func(q, pages, pages, cu_q, offsets((5, 20), "cpu"), mq, 20, block_table=table)
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 10 must be in 0..9"):
        flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk,
                                         seqused_k=torch.tensor([5, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_k may be None only with block_table"):
        flashtile.flash_attn_varlen_func(q, k, v, cu_q, None, mq, mk)


def test_varlen_seqused_without_cu_seqlens_k():
    """vLLM's paged call: cu_seqlens_k None, seqused_k gives each sequence's keys."""
    q, k, v, cu_q, _, mq, _ = varlen_args()
    pages_k, table = paged_copy(k, [5, 9], 16, 3, torch.Generator().manual_seed(0))
    pages_v, _ = paged_copy(v, [5, 9], 16, 3, torch.Generator().manual_seed(0))
    used = torch.tensor([5, 9], dtype=torch.int32)
    out = flashtile.flash_attn_varlen_func(q, pages_k, pages_v, cu_q, None, mq, 9, block_table=table, seqused_k=used)
    ref = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_q, mq, 9)
    torch.testing.assert_close(out, ref)


def test_varlen_lse_layout_and_packed_forms():
    """softmax_lse is (nheads, total_q); the kv-packed form reads the same values."""
    q, k, v, cu_q, cu_k, mq, mk = varlen_args(h=4, hk=2)
    out, lse, probs = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, return_attn_probs=True)
    assert probs is None and lse.shape == (4, 14) and lse.dtype == torch.float32
    out2 = flashtile.flash_attn_varlen_kvpacked_func(q, torch.stack((k, v), 1), cu_q, cu_k, mq, mk)
    torch.testing.assert_close(out, out2)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_no_query_rows_give_zero_key_gradients(backend):
    """q with no rows (dense seqlen_q = 0, or every sequence empty on the q side): dk and dv are
    zeros, not the unwritten contents of a fresh buffer."""
    k, v = (torch.randn(2, 7, 2, 16, requires_grad=True) for _ in range(2))
    q = torch.randn(2, 0, 4, 16, requires_grad=True)
    kp, vp = (torch.randn(8, 2, 16, requires_grad=True) for _ in range(2))
    qp = torch.randn(0, 4, 16, requires_grad=True)
    cu_q, cu_k = offsets([0, 0], "cpu"), offsets([5, 3], "cpu")
    with api.use_backend(backend):
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        out_p = flashtile.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 0, 5)
    for o, inputs in ((out, (q, k, v)), (out_p, (qp, kp, vp))):
        grads = torch.autograd.grad(o.sum() + sum(t.sum() * 0 for t in inputs), inputs)
        for g in grads[1:]:
            assert torch.equal(g, torch.zeros_like(g))


def test_index_tensors_with_other_strides():
    """cu_seqlens, seqused_k and block_table given as strided views (the values the host reads
    are the values the kernels use)."""
    lens = [20, 35, 9]
    h, hk, d = 4, 2, 32
    q, k, v = torch.randn(sum(lens), h, d), torch.randn(sum(lens), hk, d), torch.randn(sum(lens), hk, d)
    cu = offsets(lens, "cpu")
    cu_strided = torch.stack([cu, cu * 7], 1)[:, 0]
    used = torch.tensor([20, 30, 9], dtype=torch.int32)
    used_strided = torch.stack([used, used], 1)[:, 0]
    assert cu_strided.stride() == (2,) and used_strided.stride() == (2,)
    ref = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 35, 35, causal=True, seqused_k=used)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu_strided, cu_strided, 35, 35, causal=True, seqused_k=used_strided)
    torch.testing.assert_close(out, ref)
    pages_k, table = paged_copy(k, lens, 16, 9, torch.Generator().manual_seed(2))
    pages_v = torch.randn_like(pages_k)
    from varlen_check import fill_pages
    fill_pages(pages_k, pages_v, k, v, lens, table)
    table_t = table.T.contiguous().T  # the same values, strides (1, batch)
    assert table_t.stride() != table.stride()
    paged = flashtile.flash_attn_varlen_func(q, pages_k, pages_v, cu, cu, 35, 35, causal=True, block_table=table_t,
                                             seqused_k=used)
    torch.testing.assert_close(paged, ref)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["no-dropout", "dropout"])
def test_varlen_backward_in_two_launches(monkeypatch, dropout_p):
    """The launch mode the GPU uses: the dQ launch computing delta (WRITE_DELTA), then the dK/dV
    launch, with TMA descriptors over the packed tensors, head-chunked launch orders and
    different tiles per launch (the interpreter's default is one fused launch)."""
    cfg = configs.BackwardConfig(configs.BlockConfig(16, 32, 4, 1), configs.BlockConfig(32, 16, 4, 1), False,
                                 dkdv_tma=True, dq_tma=True, head_chunk=3, dq_head_chunk=2)
    monkeypatch.setattr(configs, "backward_config", lambda *args: cfg)
    check_varlen([17, 0, 1, 70, 40], [33, 5, 1, 70, 0], 4, 2, 64, torch.float16, "cpu", causal=True,
                 dropout_p=dropout_p)
    check_varlen([30, 45], [64, 20], 6, 3, 32, torch.float32, "cpu", window=(9, 4), seqused=[50, 20],
                 dropout_p=dropout_p)


def test_varlen_dropout_window_seqused():
    check_varlen([23, 40, 5], [33, 51, 9], 4, 2, 32, torch.float32, "cpu", window=(11, 2), seqused=[30, 51, 0],
                 dropout_p=0.3)


def test_varlen_reference_under_torch_compile():
    """The reference path returns contiguous outputs, as the custom op's fake impl declares (a
    permuted q used to fail Inductor's stride assertion)."""
    lens = [5, 9]
    cu = offsets(lens, "cpu")
    q = torch.randn(4, 14, 16).transpose(0, 1)  # (14, 4, 16), not contiguous
    k, v = torch.randn(14, 2, 16), torch.randn(14, 2, 16)

    def f(q, k, v):
        return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True)

    with api.use_backend("reference"):
        torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))


def test_host_values_cache():
    """A tensor's values are read once per version: an in-place update is seen, a write the version
    counter misses (.data) is not (documented), inference tensors are read every time."""
    from flashtile import _checks

    t = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert _checks.cached_copy(t).tolist() == [0, 3, 7]
    t.data[1] = 4  # bypasses the version counter: the cached values stay
    assert _checks.cached_copy(t).tolist() == [0, 3, 7]
    t[1] = 5  # in place: a new version, read again
    assert _checks.cached_copy(t).tolist() == [0, 5, 7]
    with torch.inference_mode():  # serving code builds its index tensors so
        u = torch.tensor([0, 2], dtype=torch.int32)
        assert _checks.cached_copy(u).tolist() == [0, 2]
        u[1] = 9
        assert _checks.cached_copy(u).tolist() == [0, 9]


def test_varlen_paged_without_pages_and_bad_seqused():
    q, k, v, cu_q, cu_k, mq, mk = varlen_args()
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="at least one page"):
        flashtile.flash_attn_varlen_func(q, torch.randn(0, 16, 2, 16), torch.randn(0, 16, 2, 16), cu_q, cu_k, mq, mk,
                                         block_table=table)
    pages = torch.randn(4, 16, 2, 16)
    with pytest.raises(ValueError, match=r"seqused_k\[0\] = -1 must be in 0..16 \(the page table's reach\)"):
        flashtile.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, mq, mk, block_table=table,
                                         seqused_k=torch.tensor([-1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seqused_k\[0\] = -3 must be >= 0"):  # cu_seqlens_k made from seqused_k
        flashtile.flash_attn_varlen_func(q, pages, pages, cu_q, None, mq, mk, block_table=table,
                                         seqused_k=torch.tensor([-3, 3], dtype=torch.int32))
