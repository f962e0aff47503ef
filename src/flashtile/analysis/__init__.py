"""The IO model: FLOPs, HBM bytes, arithmetic intensity, block sizes, roofline times; tile counters."""

from flashtile.analysis.counters import IOCounter
from flashtile.analysis.gpus import DTYPES, GPU, GPUS, element_size, get_gpu, roofline
from flashtile.analysis.io_model import (
                                         Cost,
                                         attention_matrix_bytes,
                                         decoding,
                                         fa1,
                                         fa1_backward,
                                         fa2,
                                         fa2_backward,
                                         standard,
)
from flashtile.reference.fa1 import block_sizes as fa1_block_sizes

__all__ = [
    "DTYPES", "GPU", "GPUS", "Cost", "IOCounter", "attention_matrix_bytes", "decoding",
    "element_size", "fa1", "fa1_backward", "fa1_block_sizes", "fa2", "fa2_backward", "get_gpu",
    "roofline", "standard",
]
