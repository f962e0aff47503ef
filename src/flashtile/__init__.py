"""flashtile: exact, IO-aware attention for PyTorch (Triton kernels + plain PyTorch references).

Re-exports only. Importing flashtile does not import triton: the kernels load on first use.
"""

from flashtile.api import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    scaled_dot_product_attention,
    use_backend,
)

__version__ = "0.1.0"
