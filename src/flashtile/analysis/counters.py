"""Instrumenting the reference loops: count every tile that moves between "HBM" and "SRAM".

`reference.fa1`, `reference.fa2` and `reference.decoding` take a `counter`; they call
`counter.read(*tiles)` for every block they load and `counter.write(*tiles)` for every block they
store. The tiles carry all (batch, head) pairs at once, so the totals are b * h times the per-head
numbers of `analysis.io_model` (kv tiles are counted per query head, as a kernel without GQA packing
loads them).
"""

from __future__ import annotations

import torch


class IOCounter:
    """Elements read from and written to HBM, priced at `element_size` bytes each.

    The element size is the model's, not the tensors': a float64 reference run can be counted as the
    float16 kernel it stands for.
    """

    def __init__(self, element_size: int):
        if not isinstance(element_size, int) or element_size < 1:
            raise ValueError(f"element_size must be a positive int (bytes), got {element_size!r}")
        self.element_size = element_size
        self.elements_read = 0
        self.elements_written = 0

    def read(self, *tiles: torch.Tensor) -> None:
        self.elements_read += sum(t.numel() for t in tiles)

    def write(self, *tiles: torch.Tensor) -> None:
        self.elements_written += sum(t.numel() for t in tiles)

    @property
    def bytes_read(self) -> int:
        return self.elements_read * self.element_size

    @property
    def bytes_written(self) -> int:
        return self.elements_written * self.element_size

    @property
    def hbm_bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def __repr__(self) -> str:
        return f"IOCounter(read={self.bytes_read} B, written={self.bytes_written} B)"
