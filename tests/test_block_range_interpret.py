"""Causal/window block skipping: block_range's three phases against a brute-force mask."""

import pytest
import torch
import triton
import triton.language as tl

from flashtile.ops._common import block_range

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
