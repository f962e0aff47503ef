"""Host code the launchers share: strides, sequence lengths, TMA boxes, and the slots of a
prefill call's tensors from which its plans take their arguments (ops.prefill)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from triton.experimental.gluon import language as gl

from flashtile import _checks
from flashtile.ops._launch import Box


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow torch's tf32 switch (DESIGN.md Numerics); half inputs use plain dots."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def seq_strides(t, packed: bool) -> tuple:
    """Strides of a BSHD tensor, or of a packed (total, heads, d) one with a batch stride of 0
    (seq_bounds moves each sequence to its first row). Pages (num_pages, page_size, heads, d) keep
    theirs: the page stride sits in the batch slot. Plain tuples: this is on every call's host path."""
    return (0, *t.stride()) if packed else t.stride()


def grid_lengths(q, k, varlen) -> tuple:
    """(batch, rows, keys) that size the grid: the tensors' for a dense batch, the number of
    sequences and the longest ones for a packed batch."""
    if varlen is None:
        return q.shape[0], q.shape[1], k.shape[1]
    return varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k


_DENSE_ARGS = ((None, None, None, None), (0, 0, 0, 0, 0), dict(IS_VARLEN=False, HAS_SEQUSED=False, PAGE_SIZE=0))


def varlen_args(q, k, varlen) -> tuple:
    """(tensors, scalars, constexprs) that every prefill kernel takes for a packed/paged batch."""
    if varlen is None:
        return _DENSE_ARGS
    table = varlen.block_table
    paged = table is not None
    total_k = table.shape[1] * k.shape[1] if paged else k.shape[0]
    return ((varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_k, table),
            (table.stride(0) if paged else 0, q.shape[0], total_k, table.shape[1] if paged else 0,
             k.shape[0] if paged else 0),
            dict(IS_VARLEN=True, HAS_SEQUSED=varlen.seqused_k is not None,
                 PAGE_SIZE=k.shape[1] if paged else 0))


def dropout_args(dropout) -> tuple:
    """(rng tensor, threshold, scale, HAS_DROPOUT) from dropout = (p, rng) or None."""
    if dropout is None or dropout[0] == 0:
        return None, 0, 1.0, False
    threshold, scale = _checks.dropout_threshold(dropout[0])
    return dropout[1], threshold, scale, True


def tensor_meta(t) -> tuple | None:
    """What a launch plan depends on of an optional tensor argument."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() & 15)


def tma_ok(t) -> bool:
    """Can the copy engine (TMA) read t? Non-empty, 16-byte aligned base, positive 16-byte aligned
    strides, contiguous last dim (an expanded gradient, with 0 strides, takes the pointer path)."""
    size = t.element_size()
    return (t.numel() > 0 and t.data_ptr() % 16 == 0 and t.stride(-1) == 1
            and all(st > 0 and st * size % 16 == 0 for st in t.stride()[:-1]))


def tma_refusal(**tensors) -> str | None:
    """Why the copy engine cannot read one of these tensors (by name), or None (tma_ok)."""
    for name, t in tensors.items():
        if not tma_ok(t):
            return (f"TMA cannot address {name} (strides {tuple(t.stride())}, address % 16 = {t.data_ptr() % 16}; "
                    "it needs 16-byte aligned rows and a contiguous head dim)")
    return None


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}


@functools.lru_cache(maxsize=None)
def tma_box_layout(rows: int, d: int, dtype):
    """Shared-memory layout of a TMA box of `rows` positions of one head of a BSHD tensor (a frozen
    dataclass: made once per shape, not on every call's host path)."""
    return gl.NVMMASharedLayout.get_default_for([1, rows, 1, d], _GL_DTYPES.get(dtype, dtype))


def box_descriptor(t, rows: int, cols: int | None = None, packed: bool = False) -> Box:
    """A TMA descriptor over a BSHD tensor whose box is `rows` positions of one head (and `cols` of
    its head dim, all by default): rows past the sequence's end read as zeros and are not written
    (never the next batch's rows). A packed batch (packed: t is (total, heads, d)), read as (1,
    total, heads, d), reads on into the next sequence's rows there: the kernels mask them."""
    cols = t.shape[-1] if cols is None else cols
    shape, strides = t.shape, t.stride()
    if packed:  # t.unsqueeze(0)'s, over t itself (a plan's box names the call's tensor)
        shape, strides = (1, *shape), (shape[0] * strides[0], *strides)
    return Box(t, shape, strides, (1, rows, 1, cols), tma_box_layout(rows, cols, t.dtype))


# The call's tensors, in the order of prefill.forward_tensors, from which a plan's launch takes its arguments
COUNTER = 12  # the Hopper kernel's tile counter (tile_counter), filled in where a plan takes it

# The call's tensors, in the order of prefill.backward_tensors, from which a plan's launches take their
# arguments; the last four are buffers between the launches, made per call as the plan says
(DOUT, Q, K, V, OUT, LSE, DQ, DK, DV, DELTA, SLOPES, CU_Q, CU_K, SEQUSED, RNG, LSE2, DELTA2, DQ_ACC,
 TURNS) = range(19)


class BackwardPlan(NamedTuple):
    """The backward's launches for one description of its call (attention_backward), and what it
    does around them per call."""

    launches: tuple  # Plans, launched in order
    zero_grads: bool  # dK and dV zeroed first (keys past seqused_k, or no query rows)
    delta: bool  # delta gets a buffer shaped like the LSE (none given)
    stats: int  # Hopper: rows of the fp32 log2-LSE and delta buffers the delta launch fills (0: none)
    dq_acc: bool  # Hopper: dQ sums in an fp32 buffer shaped like q, zeroed by the delta launch (else in dq)
    turns: int  # Hopper, deterministic: int32 counters, zeroed (0: none)
    dq_scale: float  # Hopper: dq = dQ sum * dq_scale, or with accumulate_dq dq += it (0: nothing to do)


