"""The awkward cases the blockwise references are checked on, shared by tests/test_reference_*.py.

Sizes are odd (no N is a multiple of a block); every feature of the API contract appears, alone and
together. Each case builds float64 inputs, so the references can be compared to the oracle to ~1e-12.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from flashtile import testing

ORACLE_ATOL = 1e-12  # float64 blockwise vs float64 materialised: rounding only


@dataclass(frozen=True)
class Case:
    b: int
    sq: int
    sk: int
    h: int
    hk: int
    d: int
    kwargs: dict = field(default_factory=dict)  # causal, window_size, softcap
    alibi: str | None = None  # None, "h" for slopes (h,), "bh" for (b, h)

    def inputs(self, dtype=torch.float64, generator=None):
        """q (b, sq, h, d), k and v (b, sk, hk, d) random normal; the feature kwargs incl. ALiBi."""
        q = testing.randn(self.b, self.sq, self.h, self.d, dtype=dtype, generator=generator)
        k = testing.randn(self.b, self.sk, self.hk, self.d, dtype=dtype, generator=generator)
        v = testing.randn(self.b, self.sk, self.hk, self.d, dtype=dtype, generator=generator)
        kwargs = dict(self.kwargs)
        if self.alibi:
            shape = (self.h,) if self.alibi == "h" else (self.b, self.h)
            kwargs["alibi_slopes"] = torch.rand(shape, generator=generator) * 0.5 + 0.05
        return q, k, v, kwargs


CASES = [
    pytest.param(Case(2, 113, 113, 2, 2, 40), id="plain-113x113-d40"),
    pytest.param(Case(1, 17, 41, 4, 2, 24, {"causal": True}), id="causal-sq17<sk41-gqa"),
    pytest.param(Case(1, 41, 17, 4, 1, 24, {"causal": True}), id="causal-sq41>sk17-mqa-empty-rows"),
    pytest.param(Case(2, 37, 37, 2, 1, 16, {"window_size": (7, 3)}), id="window-7-3-mqa"),
    pytest.param(Case(1, 29, 11, 2, 2, 16, {"window_size": (2, 0)}), id="window-2-0-sq29>sk11"),
    pytest.param(Case(1, 33, 33, 2, 2, 32, {"softcap": 0.7}), id="softcap-0.7"),
    pytest.param(Case(2, 30, 30, 4, 2, 16, {"causal": True}, alibi="h"), id="alibi-h-causal"),
    pytest.param(Case(2, 23, 31, 2, 2, 16, {"window_size": (5, 5)}, alibi="bh"), id="alibi-bh-window"),
    pytest.param(Case(2, 1, 57, 4, 2, 16, {"causal": True}), id="decode-sq1-sk57"),
    pytest.param(Case(2, 19, 27, 4, 2, 40, {"causal": True, "window_size": (6, -1), "softcap": 2.0},
                      alibi="h"), id="all-features"),
]


class HBMWrites:
    """A counter that keeps what a reference writes to "HBM", to look at the state between steps."""

    def __init__(self):
        self.writes = []

    def read(self, *tiles):
        pass

    def write(self, *tiles):
        self.writes.append([t.clone() for t in tiles])
