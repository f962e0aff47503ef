"""Which tile a program works on: the order of query blocks (heaviest causal blocks first), key
blocks of the backward, and chunks of heads that share L2 (FA4's `tile_scheduler.py` holds the
same decisions).
"""


import triton
import triton.language as tl


@triton.jit
def key_block_program(n_kb, n_rows, chunk, HEAD_CHUNKED: tl.constexpr, DETERMINISTIC: tl.constexpr,
                      MODS: tl.constexpr):
    """(key block, row) of this program of the Hopper backward's grid of n_kb key blocks x n_rows
    (batch, K/V head) rows: with HEAD_CHUNKED a 1D grid in chunks of `chunk` rows (chunked_order;
    the chunk is an argument, so no length compiles another kernel), else the (key blocks, K/V
    heads, batch) grid. DETERMINISTIC under a right bound reverses each row's key blocks (dq_order:
    there the last adds first), so that in every row the key block whose addition into a Q block
    comes first is launched first, the next one after it, and so on: a program only waits for
    programs launched before it (tests/test_block_range_interpret.py)."""
    if HEAD_CHUNKED:
        pid, row = chunked_order(tl.program_id(0), n_kb, n_rows, chunk)
    else:
        pid, row = head_chunked_order(n_kb, n_rows, 1)
    if DETERMINISTIC and MODS.right:
        pid = n_kb - 1 - pid
    return pid, row


@triton.jit
def q_block_program(nheads, group, BLOCK_M: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """(start_m, bh, b, h, hk) of a program of a (Q block, head, batch) grid: batch x heads may
    pass the 65535 programs a grid's y axis holds (batch and heads each stay within it, as in
    flash-attn); bh = b * nheads + h, launched in that order.

    With HEAVY_LAST (a right-bounded mask, e.g. causal) the last Q blocks see the most keys, so
    program 0 takes the last block: the long programs start first and the short ones fill the tail.
    """
    bh = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)
    return q_block_of(tl.program_id(0), tl.num_programs(0), bh, nheads, group, BLOCK_M, HEAVY_LAST)


@triton.jit
def q_block_of(pid_m, n_m, bh, nheads, group, BLOCK_M: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """(start_m, bh, b, h, hk) of Q block pid_m of n_m in row bh = b * nheads + h (q_block_program's
    order; the persistent Hopper forward's tiles take the same)."""
    if HEAVY_LAST:
        pid_m = n_m - 1 - pid_m
    h = bh % nheads
    return pid_m * BLOCK_M, bh, bh // nheads, h, h // group  # hk: the K/V head of query head h


@triton.jit
def head_chunked_order(n_programs, n_heads, HEAD_CHUNK: tl.constexpr):
    """(program, head) of this program of a grid of n_programs x n_heads programs.

    HEAD_CHUNK = 1: grid (n_programs, heads, batch) with n_heads = batch x heads, launched one
    head after the other (the y axis holds 65535 programs, batch x heads may need more). Otherwise a 1D
    grid launched in chunks of HEAD_CHUNK heads: program 0 of each head of the chunk, then
    program 1 of each, and so on. Under a causal mask program 0 is the longest (callers order them
    so; the deterministic Hopper backward reverses them afterwards: key_block_program, dq_order),
    so a chunk runs its long programs first, where one head at a time would start the long
    programs of the last heads last and leave SMs idle at the end; the chunk bounds how many heads'
    rows stream through L2 at once. (The index arithmetic costs registers: 126 -> 136 in the dQ
    program at d=64, which halved its occupancy at 8 warps; hence the plain 2D grid for 1.)
    """
    if HEAD_CHUNK == 1:
        return tl.program_id(0), tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)
    return chunked_order(tl.program_id(0), n_programs, n_heads, HEAD_CHUNK)


@triton.jit
def chunked_order(lin, n_programs, n_heads, chunk):
    """(program, head) of item lin of n_programs x n_heads items taken in chunks of `chunk` heads:
    program 0 of each head of the chunk, then program 1 of each, and so on (head_chunked_order's
    1D order; chunk = 1 is one head after the other)."""
    per_chunk = chunk * n_programs
    c = lin // per_chunk
    r = lin - c * per_chunk
    heads_here = tl.minimum(chunk, n_heads - c * chunk)
    return r // heads_here, c * chunk + r % heads_here

