"""One check of the prefill kernels on a packed (varlen) batch, shared by interpret and cuda tests.

Each sequence's float64 oracle is naive attention on that sequence alone (with the kernels' dropout
mask, reference.dropout), assembled into packed tensors; the kernels' output, LSE and gradients must
satisfy the 2x rule against it. Outputs and gradients are poisoned first.
"""

from __future__ import annotations

import torch

from flashtile import _checks
from flashtile.ops.prefill import attention_backward, attention_forward
from flashtile.reference import fa2, naive
from flashtile.reference.dropout import DropoutMask, draw_rng
from flashtile.testing import assert_2x, poison


def offsets(lengths, device) -> torch.Tensor:
    return torch.tensor([0] + list(lengths), device=device).cumsum(0).to(torch.int32)


def paged_copy(t: torch.Tensor, lengths, page_size: int, num_pages: int, generator=None):
    """Keys t (total_k, hk, d) of sequences of `lengths` laid into randomly permuted pages of a
    (num_pages, page_size, hk, d) cache (the other rows random); returns (pages, block_table)."""
    max_pages = max(1, max(-(-n // page_size) for n in lengths))
    order = torch.randperm(num_pages, generator=generator).tolist()
    pages = torch.randn(num_pages, page_size, *t.shape[1:], generator=generator).to(t.dtype).to(t.device)
    table = torch.full((len(lengths), max_pages), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(lengths):
        for j in range(-(-n // page_size)):
            page = order.pop()
            table[b, j] = page
            rows = min(page_size, n - j * page_size)
            pages[page, :rows] = t[start + j * page_size:start + j * page_size + rows]
        start += n
    return pages, table.to(t.device)


def fill_pages(pages_k, pages_v, k, v, lengths, table):
    """Write packed k/v into the pages `table` names (the layout of paged_copy)."""
    page_size = pages_k.shape[1]
    start = 0
    for b, n in enumerate(lengths):
        for j in range(-(-n // page_size)):
            rows = min(page_size, n - j * page_size)
            page = int(table[b, j])
            pages_k[page, :rows] = k[start + j * page_size:start + j * page_size + rows]
            pages_v[page, :rows] = v[start + j * page_size:start + j * page_size + rows]
        start += n


TILE = 1024  # the tiled oracle's blocks: a float64 tile of scores is 8 MB a head


def _tiled(args, dout, opts):
    """(out, lse, grads) of the tiled FA2 reference (reference.fa2) in opts' compute dtype: exact in
    float64 like naive attention, in the memory of a tile instead of the whole score matrix (a 32k
    sequence's S is 8.6 GB a head in float64)."""
    dtype = opts.pop("compute_dtype")
    if opts.pop("learnable_sink", None) is not None or "dropout_p" in opts:
        raise NotImplementedError("the tiled oracle takes no sink or dropout")
    q, k, v = (t.to(dtype) for t in args)
    out, lse = fa2.forward(q, k, v, block_m=TILE, block_n=TILE, **opts)
    if dout is None:
        return out, lse, None
    return out, lse, fa2.backward(dout.to(dtype), q, k, v, out, lse, block_m=TILE, block_n=TILE, **opts)


def oracle(q, k, v, lens_q, lens_k, used, dout=None, compute_dtype=torch.float64, dropout=None, tiled=False, **kw):
    """Packed (out, lse) and, with dout, (dq, dk, dv) of naive attention run on each sequence, or
    with tiled of the tiled FA2 reference (_tiled; no sink or dropout).

    used: keys attended per sequence (seqused_k, or lens_k); keys past it get zero gradients.
    dropout: (p, rng) or None; kw: naive.attention's options; alibi_slopes may be (b, h)."""
    h = q.shape[1]
    dtype = compute_dtype or q.dtype
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse = torch.full((h, q.shape[0]), float("-inf"), dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                     device=q.device)
    grads = [torch.zeros(t.shape, dtype=dtype, device=q.device) for t in (q, k, v)]
    slopes = kw.pop("alibi_slopes", None)
    q0 = k0 = 0
    for b, (n_q, n_k, n_used) in enumerate(zip(lens_q, lens_k, used)):
        args = (q[None, q0:q0 + n_q], k[None, k0:k0 + n_used], v[None, k0:k0 + n_used])
        opts = dict(kw, alibi_slopes=None if slopes is None else slopes[b:b + 1], compute_dtype=compute_dtype)
        if dropout is not None and dropout[0] > 0:
            opts.update(dropout_p=dropout[0],
                        dropout_mask=DropoutMask(dropout[0], dropout[1], h, [b]).full(n_q, n_used, q.device))
        if n_q and tiled:
            o, l, g = _tiled(args, None if dout is None else dout[None, q0:q0 + n_q], opts)
        elif n_q:
            o, l = naive.attention(*args, **opts)
            g = None if dout is None else naive.attention_backward(dout[None, q0:q0 + n_q], *args, **opts)
        if n_q:
            out[q0:q0 + n_q] = o[0]
            lse[:, q0:q0 + n_q] = l[0]
            if dout is not None:
                grads[0][q0:q0 + n_q] = g[0][0]
                grads[1][k0:k0 + n_used] = g[1][0]
                grads[2][k0:k0 + n_used] = g[2][0]
        q0 += n_q
        k0 += n_k
    return out, lse, grads


def check_varlen(lens_q, lens_k, h, hk, d, dtype, device, causal=False, window=(-1, -1), softcap=0.0,
                 alibi=False, page_size=0, seqused=None, dropout_p=0.0, backward=True, factor=2, sink=False,
                 tiled_oracle=False):
    """Forward (and backward, unless paged) of a packed batch against the per-sequence oracle;
    sink: with an attention sink (prefill_check.sink_logits), its gradient checked too;
    tiled_oracle: the float64 oracle by the tiled FA2 reference (sequences past 16k)."""
    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)

    b = len(lens_q)
    q, k, v = rand(sum(lens_q), h, d), rand(sum(lens_k), hk, d), rand(sum(lens_k), hk, d)
    cu_q, cu_k = offsets(lens_q, device), offsets(lens_k, device)
    used = list(lens_k) if seqused is None else list(seqused)
    left, right = window[0], (0 if causal else window[1])
    win = (None if left < 0 else left, None if right < 0 else right)
    slopes = torch.rand(b, h, device=device) if alibi else None
    dropout = (dropout_p, draw_rng(device)) if dropout_p else None
    kw = dict(softmax_scale=d ** -0.5, window_size=(left, right), softcap=softcap, alibi_slopes=slopes)
    sink_t = None
    if sink:
        from prefill_check import sink_logits

        kw["learnable_sink"] = sink_t = sink_logits(h, max(lens_k, default=1), device)
    k_in, v_in, table = k, v, None
    if page_size:
        num_pages = sum(-(-n // page_size) for n in lens_k) + 3
        gen = torch.Generator().manual_seed(len(lens_k) + page_size)
        k_in, table = paged_copy(k, lens_k, page_size, num_pages, gen)
        v_in = torch.randn_like(k_in)
        fill_pages(k_in, v_in, k, v, lens_k, table)
    seqused_t = None if seqused is None else torch.tensor(seqused, dtype=torch.int32, device=device)
    varlen = _checks.check_varlen(q, k_in, v_in, cu_q, cu_k, max(lens_q, default=0), max(used, default=0),
                                  seqused_t, table)

    out = torch.empty_like(q)
    poison(out)
    out, lse = attention_forward(q, k_in, v_in, d ** -0.5, win, softcap, slopes, out=out, varlen=varlen,
                                 dropout=dropout, sink=sink_t)
    dout = torch.randn_like(out) if backward and not page_size else None
    ref_out, ref_lse, ref_grads = oracle(q, k, v, lens_q, lens_k, used, dout, dropout=dropout, tiled=tiled_oracle,
                                         **kw)
    base_out, base_lse, base_grads = oracle(q, k, v, lens_q, lens_k, used, dout, compute_dtype=None,
                                            dropout=dropout, **kw)
    assert_2x("out", out, ref_out, base_out, factor=factor)
    assert_2x("lse", lse, ref_lse, base_lse, factor=factor)
    if dout is None:
        return
    grads = [torch.empty_like(t) for t in (q, k, v)]
    poison(*grads)
    delta = None if sink_t is None else torch.empty_like(lse)
    got = attention_backward(dout, q, k, v, out, lse, d ** -0.5, win, softcap, slopes, *grads, varlen=varlen,
                             dropout=dropout, delta=delta)
    for name, g, r, bb in zip(("dq", "dk", "dv"), got, ref_grads, base_grads):
        assert_2x(name, g, r, bb, factor=factor)
    if sink_t is not None:
        from prefill_check import check_sink_grad

        check_sink_grad(sink_t, lse, delta, dout, (ref_out, ref_lse), (base_out, base_lse), factor)
