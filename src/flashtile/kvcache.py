"""KV caches for a generate loop: contiguous (KVCache) and paged (PagedKVCache).

Both hold every layer's keys and values and count each sequence's tokens twice: on the host
(`lengths`, for the checks, page allocation and the num_splits heuristic, so a decoding step never
waits on the GPU) and on the device (`seqlens`, (batch,) int32, what the kernels read; the checks
know its values from `lengths`, so they never copy it back). The first attend of a step makes the
step's DecodePlan; every other layer of the step runs it:

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

from flashtile import _checks, api
from flashtile._checks import ArgumentError


def _check_sizes(**sizes) -> None:
    """Each size an int >= its least value (_checks.check_int): name=(value, least)."""
    for name, (n, least) in sizes.items():
        _checks.check_int(name, n, least)


class _Cache:
    """What both layouts share: lengths on host and device, the step's plan, attend, advance.
    Subclasses provide the tensors and may allocate in _reserve."""

    def __init__(self, batch: int, capacity: int, device):
        self.capacity = capacity
        self.lengths = [0] * batch
        # made outside inference mode even when the cache is made inside it: an inference tensor
        # has no version counter, so the checks could not tell that they know its values
        with torch.inference_mode(False):
            self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        self._lengths_changed()

    def _lengths_changed(self) -> None:
        """After seqlens was written: tell the checks its values, drop the step's plan."""
        _checks.set_host_copy(self.seqlens, torch.tensor(self.lengths, dtype=torch.int32))
        self._plan = self._plan_key = self._plan_kwargs = None

    def _reserve(self, seqlen_new: int) -> None:
        """Make room for seqlen_new more tokens in every sequence, or raise."""
        longest = max(self.lengths, default=0)
        if longest + seqlen_new > self.capacity:
            raise ArgumentError(f"cache overflow: a sequence holds {longest} tokens and appends "
                                f"{seqlen_new}, but the cache holds {self.capacity} per sequence")

    def plan(self, q: torch.Tensor, seqlen_new: int, **kwargs) -> api.DecodePlan:
        """The DecodePlan of this step for q (its shape and dtype) and seqlen_new new tokens per
        sequence: made by the first call of a step (after reserving room), then reused until the
        lengths change (advance, reset) or the arguments do. kwargs: DecodePlan's options."""
        key = (q.shape, q.dtype, seqlen_new, [(name, _identity(x)) for name, x in kwargs.items()])
        if self._plan is None or self._plan_key != key:
            self._reserve(seqlen_new)
            self._plan = api.DecodePlan(
                len(self.lengths), q.shape[2], self.k.shape[1:], self.seqlens, dtype=self.k.dtype,
                device=self.seqlens.device, seqlen_q=q.shape[1], seqlen_new=seqlen_new, **self._table(), **kwargs)
            self._plan_key = key
            self._plan_kwargs = kwargs  # alive while their ids are in the key: no other object takes them
        return self._plan

    def attend(self, q, k, v, layer: int = 0, **kwargs):
        """Append k, v (batch, seqlen_new, kv_heads, head_dim) after each sequence's tokens and
        attend q (batch, seqlen_q, nheads, head_dim) over everything cached.

        kwargs are flash_attn_with_kvcache's (causal, window_size, rotary_cos, ...,
        return_softmax_lse, learnable_sink: this layer's attention sink). Lengths do not move until
        advance(): every layer of one step appends at the same positions, with the step's plan
        (made by the first layer's call).
        """
        if k is None or v is None:
            raise ArgumentError("attend appends k and v (the step's new tokens): for attention over the cache "
                                "alone call flash_attn_with_kvcache(q, **cache.views(layer), ...)")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(self._k):
            raise ArgumentError(f"layer must be an int in [0, {len(self._k)}) (num_layers), got {layer!r}")
        return_lse = kwargs.pop("return_softmax_lse", False)
        sink = kwargs.pop("learnable_sink", None)  # per layer: a run argument, not a plan's
        plan = self.plan(q, k.shape[1], **kwargs)
        return plan.run(q, self._k[layer], self._v[layer], k, v, return_softmax_lse=return_lse, learnable_sink=sink)

    def advance(self, n=1) -> None:
        """Count n new tokens in every sequence (an int) or n[i] in sequence i (a list of ints, or a
        1-D tensor or array).

        A negative count rolls a sequence back (the rejected draft tokens of speculative decoding):
        its last -n tokens are forgotten and the next append overwrites them. Lengths must stay in
        [0, capacity]; otherwise ValueError and nothing changes."""
        if not isinstance(n, (list, tuple)) and getattr(n, "ndim", 0) != 1:  # a 1-D tensor or array counts per sequence
            n = _count(n)
            lengths = [x + n for x in self.lengths]
        else:
            if len(n) != len(self.lengths):
                raise ArgumentError(f"advance needs one count per sequence ({len(self.lengths)}), got {len(n)}")
            lengths = [x + _count(m) for x, m in zip(self.lengths, n)]
        if lengths and (max(lengths) > self.capacity or min(lengths) < 0):
            raise ArgumentError(f"advance past the capacity ({self.capacity} tokens per sequence) or below 0: "
                                f"advance({n}) from lengths {self.lengths}")
        self.lengths = lengths
        if isinstance(n, int):
            self.seqlens += n  # on the device: no host -> device copy
        else:
            _checks.upload(torch.tensor(lengths, dtype=torch.int32), self.seqlens)
        self._lengths_changed()

    def reset(self, seq: int) -> None:
        """Empty sequence seq so its slot can start a new one."""
        self._check_seq(seq)
        self.lengths[seq] = 0
        self.seqlens[seq] = 0
        self._lengths_changed()

    def _table(self) -> dict:
        return {}

    def _check_seq(self, seq) -> None:
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < len(self.lengths):
            raise ArgumentError(f"seq must be an int in [0, {len(self.lengths)}) (batch), got {seq!r}")


