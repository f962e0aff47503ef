"""Flash-Decoding (Dao, Haziza, Massa, Sizov, 2023) in plain PyTorch: split the keys, merge by LSE.

With one query per sequence the only long axis left is the keys, so they are cut into S chunks,
attention is computed on each chunk independently (`split_partials`: a partial output O_s and its
log-sum-exp L_s, each chunk being an FA2 loop on a GPU SM of its own), and the chunks are combined
exactly (`merge`):

    L = log sum_s exp(L_s),    O = sum_s exp(L_s - L) O_s

A chunk that sees no key has L_s = -inf and weight 0; a row where every chunk is empty gets O = 0
and L = -inf, like a fully masked row of `naive`. `merge` is also the CPU path of the public
`merge_attention_states`, so it takes any leading shape.

An attention sink (a logit t with no value, gpt-oss) is one more piece: O = 0, L = t. It joins once,
after the pieces are merged (`add_sink`), never once per piece.
"""

from __future__ import annotations

import torch

from flashtile import _checks
from flashtile.reference import _tiles, fa2
from flashtile.reference._tiles import exp_minus, finite_or_zero, nonzero


def split_bounds(seqlen_k: int, num_splits: int) -> list[int]:
    """Chunk boundaries [0, c, 2c, ..., seqlen_k] with c = ceil(seqlen_k / num_splits).

    Always num_splits + 1 entries; with more splits than keys the trailing chunks are empty.
    """
    _tiles.check_block("num_splits", num_splits)
    chunk = max(1, -(-seqlen_k // num_splits))
    return [min(s * chunk, seqlen_k) for s in range(num_splits + 1)]


def _check_bounds(bounds, seqlen_k: int) -> list[int]:
    bounds = [int(x) for x in bounds]
    ok = len(bounds) >= 2 and bounds[0] == 0 and bounds[-1] == seqlen_k
    if not ok or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"bounds must rise from 0 to seqlen_k={seqlen_k} (equal neighbours make an "
                         f"empty split), got {bounds}")
    return bounds


def split_partials(q, k, v, num_splits=1, softmax_scale=None, causal=False, window_size=(-1, -1),
                   softcap=0.0, alibi_slopes=None, bounds=None, block_m=fa2.BLOCK_M,
                   block_n=fa2.BLOCK_N, counter=None):
    """Attention of q over each chunk of the keys on its own. Returns (out_partial, lse_partial).

    q (b, sq, h, d), k and v (b, sk, hk, d) and the feature arguments as `fa2.forward` (masks stay
    aligned to the full sk, so a chunk sees exactly the keys it would see unsplit). The keys are cut
    by `split_bounds(sk, num_splits)`, or by `bounds` (S + 1 non-decreasing ints from 0 to sk) when
    given. out_partial (S, b, sq, h, d) and lse_partial (S, b, sq, h), both float32 (float64 for
    float64 inputs): each split's normalised output and log-sum-exp, laid out so that
    `merge(out_partial, lse_partial)` combines them. Empty chunks have out 0 and lse -inf.
    """
    p = _tiles.Problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes)
    _tiles.check_block("block_m", block_m)
    _tiles.check_block("block_n", block_n)
    bounds = split_bounds(p.sk, num_splits) if bounds is None else _check_bounds(bounds, p.sk)
    io = counter or _tiles.NO_COUNTER
    outs, lses = [], []
    for lo, hi in zip(bounds, bounds[1:]):  # one GPU program per (b, h, split)
        O_s, L_s = fa2.attend(p, lo, hi, block_m, block_n, io)  # (b, h, sq, d), (b, h, sq)
        outs.append(O_s.transpose(1, 2))  # (b, sq, h, d)
        lses.append(L_s.transpose(1, 2))  # (b, sq, h)
    return torch.stack(outs), torch.stack(lses)


def add_sink(out, lse, sink):
    """Fold the attention sink into finished attention: out (*, d) and lse (*) over some keys, and
    one more key of logit `sink` (broadcastable to lse's shape) with no value. Returns (out * exp(lse -
    lse'), lse') with lse' = logaddexp(lse, sink), in the inputs' dtypes: a row that saw no key
    gets out 0 and lse = sink; a sink of +inf takes all the weight (out 0, lse +inf), shared
    equally with attention whose lse is +inf too (exp_minus)."""
    sink = sink.to(lse.dtype)
    new = torch.logaddexp(lse, sink)
    m = finite_or_zero(new)
    w, w_sink = exp_minus(lse, m), exp_minus(sink, m)  # (*): w + w_sink = 1 unless both are +inf or empty
    w = w / nonzero(w + w_sink)
    return (out * w[..., None].to(out.dtype)).to(out.dtype), new


