"""Block sizes, autotune lists and heuristics for every kernel: no literals elsewhere.

Plain functions, so a user can override a choice by replacing the function. Every replacement
(an assignment to this module, a test's monkeypatch) adds one to `generation`: the launchers
cache what the choices gave for a call's shapes (their launch plans) under it.
"""

import functools
import sys
import types
from typing import NamedTuple

import torch

from flashtile.ops._launch import cdiv, next_pow2

generation = 0


class _Configs(types.ModuleType):
    """This module, counting assignments to it in `generation`."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name != "generation":
            super().__setattr__("generation", self.generation + 1)


sys.modules[__name__].__class__ = _Configs


class BlockConfig(NamedTuple):
    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=None)
def padded_headdim(d: int) -> int:
    """Head dims are padded (by masks, never by copies) to a power of two; tl.dot needs K >= 16."""
    return max(16, next_pow2(d))


# Under TRITON_INTERPRET=1 (CPU) small tiles keep numpy fast and make the small test shapes cross
# several blocks, so every loop phase (masked / unmasked / skipped) runs in CI.
INTERPRETER_CONFIG = BlockConfig(16, 16, 4, 1)


def forward_config(d: int, dtype: torch.dtype, device: torch.device, causal: bool) -> BlockConfig:
    """Tiles for ops.forward on an H100 (sm_90), by head dim, dtype and mask only: a sequence length
    never picks a tile, so a new length never compiles a kernel (tests/test_recompile.py). The
    sweeps behind each: docs/tuning.md."""
    if not on_gpu(device):
        return INTERPRETER_CONFIG
    bd = padded_headdim(d)
    if dtype == torch.float32:
        return BlockConfig(64, 32, 4, 2) if bd <= 128 else BlockConfig(32, 32, 4, 1)
    if bd <= 64:
        return BlockConfig(64, 64, 4, 3) if causal else BlockConfig(128, 64, 8, 3)
    if bd <= 128:
        return BlockConfig(64, 64, 4, 3) if causal else BlockConfig(128, 128, 8, 3)
    return BlockConfig(128, 64, 8, 2)


def hopper_forward_config(d: int, dtype: torch.dtype, device: torch.device, causal: bool,
                          softcap: bool = False) -> BlockConfig | None:
    """Tiles for the Hopper forward (ops.forward_sm90._fwd_kernel_sm90), or None (the Triton kernel runs),
    by head dim, dtype and flags only: no length picks the kernel or its tiles, so after one call
    no other length, batch or packed batch compiles anything (tests/test_recompile.py). block_m
    rows, 64 per consumer warpgroup of num_warps = 4 (hopper_forward_consumers; the other consumers
    and the loader warp come on top). A capped causal forward at d=64 keeps the Triton kernel: three
    exponential-unit operations a score where the products of 64 columns take half d=128's time
    (so does d=48, whose Triton tiles read whole 16-byte pieces: hopper_takes); the measurements:
    docs/tuning.md.
    """
    if not hopper_takes(d, dtype, device):
        return None
    whole = d % 16 == 0  # the Triton kernel's accesses 16 bytes wide (hopper_takes)
    if hopper_head_dim(d) == 64 and whole and causal and softcap:
        return None
    return hopper_forward_tiles(d)


HOPPER_HEAD_DIMS = (64, 128, 256)
# Head dims up to this one keep the Triton kernels: their unmasked 32-column tiles measured as fast as
# the Hopper kernels computing d=32 at 64, or faster (docs/tuning.md)
HOPPER_MAX_TRITON_HEAD_DIM = 32


def hopper_head_dim(d: int) -> int | None:
    """The head dim the Hopper kernels compute a head dim d at: 64, 128 or 256, the smallest of
    them >= d (None past 256). The TMA boxes are that wide and read the columns past d as zeros,
    which add nothing to Q K^T and make zero columns of P V, and the stores clip them: no tensor is
    copied or padded."""
    return next((p for p in HOPPER_HEAD_DIMS if p >= d), None)


def hopper_takes(d: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the Hopper kernels may take head dim d in dtype on device (hopper_forward_config and
    hopper_backward_config add their flags): fp16 / bf16 on sm_90, 32 < d <= 256. At the dims
    between 64, 128 and 256 they compute at the next of those dims (hopper_head_dim) and measured
    faster than the Triton kernels at every length and mask, also since the Triton kernels take
    the head dim as a constexpr: their accesses are then 16 bytes wide at multiples of 16, while at
    other multiples of 8 the head stride, d itself, still makes them scalar (docs/tuning.md).
    d=48 runs the d=64 Triton tiles whole, so hopper_forward_config keeps d=64's cuts for it."""
    return hopper_refusal(d, dtype, device) is None


