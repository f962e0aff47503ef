"""flashtile: exact, IO-aware attention for PyTorch (Triton kernels + plain PyTorch references)."""

__version__ = "0.1.0"
