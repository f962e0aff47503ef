"""Kernel state by name, in either dialect: Triton's aggregates (a class of typed fields, built in
a kernel and passed to its helpers and warp partitions as one value; FA4 has BlockInfo and
SeqlenInfo, Triton's Gluon attention example its config and channels), with the one rule the
kernels' need: a field holds a runtime value or, where Triton specialised the argument (an int of
1, an absent tensor), a constexpr."""

import triton
import triton.language as tl
from triton.language.core import _aggregate as aggregate
from triton.language.core import base_value

__all__ = ["VALUE", "aggregate", "kept", "keep_all"]


@triton.constexpr_function
def kept(x):
    """An aggregate field's value: a runtime value (a tensor, another aggregate) as it is, else a
    constexpr."""
    return x if isinstance(x, base_value) else tl.constexpr(x)


VALUE = (tl.tensor, tl.constexpr)  # a field that is a runtime value or a constexpr (kept)


@triton.constexpr_function
def keep_all(obj, values: dict) -> None:
    """An aggregate's constructor body: each argument (its locals() but self) into the field of its
    name, kept."""
    for name, value in values.items():
        if name != "self":
            setattr(obj, name, kept(value))
