"""Masks, block ranges and where a sequence's rows live: shared by every Triton kernel and read by
the Hopper kernels too.

Masks follow flash-attn 2.x: aligned to the bottom-right corner, so query i sits at key position
i + sk - sq ("the diagonal"), and may see key j iff
    j >= i + (sk - sq) - left    (when MODS.left)
    j <= i + (sk - sq) + right   (when MODS.right; causal is right = 0).
`block_range` splits a block's keys into masked, fully visible and skipped runs (FA2's causal
block skipping, generalised to windows).

Packed variable-length batches (varlen) give each sequence b its own rows [q_start, q_start + sq_b)
and keys [k_start, k_start + sk_b) of one packed tensor (seq_bounds); every index a kernel works
with after that is local to the sequence, so the masks above hold per sequence. A paged K/V keeps
key j of sequence b in row j % PAGE_SIZE of page block_table[b, j // PAGE_SIZE] (page_of).
"""


import triton
import triton.language as tl


@triton.jit
def in_window(i, j, diag_offset, left, right, MODS: tl.constexpr):
    """Is key j inside query row i's window (both sides given by MODS.left / MODS.right)?"""
    diag = i + diag_offset
    if MODS.left and MODS.right:
        return (j >= diag - left) & (j <= diag + right)
    if MODS.left:
        return j >= diag - left
    return j <= diag + right


@triton.jit
def visible(i, j, diag_offset, n_keys, left, right, MODS: tl.constexpr):
    """May query row i see key j? i and j broadcast against each other (either may be rows)."""
    ok = j < n_keys
    if MODS.left or MODS.right:
        ok = ok & in_window(i, j, diag_offset, left, right, MODS)
    return ok


@triton.jit
def block_range(start, BLOCK_OUTER: tl.constexpr, BLOCK_INNER: tl.constexpr, n_inner, offset,
                left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Which inner blocks an outer block [start, start + BLOCK_OUTER) meets, in three phases.

    Outer index o sees inner index x iff o + offset - left <= x <= o + offset + right (each side
    only when bounded). Returns (lo, full_lo, full_hi, hi): blocks in [lo, full_lo) and
    [full_hi, hi) need the mask; [full_lo, full_hi) are visible to every outer row and fully inside
    n_inner, so they run without one. Blocks outside [lo, hi) are never touched (causal skipping).
    The forward and dQ loops call this with (rows over keys, offset = sk - sq, MODS.left and
    MODS.right); the dK/dV loop with (keys over rows, offset = sq - sk, left and right swapped).
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
def phase_blocks(PHASE: tl.constexpr, lo, full_lo, full_hi, hi):
    """The blocks of block_range's phase PHASE (0, 1, 2): the masked ones before, those every row
    sees whole (no mask work), the masked ones after. The loops run the three in a static_range,
    with MASKED = PHASE != 1."""
    if PHASE == 0:
        return lo, full_lo
    elif PHASE == 1:
        return full_lo, full_hi
    else:
        return full_hi, hi


@triton.jit
def dq_order(n, n_blocks, sq, sk, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             MODS: tl.constexpr):
    """(a, c): what dq_turn needs of key block n (of n_blocks of BLOCK_N keys), computed once.

    The deterministic order of dQ's additions is the order in which the programs reach a Q block,
    so that a program seldom waits. Under a right bound (causal) a program starts at the first rows
    that see its keys, so the last key block that sees a Q block reaches it first: descending order,
    and n's turn at the rows from start_m is last(start_m) - n, last = min(n_blocks - 1,
    (start_m + BLOCK_M - 1 - (sq - sk) + right) // BLOCK_N). Without one every program starts at
    its first rows together: ascending, n - first(start_m) with first = max(start_m - (sq - sk) -
    left, 0) // BLOCK_N (0 without a left bound). These invert the rows the programs take from
    block_range (keys over rows, ops.backward_sm90._bwd_kernel_sm90), so the key blocks counted are exactly those
    whose programs visit the rows."""
    if MODS.right:  # floor division is exact here: start_m + c >= 0 wherever key block n visits
        return n_blocks - 1 - n, BLOCK_M - 1 - (sq - sk) + right - n * BLOCK_N
    else:
        return n, (sq - sk) + left


@triton.jit
def dq_turn(start_m, a, c, BLOCK_N: tl.constexpr, MODS: tl.constexpr):
    """Additions into the dQ rows from start_m that come before this program's (a, c: dq_order)."""
    if MODS.right:
        turn = tl.minimum(a, (start_m + c) // BLOCK_N)
    elif MODS.left:
        turn = a - tl.maximum(start_m - c, 0) // BLOCK_N
    else:
        turn = a
    return turn


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

