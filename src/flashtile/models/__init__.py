"""Models built on flashtile: a small Llama-style GPT (gpt.py), the text it trains on and a
character-level loader (text.py), and its training script (train.py). Re-exports only."""

from flashtile.models.gpt import GPT, GPTConfig, TensorKVCache, sample
from flashtile.models.text import CharTokenizer, get_batch, load_text

__all__ = ["GPT", "GPTConfig", "TensorKVCache", "sample", "CharTokenizer", "get_batch", "load_text"]
