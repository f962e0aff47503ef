"""Shared Triton helpers and constants for every kernel file.

Masks follow flash-attn 2.x: aligned to the bottom-right corner, so query i sits at key position
i + sk - sq ("the diagonal"), and may see key j iff
    j >= i + (sk - sq) - left    (when HAS_LEFT)
    j <= i + (sk - sq) + right   (when HAS_RIGHT; causal is right = 0).
Scores live in the log2 domain inside the kernels: s2 = log2(e) * score, so exp2 replaces exp.

Packed variable-length batches (varlen) give each sequence b its own rows [q_start, q_start + sq_b)
and keys [k_start, k_start + sk_b) of one packed tensor (seq_bounds); every index a kernel works
with after that is local to the sequence, so the masks above hold per sequence. A paged K/V keeps
key j of sequence b in row j % PAGE_SIZE of page block_table[b, j // PAGE_SIZE] (page_of).
"""

import math
import os

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# tl.constexpr so jit code can read them; launchers use .value
LOG2E = tl.constexpr(math.log2(math.e))  # exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(math.log(2.0))  # ln(x) = log2(x) * LN2


def kernel_scale(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, softcap) as the kernels take them: see scores_log2."""
    if softcap > 0:  # the cap comes before the log2(e) factor
        return softmax_scale / softcap, softcap
    return softmax_scale * LOG2E.value, 0.0


def alibi_strides(alibi_slopes) -> tuple[int, int]:
    """(batch, head) strides of ALiBi slopes shaped (h,) or (b, h); (0, 0) when there are none."""
    if alibi_slopes is None:
        return 0, 0
    if alibi_slopes.dim() == 1:
        return 0, alibi_slopes.stride(0)
    return alibi_slopes.stride(0), alibi_slopes.stride(1)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow torch's tf32 switch (DESIGN.md Numerics); half inputs use plain dots."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


@triton.jit
def in_window(i, j, diag_offset, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Is key j inside query row i's window (both sides given by HAS_LEFT / HAS_RIGHT)?"""
    diag = i + diag_offset
    if HAS_LEFT and HAS_RIGHT:
        return (j >= diag - left) & (j <= diag + right)
    if HAS_LEFT:
        return j >= diag - left
    return j <= diag + right


