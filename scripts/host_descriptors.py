"""Host cost of handing a Hopper kernel its TMA descriptors: Triton's wrapper against ops._launch's.

    PYTHONPATH=src python scripts/host_descriptors.py

Runs on the CPU, without a GPU: the C launch is a no-op and the driver's descriptor encoder
(cuTensorMapEncodeTiled, called the same number of times either way) a Python stand-in. The
arguments are the Hopper forward's: 14 tensors of which 4 are TMA descriptors, then 22 scalars.
Times one cached launch's argument handling (ops._launch._pointers, then the launch function):
through the wrapper Triton puts around a kernel with descriptors (driver.wrap_handle_tensordesc),
and through the C launch with the descriptors encoded in _pointers (ops._launch._unwrapped).
"""

import time
from types import SimpleNamespace

import torch
import triton
from triton.backends.nvidia import driver

from flashtile.ops import _launch

CALLS = 20000


def per_call_us(fn) -> float:
    for _ in range(1000):
        fn()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    return (time.perf_counter() - start) / CALLS * 1e6


def main() -> None:
    triton.runtime.driver._active = SimpleNamespace(utils=SimpleNamespace(
        fill_tma_descriptor=lambda ptr, *fields: ptr))
    t = torch.empty(2, 256, 8, 256, dtype=torch.bfloat16)
    signature, tensors = {}, []
    for i in range(14):
        if 3 <= i < 7:
            signature[i] = "tensordesc<bf16[1, 64, 1, 256]>"
            tensors.append(_launch.Box(t, t.shape, t.stride(), (1, 64, 1, 256), None))
        else:
            signature[i] = "*bf16"
            tensors.append(t)
    signature.update({i: "i32" for i in range(14, 36)})
    scalars = tuple(range(22))
    meta = dict(swizzle=3, elem_size=2, elem_type=9, block_size=[1, 64, 1, 256], fp4_padded=False)
    wrapped = driver.wrap_handle_tensordesc(lambda *args: None, signature, [meta] * 4)
    run, boxes = _launch._unwrapped(wrapped)
    base = tuple(range(driver._BASE_ARGS_FORMAT_LEN))
    for _ in range(2):
        print(f"Triton's wrapper {per_call_us(lambda: wrapped(*base, *_launch._pointers(tensors), *scalars)):.2f} us, "
              f"unwrapped {per_call_us(lambda: run(*base, *_launch._pointers(tensors, boxes), *scalars)):.2f} us")


if __name__ == "__main__":
    main()
