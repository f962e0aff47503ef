"""The prefill passes' entry points: attention_forward and attention_backward.

A call is planned once per description of it (plan_key: shapes, strides, dtypes, alignments,
options) and replayed: the plan holds the launches of the kernel ops.dispatch chose for it, with
their tiles, grids, scalars and TMA boxes (ops._launch.Plan). A call that matches a plan allocates
its outputs and launches.
"""

from __future__ import annotations

import torch

from flashtile.ops import backward, backward_sm90, configs, dispatch, forward, forward_sm90
from flashtile.ops._launch import Plan, distinct, new_plans, remember
from flashtile.ops.host import (
    COUNTER,
    DELTA,
    DELTA2,
    DQ_ACC,
    LSE2,
    RNG,
    TURNS,
    BackwardPlan,
    dropout_args,
    grid_lengths,
    tensor_meta,
)
from flashtile.ops.mods import kernel_scale

_forward_plans = new_plans()  # plan_key -> Plan


def plan_key(q, k, v, out, softmax_scale, window, softcap, alibi_slopes, varlen, dropout, sink) -> tuple:
    """Everything a prefill launch is derived from (the forward's and the backward's plans): shapes,
    strides, dtypes, the device, each tensor's address modulo 16 (TMA boxes and Triton's pointer
    specialisation), the options, the tf32 switch of fp32 dots and configs.generation (a replaced
    config function plans anew)."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, q.data_ptr() & 15,
            k.data_ptr() & 15, v.data_ptr() & 15, tensor_meta(out), softmax_scale, window, softcap,
            tensor_meta(alibi_slopes),
            None if varlen is None else (varlen.max_seqlen_q, varlen.max_seqlen_k, tensor_meta(varlen.cu_seqlens_q),
                                         tensor_meta(varlen.cu_seqlens_k), tensor_meta(varlen.seqused_k),
                                         tensor_meta(varlen.block_table)),
            None if dropout is None else dropout[0], tensor_meta(sink),
            q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32, configs.generation)


def forward_tensors(q, k, v, out, lse, alibi_slopes, varlen, dropout, sink) -> list:
    """A forward call's tensors in the plans' order (COUNTER's slot empty)."""
    vl = (None,) * 4 if varlen is None else (varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_k,
                                              varlen.block_table)
    return [q, k, v, out, lse, alibi_slopes, *vl, None if dropout is None else dropout[1], sink, None]


def attention_forward(q, k, v, softmax_scale: float, window: tuple, softcap: float = 0.0,
                      alibi_slopes=None, out=None, varlen=None, dropout=None, sink=None):
    """Launch the forward. q (b, sq, h, d), k/v (b, sk, hk, d), any strides, fp16/bf16/fp32; or
    with varlen (a checked _checks.Varlen) q (total_q, h, d) and k/v (total_k, hk, d) or pages.

    window = (left, right), None for an unbounded side (causal is right = 0; right may be negative,
    as torch's top-left causal needs when sq < sk). dropout = (p, rng): drop probability and the
    (2,) int64 Philox seed tensor (reference.dropout.draw_rng). sink: the attention sink, (h,)
    contiguous, any float dtype, natural log, or None. Returns out shaped like q in q's
    dtype (written into `out` when given) and lse, float32, natural log: (b, h, sq), or (h,
    total_q) with varlen.

    What the launch takes from the call's shapes, strides, dtypes and options (the kernel, its
    tiles, grid, scalars, TMA boxes) is planned once per description of the call (plan_key) and
    replayed: a call that matches one allocates its outputs and launches (the host path of small
    calls: README, "Small calls and compilation").
    """
    key = plan_key(q, k, v, out, softmax_scale, window, softcap, alibi_slopes, varlen, dropout, sink)
    plan = _forward_plans.get(key)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[-2], q.shape[1]) if varlen is None else (q.shape[-2], q.shape[0]),
                      dtype=torch.float32, device=q.device)
    env = forward_tensors(q, k, v, out, lse, alibi_slopes, varlen, dropout, sink)
    if plan is None:
        plan = remember(_forward_plans, key, _forward_plan(distinct(env), softmax_scale, window, softcap, varlen,
                                                           dropout))
    if COUNTER in plan.slots:
        env[COUNTER] = forward_sm90.tile_counter(q.device)
    plan.run(env)
    return out, lse



