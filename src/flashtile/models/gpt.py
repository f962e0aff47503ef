"""A small GPT: a Llama-style decoder whose attention is flashtile, torch SDPA or eager.

    x = tok_embeddings(idx)                                  # (B, T, C)
    for each layer:                                          # pre-norm residual blocks
        x = x + attention(attention_norm(x))                 # RoPE on q and k, GQA, causal
        x = x + feed_forward(ffn_norm(x))                    # SwiGLU: w2(silu(w1 x) * w3 x)
    logits = output(norm(x))                                 # (B, T, vocab)

Module and weight names follow Meta's Llama reference code (as gpt-fast does). `GPT.attn` picks the
attention and can be changed on a built model; the three give the same logits (up to float
rounding) and take the same weights:

  "flashtile"  training / prefill: flash_attn_func, or flash_attn_varlen_func for a packed batch
               (cu_seqlens); generation: a flashtile KVCache or PagedKVCache, whose attend()
               rotates q and k (RoPE), appends k, v and attends in flash_attn_with_kvcache's
               kernels, planned once per step for all layers (DecodePlan).
  "sdpa"       torch.nn.functional.scaled_dot_product_attention (enable_gqa=True); generation
               with a plain tensor cache (TensorKVCache).
  "eager"      softmax(q k^T / sqrt(d)) v with the scores materialised; same cache as sdpa.

Every mask is causal and aligned to the bottom-right corner, as flash-attn's: with T new queries
over S keys (S - T of them cached), query i sees keys j <= i + S - T.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import flashtile
from flashtile.kvcache import KVCache, PagedKVCache

ATTENTION = ("flashtile", "sdpa", "eager")


def _is_int(x) -> bool:
    """An integer argument: an int or a numpy integer, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 256  # the longest sequence: the RoPE tables' length
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2  # GQA: every n_head // n_kv_head query heads share one key/value head
    n_embd: int = 128
    mlp_hidden: int | None = None  # SwiGLU width; None: 8/3 n_embd rounded up to a multiple of 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0  # attention dropout (on the probabilities), in training only
    tie_embeddings: bool = False  # True: the output layer reuses the token embedding matrix
    attn: str = "flashtile"  # "flashtile" | "sdpa" | "eager"

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd ({self.n_embd}) must be n_head ({self.n_head}) x an even head dim")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.attn not in ATTENTION:
            raise ValueError(f"attn must be one of {ATTENTION}, got {self.attn!r}")
        if self.mlp_hidden is None:
            self.mlp_hidden = 64 * math.ceil(8 * self.n_embd / 3 / 64)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# ---------------------------------------------------------------------------------------------
# Attention: the three implementations, BSHD in and out
# ---------------------------------------------------------------------------------------------

