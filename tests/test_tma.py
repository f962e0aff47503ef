"""Which layouts the backward hands to TMA descriptors (ops.host.tma_ok); the rest use pointers."""

import torch

from flashtile.ops.host import tma_ok


def test_tma_layouts():
    q = torch.randn(2, 64, 4, 128, dtype=torch.float16)
    assert tma_ok(q)
    assert tma_ok(q.transpose(1, 2).contiguous().transpose(1, 2))  # BHSD storage viewed as BSHD
    assert tma_ok(torch.randn(2, 64, 3, 4, 128, dtype=torch.float16)[:, :, 1])  # packed qkv
    assert not tma_ok(torch.randn(2, 64, 4, 59, dtype=torch.float16))  # 118-byte rows
    assert tma_ok(torch.randn(2, 64, 4, 128, dtype=torch.float16)[..., :96])  # a slice of wider rows
    assert tma_ok(torch.randn(2, 64, 4, 96, dtype=torch.float16))
    assert not tma_ok(torch.randn(2, 64, 4, 128, dtype=torch.float16)[..., 1:])  # unaligned base
    assert not tma_ok(torch.ones(1, 1, 1, 1, dtype=torch.float16).expand(2, 64, 4, 128))  # 0 strides
    assert not tma_ok(torch.ones(1, 64, 4, 128, dtype=torch.float16).expand(2, 64, 4, 128))
    assert not tma_ok(torch.randn(2, 64, 4, 128, dtype=torch.float16).transpose(2, 3))  # d not last
    assert not tma_ok(torch.empty(2, 0, 4, 128, dtype=torch.float16))