_backward_plans = new_plans()  # (plan_key, the backward's own) -> BackwardPlan


def backward_tensors(dout, q, k, v, out, lse, dq, dk, dv, delta, alibi_slopes, varlen, dropout) -> list:
    """A backward call's tensors in the plans' order (the buffers' slots empty)."""
    vl = (None,) * 3 if varlen is None else (varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_k)
    return [dout, q, k, v, out, lse, dq, dk, dv, delta, alibi_slopes, *vl, None if dropout is None else dropout[1],
            None, None, None, None]


def attention_backward(dout, q, k, v, out, lse, softmax_scale: float, window: tuple,
                       softcap: float = 0.0, alibi_slopes=None, dq=None, dk=None, dv=None, varlen=None,
                       dropout=None, delta=None, deterministic: bool = False, accumulate_dq: bool = False):
    """Launch the backward. Shapes and varlen / dropout as attention_forward (varlen
    without block_table); lse as it returned.

    Returns (dq, dk, dv) shaped like q, k, v (dk/dv summed over each GQA group), written into the
    given dq/dk/dv when passed (e.g. views of one packed gradient buffer). Keys past seqused_k get
    zero gradients. delta: where to leave delta = rowsum(dO * O), shaped like lse (the attention
    sink's gradient is made of it: autograd.sink_grad); by default a buffer of its own.
    deterministic: bitwise reproducible gradients. The Triton programs always are (dQ without
    atomics); the Hopper kernel (configs.hopper_backward_config, the calls it supports) then adds
    dQ's parts in a fixed order, else in the order the programs come (as flash-attn's), which
    varies from run to run. Deterministic calls keep the Triton programs where the Hopper kernel
    has no fixed order (configs.hopper_backward_ordered).
    accumulate_dq: dq is a float32 tensor shaped like q, and the call adds dQ / softmax_scale into
    it: the sum the Hopper kernel keeps anyway, left unscaled (ring attention sums the dQ of a
    shard's pieces so, without a buffer per piece, and scales the sum once; with dropout the
    Hopper kernel's dQ is in units of backward_ds_unit, and goes through a buffer of its own).
    As the forward, the launches are planned once per description of the call and replayed.
    """
    if accumulate_dq and (dq is None or dq.dtype != torch.float32 or dq.shape != q.shape):
        raise ValueError(f"accumulate_dq needs dq: a float32 tensor shaped like q {tuple(q.shape)}, got "
                         f"{None if dq is None else (dq.dtype, tuple(dq.shape))}")
    if varlen is not None and varlen.block_table is not None:
        raise ValueError("the backward reads contiguous k/v: gather the pages first (the API does)")
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if dq is None else dq
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if dk is None else dk
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if dv is None else dv
    key = (plan_key(q, k, v, out, softmax_scale, window, softcap, alibi_slopes, varlen, dropout, None),
           tensor_meta(dout), tensor_meta(lse), tensor_meta(dq), tensor_meta(dk), tensor_meta(dv), tensor_meta(delta),
           deterministic, accumulate_dq)
    plan = _backward_plans.get(key)
    env = backward_tensors(dout, q, k, v, out, lse, dq, dk, dv, delta, alibi_slopes, varlen, dropout)
    if plan is None:  # distinct(): a call with one tensor in two slots must not plan for every later call
        plan = remember(_backward_plans, key, _backward_plan(distinct(env), softmax_scale, window, softcap, varlen,
                                                             dropout, deterministic, accumulate_dq))
    if plan.zero_grads:
        dk.zero_()
        dv.zero_()
    if plan.delta:
        env[DELTA] = torch.empty_like(lse)
    if plan.stats:
        env[LSE2], env[DELTA2] = torch.empty((2, plan.stats), dtype=torch.float32, device=q.device).unbind(0)
    if plan.dq_acc:  # zeroed by the plan's first launch
        env[DQ_ACC] = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if plan.turns:
        env[TURNS] = torch.zeros(plan.turns, dtype=torch.int32, device=q.device)
    for launch in plan.launches:
        launch.run(env)
    if plan.dq_scale:
        if not accumulate_dq:
            torch.mul(env[DQ_ACC], plan.dq_scale, out=dq)
        else:
            dq.add_(env[DQ_ACC], alpha=plan.dq_scale)
    return dq, dk, dv


