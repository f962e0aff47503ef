"""Context parallelism on torch.distributed: ring attention over a sequence sharded across ranks,
and the helpers that shard and gather it. Re-exports only; see ring.py for the algorithm."""

from flashtile.distributed.api import ring_flash_attn_func, ring_flash_attn_varlen_func
from flashtile.distributed.plan import LAYOUTS
from flashtile.distributed.shard import gather_sequence, shard_index, shard_sequence, unshard_sequence

__all__ = ["LAYOUTS", "gather_sequence", "ring_flash_attn_func", "ring_flash_attn_varlen_func", "shard_index",
           "shard_sequence", "unshard_sequence"]