@triton.jit
def visible(i, j, diag_offset, n_keys, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """May query row i see key j? i and j broadcast against each other (either may be rows)."""
    ok = j < n_keys
    if HAS_LEFT or HAS_RIGHT:
        ok = ok & in_window(i, j, diag_offset, left, right, HAS_LEFT, HAS_RIGHT)
    return ok


@triton.jit
def block_range(start, BLOCK_OUTER: tl.constexpr, BLOCK_INNER: tl.constexpr, n_inner, offset,
                left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Which inner blocks an outer block [start, start + BLOCK_OUTER) meets, in three phases.

    Outer index o sees inner index x iff o + offset - left <= x <= o + offset + right (each side
    only when bounded). Returns (lo, full_lo, full_hi, hi): blocks in [lo, full_lo) and
    [full_hi, hi) need the mask; [full_lo, full_hi) are visible to every outer row and fully inside
    n_inner, so they run without one. Blocks outside [lo, hi) are never touched (causal skipping).
    The forward and dQ loops call this with (rows over keys, offset = sk - sq); the dK/dV loop
    with (keys over rows, offset = sq - sk, left and right swapped).
    """
    last = start + BLOCK_OUTER - 1
    lo = 0
    hi = n_inner
    full_lo = 0
    full_hi = (n_inner // BLOCK_INNER) * BLOCK_INNER
    if HAS_LEFT:
        lo = tl.maximum(start + offset - left, 0) // BLOCK_INNER * BLOCK_INNER
        full_lo = tl.maximum(last + offset - left, 0)
        full_lo = (full_lo + BLOCK_INNER - 1) // BLOCK_INNER * BLOCK_INNER
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(last + offset + right + 1, 0), n_inner)
        full_hi = tl.minimum(full_hi, tl.maximum(start + offset + right + 1, 0) // BLOCK_INNER * BLOCK_INNER)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def dq_order(n, n_blocks, sq, sk, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             HAS_RIGHT: tl.constexpr):
    """(a, c): what dq_turn needs of key block n (of n_blocks of BLOCK_N keys), computed once.

    The deterministic order of dQ's additions is the order in which the programs reach a Q block,
    so that a program seldom waits. Under a right bound (causal) a program starts at the first rows
    that see its keys, so the last key block that sees a Q block reaches it first: descending order,
    and n's turn at the rows from start_m is last(start_m) - n, last = min(n_blocks - 1,
    (start_m + BLOCK_M - 1 - (sq - sk) + right) // BLOCK_N). Without one every program starts at
    its first rows together: ascending, n - first(start_m) with first = max(start_m - (sq - sk) -
    left, 0) // BLOCK_N (0 without a left bound). These invert the rows the programs take from
    block_range (keys over rows, ops.backward._bwd_kernel_sm90), so the key blocks counted are exactly those
    whose programs visit the rows."""
    if HAS_RIGHT:  # floor division is exact here: start_m + c >= 0 wherever key block n visits
        return n_blocks - 1 - n, BLOCK_M - 1 - (sq - sk) + right - n * BLOCK_N
    else:
        return n, (sq - sk) + left


@triton.jit
def dq_turn(start_m, a, c, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Additions into the dQ rows from start_m that come before this program's (a, c: dq_order)."""
    if HAS_RIGHT:
        turn = tl.minimum(a, (start_m + c) // BLOCK_N)
    elif HAS_LEFT:
        turn = a - tl.maximum(start_m - c, 0) // BLOCK_N
    else:
        turn = a
    return turn


@triton.jit
def key_block_program(n_kb, n_rows, chunk, HEAD_CHUNKED: tl.constexpr, DETERMINISTIC: tl.constexpr,
                      HAS_RIGHT: tl.constexpr):
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
    if DETERMINISTIC and HAS_RIGHT:
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


@triton.jit
def head_dim_mask(offs_d, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr):
    """(1, BLOCK_D) mask of the real head dims. With d a power of two it is a constant, so a mask
    made of it and a row mask stays constant along each row and the loads/stores it guards are
    vectorised. Other head dims are compared against HEAD_DIM, a constexpr: the compiler then
    knows the mask constant over runs of the largest power of two dividing d (32 at d=96), so a
    multiple of 16 keeps 16-byte accesses (and the forward's cp.async pipeline); against a runtime
    head dim every access was a 16-bit scalar (ptxas: 192 16-bit loads and 128 16-bit stores in
    the dK/dV kernel at d=128; at d=96 the forward's 320 scalar loads). A multiple of 8 only (40,
    72, ...) stays scalar all the same: the head stride of a BSHD tensor is d, and Triton marks an
    int argument aligned only when 16 divides it (tests/test_codegen.py)."""
    if EVEN_D:
        return tl.full([1, offs_d.shape[0]], 1, tl.int1)
    return offs_d[None, :] < HEAD_DIM


@triton.jit
def load_tile_pair(a_ptrs, b_ptrs, row_ok, d_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """Two (rows, BLOCK_D) tiles that share row and head-dim bounds (K and V, or Q and dO).

    Tiles of the masked loop phases check rows (row_ok); the unmasked phase's rows are all in
    bounds, so only an uneven head dim (padded to BLOCK_D) needs a mask there.
    """
    if MASKED:
        mask = row_ok & d_mask
        a = tl.load(a_ptrs, mask=mask, other=0.0)
        b = tl.load(b_ptrs, mask=mask, other=0.0)
    elif EVEN_D:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        a = tl.load(a_ptrs, mask=d_mask, other=0.0)
        b = tl.load(b_ptrs, mask=d_mask, other=0.0)
    return a, b


@triton.jit
def seq_bounds(b, CuSeqQ, CuSeqK, SeqUsedK, sq, sk, total_q, total_k, IS_VARLEN: tl.constexpr,
               HAS_SEQUSED: tl.constexpr, PAGED: tl.constexpr):
    """(q_start, sq_b, k_start, sk_b) of sequence b: dense (0, sq, 0, sk); varlen from cu_seqlens.

    The API checks cu_seqlens on the host (monotone, ending at total_q / total_k); the clamps here
    keep a bad table (unchecked under CUDA-graph capture) inside the tensors: rows and keys outside
    [0, total) are never touched. With seqused_k only its first sk_b keys count. Paged keys start at
    0 in each sequence's own pages, and total_k is the page table's reach.
    """
    if IS_VARLEN:
        q_start = tl.minimum(tl.maximum(tl.load(CuSeqQ + b), 0), total_q)
        q_end = tl.minimum(tl.maximum(tl.load(CuSeqQ + b + 1), q_start), total_q)
        k_first = tl.load(CuSeqK + b)
        k_count = tl.load(CuSeqK + b + 1) - k_first
        if PAGED:
            k_start = 0
            limit = total_k
        else:
            k_start = tl.minimum(tl.maximum(k_first, 0), total_k)
            limit = total_k - k_start
        if HAS_SEQUSED:
            k_count = tl.load(SeqUsedK + b)
        return q_start, q_end - q_start, k_start, tl.minimum(tl.maximum(k_count, 0), limit)
    return 0, sq, 0, sk


@triton.jit
def lse_row_base(b, h, nheads, sq, q_start, total_q, IS_VARLEN: tl.constexpr):
    """Offset of the first row of (sequence b, head h) in an LSE-shaped tensor (LSE, delta): (b, h,
    sq) for a dense batch, (h, total_q) for a packed one (flash-attn's varlen LSE layout)."""
    if IS_VARLEN:
        return h.to(tl.int64) * total_q + q_start
    return (b * nheads + h).to(tl.int64) * sq


@triton.jit
def page_of(table, start_n, offs_n, max_pages, num_pages, PAGE_SIZE: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """(page, row) of keys start_n + offs_n of a paged K/V: row of page table[pos // PAGE_SIZE].

    A tile inside one page (PAGE_SIZE a multiple of BLOCK_N and start_n a multiple of BLOCK_N)
    loads one page index; smaller pages one per key. Table slots and page numbers are clamped into
    range: a bad table (unchecked under CUDA-graph capture) gives wrong keys, never an access
    outside the table or the pages. page is int64 (page * page stride can pass 2^31).
    """
    if PAGE_SIZE % BLOCK_N == 0:
        slot = tl.minimum(start_n // PAGE_SIZE, max_pages - 1)
        row = start_n % PAGE_SIZE + offs_n
    else:
        pos = start_n + offs_n
        slot = tl.minimum(pos // PAGE_SIZE, max_pages - 1)
        row = pos % PAGE_SIZE
    page = tl.minimum(tl.maximum(tl.load(table + slot), 0), num_pages - 1)
    return page.to(tl.int64), row


# Philox2x32 (Salmon et al., 2011; Random123's constants): one round maps a counter (c0, c1) under
# a key k to (hi(M c0) ^ k ^ c1, lo(M c0)); the key grows by W between rounds.
PHILOX2_M = tl.constexpr(0xD256D193)
PHILOX2_W = tl.constexpr(0x9E3779B9)
PHILOX_ROUNDS = tl.constexpr(7)  # reference/dropout.py says why 7
HEAD_KEY_STRIDE = tl.constexpr(0x2545F491)  # odd: distinct heads of one call get distinct keys
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")  # no inline PTX there


@triton.jit
def philox2x32(key, c0, c1):
    """Philox2x32-7 of uint32 counters (c0, c1) under the uint32 key: two uint32 words."""
    for _ in tl.static_range(PHILOX_ROUNDS):
        if INTERPRETED:
            hi = tl.math.umulhi(c0, PHILOX2_M)
            lo = tl.mul(c0, PHILOX2_M, sanitize_overflow=False)
        else:  # both halves of the product from one instruction (IMAD.WIDE), not two
            hi, lo = tl.inline_asm_elementwise(
                "{ .reg .b64 t; mul.wide.u32 t, $2, 0xD256D193; mov.b64 {$1, $0}, t; }", "=r,=r,r", [c0],
                dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
        c0 = hi ^ key ^ c1
        c1 = lo
        key = tl.add(key, PHILOX2_W, sanitize_overflow=False)
    return c0, c1


@triton.jit
def dropout_keep(seed, bh, start_m, BLOCK_M: tl.constexpr, start_n, BLOCK_N: tl.constexpr, threshold,
                 TRANSPOSED: tl.constexpr):
    """Which scores of rows [start_m, start_m + BLOCK_M) x keys [start_n, start_n + BLOCK_N) of
    head bh survive dropout: (BLOCK_M, BLOCK_N), or (BLOCK_N, BLOCK_M) when TRANSPOSED.

    One Philox2x32-7 call gives two 32-bit words, eight bytes: one for each score of the 2 x 4
    group rows {i0, i0 + 8} x keys {j0, j0 + 1, j0 + 8, j0 + 9} (i0 = 16 (i // 16) + i % 8,
    j0 = 16 (j // 16) + j % 8 - j % 2). seed = (key, x0, x1) of the call (dropout_seed); counter
    (j0 // 16 * 4 + j0 % 8 // 2 ^ x0, i0 // 16 * 8 + i0 % 8 ^ x1), key + bh * HEAD_KEY_STRIDE (the
    XORs are bijections, so one call's counters stay distinct, and 96 random bits set a call's
    stream); score (i, j) reads byte 2 ((j // 8) % 2) + (i // 8) % 2 (low byte first) of word
    j % 2 and is kept when it is >= threshold = round(p * 2^8) (_checks.dropout_threshold).
    Why this grouping: in an MMA accumulator each warp holds 16 rows and a thread rows r and r + 8
    of them, at keys 2q, 2q + 1 of every 8. So in the forward and dQ tiles a thread holds whole
    groups, and a call's eight bytes serve eight of its scores. The dK/dV tile is transposed: a
    thread holds keys k and k + 8 of a 16-key block, lane ^ 4 holds keys k ^ 1 and k ^ 1 + 8, and
    both hold rows 2q and 2q + 1 of every 8. Each of the two needs one word of the groups at
    i0 = 2q and i0 = 2q + 1: a Hopper kernel makes one of those calls per thread and trades the
    other word with lane ^ 4 (dropout_words_sm90); the Triton dK/dV programs here make both calls.
    Rows and keys are indices within the sequence; bh = sequence * nheads + head. The mask depends
    on nothing else, so the backward regenerates it exactly; reference/dropout.py builds the same
    mask in plain PyTorch. start_m, start_n, BLOCK_M and BLOCK_N are multiples of 16.
    """
    if TRANSPOSED:  # (key block, k % 8, row block, q): the words of rows 2q and 2q + 1 for key k
        kb = start_n // 16 + tl.arange(0, BLOCK_N // 16)
        k8 = tl.arange(0, 8)
        keys = (kb * 4)[:, None, None, None] + (k8 // 2)[None, :, None, None]
        rows = ((start_m // 16 + tl.arange(0, BLOCK_M // 16)) * 8)[None, None, :, None] + \
            (2 * tl.arange(0, 4))[None, None, None, :]
        odd = (k8 % 2 == 1)[None, :, None, None]
        e0, e1 = dropout_words(seed, bh, rows, keys)
        o0, o1 = dropout_words(seed, bh, rows + 1, keys)
        bits = dropout_bytes(tl.where(odd, e1, e0), tl.where(odd, o1, o0), BLOCK_N, BLOCK_M, True)
    else:  # (row block, i % 8, key block, q): whole calls
        i = (start_m // 16 + tl.arange(0, BLOCK_M // 16))[:, None, None, None] * 8 + \
            tl.arange(0, 8)[None, :, None, None]
        j = (start_n // 16 + tl.arange(0, BLOCK_N // 16))[None, None, :, None] * 4 + \
            tl.arange(0, 4)[None, None, None, :]
        w0, w1 = dropout_words(seed, bh, i, j)
        bits = dropout_bytes(w0, w1, BLOCK_M, BLOCK_N, False)
    return bits >= dropout_bar(threshold)


@triton.jit
def dropout_bar(threshold):
    """Each score's byte sits in the top 8 bits of a word: one unsigned compare with threshold << 24."""
    return threshold.to(tl.uint32) << 24


@triton.jit
def dropout_words(seed, bh, i, j):
    """The Philox2x32-7 calls of head bh at group counters i (rows: i0 // 16 * 8 + i0 % 8) and j
    (keys: j0 // 16 * 4 + j0 % 8 // 2), broadcast against each other: (w0, w1)."""
    key, x0, x1 = seed
    head_key = tl.add(key, tl.mul(bh.to(tl.uint32), HEAD_KEY_STRIDE, sanitize_overflow=False),
                      sanitize_overflow=False)
    c0, c1 = tl.broadcast(j.to(tl.uint32) ^ x0, i.to(tl.uint32) ^ x1)
    return philox2x32(head_key, c0, c1)


@triton.jit
def dropout_bytes(w0, w1, ROWS: tl.constexpr, COLS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Words of (A, 8, B, 4) groups spread over their (ROWS, COLS) scores, each score's byte in
    the top 8 bits of its word. Not TRANSPOSED: (row block, i % 8, key block, q), w0 and w1 the
    words of keys j0 = 2q and j0 + 1. TRANSPOSED: (key block, k % 8, row block, q), w0 and w1 the
    words of key k in the groups of rows 2q and 2q + 1."""
    return dropout_spread(dropout_word_bytes(w0), dropout_word_bytes(w1), ROWS, COLS, TRANSPOSED)


@triton.jit
def dropout_spread(x0, x1, ROWS: tl.constexpr, COLS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Values of each score of the (A, 8, B, 4) groups, (..., 2, 2) indexed [i // 8 % 2, j // 8 %
    2] (x0 for w0's scores, x1 for w1's, as dropout_bytes names them), as the (ROWS, COLS) tile."""
    x = tl.join(x0, x1)  # (..., i // 8 % 2, j // 8 % 2, w)
    if TRANSPOSED:  # -> (key block, j // 8 % 2, k % 8, row block, i // 8 % 2, q, w)
        x = tl.permute(x, (0, 5, 1, 2, 4, 3, 6))
    else:  # -> (row block, i // 8 % 2, i % 8, key block, j // 8 % 2, q, w)
        x = tl.permute(x, (0, 4, 1, 2, 5, 3, 6))
    return tl.reshape(x, (ROWS, COLS))


@triton.jit
def dropout_word_bytes(w):
    """A word's four bytes, each moved to the top: (..., 2, 2) indexed [i // 8 % 2, j // 8 % 2]."""
    return tl.join(tl.join(w << 24, w << 16), tl.join(w << 8, w))


@gluon.jit
def dropout_words_sm90(seed, bh, start_m, start_n, ROWS: gl.constexpr, KEYS: gl.constexpr,
                       TRANSPOSED: gl.constexpr):
    """dropout_keep's Philox calls for a Hopper kernel's wgmma accumulator of rows [start_m,
    start_m + ROWS) x keys [start_n, start_n + KEYS), or its transpose, held by one warpgroup
    (four warps of 16 rows, or of 16 keys when TRANSPOSED). The group tensor is laid out so that
    each thread makes one call per 16 x 16 block of its scores, which dropout_keep_sm90,
    dropout_sign_sm90 and dropout_apply_sm90 then spread over the accumulator's layout without
    moving data between threads: issued before the wait for the scores, the calls run under the
    matrix product. TRANSPOSED, the thread with
    the even key k calls the group of rows 2q, the one with k + 1 (lane ^ 4) that of rows 2q + 1,
    and they trade a word by shuffle. (w0, w1)."""
    g: gl.constexpr = gl.BlockedLayout([1, 1, (ROWS if TRANSPOSED else KEYS) // 16, 1], [1, 8, 1, 4],
                                       [gl.num_warps(), 1, 1, 1], [3, 2, 1, 0])
    outer: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, g))  # dims 0, 1
    inner: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, g))  # dims 2, 3
    if TRANSPOSED:  # (KEYS // 16, 8, ROWS // 16, 4)
        k8 = gl.arange(0, 8, layout=gl.SliceLayout(0, outer))
        keys = (start_n // 16 + gl.arange(0, KEYS // 16, layout=gl.SliceLayout(1, outer)))[:, None] * 4 + \
            (k8 // 2)[None, :]
        rows = ((start_m // 16 + gl.arange(0, ROWS // 16, layout=gl.SliceLayout(1, inner)))[:, None] * 8
                + 2 * gl.arange(0, 4, layout=gl.SliceLayout(0, inner))[None, :])
        odd = (k8 % 2)[None, :][:, :, None, None]  # key k + 1, held by lane ^ 4 of key k's thread
        w0, w1 = dropout_words(seed, bh, rows[None, None, :, :] + odd, keys[:, :, None, None])
        is_odd = odd == 1
        # each keeps the word of its own key (w0 of key k, w1 of k + 1) and sends the other one
        got = gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 4, 31, -1;", "=r,r",
                                        [gl.where(is_odd, w0, w1)], dtype=gl.uint32, is_pure=False, pack=1)
        mine = gl.where(is_odd, w1, w0)
        words = (gl.where(is_odd, got, mine), gl.where(is_odd, mine, got))  # rows 2q, 2q + 1
    else:  # (ROWS // 16, 8, KEYS // 16, 4)
        rows = ((start_m // 16 + gl.arange(0, ROWS // 16, layout=gl.SliceLayout(1, outer)))[:, None] * 8
                + gl.arange(0, 8, layout=gl.SliceLayout(0, outer))[None, :])
        keys = ((start_n // 16 + gl.arange(0, KEYS // 16, layout=gl.SliceLayout(1, inner)))[:, None] * 4
                + gl.arange(0, 4, layout=gl.SliceLayout(0, inner))[None, :])
        words = dropout_words(seed, bh, rows[:, :, None, None], keys[None, None, :, :])
    return words


@gluon.jit
def dropout_keep_sm90(words, threshold, layout: gl.constexpr, ROWS: gl.constexpr, KEYS: gl.constexpr,
                      TRANSPOSED: gl.constexpr):
    """The keep-mask of dropout_words_sm90's calls in the accumulator's `layout`: (ROWS, KEYS), or
    (KEYS, ROWS) when TRANSPOSED; bit for bit dropout_keep's (the conversion is asserted trivial)."""
    w0, w1 = words
    if TRANSPOSED:
        bits = dropout_bytes(w0, w1, KEYS, ROWS, True)
    else:
        bits = dropout_bytes(w0, w1, ROWS, KEYS, False)
    return gl.convert_layout(bits, layout, assert_trivial=True) >= dropout_bar(threshold)


@gluon.jit
def dropout_keep_bits_sm90(w, threshold):
    """A Philox word's four bytes compared with threshold in one go (SWAR): the top bit of each
    byte of the result is set where that byte is >= threshold (1..255), the other bits are
    anything. With h the top bits, (w | h) - (threshold & 0x7F) in every byte borrows nothing
    across bytes and sets a byte's top bit where its low 7 bits are >= threshold's; a threshold
    below 128 then keeps bytes with either top bit set (w | d), one of 128 or more needs both
    (w & d): one LOP3 of w, d and threshold's top bit spread over the word."""
    low = (threshold & 0x7F).to(gl.uint32) * 0x01010101
    high = gl.where(threshold >= 128, 0xFFFFFFFF, 0).to(gl.uint32)
    return gl.inline_asm_elementwise(
        "{ .reg .b32 d; or.b32 d, $1, 0x80808080; sub.u32 d, d, $2; lop3.b32 $0, $1, d, $3, 0xD4; }", "=r,r,r,r",
        [w, low, high], dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def dropout_sign_sm90(p, keep_words, ROWS: gl.constexpr, KEYS: gl.constexpr, TRANSPOSED: gl.constexpr):
    """p (fp32, >= 0, an accumulator's layout as dropout_keep_sm90's) with the sign of every dropped
    score flipped: the keep-mask rides in P's sign bit, no register of its own. keep_words:
    dropout_keep_bits_sm90 of each word of dropout_words_sm90's calls (compared four bytes at a
    time before the scores arrive); each score's keep bit is shifted to bit 31 (dropout_bytes) and
    one LOP3 flips p's sign where it is clear: p ^ (~bits & 0x80000000)."""
    m0, m1 = keep_words
    if TRANSPOSED:
        bits = dropout_bytes(m0, m1, KEYS, ROWS, True)
    else:
        bits = dropout_bytes(m0, m1, ROWS, KEYS, False)
    bits = gl.convert_layout(bits, p.type.layout, assert_trivial=True)
    return gl.inline_asm_elementwise("lop3.b32 $0, $1, $2, 0x80000000, 0xD2;", "=r,r,r", [p, bits],
                                     dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def relu_to_sm90(x, dtype: gl.constexpr):
    """max(x, 0) of fp32 x in dtype (fp16 / bf16): one conversion with ReLU per pair, where the
    maximum and the conversion took three instructions."""
    if dtype == gl.bfloat16:
        y = gl.inline_asm_elementwise("cvt.rn.relu.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.bfloat16,
                                      is_pure=True, pack=2)
    else:
        y = gl.inline_asm_elementwise("cvt.rn.relu.f16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.float16,
                                      is_pure=True, pack=2)
    return y


@triton.jit
def dropout_word_copies(w):
    """A word for each of its four scores, (..., 2, 2) as dropout_word_bytes (no data moves)."""
    return tl.join(tl.join(w, w), tl.join(w, w))


@gluon.jit
def dropout_selector_sm90(like, BYTE: gl.constexpr):
    """PRMT's selector for byte BYTE of two words a and b, sign-replicated: a's over the low 16 bits,
    b's over the high 16 (nibbles 8 + BYTE and 12 + BYTE), as a tensor shaped like `like`."""
    return gl.full(like.shape, (8 + BYTE) * 0x11 + (12 + BYTE) * 0x1100, gl.uint32, like.type.layout)


@gluon.jit
def dropout_apply_sm90(p, m0, m1, ROWS: gl.constexpr, KEYS: gl.constexpr, dtype: gl.constexpr):
    """p (fp32, an accumulator's layout, rows x keys of the calls) in dtype (fp16 / bf16) with the
    dropped scores zeroed, from dropout_keep_bits_sm90's words m0 and m1 of the calls
    (dropout_words_sm90's layout, not transposed). A pair of p's scores (row i, keys j0 and j0 + 1)
    takes byte 2 (j // 8 % 2) + i // 8 % 2 of m0 and of m1: one PRMT spreads the top bits of the two
    over the pair's 16-bit halves (sign-replicating selector nibbles 8 + byte and 12 + byte), one
    AND applies them to the pair converted by one CVT. The words reach each score as dropout_bytes
    spreads them (dropout_spread), with the byte's selector beside them as a constant of the
    register's position. The conversion sits in the same asm so that the pair goes from fp32 to
    P V's operand with no unpacking in between (packed bf16 in and out of the asm cost ptxas 26
    register moves a step at d=128)."""
    sels = gl.join(gl.join(dropout_selector_sm90(m0, 0), dropout_selector_sm90(m0, 1)),
                   gl.join(dropout_selector_sm90(m0, 2), dropout_selector_sm90(m0, 3)))
    words = gl.convert_layout(dropout_spread(dropout_word_copies(m0), dropout_word_copies(m1), ROWS, KEYS, False),
                              p.type.layout, assert_trivial=True)
    sels = gl.convert_layout(dropout_spread(sels, sels, ROWS, KEYS, False), p.type.layout, assert_trivial=True)
    if dtype == gl.bfloat16:
        q = gl.inline_asm_elementwise(
            "{ .reg .b32 t, m; cvt.rn.bf16x2.f32 t, $2, $1; prmt.b32 m, $3, $4, $5; and.b32 $0, t, m; }",
            "=r,r,r,r,r,r,r", [p, words, sels], dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        q = gl.inline_asm_elementwise(
            "{ .reg .b32 t, m; cvt.rn.f16x2.f32 t, $2, $1; prmt.b32 m, $3, $4, $5; and.b32 $0, t, m; }",
            "=r,r,r,r,r,r,r", [p, words, sels], dtype=gl.float16, is_pure=True, pack=2)
    return q


def softcap_scales(qk_scale: float, softcap: float) -> tuple[float, float]:
    """(cap_scale, softcap2) of capped_sm90 from kernel_scale's (qk_scale, softcap) of a capped
    call: the products' factor 2 log2(e) softmax_scale / softcap (one exp2 gives e^{2x}) and the
    cap in the log2 domain."""
    return 2.0 * LOG2E.value * qk_scale, softcap * LOG2E.value


# the first named barrier the Hopper kernels may take for their own: Gluon's are 0 (the default
# partition's warpgroup), 1 (the CTA's) and 2 + worker partition (2, or 2-3 with three consumers)
FIRST_FREE_BARRIER = gl.constexpr(8)


@gluon.jit
def named_barrier_sm90(barrier, ARRIVE: gl.constexpr):
    """Hardware named barrier `barrier` of two warpgroups (256 threads): bar.sync, which waits until
    all 256 have arrived, or with ARRIVE bar.arrive, which counts this warpgroup and goes on. An
    mbarrier's arrival and wait are shared-memory operations and a polling loop; this is neither."""
    if ARRIVE:
        gl.inline_asm_elementwise("bar.arrive $1, 256; mov.b32 $0, 0;", "=r,r", [barrier], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.sync $1, 256; mov.b32 $0, 0;", "=r,r", [barrier], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def capped_sm90(qk, cap_scale, softcap2):
    """The Hopper kernels' capped scores (log2 domain) of raw products qk, softcap * tanh(x) with
    x = qk * softmax_scale / softcap (scores_log2's, softcap_scales' arguments), and r: tanh(x) =
    1 - 2 r, r = 1 / (1 + e^{2x}) by one exp2 and an approximate reciprocal (two MUFU operations,
    where the IEEE division of tanh() costs a range check and more). The cap's derivative is
    1 - tanh^2 = 4 r (1 - r) (cap_derivative_sm90). Limits: r -> 0 (score -> +softcap) and r -> 1
    (-softcap)."""
    r = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + gl.exp2(qk * cap_scale)],
                                  dtype=gl.float32, is_pure=True, pack=1)
    return gl.fma(r, -2.0 * softcap2, softcap2), r


@gluon.jit
def cap_derivative_sm90(r):
    """1 - tanh^2 = 4 r - 4 r^2 of capped_sm90's r, in two instructions."""
    four_r = 4.0 * r
    return gl.fma(-four_r, r, four_r)


# Positions the Hopper kernels' ALiBi takes: |position| < 2^22, so that 1.5 * 2^23 + position is
# an exact float32 whose bits are those of 1.5 * 2^23 plus the integer (alibi_sm90)
ALIBI_MAX_POSITION = 1 << 22
ALIBI_MAGIC_BITS = gl.constexpr(0x4B400000)  # the bits of 12582912.0 = 1.5 * 2^23


@gluon.jit
def alibi_sm90(s, rows, cols, slope):
    """The Hopper kernels' ALiBi: s - slope * |rows - cols| on a block of scores s, in whatever
    units s has there (alibi_unit_sm90), rows and cols int32 positions along its two axes, one of
    them shifted by diag_offset (scores_log2's |i + diag_offset - j|), |position| <
    ALIBI_MAX_POSITION. A thread holds a few rows and many columns: the rows are converted, the
    columns made floats (both plus 1.5 * 2^23, which their difference drops) by an integer add
    to the bits of 1.5 * 2^23: int-to-float conversions issue on the unit the softmax's
    exponentials saturate. One per column made 138 of them in the d=128 forward's SASS (15 now),
    and the d=64 causal backward with 128-row Q blocks ran at 278 TFLOP/s against 350 now
    (NOTES.md "ALiBi on the Hopper kernels")."""
    rows_f = rows.to(gl.float32) + 12582912.0
    cols_f = (cols + ALIBI_MAGIC_BITS).to(gl.float32, bitcast=True)
    return s - slope * gl.abs(rows_f[:, None] - cols_f[None, :])


def alibi_fits_sm90(alibi_slopes, q, k, varlen) -> bool:
    """Whether the Hopper kernels can take this call's ALiBi (or it has none): every position of
    their blocks (up to a block past the longest sequence) below ALIBI_MAX_POSITION. q, k as the
    kernels take them; a packed batch (varlen) is bounded by its totals, which bound every
    sequence's length whatever max_seqlen says (not checked under CUDA-graph capture)."""
    if alibi_slopes is None:
        return True
    rows, keys = (q.shape[0], k.shape[0]) if varlen is not None else (q.shape[1], k.shape[1])
    return max(rows, keys) + 256 <= ALIBI_MAX_POSITION


@gluon.jit
def alibi_unit_sm90(qk_scale, HAS_SOFTCAP: gl.constexpr):
    """What a slope is multiplied by to subtract it from the Hopper kernels' scores where ALiBi
    meets them: after the cap, scores are in the log2 domain (log2(e)); without one they are raw
    products, scaled by qk_scale = softmax_scale log2(e) only after the max (log2(e) / qk_scale)."""
    return LOG2E if HAS_SOFTCAP else LOG2E / qk_scale


@triton.jit
def dropout_seed(Rng):
    """(key, x0, x1) of a call's Philox stream, uint32 each: the low and high words of the first
    int64 drawn from torch's generator (reference.dropout.draw_rng) and the low word of the second.
    Read on the device, so a CUDA graph replays fresh masks."""
    seed = tl.load(Rng)
    offset = tl.load(Rng + 1)
    return ((seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32),
            (offset & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def tanh(x):
    """tanh from exp2 (no tanh in triton.language): 1 - 2 / (1 + e^{2x}); exact limits at +-inf."""
    return 1.0 - 2.0 / (1.0 + tl.exp2(x * (2.0 * LOG2E)))


@triton.jit
def scores_log2(qk, i, j, qk_scale, softcap, slope, diag_offset,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Raw q.k products -> scores in the log2 domain, and the softcap derivative factor.

    Without softcap, qk_scale = softmax_scale * log2(e) folds both multiplies into one. With
    softcap, qk_scale = softmax_scale / softcap and the cap is applied before the log2(e) factor.
    Returns (s2, dcap) where dcap = d(score)/d(scaled qk) = 1 - tanh^2 (1.0 without softcap).
    """
    if HAS_SOFTCAP:
        t = tanh(qk * qk_scale)
        s2 = t * (softcap * LOG2E)
        dcap = 1.0 - t * t
    else:
        s2 = qk * qk_scale
        dcap = 1.0
    if HAS_ALIBI:
        dist = tl.abs(i + diag_offset - j).to(tl.float32)
        s2 = s2 - (slope * LOG2E) * dist
    return s2, dcap


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