def merge(out_partial, lse_partial, counter=None, sink=None):
    """Combine partial attention results exactly. Returns (out, lse).

    out_partial (S, *, d) and lse_partial (S, *) with the same leading shape, float dtypes, natural
    log; S >= 1. Computes in float32 (float64 if either input is float64). out (*, d) in
    out_partial's dtype, lse (*) in lse_partial's dtype. Splits with lse -inf contribute nothing
    (whatever their out holds); where every split is empty, out is 0 and lse -inf. Splits with lse
    +inf take all the weight, in equal shares (out their mean, lse +inf). sink: the attention
    sink's logit, broadcastable to (*), added once as one more piece (out 0), or None.
    """
    if not isinstance(out_partial, torch.Tensor):
        raise TypeError(f"out_partial must be a torch.Tensor, got {type(out_partial).__name__}")
    if out_partial.dim() < 2 or out_partial.shape[0] < 1:
        raise ValueError(f"out_partial must be (S, *, d) with S >= 1, got shape {tuple(out_partial.shape)}")
    _checks.check_tensor("out_partial", out_partial, out_partial.dim())
    _checks.check_tensor("lse_partial", lse_partial, out_partial.dim() - 1)
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        raise ValueError(f"lse_partial must have shape {tuple(out_partial.shape[:-1])} (out_partial's "
                         f"without its last dimension), got {tuple(lse_partial.shape)}")
    if lse_partial.device != out_partial.device:
        raise ValueError(f"lse_partial must be on {out_partial.device}, got {lse_partial.device}")
    io = counter or _tiles.NO_COUNTER
    io.read(out_partial, lse_partial)
    dtype = torch.promote_types(_tiles.compute_dtype(out_partial.dtype),
                                _tiles.compute_dtype(lse_partial.dtype))
    L_s = lse_partial.to(dtype)  # (S, *)
    O_s = out_partial.to(dtype)  # (S, *, d)
    if sink is not None:  # one more piece, out 0 and lse = the sink (as the kernels start their merge)
        L_s = torch.cat((L_s, torch.broadcast_to(sink.to(dtype), L_s.shape[1:])[None]))
        O_s = torch.cat((O_s, O_s.new_zeros((1,) + O_s.shape[1:])))
    L_max = finite_or_zero(L_s.amax(0))  # (*), 0 where every split is empty
    w = exp_minus(L_s, L_max)  # (S, *) exp(L_s - L_max); 0 for an empty split, 1 for +inf
    w_sum = w.sum(0)  # (*)
    O_s = torch.where(w[..., None] > 0, O_s, 0.0)  # (S, *, d) empty splits dropped
    out = (w[..., None] * O_s).sum(0) / nonzero(w_sum)[..., None]  # (*, d)
    # -inf where every split is empty, through a where: log(0)'s gradient would be NaN there
    lse = torch.where(w_sum > 0, L_max + torch.log(nonzero(w_sum)), float("-inf"))  # (*)
    io.write(out, lse)
    return out.to(out_partial.dtype), lse.to(lse_partial.dtype)


def attention(q, k, v, num_splits=1, softmax_scale=None, causal=False, window_size=(-1, -1),
              softcap=0.0, alibi_slopes=None, bounds=None, block_m=fa2.BLOCK_M, block_n=fa2.BLOCK_N,
              counter=None):
    """Flash-Decoding end to end: `merge(*split_partials(...))`. Returns (out, lse).

    Arguments as `split_partials`. out (b, sq, h, d) in q's dtype; lse (b, h, sq) float32 (float64
    for float64 inputs), as `fa2.forward` returns them.
    """
    out_partial, lse_partial = split_partials(
        q, k, v, num_splits, softmax_scale, causal, window_size, softcap, alibi_slopes, bounds,
        block_m, block_n, counter)
    out, lse = merge(out_partial, lse_partial, counter)  # (b, sq, h, d), (b, sq, h)
    return out.to(q.dtype), lse.transpose(1, 2)
