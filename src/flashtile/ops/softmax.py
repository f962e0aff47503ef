"""The online softmax's shared steps, in the log2 domain of every kernel.

Scores live in the log2 domain inside the kernels: s2 = log2(e) * score, so exp2 replaces exp
(FlashAttention-2's kernels and FA4's `softmax.py` do the same). A row's running max m and sum l
are fp32; `exp_minus` is the one rule for exp2(x - m) that also holds where m is infinite (a row
that sees nothing, a sink of +inf); `fold_sink` adds an attention sink to a row's sum once.
"""

import math

import triton
import triton.language as tl

# tl.constexpr so jit code can read them; launchers use .value
LOG2E = tl.constexpr(math.log2(math.e))  # exp(x) = exp2(x * LOG2E)


LN2 = tl.constexpr(math.log(2.0))  # ln(x) = log2(x) * LN2


@triton.jit
def fold_sink(acc, l_i, m_i, Sink, heads):
    """Add the attention sink to a finished online softmax: one more key per row, of logit
    Sink[heads] (natural log, any float dtype; heads a scalar or one head per row) and no value.

    (acc, l_i, m_i) in the log2 domain as the loops leave them (acc unnormalised, l_i = sum of
    exp2(s2 - m_i), m_i = -inf for a row that saw no key) -> the same three with the sink in l_i:
    the caller's epilogue is unchanged, and a row that saw no key gets out = 0 and lse = sink.
    """
    sink2 = tl.load(Sink + heads).to(tl.float32) * LOG2E
    m_new = tl.maximum(m_i, sink2)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # a sink of -inf on an empty row: stays empty
    alpha = tl.exp2(m_i - m_sub)
    # a sink of +inf takes every row's weight (out 0, lse +inf) where its exp2(inf - inf) is NaN
    return acc * alpha[:, None], l_i * alpha + exp_minus(sink2, m_sub, 1.0), m_new


@triton.jit
def exp_minus(x, m_sub, unit):
    """exp2((x - m_sub) * unit) for a term x of a merge whose running max is m_sub (0 for an empty
    row), unit 1 in the log2 domain and LOG2E in the natural one, with a term of +inf weighing 1
    where inf - inf is NaN: it takes all the weight, shared equally with other +inf terms (a sink
    of +inf, a piece whose LSE is +inf; reference._tiles.exp_minus)."""
    return tl.exp2(tl.where(x == float("inf"), 0.0, (x - m_sub) * unit))

