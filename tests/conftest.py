"""Markers: none = CPU; `interpret` = Triton kernels under TRITON_INTERPRET=1; `cuda` = needs a GPU.

Without a GPU the whole session runs Triton in interpreter mode; the flag must be set before triton
is first imported, which is why it is set here, at collection time.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_interp = pytest.mark.skip(reason="interpreter tests run on CPU-only machines (TRITON_INTERPRET=1)")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if "interpret" in item.keywords and os.environ.get("TRITON_INTERPRET") != "1":
            item.add_marker(skip_interp)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Every test plans its launches anew (ops._launch.clear_plans): tests replace launchers'
    internals and count launches."""
    from flashtile.ops import _launch

    _launch.clear_plans()
