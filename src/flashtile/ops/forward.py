"""FA2-style forward: one program per (Q block, batch x head); K/V blocks stream through SRAM.

Online softmax in the log2 domain with the scale folded into one multiply, the output kept
unnormalised and divided by l once at the end, the log-sum-exp written for the backward. The KV loop
runs in up to three phases (ops.masks.block_range): masked blocks, then blocks every row of the Q
block fully sees (no mask work at all), then masked blocks again; blocks nobody sees are skipped.

Flags of the same kernel (constexprs: off, they compile to the dense kernel's code):
  IS_VARLEN    a packed batch: program (Q block, sequence x head) finds its sequence's rows and keys
               in cu_seqlens (ops.masks.seq_bounds) and returns at once past its sequence's end
  PAGE_SIZE    K/V read through a page table (ops.masks.page_of), for chunked prefill against a
               paged cache
  HAS_DROPOUT  P is multiplied by a Philox keep-mask (ops.philox.dropout_keep) before P V; the
               row sum l and the LSE are those of the softmax before dropout, as in flash-attn
  HAS_SINK     the attention sink (a per-head logit with no value, gpt-oss) joins each row's sum
               once, after the loop (ops.softmax.fold_sink); the backward needs no flag of its own:
               P recomputed from this LSE is the sink's softmax already
"""


import triton
import triton.language as tl

from flashtile.ops import configs
from flashtile.ops._launch import Plan, cdiv
from flashtile.ops.aggregates import VALUE, aggregate, keep_all
from flashtile.ops.host import dot_precision, dropout_args, grid_lengths, seq_strides, varlen_args
from flashtile.ops.masks import (
    block_range,
    head_dim_mask,
    load_tile_pair,
    lse_row_base,
    page_of,
    phase_blocks,
    seq_bounds,
    visible,
)
from flashtile.ops.mods import ModArgs, Mods, alibi_strides, kernel_scale, scores_log2
from flashtile.ops.philox import dropout_keep, dropout_seed
from flashtile.ops.schedule import q_block_program
from flashtile.ops.softmax import LN2, fold_sink


@aggregate
class FwdTile:
    """What each K/V block step of a program reads (_fwd_kernel's names): its Q block and the K/V
    pointers of its head, its rows, the sequence's keys and mask bounds, the score mods' scalars,
    the page table, and dropout's head and threshold."""

    q: VALUE
    k_ptrs: VALUE
    v_ptrs: VALUE
    start_m: VALUE
    offs_m: VALUE
    mod_args: ModArgs  # the score and mask mods' scalars
    stride_kn: VALUE
    stride_vn: VALUE
    d_mask: VALUE
    table: VALUE
    max_pages: VALUE
    num_pages: VALUE
    stride_kb: VALUE
    stride_vb: VALUE
    bh: VALUE
    threshold: VALUE

    @triton.constexpr_function
    def __init__(self, q, k_ptrs, v_ptrs, start_m, offs_m, mod_args, stride_kn, stride_vn, d_mask, table, max_pages,
                 num_pages, stride_kb, stride_vb, bh, threshold):
        keep_all(self, dict(locals()))