def causal_mask(sq: int, sk: int, device, seq_ids=None) -> torch.Tensor:
    """(sq, sk) bool, True where query i may see key j: j <= i + sk - sq (bottom-right aligned).
    With seq_ids (sq,) (a packed batch, sq == sk), also only keys of the query's own sequence."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    mask = j <= i + (sk - sq)  # (sq, sk)
    if seq_ids is not None:
        mask = mask & (seq_ids[:, None] == seq_ids[None, :])
    return mask


def sdpa_attention(q, k, v, dropout_p: float = 0.0, mask=None):
    """Causal attention with torch's SDPA: q (B, T, H, D), k, v (B, S, Hk, D) -> (B, T, H, D).
    mask: (T, S) bool to use instead of the bottom-right causal mask (a packed batch)."""
    sq, sk = q.shape[1], k.shape[1]
    is_causal = False
    if mask is None:
        if sq == sk:
            is_causal = True  # torch's is_causal is top-left aligned: the same square mask
        elif sq > 1:
            mask = causal_mask(sq, sk, q.device)
        # sq == 1: the one query is the last token, it sees every key: no mask
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                         enable_gqa=True)  # (B, H, T, D)
    return out.transpose(1, 2)


def eager_attention(q, k, v, dropout_p: float = 0.0, mask=None):
    """softmax(q k^T / sqrt(d)) v, the (B, H, T, S) scores in memory. Shapes as sdpa_attention."""
    group = q.shape[2] // k.shape[2]
    if mask is None:
        mask = causal_mask(q.shape[1], k.shape[1], q.device)
    q = q.transpose(1, 2)  # (B, H, T, D)
    k = k.transpose(1, 2).repeat_interleave(group, dim=1)  # (B, H, S, D): GQA by copying kv heads
    v = v.transpose(1, 2).repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, T, S)
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)  # (B, H, T, S)
    if dropout_p > 0:
        p = F.dropout(p, dropout_p)
    return (p @ v).transpose(1, 2)  # (B, T, H, D)


def flashtile_attention(q, k, v, dropout_p: float = 0.0, mask=None):
    """flash_attn_func, causal (bottom-right aligned). Shapes as sdpa_attention; no mask: a packed
    batch goes through flash_attn_varlen_func instead (Attention.forward)."""
    if mask is not None:
        raise ValueError("flashtile attention takes no mask: pass cu_seqlens for a packed batch")
    return flashtile.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True)


ATTENTION_FUNCTIONS = {"flashtile": flashtile_attention, "sdpa": sdpa_attention, "eager": eager_attention}


# ---------------------------------------------------------------------------------------------
# The cache of the sdpa and eager paths (flashtile's are flashtile.KVCache / PagedKVCache)
# ---------------------------------------------------------------------------------------------

class TensorKVCache:
    """k, v (num_layers, batch, capacity, kv_heads, head_dim) and one length shared by the batch:
    the sdpa and eager paths attend the first `length` rows of each layer's buffers.

    The same surface as flashtile's caches where the model uses it: `lengths` (host), `seqlens`
    ((batch,) int32 on the device, for the RoPE positions) and advance(n) once per step.
    """

    def __init__(self, batch: int, capacity: int, kv_heads: int, head_dim: int, *, num_layers: int = 1,
                 dtype=torch.float32, device="cpu"):
        shape = (num_layers, batch, capacity, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity, self.length = capacity, 0
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)

    @property
    def lengths(self) -> list[int]:
        return [self.length] * self.k.shape[1]

    def update(self, layer: int, k, v):
        """Write k, v (batch, T, kv_heads, head_dim) after the cached rows of `layer`; return that
        layer's keys and values so far, (batch, length + T, kv_heads, head_dim) views."""
        end = self.length + k.shape[1]
        if end > self.capacity:
            raise ValueError(f"cache overflow: {self.length} tokens cached, {k.shape[1]} appended, "
                             f"capacity {self.capacity}")
        self.k[layer, :, self.length:end] = k
        self.v[layer, :, self.length:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def advance(self, n: int = 1) -> None:
        """Count n new tokens in every sequence, after every layer of a step has appended them."""
        self.length += n
        self.seqlens += n


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(block_size: int, head_dim: int, theta: float):
    """cos, sin (block_size, head_dim / 2) float32: position p turns pair i by p * theta^(-2i/d)."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (d/2,)
    angles = torch.outer(torch.arange(block_size, dtype=torch.float64), inv_freq)  # (block_size, d/2)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x, cos, sin):
    """x (B, T, H, D) rotated at its positions: cos, sin (B or 1, T, D/2) float32. Pairs (i, i + D/2)
    are rotated ("rotate half", as Llama in transformers and GPT-NeoX)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, T, H, D/2) each
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)  # (B or 1, T, 1, D/2)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


@dataclass
class _Step:
    """What every layer of one forward shares."""
    attn: str
    cos: torch.Tensor | None  # (B or 1, T, head_dim / 2) at the tokens' positions; None: RoPE in the kernel
    sin: torch.Tensor | None
    cache: object = None  # KVCache / PagedKVCache (flashtile) or TensorKVCache (sdpa, eager)
    cache_options: dict | None = None  # flashtile cache.attend's keyword arguments
    mask: torch.Tensor | None = None  # (T, T) of a packed batch, for sdpa and eager
    cu_seqlens: torch.Tensor | None = None  # (n + 1,) int32 of a packed batch, for flashtile
    max_seqlen: int = 0


