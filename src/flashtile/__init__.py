"""flashtile: exact, IO-aware attention for PyTorch (Triton kernels + plain PyTorch references).

Re-exports only. Importing flashtile does not import triton: the kernels load on first use.
"""

from flashtile._checks import ArgumentError
from flashtile.api import (
    DecodePlan,
    explain,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    merge_attention_states,
    scaled_dot_product_attention,
    use_backend,
)
from flashtile.flex import create_block_mask
from flashtile.kvcache import KVCache, PagedKVCache
from flashtile.padding import pad_input, unpad_input

__version__ = "0.1.0"