@triton.jit
def _fwd_step(acc, l_i, m_i, start_n, tile, seed, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
              MODS: tl.constexpr, DOT_PRECISION: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """One K/V block: S = Q K^T, online-softmax update of (m_i, l_i), acc += P V."""
    mod_args = tile.mod_args
    q, k_ptrs, v_ptrs, start_m, offs_m, sk = tile.q, tile.k_ptrs, tile.v_ptrs, tile.start_m, tile.offs_m, mod_args.sk
    diag_offset, left, right, qk_scale = mod_args.diag_offset, mod_args.left, mod_args.right, mod_args.qk_scale
    softcap, slope, stride_kn, stride_vn = mod_args.softcap, mod_args.slope, tile.stride_kn, tile.stride_vn
    d_mask, table, max_pages, num_pages = tile.d_mask, tile.table, tile.max_pages, tile.num_pages
    stride_kb, stride_vb, bh, threshold = tile.stride_kb, tile.stride_vb, tile.bh, tile.threshold
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if PAGE_SIZE > 0:  # k_ptrs / v_ptrs hold the head and head-dim offsets only
        page, row = page_of(table, start_n, tl.arange(0, BLOCK_N), max_pages, num_pages, PAGE_SIZE, BLOCK_N)
        k_ptrs = k_ptrs + (page * stride_kb + row * stride_kn)[:, None]
        v_ptrs = v_ptrs + (page * stride_vb + row * stride_vn)[:, None]
    else:
        k_ptrs = k_ptrs + tl.cast(start_n, tl.int64) * stride_kn
        v_ptrs = v_ptrs + tl.cast(start_n, tl.int64) * stride_vn
    k, v = load_tile_pair(k_ptrs, v_ptrs, offs_n[:, None] < sk, d_mask, MASKED, EVEN_D)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32
    s2, _ = scores_log2(qk, offs_m[:, None], offs_n[None, :], qk_scale, softcap, slope,
                        diag_offset, MODS)
    if MASKED:
        ok = visible(offs_m[:, None], offs_n[None, :], diag_offset, sk, left, right, MODS)
        s2 = tl.where(ok, s2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        # a row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        m_sub = m_new
    p = tl.exp2(s2 - m_sub[:, None])  # P_tilde, (BLOCK_M, BLOCK_N)
    alpha = tl.exp2(m_i - m_sub)  # rescales what was accumulated under the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if HAS_DROPOUT:  # l sums P before dropout; only P V sees the mask (1 / (1 - p) comes at the end)
        BLOCK_M: tl.constexpr = offs_m.shape[0]
        keep = dropout_keep(seed, bh, start_m, BLOCK_M, start_n, BLOCK_N, threshold, False)
        p = tl.where(keep, p, 0.0)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# Lengths, window and head dim are not specialised (divisibility by 16): one compiled variant per
# tile and flag set instead of several per shape, which kept the 1152-case cuda grid's compile time
# to minutes.
@triton.jit(do_not_specialize=["sq", "sk", "total_q", "total_k", "max_pages", "num_pages", "left",
                               "right", "threshold"])
def _fwd_kernel(
    Q, K, V, Out, Lse, Slopes, CuSeqQ, CuSeqK, SeqUsedK, BlockTable, Rng, Sink,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_slope_b, stride_slope_h, stride_tb,
    nheads, group, sq, sk, total_q, total_k, max_pages, num_pages, left, right, qk_scale, softcap,
    threshold, dropout_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MODS: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_SINK: tl.constexpr,
):
    start_m, bh, b, h, hk = q_block_program(nheads, group, BLOCK_M, MODS.right)
    q_start, sq, k_start, sk = seq_bounds(b, CuSeqQ, CuSeqK, SeqUsedK, sq, sk, total_q, total_k,
                                          IS_VARLEN, HAS_SEQUSED, PAGE_SIZE > 0)
    if IS_VARLEN:
        if start_m >= sq:  # the grid covers the longest sequence
            return
    diag_offset = sk - sq

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = head_dim_mask(offs_d, HEAD_DIM, EVEN_D)
    q_ptrs = (Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
              + (q_start + offs_m)[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd)
    if PAGE_SIZE > 0:  # rows come from the page table in each step
        table = BlockTable + b.to(tl.int64) * stride_tb
        k_ptrs = K + hk.to(tl.int64) * stride_kh + offs_d[None, :] * stride_kd
        v_ptrs = V + hk.to(tl.int64) * stride_vh + offs_d[None, :] * stride_vd
    else:
        table = BlockTable
        k_ptrs = (K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
                  + (k_start + offs_n)[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd)
        v_ptrs = (V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
                  + (k_start + offs_n)[:, None].to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd)
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < sq) & d_mask, other=0.0)

    slope = 0.0
    if MODS.alibi:
        slope = tl.load(Slopes + b * stride_slope_b + h * stride_slope_h)
    seed = (0, 0, 0)
    if HAS_DROPOUT:
        seed = dropout_seed(Rng)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, full_lo, full_hi, hi = block_range(start_m, BLOCK_M, BLOCK_N, sk, diag_offset, left, right,
                                           MODS.left, MODS.right)
    tile = FwdTile(q, k_ptrs, v_ptrs, start_m, offs_m, ModArgs(sk, diag_offset, left, right, qk_scale, softcap,
                   slope), stride_kn, stride_vn, d_mask, table, max_pages, num_pages, stride_kb, stride_vb, bh,
                   threshold)
    for phase in tl.static_range(3):  # masked blocks, those every row sees whole, masked blocks
        first, last = phase_blocks(phase, lo, full_lo, full_hi, hi)
        for start_n in range(first, last, BLOCK_N):
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, start_n, tile, seed, BLOCK_N, phase != 1, EVEN_D, MODS,
                                      DOT_PRECISION, PAGE_SIZE, HAS_DROPOUT)

    if HAS_SINK:
        acc, l_i, m_i = fold_sink(acc, l_i, m_i, Sink, h)
    # Rows that saw no key (nor a sink): l = 0 -> output 0 and LSE = -inf (log of an empty sum).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if HAS_DROPOUT:
        l_safe = l_safe / dropout_scale
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    o_ptrs = (Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
              + (q_start + offs_m)[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m[:, None] < sq) & d_mask)
    lse_ptrs = Lse + lse_row_base(b, h, nheads, sq, q_start, total_q, IS_VARLEN) + offs_m
    tl.store(lse_ptrs, lse, mask=offs_m < sq)


def plan(env: list, softmax_scale: float, window: tuple, softcap: float, varlen, dropout) -> Plan:
    """The launch of _fwd_kernel for the call whose tensors are env (ops.prefill.forward_tensors, as
    distinct() made it: every tensor is taken from there); varlen and dropout hold env's tensors."""
    q, k, v, out, lse, alibi_slopes, *_, rng, sink, _ = env
    h, d = q.shape[-2:]
    hk = k.shape[-2]
    b, sq, sk = grid_lengths(q, k, varlen)
    # "causal" for the tiles: any right bound (a window's too), so that top-left causal masks of
    # every seqlen_q - seqlen_k (scaled_dot_product_attention's) run one kernel
    right_bounded = window[1] is not None
    qk_scale, softcap = kernel_scale(softmax_scale, softcap)
    left, right = window
    if varlen is None:
        strides = (*q.stride(), *k.stride(), *v.stride(), *out.stride())
    else:
        packed_kv = varlen.block_table is None
        strides = (*seq_strides(q, True), *seq_strides(k, packed_kv), *seq_strides(v, packed_kv),
                   *seq_strides(out, True))
    vl_tensors, (stride_tb, total_q, total_k, max_pages, num_pages), vl_flags = varlen_args(q, k, varlen)
    rng, threshold, dropout_scale, has_dropout = dropout_args(dropout)
    cfg = configs.forward_config(d, q.dtype, q.device, causal=right_bounded)
    block_d = configs.padded_headdim(d)
    return Plan.of(env, _fwd_kernel, (cdiv(sq, cfg.block_m), h, b),
                   (q, k, v, out, lse, alibi_slopes, *vl_tensors, rng, sink),
                   (*strides, *alibi_strides(alibi_slopes),
                    stride_tb, h, h // hk, sq, sk, total_q, total_k, max_pages, num_pages, left or 0, right or 0,
                    qk_scale, softcap, threshold, dropout_scale),
                   cfg.num_warps, cfg.num_stages, None,
                   dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                        MODS=Mods.of(window, softcap, alibi_slopes), EVEN_D=d == block_d,
                        DOT_PRECISION=dot_precision(q.dtype), HAS_DROPOUT=has_dropout, HAS_SINK=sink is not None,
                        **vl_flags))

