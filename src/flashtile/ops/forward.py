"""FA2-style forward: one program per (Q block, batch x head); K/V blocks stream through SRAM.

Online softmax in the log2 domain with the scale folded into one multiply, the output kept
unnormalised and divided by l once at the end, the log-sum-exp written for the backward. The KV loop
runs in up to three phases (ops._common.block_range): masked blocks, then blocks every row of the Q
block fully sees (no mask work at all), then masked blocks again; blocks nobody sees are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtile.ops import configs
from flashtile.ops._launch import cdiv, launch
from flashtile.ops._common import (LN2, alibi_strides, block_range, dot_precision, head_dim_mask,
                                   kernel_scale, load_tile_pair, q_block_program, scores_log2,
                                   visible)


@triton.jit
def _fwd_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, start_n, sk, diag_offset, left, right,
              qk_scale, softcap, slope, stride_kn, stride_vn, d_mask,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
              HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One K/V block: S = Q K^T, online-softmax update of (m_i, l_i), acc += P V."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_ptrs = k_ptrs + tl.cast(start_n, tl.int64) * stride_kn
    v_ptrs = v_ptrs + tl.cast(start_n, tl.int64) * stride_vn
    k, v = load_tile_pair(k_ptrs, v_ptrs, offs_n[:, None] < sk, d_mask, MASKED, EVEN_D)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32
    s2, _ = scores_log2(qk, offs_m[:, None], offs_n[None, :], qk_scale, softcap, slope,
                        diag_offset, HAS_SOFTCAP, HAS_ALIBI)
    if MASKED:
        ok = visible(offs_m[:, None], offs_n[None, :], diag_offset, sk, left, right, HAS_LEFT, HAS_RIGHT)
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
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# Lengths, window and head dim are not specialised (divisibility by 16): one compiled variant per
# tile and flag set instead of several per shape, which kept the 1152-case cuda grid's compile time
# to minutes.
@triton.jit(do_not_specialize=["sq", "sk", "left", "right", "head_dim"])
def _fwd_kernel(
    Q, K, V, Out, Lse, Slopes,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_slope_b, stride_slope_h,
    nheads, group, sq, sk, left, right, qk_scale, softcap,
    head_dim, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    start_m, bh, b, h, hk = q_block_program(nheads, group, BLOCK_M, HAS_RIGHT)
    diag_offset = sk - sq

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = head_dim_mask(offs_d, head_dim, EVEN_D)
    q_ptrs = (Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
              + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd)
    k_ptrs = (K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
              + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd)
    v_ptrs = (V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
              + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd)
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < sq) & d_mask, other=0.0)

    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + b * stride_slope_b + h * stride_slope_h)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, full_lo, full_hi, hi = block_range(start_m, BLOCK_M, BLOCK_N, sk, diag_offset, left, right,
                                           HAS_LEFT, HAS_RIGHT)
    for start_n in range(lo, full_lo, BLOCK_N):
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, start_n, sk, diag_offset,
                                  left, right, qk_scale, softcap, slope, stride_kn, stride_vn, d_mask,
                                  BLOCK_N, True, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                                  DOT_PRECISION)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, start_n, sk, diag_offset,
                                  left, right, qk_scale, softcap, slope, stride_kn, stride_vn, d_mask,
                                  BLOCK_N, False, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                                  DOT_PRECISION)
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, start_n, sk, diag_offset,
                                  left, right, qk_scale, softcap, slope, stride_kn, stride_vn, d_mask,
                                  BLOCK_N, True, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                                  DOT_PRECISION)

    # Rows that saw no key: l = 0 -> output 0 and LSE = -inf (log of an empty sum).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    o_ptrs = (Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
              + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m[:, None] < sq) & d_mask)
    tl.store(Lse + bh.to(tl.int64) * sq + offs_m, lse, mask=offs_m < sq)


def attention_forward(q, k, v, softmax_scale: float, window: tuple, softcap: float = 0.0,
                      alibi_slopes=None, out=None):
    """Launch the forward. q (b, sq, h, d), k/v (b, sk, hk, d), any strides, fp16/bf16/fp32.

    window = (left, right), None for an unbounded side (causal is right = 0; right may be negative,
    as torch's top-left causal needs when sq < sk). Returns out (b, sq, h, d)
    in q's dtype (written into `out` when given) and lse (b, h, sq) float32, natural log.
    """
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if out is None:
        out = torch.empty((b, sq, h, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    cfg = configs.forward_config(d, q.dtype, q.device, causal=window[1] == 0, seqlen_k=sk)
    block_d = configs.padded_headdim(d)
    qk_scale, softcap = kernel_scale(softmax_scale, softcap)
    left, right = window
    launch(_fwd_kernel, (cdiv(sq, cfg.block_m), b * h), (q, k, v, out, lse, alibi_slopes),
           (*q.stride(), *k.stride(), *v.stride(), *out.stride(), *alibi_strides(alibi_slopes),
            h, h // hk, sq, sk, left or 0, right or 0, qk_scale, softcap, d),
           cfg.num_warps, cfg.num_stages,
           BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_LEFT=left is not None,
           HAS_RIGHT=right is not None, HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None,
           EVEN_D=d == block_d, DOT_PRECISION=dot_precision(q.dtype))
    return out, lse
