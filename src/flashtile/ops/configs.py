"""Block sizes, autotune lists and heuristics for every kernel: no literals elsewhere.

Plain functions, so a user can override a choice by replacing the function.
"""

from typing import NamedTuple

import torch
import triton


class BlockConfig(NamedTuple):
    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def padded_headdim(d: int) -> int:
    """Head dims are padded (by masks, never by copies) to a power of two; tl.dot needs K >= 16."""
    return max(16, triton.next_power_of_2(d))


# Under TRITON_INTERPRET=1 (CPU) small tiles keep numpy fast and make the small test shapes cross
# several blocks, so every loop phase (masked / unmasked / skipped) runs in CI.
INTERPRETER_CONFIG = BlockConfig(16, 16, 4, 1)


def forward_config(d: int, dtype: torch.dtype, device: torch.device, causal: bool) -> BlockConfig:
    """Tiles for ops.forward on an H100 (sm_90).

    From scripts/sweep_prefill.py (bf16, seqlen 4096, 16k tokens, benchmarks/results/h100/sweep.json):
    d=64: (128, 64, 4 warps, 3 stages) 398 TFLOP/s, next (64, 128, 4, 3) 369, 8 warps <= 333.
    d=128: (128, 128, 8, 3) 446 (causal 362), (64, 64, 4, 3) 419 (365), (128, 64, 4, 3) spills: 118.
    """
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    bd = padded_headdim(d)
    if dtype == torch.float32:
        return BlockConfig(64, 32, 4, 2) if bd <= 128 else BlockConfig(32, 32, 4, 1)
    if bd <= 64:
        return BlockConfig(128, 64, 4, 3)
    if bd <= 128:
        return BlockConfig(128, 128, 8, 3)
    return BlockConfig(64, 64, 4, 2)


def delta_config(d: int, device: torch.device) -> BlockConfig:
    """The rowsum(dO * O) preprocess is a pure stream: big row blocks, no pipelining needed."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    return BlockConfig(128, 0, 4, 1)


def dkdv_config(d: int, dtype: torch.dtype, device: torch.device, causal: bool) -> BlockConfig:
    """Tiles for the dK/dV kernel: block_n keys stay put, block_m query rows stream past.

    Sweep (whole backward TFLOP/s, bf16, seqlen 4096): d=64 (32, 128, 4, 3) 244 / causal 197, the
    8-warp tiles 185-210; d=128 (64, 64, 4, 2) 298 / 230, (64, 128, 8, 1) 291 / 247.
    """
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    bd = padded_headdim(d)
    if dtype == torch.float32:
        return BlockConfig(32, 64, 4, 1) if bd <= 128 else BlockConfig(16, 32, 4, 1)
    if bd <= 64:
        return BlockConfig(32, 128, 4, 3)
    if bd <= 128:
        return BlockConfig(64, 128, 8, 1) if causal else BlockConfig(64, 64, 4, 2)
    return BlockConfig(32, 64, 4, 1)


def dq_config(d: int, dtype: torch.dtype, device: torch.device, causal: bool) -> BlockConfig:
    """Tiles for the dQ kernel: block_m query rows stay put, block_n keys stream past.

    Sweep (whole backward, bf16, seqlen 4096): d=64 (64, 32, 4, 3) 239 / causal 189;
    d=128 (64, 64, 4, 2) 301 / 234, (128, 64, 8, 3) 298 / 232.
    """
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    bd = padded_headdim(d)
    if dtype == torch.float32:
        return BlockConfig(64, 32, 4, 1) if bd <= 128 else BlockConfig(32, 16, 4, 1)
    if bd <= 64:
        return BlockConfig(64, 32, 4, 3)
    if bd <= 128:
        return BlockConfig(64, 64, 4, 2)
    return BlockConfig(64, 32, 4, 1)
