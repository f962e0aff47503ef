"""The text the small GPT learns, and a character-level tokenizer and batch loader for it.

`load_text()` reads a text shipped in flashtile/models/data/ (sonnets.txt: 37 of Shakespeare's
sonnets, public domain, ~23 KB). Characters are the tokens: the vocabulary is the text's set of
characters (~70), so no tokenizer file is needed.
"""

from __future__ import annotations

from pathlib import Path

import torch

DATA = Path(__file__).parent / "data"


def load_text(name: str = "sonnets") -> str:
    """The text of data/<name>.txt."""
    path = DATA / f"{name}.txt"
    if not path.is_file():
        available = sorted(p.stem for p in DATA.glob("*.txt"))
        raise ValueError(f"no text named {name!r} in {DATA}; available: {available}")
    return path.read_text(encoding="utf-8")


class CharTokenizer:
    """Characters <-> ids 0..vocab_size - 1, in sorted order of the characters of `text`."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """(len(text),) long; every character must be in the vocabulary."""
        try:
            return torch.tensor([self.index[c] for c in text], dtype=torch.long)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def split(data: torch.Tensor, val_fraction: float = 0.1):
    """(train, val): the first 1 - val_fraction of the tokens and the rest."""
    n = int(len(data) * (1 - val_fraction))
    return data[:n], data[n:]


def get_batch(data: torch.Tensor, batch_size: int, block_size: int, generator=None, device="cpu"):
    """x, y (batch_size, block_size): random windows of data and the same windows one token on."""
    if len(data) <= block_size:
        raise ValueError(f"the data ({len(data)} tokens) must be longer than block_size ({block_size})")
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([data[s:s + block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts.tolist()])
    return x.to(device), y.to(device)
