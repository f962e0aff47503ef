"""Causal/window block skipping: block_range's three phases against a brute-force mask; the
deterministic Hopper backward's turns (dq_order, dq_turn) against block_range's visitors, and its
launch order (key_block_program) against the turns."""

import pytest
import torch
import triton
import triton.language as tl

from flashtile.ops.masks import block_range, dq_order, dq_turn
from flashtile.ops.mods import Mods
from flashtile.ops.schedule import key_block_program

pytestmark = pytest.mark.interpret


@triton.jit
def _ranges_kernel(Out, n_outer, n_inner, offset, left, right, BLOCK_OUTER: tl.constexpr,
                   BLOCK_INNER: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    pid = tl.program_id(0)
    lo, full_lo, full_hi, hi = block_range(pid * BLOCK_OUTER, BLOCK_OUTER, BLOCK_INNER, n_inner, offset,
                                           left, right, HAS_LEFT, HAS_RIGHT)
    tl.store(Out + pid * 4 + 0, lo)
    tl.store(Out + pid * 4 + 1, full_lo)
    tl.store(Out + pid * 4 + 2, full_hi)
    tl.store(Out + pid * 4 + 3, hi)


@pytest.mark.parametrize("sq,sk", [(37, 53), (53, 37), (64, 64), (5, 70), (70, 5)], ids=str)
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (9, 0), (4, 6), (-1, -20)], ids=str)
@pytest.mark.parametrize("blocks", [(16, 16), (16, 32), (32, 8)], ids=str)
def test_block_range_is_tight_and_safe(sq, sk, window, blocks):
    bm, bn = blocks
    left, right = window
    n_outer = triton.cdiv(sq, bm)
    # rows past sq (the padding of the last outer block) count as rows here: the kernels mask them
    i = torch.arange(n_outer * bm).view(-1, 1)
    j = torch.arange(sk).view(1, -1)
    ok = torch.ones(n_outer * bm, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i + sk - sq - left
    if right != -1:
        ok &= j <= i + sk - sq + right
    out = torch.empty(n_outer * 4, dtype=torch.int32)
    _ranges_kernel[(n_outer,)](out, sq, sk, sk - sq, max(left, 0), right if right != -1 else 0,
                               BLOCK_OUTER=bm, BLOCK_INNER=bn, HAS_LEFT=left >= 0, HAS_RIGHT=right != -1)
    for m, (lo, full_lo, full_hi, hi) in enumerate(out.view(-1, 4).tolist()):
        assert lo <= full_lo <= full_hi <= hi
        rows = ok[m * bm:(m + 1) * bm]
        for start in range(0, sk, bn):
            block = rows[:, start:start + bn]
            # every block with a visible pair is computed; every other block is skipped
            assert (lo <= start < hi) == bool(block.any()), (m, start, lo, full_lo, full_hi, hi)
            if full_lo <= start < full_hi:  # the unmasked phase: all of it visible, all in bounds
                assert block.shape[1] == bn and bool(block.all()), (m, start)


@triton.jit
def _launch_turns_kernel(Turns, Launched, sq, sk, left, right, n_row_blocks, n_rows, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, HEAD_CHUNK: tl.constexpr, MODS: tl.constexpr):
    """The deterministic Hopper backward's programs as its kernel finds them (key_block_program,
    then the rows block_range gives and the turns dq_order / dq_turn give): Turns[row, key block,
    Q block], and Launched[row, key block] = the launch index (x fastest, then y, then z)."""
    n_kb = tl.cdiv(sk, BLOCK_N)
    n, row = key_block_program(n_kb, n_rows, HEAD_CHUNK, HEAD_CHUNK != 1, True, MODS)
    lin = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)
    tl.store(Launched + row * n_kb + n, lin)
    lo, _, _, hi = block_range(n * BLOCK_N, BLOCK_N, BLOCK_M, sq, sq - sk, right, left, MODS.right, MODS.left)
    a, c = dq_order(n, n_kb, sq, sk, left, right, BLOCK_M, BLOCK_N, MODS)
    for start_m in range(lo, hi, BLOCK_M):
        tl.store(Turns + (row * n_kb + n) * n_row_blocks + start_m // BLOCK_M,
                 dq_turn(start_m, a, c, BLOCK_N, MODS))


