"""Roofline times: a Cost on a GPU takes at least max(FLOPs / peak, bytes / bandwidth).

Peaks are dense (no 2:4 sparsity) datasheet numbers of the SXM parts; `h100-measured` is what our
own H100 reaches (BENCHMARKS.md: 8192^3 bf16 matmul and 1 GiB device copy), the ceilings that
benchmark ratios are taken against.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashtile.analysis.io_model import Cost

DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}  # element sizes in bytes


def element_size(dtype: str) -> int:
    """Bytes per element of "float16", "bfloat16" or "float32"."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


@dataclass(frozen=True)
class GPU:
    name: str
    tflops_16bit: float  # dense fp16/bf16 tensor-core peak, TFLOP/s
    tflops_fp32: float | None  # IEEE fp32 (no TF32: torch's default for matmuls), TFLOP/s
    hbm_tbps: float  # HBM bandwidth, TB/s (10^12 bytes/s)
    source: str

    def peak_flops(self, dtype: str) -> float:
        """FLOP/s for inputs of `dtype` ("float16", "bfloat16" or "float32")."""
        element_size(dtype)
        tflops = self.tflops_fp32 if dtype == "float32" else self.tflops_16bit
        if tflops is None:
            raise ValueError(f"no {dtype} compute ceiling is known for {self.name}; pick another gpu")
        return tflops * 1e12


GPUS = {
    "a100": GPU("NVIDIA A100 SXM 80GB", 312.0, 19.5, 2.039, "NVIDIA A100 datasheet"),
    "h100": GPU("NVIDIA H100 SXM", 989.0, 67.0, 3.35, "NVIDIA H100 datasheet"),
    "h200": GPU("NVIDIA H200 SXM", 989.0, 67.0, 4.8, "NVIDIA H200 datasheet"),
    "h100-measured": GPU("NVIDIA H100 80GB HBM3, measured", 687.0, None, 3.003,
                         "BENCHMARKS.md: bf16 matmul 687 TFLOP/s, copy 3003 GB/s"),
}


def get_gpu(name: str) -> GPU:
    if name not in GPUS:
        raise ValueError(f"gpu must be one of {sorted(GPUS)}, got {name!r}")
    return GPUS[name]


def roofline(cost: Cost, gpu: GPU, dtype: str) -> tuple[float, str]:
    """(seconds, "compute" or "memory"): the lower bound on the time and the roof that sets it."""
    compute_s = cost.flops / gpu.peak_flops(dtype)
    memory_s = cost.hbm_bytes / (gpu.hbm_tbps * 1e12)
    return (compute_s, "compute") if compute_s >= memory_s else (memory_s, "memory")
