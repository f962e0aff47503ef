"""The orders in which the kernels walk their programs or tiles (ops.schedule.chunked_order and
head_chunked_order, the Hopper kernels' chunks of heads under a right-bounded mask): every
(program, head) pair once, in the order their docstrings give."""

import pytest
import torch
import triton
import triton.language as tl

from flashtile.ops.schedule import chunked_order, head_chunked_order

pytestmark = pytest.mark.interpret


@triton.jit
def _chunked_kernel(Out, n_programs, n_heads, chunk):
    lin = tl.program_id(0)
    program, head = chunked_order(lin, n_programs, n_heads, chunk)
    tl.store(Out + lin * 2, program)
    tl.store(Out + lin * 2 + 1, head)


@triton.jit
def _head_chunked_kernel(Out, n_programs, n_heads, HEAD_CHUNK: tl.constexpr):
    program, head = head_chunked_order(n_programs, n_heads, HEAD_CHUNK)
    slot = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)
    tl.store(Out + slot * 2, program)
    tl.store(Out + slot * 2 + 1, head)


def chunked(n_programs: int, n_heads: int, chunk: int) -> list:
    """Program 0 of each head of a chunk, then program 1 of each, ...; the last chunk may be short."""
    return [[p, c + h] for c in range(0, n_heads, chunk) for p in range(n_programs)
            for h in range(min(chunk, n_heads - c))]


@pytest.mark.parametrize("n_programs,n_heads,chunk", [(5, 7, 1), (5, 7, 3), (5, 7, 7), (5, 7, 64), (1, 9, 4),
                                                      (8, 1, 4), (6, 8, 4)], ids=str)
def test_chunked_order(n_programs, n_heads, chunk):
    out = torch.full((n_programs * n_heads, 2), -1, dtype=torch.int32)
    _chunked_kernel[(n_programs * n_heads,)](out, n_programs, n_heads, chunk)
    assert out.tolist() == chunked(n_programs, n_heads, chunk)


@pytest.mark.parametrize("chunk", [1, 4])
def test_head_chunked_order(chunk):
    """HEAD_CHUNK = 1: the 3D grid (programs, heads, batch), head b * heads + h of program (x, h, b);
    more: the 1D grid in chunked_order."""
    n_programs, heads, batch = 3, 5, 2
    out = torch.full((n_programs * heads * batch, 2), -1, dtype=torch.int32)
    grid = (n_programs, heads, batch) if chunk == 1 else (n_programs * heads * batch, 1, 1)
    _head_chunked_kernel[grid](out, n_programs, heads * batch, HEAD_CHUNK=chunk)
    if chunk == 1:
        expected = [[x, b * heads + h] for b in range(batch) for h in range(heads) for x in range(n_programs)]
    else:
        expected = chunked(n_programs, heads * batch, chunk)
    assert out.tolist() == expected
