"""KV caches for a generate loop: contiguous (KVCache) and paged (PagedKVCache).

Both hold every layer's keys and values and count each sequence's tokens twice: on the host
(`lengths`, for the capacity check, page allocation and the num_splits heuristic, so a decoding
step never waits on the GPU) and on the device (`seqlens`, (batch,) int32, what the kernels read).

    cache = PagedKVCache(num_pages=4096, page_size=16, batch=4, kv_heads=8, head_dim=128,
                         num_layers=32, dtype=torch.bfloat16, device="cuda")
    for step in range(max_new_tokens):
        for i, layer in enumerate(layers):
            q, k, v = layer.qkv(x)                 # (4, 1, 32, 128), (4, 1, 8, 128), (4, 1, 8, 128)
            x = layer.out(cache.attend(q, k, v, layer=i, causal=True))
        cache.advance(1)                           # once per step, after every layer
"""

from __future__ import annotations

import torch

from flashtile import api


class _Cache:
    """What both layouts share: lengths on host and device, attend, advance. Subclasses provide
    the tensors (views) and may allocate in _reserve."""

    def __init__(self, batch: int, capacity: int, device):
        self.capacity = capacity
        self.lengths = [0] * batch
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)

    def _reserve(self, seqlen_new: int) -> None:
        """Make room for seqlen_new more tokens in every sequence, or raise."""
        longest = max(self.lengths, default=0)
        if longest + seqlen_new > self.capacity:
            raise ValueError(f"cache overflow: a sequence holds {longest} tokens and appends "
                             f"{seqlen_new}, but the cache holds {self.capacity} per sequence")

    def attend(self, q, k, v, layer: int = 0, **kwargs):
        """Append k, v (batch, seqlen_new, kv_heads, head_dim) after each sequence's tokens and
        attend q (batch, seqlen_q, nheads, head_dim) over everything cached.

        kwargs are flash_attn_with_kvcache's (causal, window_size, rotary_cos, ...,
        return_softmax_lse). Lengths do not move until advance(): every layer of one step appends
        at the same positions.
        """
        self._reserve(k.shape[1])
        return_lse = kwargs.pop("return_softmax_lse", False)
        out, lse = api._kvcache_attention(q, k=k, v=v, **self.views(layer), **kwargs,
                                          max_keys=max(self.lengths, default=0) + k.shape[1])
        return (out, lse) if return_lse else out

    def advance(self, n=1) -> None:
        """Count n new tokens in every sequence (an int) or n[i] in sequence i (a list of ints)."""
        if isinstance(n, int):
            self.lengths = [x + n for x in self.lengths]
            self.seqlens += n  # on the device: no host -> device copy, no sync
        else:
            if len(n) != len(self.lengths):
                raise ValueError(f"advance needs one count per sequence ({len(self.lengths)}), got {len(n)}")
            self.lengths = [x + int(m) for x, m in zip(self.lengths, n)]
            self.seqlens.copy_(torch.tensor(self.lengths, dtype=torch.int32))
        if max(self.lengths, default=0) > self.capacity:
            raise ValueError(f"advance past the capacity ({self.capacity} tokens per sequence)")

    def reset(self, seq: int) -> None:
        """Empty sequence seq so its slot can start a new one."""
        self.lengths[seq] = 0
        self.seqlens[seq] = 0


class KVCache(_Cache):
    """A contiguous cache: k, v (num_layers, batch, capacity, kv_heads, head_dim)."""

    def __init__(self, batch: int, capacity: int, kv_heads: int, head_dim: int, *, num_layers: int = 1,
                 dtype=torch.float16, device="cpu"):
        super().__init__(batch, capacity, device)
        shape = (num_layers, batch, capacity, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def views(self, layer: int = 0) -> dict:
        """flash_attn_with_kvcache's cache arguments for one layer."""
        return {"k_cache": self.k[layer], "v_cache": self.v[layer], "cache_seqlens": self.seqlens}


class PagedKVCache(_Cache):
    """A paged cache: k, v (num_layers, num_pages, page_size, kv_heads, head_dim), shared by all
    sequences through block_table (batch, max_seq_len / page_size) int32.

    Pages are handed out as sequences grow (attend reserves them before writing) and come back with
    reset(seq). Unused block_table entries hold -1. page_size must be a multiple of 16 (vLLM uses
    16; the kernel reads one page index per key tile when page_size is a multiple of the tile).
    """

    def __init__(self, num_pages: int, page_size: int, batch: int, kv_heads: int, head_dim: int, *,
                 max_seq_len: int | None = None, num_layers: int = 1, dtype=torch.float16,
                 device="cpu"):
        if page_size % 16 != 0:
            raise ValueError(f"page_size must be a multiple of 16, got {page_size}")
        max_blocks = -(-(max_seq_len or num_pages * page_size) // page_size)
        super().__init__(batch, max_blocks * page_size, device)
        self.page_size = page_size
        shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_table = torch.full((batch, max_blocks), -1, dtype=torch.int32, device=device)
        self._table = torch.full((batch, max_blocks), -1, dtype=torch.int32)  # host copy
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 goes out first
        self._pages = [[] for _ in range(batch)]

    @property
    def pages_free(self) -> int:
        return len(self._free)

    def views(self, layer: int = 0) -> dict:
        return {"k_cache": self.k[layer], "v_cache": self.v[layer], "cache_seqlens": self.seqlens,
                "block_table": self.block_table}

    def _reserve(self, seqlen_new: int) -> None:
        super()._reserve(seqlen_new)
        changed = False
        for seq, n in enumerate(self.lengths):
            pages = self._pages[seq]
            while len(pages) * self.page_size < n + seqlen_new:
                if not self._free:
                    raise RuntimeError(f"out of pages: all {self.k.shape[1]} are in use; reset() "
                                       f"finished sequences or allocate more")
                self._table[seq, len(pages)] = self._free[-1]
                pages.append(self._free.pop())
                changed = True
        if changed:  # a new page every page_size tokens: one small copy, not one per step
            self.block_table.copy_(self._table)

    def reset(self, seq: int) -> None:
        super().reset(seq)
        self._free.extend(reversed(self._pages[seq]))
        self._pages[seq] = []
        self._table[seq] = -1
        self.block_table[seq] = -1