class Attention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.dropout = config.dropout
        self.wq = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.wk = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.wv = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)

    def forward(self, x, step: _Step):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim)  # (B, T, Hk, D)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim)
        dropout_p = self.dropout if self.training else 0.0
        if step.cos is not None:
            q, k = apply_rotary(q, step.cos, step.sin), apply_rotary(k, step.cos, step.sin)

        if step.cache is not None:
            if step.attn == "flashtile":  # rotate q and k, append k, v and attend, in the kernels
                out = step.cache.attend(q, k, v, layer=self.layer, **step.cache_options)
            else:
                k, v = step.cache.update(self.layer, k, v)  # (B, cached + T, Hk, D)
                out = ATTENTION_FUNCTIONS[step.attn](q, k, v, dropout_p)
        elif step.cu_seqlens is not None and step.attn == "flashtile":  # packed: (1, total, ...)
            out = flashtile.flash_attn_varlen_func(
                q[0], k[0], v[0], step.cu_seqlens, step.cu_seqlens, step.max_seqlen, step.max_seqlen,
                dropout_p=dropout_p, causal=True)[None]
        else:
            out = ATTENTION_FUNCTIONS[step.attn](q, k, v, dropout_p, step.mask)
        return self.wo(out.reshape(B, T, self.n_head * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.w3 = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.w2 = nn.Linear(config.mlp_hidden, config.n_embd, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attention = Attention(config, layer)
        self.ffn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, step: _Step):
        x = x + self.attention(self.attention_norm(x), step)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.attn = config.attn
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # float32 whatever the weights' dtype: plain attributes, not buffers, which model.to(dtype)
        # would round (bf16 keeps 3 digits of a cosine); moved to the tokens' device on first use
        self.rope_cos, self.rope_sin = rope_tables(config.block_size, config.head_dim, config.rope_theta)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    @property
    def attn(self) -> str:
        return self._attn

    @attn.setter
    def attn(self, name: str) -> None:
        if name not in ATTENTION:
            raise ValueError(f"attn must be one of {ATTENTION}, got {name!r}")
        self._attn = name

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, idx, targets=None, *, cache=None, cu_seqlens=None, max_seqlen=None, last_only=False):
        """Logits of every position (and the loss when targets are given).

        Arguments:
            idx: (B, T) token ids (long).
            targets: (B, T) the next token of each position; -1 = no loss there.
            cache: from make_cache(): the T tokens follow each sequence's cached ones and attend to
                them; they are appended, and the cache advances by T.
            cu_seqlens, max_seqlen: idx (1, total) holds several sequences end to end: sequence b is
                idx[0, cu_seqlens[b]:cu_seqlens[b + 1]] ((n + 1,) int32 on idx's device, as
                flash_attn_varlen_func), its positions count from 0 and it attends only to itself.
                max_seqlen: the longest sequence (computed from cu_seqlens when None).
            last_only: logits of the last position only, (B, 1, vocab) (generation).
        Returns:
            logits (B, T, vocab) (or (B, 1, vocab)), in the weights' dtype, and the mean cross
            entropy over positions with targets (float32), or None without targets.
        """
        logits = self._logits(idx, cache, cu_seqlens, max_seqlen, last_only)
        if cache is not None:
            cache.advance(idx.shape[1])
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)
        return logits, loss

    def _logits(self, idx, cache=None, cu_seqlens=None, max_seqlen=None, last_only=False):
        """forward() without advancing the cache: what a captured CUDA-graph decoding step runs. Reads
        nothing on the host when given a flashtile cache whose step plan exists."""
        B, T = idx.shape
        device = idx.device
        longest = T + (max(cache.lengths, default=0) if cache is not None else 0)
        if longest > self.config.block_size:
            raise ValueError(f"{longest} positions exceed block_size ({self.config.block_size}), the RoPE tables' length")
        if cache is not None:
            flash_cache = isinstance(cache, (KVCache, PagedKVCache))
            if flash_cache != (self.attn == "flashtile"):
                raise TypeError(f"attn={self.attn!r} needs {'a flashtile' if self.attn == 'flashtile' else 'a TensorKVCache'}"
                                f" cache, got {type(cache).__name__}: use make_cache()")
            if cu_seqlens is not None:
                raise ValueError("a packed batch (cu_seqlens) cannot be appended to a cache")
        if cache is not None and self.attn == "flashtile":  # the kernels rotate at the cache positions
            step = _Step(self.attn, None, None, cache=cache, cache_options=self._cache_options(device))
        else:
            step = _Step(self.attn, *self._rope(B, T, cache, cu_seqlens, device), cache=cache)
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"a packed batch is idx (1, total), got {tuple(idx.shape)}")
            if self.attn == "flashtile":
                lengths = cu_seqlens[1:] - cu_seqlens[:-1]
                step.cu_seqlens = cu_seqlens
                step.max_seqlen = int(lengths.max()) if max_seqlen is None else max_seqlen
            else:
                step.mask = causal_mask(T, T, device, _sequence_ids(cu_seqlens, T))

        x = self.tok_embeddings(idx)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, step)
        if last_only:
            x = x[:, -1:]
        return self.output(self.norm(x))  # (B, T or 1, vocab)

    def _rope(self, B, T, cache, cu_seqlens, device):
        """cos, sin (B or 1, T, head_dim / 2) at each token's position: after the cached tokens
        (read on the device: a captured decoding step replays at the current lengths), or from 0 in
        each sequence of a packed batch."""
        pos = torch.arange(T, device=device)[None]  # (1, T)
        if cache is not None:
            pos = cache.seqlens.long()[:, None] + pos  # (B, T)
        elif cu_seqlens is not None:
            pos = pos - cu_seqlens.long()[_sequence_ids(cu_seqlens, T)]  # (1, T)
        cos, sin = self._rope_tables(device)
        return cos[pos], sin[pos]

    def _rope_tables(self, device):
        """The (block_size, head_dim / 2) float32 tables, on device."""
        if self.rope_cos.device != device:
            self.rope_cos, self.rope_sin = self.rope_cos.to(device), self.rope_sin.to(device)
        return self.rope_cos, self.rope_sin

    def _cache_options(self, device) -> dict:
        """cache.attend's options in every layer of a flashtile cache's step: causal, and the RoPE
        tables, which flash_attn_with_kvcache applies to k at its cache position and to q at the
        cache length + its row (GPT-NeoX's pairs (i, i + d/2), as apply_rotary). The same tensors
        every step: the step's plan is keyed by them."""
        cos, sin = self._rope_tables(device)
        return dict(causal=True, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False)

    # -- generation --------------------------------------------------------------------------------

    def make_cache(self, batch: int, capacity: int, *, paged: bool = False, page_size: int = 16):
        """An empty cache for `batch` sequences of up to `capacity` tokens, in the weights' dtype and
        device: flashtile.KVCache (or, paged, a PagedKVCache with enough pages for every sequence to
        reach capacity) for attn="flashtile", a TensorKVCache for sdpa and eager."""
        c = self.config
        p = self.tok_embeddings.weight
        shape = dict(kv_heads=c.n_kv_head, head_dim=c.head_dim, num_layers=c.n_layer, dtype=p.dtype, device=p.device)
        if self.attn != "flashtile":
            if paged:
                raise ValueError(f"paged caches are flashtile's: attn={self.attn!r} uses a TensorKVCache")
            return TensorKVCache(batch, capacity, **shape)
        if paged:
            pages = -(-capacity // page_size)
            return PagedKVCache(batch * pages, page_size, batch, max_seq_len=pages * page_size, **shape)
        return KVCache(batch, capacity, **shape)

    @torch.no_grad()
    def prefill(self, idx, cache, chunk: int | None = None):
        """Run the prompt idx (B, T) into an empty or partly filled cache, `chunk` tokens per
        forward (None: all at once). Returns the logits of the last position, (B, vocab)."""
        chunk = chunk or idx.shape[1]
        for start in range(0, idx.shape[1], chunk):
            logits, _ = self(idx[:, start:start + chunk], cache=cache, last_only=True)
        return logits[:, -1]

    def decoder(self, cache, *, use_cuda_graph: bool = False, max_steps: int | None = None):
        """step(tok (B, 1)) -> logits (B, vocab) of tok, appended to the cache: one decoding step.

        use_cuda_graph (CUDA, attn="flashtile"): the step is captured once in a CUDA graph and
        replayed. Its DecodePlan (made here, kept alive with the graph) reads the lengths on the
        device, so the replays see each new length; room for max_steps tokens per sequence is
        reserved now (a paged cache hands out its pages), since nothing is checked or allocated
        during a replay. The returned logits are the graph's output buffer: read them before the
        next step.
        """
        if not use_cuda_graph:
            @torch.no_grad()
            def step(tok):
                return self(tok, cache=cache, last_only=True)[0][:, -1]
            return step
        if self.attn != "flashtile" or not self.tok_embeddings.weight.is_cuda:
            raise ValueError(f"use_cuda_graph needs attn='flashtile' on CUDA (got attn={self.attn!r} on "
                             f"{self.tok_embeddings.weight.device})")
        if max_steps is None:
            raise ValueError("use_cuda_graph needs max_steps: the room the captured steps may fill")
        from flashtile.bench.harness import capture

        c = self.config
        batch = len(cache.lengths)
        tok_in = torch.zeros(batch, 1, dtype=torch.long, device=cache.seqlens.device)
        q = torch.empty(batch, 1, c.n_head, c.head_dim, dtype=cache.k.dtype, device=cache.seqlens.device)
        options = self._cache_options(q.device)
        cache.plan(q, max_steps, **options)  # reserves room for every step (or raises)
        plan = cache.plan(q, 1, **options)  # the plan attend() finds in every layer of the step
        # the warm-up run writes tok_in's k, v at the current lengths, as each replay will
        with torch.no_grad():
            graph, logits = capture(lambda: self._logits(tok_in, cache, last_only=True))

        @torch.no_grad()
        def step(tok):
            tok_in.copy_(tok)
            graph.replay()
            cache.advance(1)  # lengths on the host, and seqlens += 1 on the device for the next replay
            return logits[:, -1]

        step.graph, step.plan = graph, plan  # alive as long as the step
        return step

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None, *,
                 use_cuda_graph: bool = False, use_cache: bool = True, paged: bool = False,
                 page_size: int = 16, generator: torch.Generator | None = None):
        """idx (B, T) followed by max_new_tokens sampled tokens, (B, T + max_new_tokens).

        temperature: divides the logits; 0 takes the most likely token (greedy). top_k: sample among
        the k most likely only. The prompt is prefilled into a cache (make_cache(paged=...)) and
        each new token runs one decoding step (decoder(use_cuda_graph=...)); use_cache=False
        recomputes the whole sequence for every token instead (the reference the cache is tested
        against).
        """
        B, T = idx.shape
        if not _is_int(max_new_tokens) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if T + max_new_tokens > self.config.block_size:
            raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds block_size "
                             f"({self.config.block_size})")
        out = [idx]
        if not use_cache:
            for _ in range(max_new_tokens):
                logits = self(torch.cat(out, dim=1))[0][:, -1]
                out.append(sample(logits, temperature, top_k, generator))
            return torch.cat(out, dim=1)
        cache = self.make_cache(B, T + max_new_tokens, paged=paged, page_size=page_size)
        logits = self.prefill(idx, cache)
        step = self.decoder(cache, use_cuda_graph=use_cuda_graph, max_steps=max_new_tokens)
        for i in range(max_new_tokens):
            out.append(sample(logits, temperature, top_k, generator))
            if i + 1 < max_new_tokens:
                logits = step(out[-1])
        return torch.cat(out, dim=1)


def sample(logits, temperature: float = 1.0, top_k: int | None = None, generator=None):
    """(B, vocab) logits -> (B, 1) token ids; temperature 0 is greedy (argmax)."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


def _sequence_ids(cu_seqlens, total: int):
    """(total,) the sequence of each packed token."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths,
                                   output_size=total)