def launch_turns(sq, sk, window, blocks, rows, chunk):
    """(turns, launched) of _launch_turns_kernel over the grid ops.backward_sm90.plan launches:
    (key blocks, K/V heads, batch) with chunk 1, else a 1D grid; rows = (K/V heads, batch)."""
    bm, bn = blocks
    left, right = window
    hk, batch = rows
    n_rows, n_kb, n_row_blocks = hk * batch, triton.cdiv(sk, bn), triton.cdiv(sq, bm)
    turns = torch.full((n_rows, n_kb, n_row_blocks), -1, dtype=torch.int32)
    launched = torch.full((n_rows, n_kb), -1, dtype=torch.int32)
    grid = (n_kb, hk, batch) if chunk == 1 else (n_kb * n_rows, 1, 1)
    _launch_turns_kernel[grid](turns, launched, sq, sk, max(left, 0), right if right >= 0 else 0, n_row_blocks,
                               n_rows, BLOCK_M=bm, BLOCK_N=bn, HEAD_CHUNK=chunk,
                               MODS=Mods(left=left >= 0, right=right >= 0))
    return turns, launched


@pytest.mark.parametrize("sq,sk", [(700, 900), (900, 700), (1024, 1024), (100, 1000), (1000, 100), (1, 300)], ids=str)
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (100, 20), (300, 0), (64, -1), (-1, 64), (0, 0), (-1, -200)],
                         ids=str)
@pytest.mark.parametrize("blocks", [(64, 128), (128, 128), (16, 32)], ids=str)
def test_dq_turns_count_the_visitors_in_launch_order(sq, sk, window, blocks):
    """The deterministic Hopper backward's order of dQ's additions: at every Q block the key blocks
    that visit it (block_range's rows) have the turns 0, 1, ... once each, so each one's wait ends
    at the additions of exactly the ones before it; and those come first in launch order (the last
    key block first under a right bound, where the kernel reverses its grid), so no program waits
    for one launched after it."""
    out, _ = launch_turns(sq, sk, window, blocks, (1, 1), 1)
    out = out[0]
    for m in range(out.shape[1]):
        visitors = sorted((n for n in range(out.shape[0]) if out[n, m] >= 0), reverse=window[1] >= 0)
        assert [int(out[n, m]) for n in visitors] == list(range(len(visitors))), (m, out[:, m].tolist())


@pytest.mark.parametrize("sq,sk", [(700, 900), (900, 700), (1024, 1024)], ids=str)
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (100, 20), (64, -1), (-1, 64)], ids=str)
@pytest.mark.parametrize("rows", [(1, 1), (7, 2)], ids=str)  # (K/V heads, batch)
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_backward_launch_order_follows_the_turns(sq, sk, window, rows, chunk):
    """The deterministic Hopper backward's grid as ops.backward_sm90.plan launches it ((key
    blocks, K/V heads, batch) with one row at a time, a 1D grid in chunks of rows otherwise): every
    (key block, row) once, and at every Q block of every row the visiting key blocks, taken in launch
    order, have the turns 0, 1, ...: each program waits only for programs launched before it (the
    kernel relies on the GPU starting programs in launch order; otherwise it would hang)."""
    turns, launched = launch_turns(sq, sk, window, (64, 128), rows, chunk)
    n_rows, n_kb, n_row_blocks = turns.shape
    assert sorted(launched.flatten().tolist()) == list(range(n_rows * n_kb))
    for r in range(n_rows):
        for m in range(n_row_blocks):
            visitors = sorted((n for n in range(n_kb) if turns[r, n, m] >= 0), key=lambda n: int(launched[r, n]))
            assert [int(turns[r, n, m]) for n in visitors] == list(range(len(visitors))), (r, m)