def hopper_refusal(d: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the Hopper kernels may not take head dim d in dtype on device (hopper_takes' rule, in
    words for ops.dispatch), or None where they may."""
    if not on_gpu(device):
        return f"needs a CUDA device, not {device.type}"
    if capability(device) != (9, 0):
        return "needs sm_90 (this GPU is sm_{}{})".format(*capability(device))
    if dtype not in (torch.float16, torch.bfloat16):
        return f"takes float16 and bfloat16, not {str(dtype).replace('torch.', '')}"
    if d > HOPPER_HEAD_DIMS[-1]:
        return f"takes head dims up to {HOPPER_HEAD_DIMS[-1]}, not {d}"
    if d <= HOPPER_MAX_TRITON_HEAD_DIM:
        return f"head dim {d} <= {HOPPER_MAX_TRITON_HEAD_DIM} runs faster on the Triton kernels (docs/tuning.md)"
    return None


def hopper_forward_tiles(d: int) -> BlockConfig:
    """The Hopper forward's tiles at head dim d (computed at hopper_head_dim(d): 64, 128 or 256),
    block_m = 64 rows per consumer warpgroup (hopper_forward_consumers). 256 takes 64-key blocks:
    its 128-key ones would not fit shared memory beside Q, and 32-key ones measured slower
    (docs/tuning.md)."""
    d = hopper_head_dim(d)
    return BlockConfig(128, 64, 4, 2) if d == 256 else BlockConfig(64 * hopper_forward_consumers(d), 128, 4, 2)


def hopper_forward_consumers(d: int) -> int:
    """Consumer warpgroups of the Hopper forward, 64 query rows each: three at d=64 (160 registers
    each), at every length (two were a little faster causal below 4k keys, but a second kernel for
    those lengths would compile when a batch crossed 4k: docs/tuning.md), two elsewhere (240
    registers: a d=128 output tile alone takes 64 of them)."""
    return 3 if d == 64 else 2


HEAD_CHUNK_MAX = 64  # bounds the backward's compiled variants (a constexpr there); past a wave it orders nothing


def l2_head_chunk(bytes_per_head: int, device: torch.device) -> int:
    """The most heads, a power of two up to HEAD_CHUNK_MAX, whose bytes_per_head fit the L2 cache
    together (at least 1): the chunks of the Hopper kernels' launch orders."""
    fit = l2_bytes(device) // max(bytes_per_head, 1)
    return min(HEAD_CHUNK_MAX, 1 << (fit.bit_length() - 1)) if fit >= 1 else 1


@functools.lru_cache(maxsize=1024)
def hopper_forward_head_chunk(d: int, seqlen_k: int, group: int, causal: bool, device: torch.device) -> int:
    """Query heads (rows b * h + head) whose tiles the Hopper forward takes interleaved
    (ops.schedule.chunked_order): the last row block of each head of a chunk first (under a right
    bound it sees the most keys), then the one before it of each, and so on. One head at a time
    (1), the launch order before, starts the last heads' longest tiles last and leaves SMs idle at
    the end. The chunk is the most query heads, a power of two, whose K and V (shared by `group`
    query heads) fit the L2 cache together (FlashAttention-4's causal sm_90 forward orders its
    tiles so). causal: the keys have a right bound (a causal mask, a window's right side); without
    one every tile of a head is as long, and the order stays. d=64 only (hopper_forward_chunked):
    chunks measured faster there, and at d=128 no faster, with more spills (docs/tuning.md)."""
    if not hopper_forward_chunked(d, causal):
        return 1
    return l2_head_chunk(seqlen_k * d * 4 // group, device)


def hopper_forward_chunked(d: int, causal: bool) -> bool:
    """Whether the Hopper forward takes its tiles in chunks of heads (HEAD_CHUNKED, a constexpr):
    by head dim and mask only, so that a chunk of one head (keys past the L2 cache) runs the same
    compiled kernel."""
    return d == 64 and causal


def hopper_forward_q_stages(d: int) -> int:
    """Q buffers of the Hopper forward: two let the next tile's Q come in while this tile runs;
    at d=256 one (two Q tiles of 64 KB beside the 128 KB K/V ring pass the SM's 227 KB)."""
    return 1 if d == 256 else 2


def hopper_forward_persistent(d: int) -> bool:
    """Whether the Hopper forward runs persistent (a program per SM walking tiles) or a program per
    tile: persistent where a second Q buffer lets the next tile's loads run under this one. At
    d=256 (one Q buffer) persistent measured slower (docs/tuning.md); there a program per tile
    skips the tile loop's fetch (PERSISTENT = False)."""
    return hopper_forward_q_stages(d) == 2


def hopper_backward_config(d: int, dtype: torch.dtype, device: torch.device, dropout: bool = False,
                           softcap: bool = False) -> BlockConfig | None:
    """Tiles for the Hopper backward (ops.backward_sm90._bwd_kernel_sm90), or None (the Triton programs),
    at every length (docs/tuning.md). block_m query rows per step, block_n keys per program in two
    halves, one per consumer warpgroup of num_warps = 4; num_stages Q/dO buffers (3 do not fit next
    to the dS^T and dQ buffers at d=128, and were slower at d=64: docs/tuning.md).
    """
    if not hopper_takes(d, dtype, device):
        return None
    return hopper_backward_tiles(d, dropout, softcap)


def hopper_backward_ordered(d: int) -> bool:
    """Whether a deterministic backward takes the Hopper kernel (dQ's additions in their fixed
    order, ops.masks.dq_order) over the Triton programs: at every length, but not at head dims
    computed at 256, whose dQ (SPLIT_D) has no fixed order (docs/tuning.md)."""
    return not hopper_backward_split_d(hopper_head_dim(d))


def hopper_backward_tiles(d: int, dropout: bool = False, softcap: bool = False) -> BlockConfig:
    """The Hopper backward's tiles at head dim d (computed at hopper_head_dim(d)): 128 keys per
    program at d <= 128; Q blocks of 64 rows at d=128 (dK, dV and the 64 x 64 S^T, dP^T of a
    warpgroup take 192 of its 240 registers) and of 128 rows at d=64, where half as many steps
    carry the per-step waits and measured faster, although ptxas then spills a few loop scalars
    (docs/tuning.md). d=256: 64 keys shared by
    both warpgroups (hopper_backward_split_d) and 64-row Q blocks in two stages: K, V and two Q
    and dO buffers of 32 KB each and the P and dS buffers (two of each, 8 KB) take 225 of the
    SM's 227 KB, so dQ leaves through the Q and dO buffers. With dropout d=64 takes 64-row blocks
    too: the Philox calls of a 128-row block spill 484 bytes and measured slower (docs/tuning.md).
    So does softcap, whose cap derivative beside a 128-row S^T spills 1512 bytes (0 with 64 rows).
    ALiBi keeps 128 rows (164 / 496 bytes spilled, causal): faster than 64 non-causal, level
    causal (docs/tuning.md)."""
    d = hopper_head_dim(d)
    if d == 256:
        return BlockConfig(64, 64, 4, 2)
    return BlockConfig(128, 128, 4, 2) if d == 64 and not (dropout or softcap) else BlockConfig(64, 128, 4, 2)


def hopper_backward_split_d(d: int) -> bool:
    """Whether the Hopper backward's two consumer warpgroups split the head dim instead of the keys:
    at d=256, where a warpgroup's dK and dV of 64 keys in fp32 would take all 256 registers of a
    thread. Each owns 128 columns of dK, dV and dQ and takes half the keys of S and dP, which go
    through shared memory to both (FA3's schedule there). Computing all of S^T and dP^T in each
    warpgroup instead (14 products' worth of wgmma for 10, P^T and dS^T from registers) measured
    below FlashAttention-2's speed, where this one is above it (docs/tuning.md)."""
    return d == 256


def hopper_backward_defer_dq(d: int, right_bounded: bool, deterministic: bool) -> bool:
    """Whether the Hopper backward issues a step's dQ product at the start of the next step, ahead
    of its S^T, so the dQ tile's way out through shared memory runs under S^T (else each step ends
    with its dQ). right_bounded: the keys have a right bound (a causal mask, a window's right side);
    deterministic: dQ leaves through the writer partition. At d=128 the deferred form hands dS^T
    over on named barriers (_bwd_sm90_ds_stored), and its dQ tile's 32 registers beside S^T, dK and
    dV spill 40 bytes where 8 were. Deferred measured faster at d=64 (causal level or faster) and
    at d=128 without a right bound; at d=128 causal and deterministic slower (docs/tuning.md)."""
    return d == 64 or (d == 128 and not right_bounded and not deterministic)


def hopper_backward_dq_by_rows(block_m: int, right_bounded: bool, deterministic: bool) -> bool:
    """Whether the Hopper backward's consumer warpgroups split a step's dQ by rows, 64 each, one
    m64n64 product a key half (FA3's split of dQ at d=64), instead of by columns (two m64n32):
    with 128-row Q blocks where the keys have a right bound or dQ's additions are ordered: rows
    measured faster there, and slower without a right bound, which keeps columns (docs/tuning.md)."""
    return block_m == 128 and (right_bounded or deterministic)


@functools.lru_cache(maxsize=1024)
def hopper_backward_head_chunk(d: int, seqlen_q: int, group: int, causal: bool, device: torch.device,
                               ordered: bool = False) -> int:
    """(batch, K/V head) rows whose programs the Hopper backward interleaves in launch order
    (ops.schedule.head_chunked_order): key block 0 of each row of a chunk first, then key block 1,
    and so on. With one row at a time (1), the grid's order, the longest programs of a causal mask
    (key block 0) of the last rows start last and leave SMs idle at the end; a chunk of rows runs
    its long programs first. The chunk is the most rows, a power of two, whose Q, dO (16-bit) and
    fp32 dQ buffer fit the L2 cache together, so the rows streaming past the resident programs stay
    there. causal: the keys have a right bound (a causal mask, a window's right side), so the key
    blocks' programs differ in length. d=128 with a right bound, where chunks measured faster;
    elsewhere they measured level, and the chunk's index arithmetic would add spills for nothing
    (tests/test_codegen.py; docs/tuning.md).
    ordered (deterministic=True, dQ's additions in dq_order): chunks without a right bound too.
    Without a right bound key block n adds into a Q block after key block n - 1, so one row at a
    time launched them side by side and each waited for the one before at every Q block; in chunks
    key block n starts a chunk's worth of programs after key block n - 1, which measured faster
    (docs/tuning.md), though the chunks' index arithmetic spills 40 bytes at d=128 where 12 were
    (none more at d=64). Under a right bound the kernel reverses the key blocks (the last first,
    ops.masks.dq_order), and key block n + 1, started beside key block n, reaches a Q block a step
    or two before it: there the ordered kernel keeps the any-order rule (chunks measured no better
    at d=64 causal: docs/tuning.md)."""
    if not hopper_backward_chunked(d, causal, ordered):
        return 1
    return l2_head_chunk(seqlen_q * group * d * (2 + 2 + 4), device)


def hopper_backward_chunked(d: int, causal: bool, ordered: bool = False) -> bool:
    """Whether the Hopper backward launches its programs in chunks of rows (HEAD_CHUNKED, a
    constexpr; the chunk itself is an argument): by head dim, mask and order only, so that every
    length runs one compiled kernel (a chunk of one row is one row after the other)."""
    return (ordered and not causal) or (d == 128 and causal)


def delta_config(d: int, device: torch.device) -> BlockConfig:
    """The rowsum(dO * O) preprocess is a pure stream: big row blocks, no pipelining needed."""
    if not on_gpu(device):
        return INTERPRETER_CONFIG
    return BlockConfig(128, 0, 4, 1)


class BackwardConfig(NamedTuple):
    dkdv: BlockConfig  # dK/dV programs: block_n keys stay put, block_m query rows stream past
    dq: BlockConfig  # dQ programs: block_m query rows stay put, block_n keys stream past
    # both kinds in one launch after a delta launch (sharing dkdv's num_warps and num_stages), or
    # the dQ launch (which computes delta) and then the dK/dV launch
    fused: bool
    dkdv_tma: bool = False  # dK/dV programs read Q and dO through TMA descriptors where the layout allows
    dq_tma: bool = False  # dQ programs read K and V through TMA descriptors where the layout allows
    # causal masks: heads interleaved in launch order (ops.schedule.head_chunked_order), for the dK/dV
    # (or the one) launch and for the dQ launch
    head_chunk: int = 1
    dq_head_chunk: int = 1
    # two launches: the dK/dV launch is a programmatic dependent launch (sm_90+) of the dQ launch
    pdl: bool = False


def supports_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` can be programmatic dependent launches (sm_90 and later): the
    backward's dK/dV launch after its dQ launch, and a decoding call's combine kernel after its
    split kernel, whose programs are then resident when the split kernel ends (no launch gap)."""
    return on_gpu(device) and capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def backward_config(d: int, dtype: torch.dtype, device: torch.device, causal: bool,
                    dropout: bool = False) -> BackwardConfig:
    """Tiles for ops.backward on an H100 (sm_90), each launch's own best in scripts/sweep_prefill.py's
    sweeps (the two launches are independent); the measurements behind each choice: docs/tuning.md.

    - Two launches, the dQ launch first computing delta on the way (no delta launch), then dK/dV:
      one launch for both kinds (fused) was slower or level, since one tile, warp and stage count
      must suit both kinds and the heavier kind's registers bind both.
    - dK/dV tiles with BLOCK_N >= 64 spill at d=128 (ptxas), but the spill-free BLOCK_N = 32 ones
      were slower. The d=64 causal dQ tile (126 registers) fits two programs an SM, which the
      chunked launch order's index arithmetic would take away: that launch keeps one head at a time.
    - TMA for K/V in the dQ programs (dq_tma), and for Q/dO in the dK/dV programs at d=128 (fewer
      spills; level at d=64). dQ with TMA at 2 stages crashes ptxas (SIGSEGV) in triton 3.6:
      (128, 64, 8, 2) on the H100, every 2-stage tile tried offline.
    - Causal launches in chunks of heads (head_chunk, dq_head_chunk): their longest programs first.
    - PDL for the dK/dV launch after the dQ launch (K/V loads overlap its tail, no launch gap): a
      little faster at d=64 causal, no sign elsewhere.
    - With dropout (Philox temporaries next to the dK/dV accumulators) the smaller dK/dV tiles that
      its sweep (4k, whole backward, without PDL) found faster.
    """
    if not on_gpu(device):
        return BackwardConfig(INTERPRETER_CONFIG, INTERPRETER_CONFIG, True)
    pdl = supports_pdl(device)
    bd = padded_headdim(d)
    if dtype == torch.float32:
        if bd <= 128:
            return BackwardConfig(BlockConfig(32, 64, 4, 1), BlockConfig(64, 32, 4, 1), False, pdl=pdl)
        return BackwardConfig(BlockConfig(16, 32, 4, 1), BlockConfig(32, 16, 4, 1), False, pdl=pdl)
    if dropout and bd <= 64:  # the dropout sweep's tile, measured without PDL (docs/tuning.md)
        return BackwardConfig(BlockConfig(32, 64, 4, 3), BlockConfig(64, 64, 4, 3), False, dq_tma=True)
    if dropout and bd <= 128 and causal:
        return BackwardConfig(BlockConfig(32, 64, 4, 2), BlockConfig(128, 64, 8, 3), False, dkdv_tma=True,
                              dq_tma=True)
    if bd <= 64:
        dq = BlockConfig(128, 64, 8, 3) if causal else BlockConfig(64, 64, 4, 3)
        return BackwardConfig(BlockConfig(32, 128, 4, 3), dq, False, dq_tma=True, head_chunk=4, pdl=pdl)
    if bd <= 128:
        return BackwardConfig(BlockConfig(64, 64, 4, 2), BlockConfig(128, 64, 8, 3), False, dkdv_tma=True,
                              dq_tma=True, head_chunk=16, dq_head_chunk=16, pdl=pdl)
    dkdv = BlockConfig(64, 64, 8, 1) if causal else BlockConfig(32, 32, 4, 2)
    return BackwardConfig(dkdv, BlockConfig(64, 32, 4, 1), False, pdl=pdl)


# --------------------------------------------------------------------------------------------
# Decoding (ops.decode): split-KV kernel tiles, combine kernel tiles, the num_splits heuristic
# --------------------------------------------------------------------------------------------

# Under the interpreter: 32-key tiles make the small test caches cross many tiles and splits, and
# exercise both paged paths (page 16 < 32 keys: one page index per key; page 64: one per tile).
DECODE_INTERPRETER_BLOCK_N = 32

# The num_splits heuristic (decode_num_splits), from H100 measurements (docs/tuning.md).
DECODE_PROGRAMS_PER_SM = 2  # programs counted per SM when sizing the grid ("slots"); 2-3 fit at once
DECODE_NO_SPLIT_FILL = 0.8  # one program per (batch, kv head) filling 80% of the slots is enough
DECODE_ROUNDS = 1  # otherwise fill every slot this many times over (contiguous caches)
DECODE_ROUNDS_PAGED = 2  # ... over paged ones
DECODE_MIN_BLOCKS_PER_SPLIT = 8  # >= 8 key tiles per split (see decode_num_splits)
DECODE_FUSED_MAX_SPLITS = 8  # the split kernel merges up to this many splits itself (decode_fuse_combine)
DECODE_MERGE_UNROLL = 4  # splits whose partial tiles the fused merge loads at once
NOMINAL_SMS = 132  # an H100's SM count, used off-GPU so CPU tests make the same split choices
NOMINAL_L2_BYTES = 50 * 2**20  # an H100's L2 cache


def on_gpu(device: torch.device) -> bool:
    """Whether the kernels for device are compiled (a CUDA device) or interpreted (the CPU under
    TRITON_INTERPRET=1, with INTERPRETER_CONFIG's small tiles): the configs' one test of it."""
    return device.type == "cuda"


def capability(device: torch.device) -> tuple:
    """A CUDA device's compute capability, (9, 0) on the H100. torch's query costs ~10 us of host
    time on the H100 machine, on every launch's path: a device with an index (every CUDA tensor's)
    is asked once (_capability.cache_clear() forgets the answers)."""
    if device.index is None:  # "cuda": whichever device is current now
        return torch.cuda.get_device_capability(device)
    return _capability(device)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """The device's SM count (NOMINAL_SMS off the GPU)."""
    if device.type != "cuda":
        return NOMINAL_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def l2_bytes(device: torch.device) -> int:
    """The device's L2 cache in bytes (NOMINAL_L2_BYTES off the GPU)."""
    if device.type != "cuda":
        return NOMINAL_L2_BYTES
    return torch.cuda.get_device_properties(device).L2_cache_size


@functools.lru_cache(maxsize=None)  # once per shape: a decoding step spends its host time here otherwise
def decode_config(rows: int, d: int, dtype: torch.dtype, page_size: int, device: torch.device,
                  split: bool = False, one_round: bool = False) -> BlockConfig:
    """Tiles for the split-KV kernel of ops.decode on an H100 (sm_90); split: for a launch that
    cuts the keys into several splits, one_round: for an unsplit one whose programs all fit the
    GPU's slots at once (decode_tiles).

    rows = seqlen_q * (nheads // nheads_k): the query rows that share one KV head are packed into
    the M side of one tl.dot (GQA packing), padded to >= 16 (mma's minimum M); more than 64 rows
    (chunked prefill) take several M blocks, each re-reading the KV. page_size = 0 for a contiguous
    cache. Decoding streams the KV cache once, so the tiles aim at bytes in flight, not FLOPs: one
    tile of K and V is 32 KB (64 keys x 128 dims x 2 B x 2 at d=128 fp16; the key count scales so
    every head dim keeps 32 KB), 4 warps, 2 stages: one buffer per program, so more programs fit
    on an SM than with 3 stages (2 cp.async buffers).
    A page smaller than the tile makes the key addresses a gather through the block table (a page
    index per key); the tiles stay the same, except at 16-token pages (d=128, up to 16 rows):
    a launch that splits takes tiles of one page (16 keys, no gather: one page index a tile) in 3
    stages, and twice the splits that makes (~250 keys a program); an unsplit launch of one round
    (programs <= slots, decode_num_splits), which holds too few bytes in flight with 64-key gather
    tiles, takes 128-key ones. Each measured faster where it runs and no faster elsewhere;
    contiguous 128-key tiles in 3 stages won on some long launches and lost on short ones, and
    max_keys is often the cache's capacity, not the lengths: not taken (docs/tuning.md). Other page
    sizes, head dims and query-row counts (more than 16 packed rows) were not measured and keep
    their tiles.
    """
    block_m = min(max(16, next_pow2(rows)), 64)
    if not on_gpu(device):
        return BlockConfig(block_m, DECODE_INTERPRETER_BLOCK_N, 4, 1)
    bd = padded_headdim(d)
    if dtype == torch.float32:
        # IEEE fp32 dots run on FMAs with the products in registers (ptxas, sm_90): 32 keys x 16
        # rows at d=128 spill 452 B, so 16 KB tiles for 16 rows and fewer keys for more rows; 32+
        # rows spill even at 16 keys with 4 warps (512 B), not with 8
        block_n = max(16, min(128, 16 * 1024 // (2 * bd * 4) * 16 // block_m))
        gather = page_size > 0 and page_size % block_n != 0
        return BlockConfig(block_m, block_n, 8 if block_m > 16 else 4, 5 if gather else 3)
    if page_size == 16 and bd == 128 and block_m == 16:  # as measured (docstring)
        if split:
            return BlockConfig(block_m, 16, 4, 3)
        if one_round:
            return BlockConfig(block_m, 128, 4, 2)
    # paged, 3 stages: the pipeliner then reads a tile's page indices (into shared memory) a tile
    # before its keys, which keep their one buffer (the same shared memory as 2 stages): a little
    # faster (docs/tuning.md)
    return BlockConfig(block_m, max(16, min(128, 32 * 1024 // (2 * bd * 2))), 4, 3 if page_size and bd <= 128 else 2)


def decode_tiles(rows: int, d: int, dtype: torch.dtype, page_size: int, device: torch.device, kv_rows: int,
                 max_keys: int, num_splits: int = 0) -> tuple[BlockConfig, int]:
    """(tiles, splits) of a decoding launch: kv_rows = batch x nheads_k, max_keys the longest key
    range of one of them; num_splits = 0 asks decode_num_splits, else it is kept. A launch that
    splits takes decode_config's split tiles, and with num_splits = 0 the count for those tiles;
    an unsplit one whose programs fit the slots at once, its one-round tiles."""
    cfg = decode_config(rows, d, dtype, page_size, device)
    programs = kv_rows * cdiv(rows, cfg.block_m)
    auto = num_splits == 0
    if auto:
        num_splits = decode_num_splits(programs, max_keys, cfg.block_n, num_sms(device), page_size > 0)
    if num_splits > 1:
        split_cfg = decode_config(rows, d, dtype, page_size, device, split=True)
        if split_cfg != cfg:
            cfg = split_cfg
            if auto:
                num_splits = decode_num_splits(programs, max_keys, cfg.block_n, num_sms(device), page_size > 0)
    elif programs <= DECODE_PROGRAMS_PER_SM * num_sms(device):
        cfg = decode_config(rows, d, dtype, page_size, device, one_round=True)
    return cfg, num_splits


DECODE_WARP_KEYS = 16  # keys each of _split_kernel_warps' 4 warps takes of a tile at d=128 (32 at d=64)
DECODE_WARP_STAGES = 3  # its tiles in flight (cp.async)


DECODE_WARP_MIN_TILES = 8  # past one program an SM, _split_kernel_warps needs rows of >= 8 tiles (below)


def decode_warp_tiles(rows: int, d: int, dtype: torch.dtype, device: torch.device, kv_rows: int, max_keys: int,
                      num_splits: int) -> tuple[BlockConfig, int] | None:
    """(tiles, splits) for ops.decode_sm90._split_kernel_warps (each warp on keys of its own) where it
    measured faster than _split_kernel, else None: on sm_90, fp16 / bf16, d=64 or 128, at most 16 query
    rows a KV head (rows = seqlen_q x nheads / nheads_k), and either a grid of at most one program
    an SM (kv_rows = batch x nheads_k programs, times the splits) or rows of at least
    DECODE_WARP_MIN_TILES tiles (max_keys: the longest). Its warps' chains being short, one program
    an SM with 3 tiles in flight reads at ~94% of the read floor, where _split_kernel needs two or
    more programs an SM and then splits (and merges) twice as much. With num_splits = 0 the keys are
    cut so the grid fills the SMs once, at >= DECODE_MIN_BLOCKS_PER_SPLIT tiles a split; past one
    program an SM they are not cut. Past one round it measured faster with rows of 8 tiles or more,
    not with 4 (docs/tuning.md)."""
    if (not on_gpu(device) or capability(device) != (9, 0) or dtype not in (torch.float16, torch.bfloat16)
            or d not in (64, 128) or rows > 16):
        return None
    block_m = 8 if rows <= 8 else 16
    block_n = 4 * DECODE_WARP_KEYS * 128 // d  # a 32 KB tile of K and V
    sms = num_sms(device)
    if kv_rows <= 0 or (kv_rows > sms and max_keys < DECODE_WARP_MIN_TILES * block_n):  # an empty batch: no launch
        return None
    if num_splits == 0:
        num_splits = max(1, min(sms // kv_rows, cdiv(max(max_keys, 1), DECODE_MIN_BLOCKS_PER_SPLIT * block_n)))
    return BlockConfig(block_m, block_n, 4, DECODE_WARP_STAGES), num_splits


def decode_num_splits(programs: int, max_keys: int, block_n: int, num_sms: int, paged: bool = False) -> int:
    """How many pieces to cut each sequence's keys into (Flash-Decoding's new parallel axis).

    programs: the split kernel's programs with one split, batch * nheads_k * M blocks.
    max_keys: the longest key range one of them reads. The caller passes the real maximum when it
    is known on the host (an int cache_seqlens, CPU tensors, the KVCache helpers' host lengths) and
    otherwise the cache capacity: reading a CUDA cache_seqlens would synchronise the GPU (and break
    CUDA-graph capture) on every decoding step. Over-estimating only costs empty splits, which exit
    after writing an LSE of -inf; the real lengths still divide evenly, on the device.

    The GPU holds DECODE_PROGRAMS_PER_SM x num_sms programs at once ("slots", 264 on an H100).
    1. programs >= DECODE_NO_SPLIT_FILL x slots (large batch: 256 x 2 KV heads): no split, so no
       partials and no combine kernel. Splitting could not make a full GPU read faster
       (docs/tuning.md).
    2. Otherwise cut the keys so the grid fills the slots DECODE_ROUNDS times (paged caches:
       DECODE_ROUNDS_PAGED): floor(rounds x slots / programs). One round measured best on
       contiguous caches, two on 16-token pages, whose gathers want more programs in flight
       (docs/tuning.md).
    3. But never below DECODE_MIN_BLOCKS_PER_SPLIT key tiles per split: a split pays a fixed cost
       (load q, write rows x d fp32 partials, read them again in the combine). 8 tiles measured
       best or within 3% (docs/tuning.md).
    """
    slots = DECODE_PROGRAMS_PER_SM * num_sms
    if programs >= DECODE_NO_SPLIT_FILL * slots:
        return 1
    by_fill = ((DECODE_ROUNDS_PAGED if paged else DECODE_ROUNDS) * slots) // max(programs, 1)
    by_keys = cdiv(max(max_keys, 1), DECODE_MIN_BLOCKS_PER_SPLIT * block_n)
    return max(1, min(by_fill, by_keys))


def decode_fuse_combine(num_splits: int) -> bool:
    """Whether the split kernel merges the splits itself (its last program per row, counted by an
    arrival counter) instead of a separate combine kernel. The merging program reads every split's
    partial tile in turn, so the fused merge costs ~num_splits L2 round trips in one program, where
    the combine kernel spreads one row's splits over many programs in one round trip; one launch
    less pays for few splits only: fused measured faster up to 8 splits, slower past 16
    (docs/tuning.md)."""
    return num_splits <= DECODE_FUSED_MAX_SPLITS


class CombineConfig(NamedTuple):
    block_s: int  # splits merged per step
    block_d: int  # output columns per program
    num_warps: int


@functools.lru_cache(maxsize=None)
def combine_config(num_splits: int, d: int) -> CombineConfig:
    """Tiles for the LSE merge: all splits of a row in one load where they fit.

    The merge loop carries a running max, so each step waits for its loads; a (splits, columns)
    tile that holds every split makes it one DRAM round trip instead of one per step (264 splits
    at 16 per step would cost ~17 round trips, ~10 us). The tile is capped near 8192 fp32 values
    (64 registers per thread at 4 warps; 115 in all at 512 splits, no spills on sm_90); fewer
    columns per program then buy more programs.
    """
    bd = padded_headdim(d)
    block_s = min(next_pow2(num_splits), 512)
    block_d = max(16, min(bd, 8192 // block_s))
    return CombineConfig(block_s, block_d, 4)
