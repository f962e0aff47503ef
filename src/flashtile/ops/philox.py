"""Dropout's random bits: Philox2x32 counters keyed by the call's seed and the (batch, head), so
the forward and the backward draw the same keep-mask without storing it (reference/dropout.py is
the same draw in PyTorch); Triton helpers and their Hopper (Gluon) twins.
"""

import os

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

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


@triton.jit
def dropout_seed(Rng):
    """(key, x0, x1) of a call's Philox stream, uint32 each: the low and high words of the first
    int64 drawn from torch's generator (reference.dropout.draw_rng) and the low word of the second.
    Read on the device, so a CUDA graph replays fresh masks."""
    seed = tl.load(Rng)
    offset = tl.load(Rng + 1)
    return ((seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32),
            (offset & 0xFFFFFFFF).to(tl.uint32))