def _count(n) -> int:
    """A token count of advance(), negative to roll back: an int (a numpy or 0-d tensor integer too)."""
    return _checks.check_int("advance's count", n, -2**63)


def _identity(x):
    """A plan argument as the plan key holds it: tensors (ALiBi slopes, rotary tables, cache_leftpad)
    by identity and version, as the plan checked them; anything else by type and value, a tuple's or
    list's elements each so (causal=1.0 after causal=True, or window_size=(3.0, 0) after (3, 0), gets
    a plan of its own and so the checks' refusal, as flash_attn_with_kvcache's recent plans do)."""
    if isinstance(x, torch.Tensor):
        return id(x), None if x.is_inference() else x._version
    if isinstance(x, (tuple, list)):
        return type(x), tuple(_identity(e) for e in x)
    return type(x), x


class KVCache(_Cache):
    """A contiguous cache: k, v (num_layers, batch, capacity, kv_heads, head_dim)."""

    def __init__(self, batch: int, capacity: int, kv_heads: int, head_dim: int, *, num_layers: int = 1,
                 dtype=torch.float16, device="cpu"):
        _check_sizes(batch=(batch, 0), capacity=(capacity, 0), kv_heads=(kv_heads, 1), head_dim=(head_dim, 1),
                     num_layers=(num_layers, 1))
        api._check_dtype(dtype)
        super().__init__(batch, capacity, device)
        shape = (num_layers, batch, capacity, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._k, self._v = self.k.unbind(0), self.v.unbind(0)  # one view per layer, made once

    def views(self, layer: int = 0) -> dict:
        """flash_attn_with_kvcache's cache arguments for one layer."""
        return {"k_cache": self._k[layer], "v_cache": self._v[layer], "cache_seqlens": self.seqlens}


class PagedKVCache(_Cache):
    """A paged cache: k, v (num_layers, num_pages, page_size, kv_heads, head_dim), shared by all
    sequences through block_table (batch, max_seq_len / page_size) int32.

    Pages are handed out as sequences grow (the step's plan reserves them before anything is
    written) and come back with reset(seq). Unused block_table entries hold -1. A sequence holds
    max_seq_len tokens rounded up to whole pages (capacity; all the pages when None). page_size must be a
    multiple of 16 (vLLM uses 16; the kernel reads one page index per key tile when page_size is a
    multiple of the tile).
    """

    def __init__(self, num_pages: int, page_size: int, batch: int, kv_heads: int, head_dim: int, *,
                 max_seq_len: int | None = None, num_layers: int = 1, dtype=torch.float16,
                 device="cpu"):
        _check_sizes(num_pages=(num_pages, 1), page_size=(page_size, 16), batch=(batch, 0), kv_heads=(kv_heads, 1),
                     head_dim=(head_dim, 1), num_layers=(num_layers, 1))
        if max_seq_len is not None:
            _check_sizes(max_seq_len=(max_seq_len, 0))
        api._check_dtype(dtype)
        if page_size % 16 != 0:
            raise ArgumentError(f"page_size must be a multiple of 16, got {page_size}")
        max_blocks = -(-(max_seq_len or num_pages * page_size) // page_size)
        self.page_size = page_size
        with torch.inference_mode(False):  # as seqlens: a version counter for the checks
            self.block_table = torch.full((batch, max_blocks), -1, dtype=torch.int32, device=device)
        self._host_table = torch.full((batch, max_blocks), -1, dtype=torch.int32)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 goes out first
        self._pages = [[] for _ in range(batch)]
        super().__init__(batch, max_blocks * page_size, device)
        shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._k, self._v = self.k.unbind(0), self.v.unbind(0)
        self._table_changed()

    @property
    def pages_free(self) -> int:
        return len(self._free)

    def views(self, layer: int = 0) -> dict:
        return {"k_cache": self._k[layer], "v_cache": self._v[layer], "cache_seqlens": self.seqlens,
                "block_table": self.block_table}

    def _table(self) -> dict:
        return {"block_table": self.block_table}

    def _table_changed(self) -> None:
        """After block_table was written: tell the checks its values (a copy: _host_table changes)."""
        _checks.set_host_copy(self.block_table, self._host_table.clone())

    def _reserve(self, seqlen_new: int) -> None:
        super()._reserve(seqlen_new)
        changed = False
        try:
            for seq, n in enumerate(self.lengths):
                pages = self._pages[seq]
                while len(pages) * self.page_size < n + seqlen_new:
                    if not self._free:
                        raise RuntimeError(f"out of pages: all {self.k.shape[1]} are in use; reset() "
                                           f"finished sequences or allocate more")
                    self._host_table[seq, len(pages)] = self._free[-1]
                    pages.append(self._free.pop())
                    changed = True
        finally:  # pages handed out before running out stay with their sequences, on the device too
            if changed:  # a new page every page_size tokens: one small copy, not one per step
                _checks.upload(self._host_table.clone(), self.block_table)

    def reset(self, seq: int) -> None:
        self._check_seq(seq)
        self._free.extend(reversed(self._pages[seq]))
        self._pages[seq] = []
        self._host_table[seq] = -1
        self.block_table[seq] = -1
        self._table_changed()
        super().reset(seq)
