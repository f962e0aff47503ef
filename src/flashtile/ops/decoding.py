"""The decoding entry points: plan() packs everything that is the same for every layer of a
decoding step (tiles, split count, the index tensors and their strides, the partial buffers) into
prepared launches once (api.DecodePlan holds it); decode_attention adds one layer's q, k/v and
cache; merge_states is the public LSE merge. The kernels: ops.decode (portable Triton) and
ops.decode_sm90 (Gluon), chosen by ops.dispatch.decode_kernel.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch

from flashtile.ops import configs, dispatch
from flashtile.ops._launch import Prepared, cdiv, current_stream, next_pow2
from flashtile.ops.decode import DecodeFlags, _combine_kernel, _split_kernel
from flashtile.ops.decode_sm90 import _split_kernel_warps
from flashtile.ops.host import dot_precision
from flashtile.ops.mods import Mods, alibi_strides, kernel_scale


def prepare_combine(num_splits: int, d: int, rows: tuple, strides: tuple, has_sink: bool = False,
                    pdl: bool = False) -> Prepared:
    """The merge of partials (S, n0, n1, n2, d) / (S, n0, n1, n2) into out (n0, n1, n2, d) / lse
    (n0, n1, n2), rows = (n0, n1, n2); strides = the four tensors' strides in those dim orders, and
    the sink's over the rows (given apart from the tensors, so that a permuted or broadcast layout
    needs no view). The call passes the tensors (out_partial, lse_partial, out, lse, sink or None)
    and no scalars. pdl: a programmatic dependent launch of the kernel before it in the stream
    (_combine_kernel's PDL)."""
    n0, n1, n2 = rows
    cfg = configs.combine_config(num_splits, d)
    return Prepared(_combine_kernel, (n0 * n1 * n2, cdiv(d, cfg.block_d)), (), (num_splits, n1, n2, *strides),
                    cfg.num_warps, 3, pdl, HEAD_DIM=d, BLOCK_S=cfg.block_s, BLOCK_D=cfg.block_d, HAS_SINK=has_sink,
                    PDL=pdl)


def merge_states(out_partial: torch.Tensor, lse_partial: torch.Tensor, sink=None):
    """out_partial (S, *, d) fp16/bf16/fp32, lse_partial (S, *) fp32 -> out (*, d) in out_partial's
    dtype, lse (*) fp32 (the public merge_attention_states, checked by the API); sink: None or a
    float tensor broadcastable to (*), added once."""
    num_splits, d = out_partial.shape[0], out_partial.shape[-1]
    lead = tuple(out_partial.shape[1:-1])
    out = torch.empty(lead + (d,), dtype=out_partial.dtype, device=out_partial.device)
    lse = torch.empty(lead, dtype=torch.float32, device=out_partial.device)
    n = out.numel() // max(d, 1)
    if n == 0:
        return out, lse
    # flatten * into one row axis; reshape copies only when * cannot be viewed as one axis
    o_part, l_part = out_partial.reshape(num_splits, n, d), lse_partial.reshape(num_splits, n)
    (ps, pn, pd), (qs, qn) = o_part.stride(), l_part.stride()
    if sink is not None:
        sink = torch.broadcast_to(sink, lead).reshape(n)
    merge = prepare_combine(num_splits, d, (n, 1, 1), (ps, pn, 0, 0, pd, qs, qn, 0, 0, d, 0, 0, 1, 1, 0, 0,
                                                       0 if sink is None else sink.stride(0), 0, 0), sink is not None)
    merge((o_part, l_part, out, lse, sink), ())
    return out, lse


class DecodeLaunch(NamedTuple):
    """A planned decoding call (plan): its launches less the per-layer tensors, and the buffers."""

    out_shape: tuple  # (b, sq, h, d), q's dtype
    lse_shape: tuple  # (b, h, sq), fp32
    num_splits: int
    seqlen_new: int  # new keys each call appends (its k and v); 0: none
    split: Optional[Prepared]  # called with (q, k_cache, v_cache, k, v, out, lse, ...) and the first five's strides
    split_any: Optional[Callable[[], Prepared]]  # with _split_kernel_warps: _split_kernel for caches it cannot copy
    combine: Optional[Prepared]  # None with one split, or with the combine fused into the split kernel
    fused: bool  # the split kernel's last program per row merges the splits (arrival counters)
    partial_sizes: tuple  # (elements of the fp32 buffer, offset of the lse partials in it)
    scratch: dict  # CUDA stream (None on CPU) -> (out_partial, lse_partial, arrivals or None) of its calls
    unread: dict  # "lse" -> where calls that do not return the LSE let the kernels write it
    has_sink: bool  # the calls pass an attention sink (h,)


def _seqlens_args(cache_seqlens):
    """(tensor or None, int): a tensor of lengths goes to the kernel; an int travels by value."""
    if isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens, 0
    return None, int(cache_seqlens)


def _stride0(t) -> int:
    return 0 if t is None else t.stride(0)


def plan(b, sq, h, hk, d, dtype, device, *, page_size, capacity, cache_rows, seqlen_new, cache_seqlens,
         cache_batch_idx, cache_leftpad, block_table, alibi_slopes, rotary_cos, rotary_sin, rotary_interleaved,
         softmax_scale, window, softcap, num_splits, max_keys, has_sink=False) -> DecodeLaunch:
    """The launches of a checked decoding call: split-KV attention of q over the cache, which the
    same launch extends by the new k/v, then the merge of the splits (unless fused).

    q (b, sq, h, d); k_cache/v_cache (cache_rows, capacity, hk, d), or pages (cache_rows, page_size,
    hk, d) with block_table (b, max_blocks) int32 (capacity = max_blocks * page_size);
    cache_seqlens int or (b,) int32 (lengths before the seqlen_new appended keys);
    cache_batch_idx / cache_leftpad (b,) int32; rotary_cos/sin (seqlen_ro, rotary_dim / 2) rotate
    k and q; window = (left, right), -1 unbounded. Index tensors are read through their strides.
    num_splits = 0 asks configs.decode_tiles (the tiles and the split count), given max_keys (the
    longest key range known on the host, else None: the capacity). has_sink: every call passes an
    attention sink.
    With splits, the calls of a plan on one CUDA stream share the split partials (and the fused
    merge's counters), allocated at its first call there: a stream runs its calls in order.
    """
    group = h // hk
    left, right = window
    if sq == 1:
        right = -1  # one query row sits at the last key: nothing is to its right
    keys = capacity if max_keys is None else max_keys
    choice, warps = dispatch.decode_kernel(sq * group, d, dtype, device, b * hk, keys, num_splits, configs.generation)
    dispatch.report("decode", f"{b} x {sq} rows x {h} heads over {keys} keys, d={d}", choice)
    if warps is not None:
        cfg, num_splits = warps
    else:
        cfg, num_splits = configs.decode_tiles(sq * group, d, dtype, page_size, device, b * hk, keys, num_splits)
    m_blocks = cdiv(sq * group, cfg.block_m)
    seqlens, seqlen_const = _seqlens_args(cache_seqlens)
    if rotary_cos is None:
        rotary_dim, rotary_len, rotary_strides = 0, 0, (0, 0, 0, 0)
    else:
        rotary_dim, rotary_len = 2 * rotary_cos.shape[1], rotary_cos.shape[0]
        rotary_strides = (*rotary_cos.stride(), *rotary_sin.stride())
    table_strides = (0, 0) if block_table is None else tuple(block_table.stride())
    block_d = configs.padded_headdim(d)

    # out (b, sq, h, d) and lse (b, h, sq) are allocated contiguous by each call; the partials
    # (S, b, sq, h, d) and (S, b, h, sq) share one fp32 buffer, the lse part 16-byte aligned
    out_strides, lse_strides = (sq * h * d, h * d, d, 1), (h * sq, sq, 1)
    o_numel = num_splits * b * sq * h * d
    lse_offset = cdiv(o_numel, 4) * 4
    sizes = (lse_offset + num_splits * b * h * sq, lse_offset)
    combine = None
    fused = num_splits > 1 and configs.decode_fuse_combine(num_splits)
    pdl = num_splits > 1 and not fused and configs.supports_pdl(device)
    if num_splits == 1:  # the split kernel writes out and lse directly: split stride 0
        o_strides, l_strides = (0, *out_strides), (0, *lse_strides)
    else:
        o_strides = (b * sq * h * d, *out_strides)
        l_strides = (b * h * sq, *lse_strides)
        # rows (b, sq, h); the lse partials are (S, b, h, sq) and lse is (b, h, sq): their row
        # strides are given in (b, sq, h) order
        (ps, pb, pm, ph, pd), (qs, qb, qh, qm) = o_strides, l_strides
        (ob, om, oh, od), (lb, lh, lm) = out_strides, lse_strides
        if not fused:
            combine = prepare_combine(num_splits, d, (b, sq, h), (ps, pb, pm, ph, pd, qs, qb, qm, qh, ob, om, oh, od,
                                                                   lb, lm, lh, 0, 0, 1), has_sink, pdl)
    qk_scale, softcap = kernel_scale(softmax_scale, softcap)
    split = split_any = None
    if b > 0:
        mods = Mods(left >= 0, right >= 0, softcap > 0, alibi_slopes is not None)
        fixed = ((seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes, rotary_cos, rotary_sin),
                 (*o_strides, *l_strides, *out_strides, *lse_strides, _stride0(seqlens), _stride0(cache_batch_idx),
                  _stride0(cache_leftpad), *table_strides, *alibi_strides(alibi_slopes), *rotary_strides,
                  seqlen_const, sq, seqlen_new, capacity, cache_rows, rotary_len, m_blocks, num_splits,
                  max(left, 0), max(right, 0), qk_scale, softcap))

        def prepare(kernel, tiles, gluon):
            flags = DecodeFlags(GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=tiles.block_m,
                                BLOCK_N=tiles.block_n, PAGE_SIZE=page_size, ROTARY_DIM=rotary_dim,
                                ROTARY_INTERLEAVED=bool(rotary_interleaved), ROTARY_BY_ROW=left >= 0 or window[1] >= 0,
                                DOT_PRECISION=dot_precision(dtype), EVEN_D=d == block_d,
                                HAS_SEQLENS=seqlens is not None, HAS_BATCH_IDX=cache_batch_idx is not None,
                                HAS_LEFTPAD=cache_leftpad is not None, FUSED_COMBINE=fused,
                                MERGE_UNROLL=configs.DECODE_MERGE_UNROLL, HAS_SINK=has_sink, APPEND=seqlen_new > 0,
                                BLOCK_T=min(16, next_pow2(seqlen_new)), LAUNCH_COMBINE=pdl,
                                STAGES=tiles.num_stages if gluon else 0)
            return Prepared(kernel, (num_splits, hk * m_blocks, b), *fixed, tiles.num_warps,
                            None if gluon else tiles.num_stages, pdl, CFG=flags, MODS=mods)

        if warps is None:
            split = prepare(_split_kernel, cfg, False)
        else:
            split = prepare(_split_kernel_warps, cfg, True)

            @functools.cache
            def split_any():
                """_split_kernel_warps copies rows of 16-byte pieces: a cache that is not
                (decode_attention) takes _split_kernel with the same splits (and one M block, as
                either's tiles hold the <= 16 rows), prepared at its first such call."""
                tiles, _ = configs.decode_tiles(sq * group, d, dtype, page_size, device, b * hk, keys, num_splits)
                return prepare(_split_kernel, tiles, False)
    return DecodeLaunch((b, sq, h, d), (b, h, sq), num_splits, seqlen_new, split, split_any, combine, fused, sizes,
                        {}, {}, has_sink)


def _scratch(p: DecodeLaunch, device, stream) -> tuple:
    """(out_partial, lse_partial, arrivals) of the calls on `stream`: one fp32 buffer for the
    partials, and for the fused merge int32 arrival counters, zeroed once and left zeroed by every
    launch (else None). Calls on one stream run in order, so they may share these; calls on
    different streams never do."""
    scratch = p.scratch.get(stream)
    if scratch is None:
        buf = torch.empty(p.partial_sizes[0], dtype=torch.float32, device=device)
        arrivals = torch.zeros(p.out_shape[0] * p.split.grid[1], dtype=torch.int32, device=device) if p.fused else None
        scratch = p.scratch[stream] = (buf, buf[p.partial_sizes[1]:], arrivals)
    return scratch


def _whole_rows(cache: torch.Tensor) -> bool:
    """Whether _split_kernel_warps can copy this cache's head rows in 16-byte pieces: the last
    dimension contiguous, every other stride and the address multiples of 16 elements / bytes (what
    Triton's specialisation tells the kernel)."""
    s0, s1, s2, s3 = cache.stride()
    return s3 == 1 and s0 % 16 == 0 and s1 % 16 == 0 and s2 % 16 == 0 and cache.data_ptr() % 16 == 0


def decode_attention(p: DecodeLaunch, q, k_cache, v_cache, k=None, v=None, want_lse: bool = True, sink=None):
    """Append k/v (b, seqlen_new, hk, d) to the cache at cache_seqlens[b] (in place, k rotated; given
    exactly when the plan has seqlen_new > 0) and attend q over the cache -> out (b, sq, h, d) in
    q's dtype, and lse (b, h, sq) fp32, or None when not want_lse: the kernels then write the LSE
    into a buffer the plan keeps for that and nobody reads (one allocation less per call). sink:
    the attention sink (h,) contiguous, given exactly when the plan was made with has_sink."""
    if (sink is not None) != p.has_sink:
        raise ValueError(f"this decoding launch was planned {'with' if p.has_sink else 'without'} an attention sink")
    device = q.device
    # q's shape is out_shape (checked by the plan's run); empty_like parses less than torch.empty
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if want_lse:
        lse = torch.empty(p.lse_shape, dtype=torch.float32, device=device)
    else:
        lse = p.unread.get("lse")
        if lse is None:
            lse = p.unread["lse"] = torch.empty(p.lse_shape, dtype=torch.float32, device=device)
    if p.split is None:
        return out, lse if want_lse else None
    stream = current_stream(q.get_device()) if q.is_cuda else None
    if p.num_splits == 1:
        o_buf, l_buf, arrivals = out, lse, None
    else:
        o_buf, l_buf, arrivals = _scratch(p, device, stream)
    finals = (out, lse, arrivals) if p.fused else (None, None, None)
    # the launch key of the call's tensors: q, k_cache, v_cache, k and v share q's dtype (checked
    # by DecodePlan.run); the outputs and buffers are allocated here, 16-byte aligned
    key = (q.dtype, q.data_ptr() % 16 == 0, k_cache.data_ptr() % 16 == 0, v_cache.data_ptr() % 16 == 0,
           None if sink is None else (sink.dtype, sink.data_ptr() % 16 == 0))
    if k is None:
        new_strides = (0,) * 8
    else:
        key += (k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0)
        new_strides = (*k.stride(), *v.stride())
    split = p.split
    if p.split_any is not None and not (_whole_rows(k_cache) and _whole_rows(v_cache)):
        split = p.split_any()
    split((q, k_cache, v_cache, k, v, o_buf, l_buf, *finals, sink),
          (*q.stride(), *k_cache.stride(), *v_cache.stride(), *new_strides), stream, key)
    if p.combine is not None:  # its tensors' key: the partials and lse are fp32, out q's dtype, all allocated here
        p.combine((o_buf, l_buf, out, lse, sink), (), stream, (key[0], key[4]))
    return out, lse if want_lse else None