def forward_choice(q, k, v, out, softmax_scale, window, softcap, alibi_slopes, varlen, dropout) -> tuple:
    """ops.dispatch's (choice, Hopper tiles or None) for a forward call."""
    qk_scale, _ = kernel_scale(softmax_scale, softcap)
    return dispatch.prefill_kernel("forward", q.shape[-1], q.dtype, q.device, window[1] is not None, softcap > 0,
                                   dropout_args(dropout)[3], False,
                                   forward_sm90.refusal(q, k, v, out, qk_scale, varlen, alibi_slopes),
                                   configs.generation)


def backward_choice(dout, q, k, v, dq, dk, dv, softmax_scale, window, softcap, alibi_slopes, varlen, dropout,
                    deterministic, accumulate_dq) -> tuple:
    """ops.dispatch's (choice, Hopper tiles or None) for a backward call."""
    return dispatch.prefill_kernel("backward", q.shape[-1], q.dtype, q.device, window[1] is not None, softcap > 0,
                                   dropout_args(dropout)[3], deterministic,
                                   backward_sm90.refusal(q, k, v, dout, dq, dk, dv, softmax_scale, varlen,
                                                         alibi_slopes, accumulate_dq),
                                   configs.generation)


def _described(q, k, window, varlen) -> str:
    """A call's description for FLASHTILE_EXPLAIN's lines."""
    shape = f"{tuple(q.shape)} x {tuple(k.shape)}" + (" packed" if varlen is not None else "")
    return f"{shape} {str(q.dtype).replace('torch.', '')} window={window}"


def _forward_plan(env: list, softmax_scale: float, window: tuple, softcap: float, varlen, dropout) -> Plan:
    """The forward's launch for the call whose tensors are env (forward_tensors, as distinct() made
    it): the kernel ops.dispatch chooses."""
    q, k, v, out, lse, alibi_slopes, cu_q, cu_k, seqused_k, table, rng, sink, _ = env
    if varlen is not None:
        varlen = varlen._replace(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused_k, block_table=table)
    if dropout is not None:
        dropout = (dropout[0], rng)
    b, sq, _ = grid_lengths(q, k, varlen)
    if b * sq == 0:
        return Plan.nothing()
    choice, tiles = forward_choice(q, k, v, out, softmax_scale, window, softcap, alibi_slopes, varlen, dropout)
    dispatch.report("forward", _described(q, k, window, varlen), choice)
    if tiles is not None:
        env[COUNTER] = forward_sm90.tile_counter(q.device)
        return forward_sm90.plan(env, tiles, softmax_scale, window, softcap, varlen, dropout)
    return forward.plan(env, softmax_scale, window, softcap, varlen, dropout)


def _backward_plan(env: list, softmax_scale: float, window: tuple, softcap: float, varlen, dropout,
                   deterministic: bool, accumulate_dq: bool) -> BackwardPlan:
    """The backward's launches for the call whose tensors are env (backward_tensors, as distinct()
    made it): the kernel ops.dispatch chooses."""
    dout, q, k, v, out, lse, dq, dk, dv, delta, alibi_slopes, cu_q, cu_k, seqused_k, rng = env[:RNG + 1]
    if varlen is not None:
        varlen = varlen._replace(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused_k)
    if dropout is not None:
        dropout = (dropout[0], rng)
    b, sq, _ = grid_lengths(q, k, varlen)
    zero_grads = varlen is not None and varlen.seqused_k is not None  # no program writes keys past seqused_k
    if b * q.shape[-2] * sq == 0:  # no query rows: no key gets a gradient
        return BackwardPlan((), True, False, 0, False, 0, 0.0)
    choice, tiles = backward_choice(dout, q, k, v, dq, dk, dv, softmax_scale, window, softcap, alibi_slopes, varlen,
                                    dropout, deterministic, accumulate_dq)
    dispatch.report("backward", _described(q, k, window, varlen), choice)
    if tiles is not None:
        return backward_sm90.plan(env, tiles, softmax_scale, window, softcap, varlen, dropout, accumulate_dq,
                                  deterministic, zero_grads)
    return backward.plan(env, softmax_scale, window, softcap, varlen, dropout, accumulate_dq, zero_grads)
