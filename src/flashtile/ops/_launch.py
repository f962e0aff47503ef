"""Host side of every launcher: integer helpers and a Triton launch that skips the per-call binder.

`kernel[grid](*args)` re-derives the compiled kernel on every call: it specialises each argument
(about 50 for the decoding kernel), builds a cache key from the result, looks the kernel up and
only then launches. On the H100 machine's host that took 34 µs per call for the decoding kernel
(52 µs through @triton.heuristics), the launch itself 7 µs (scripts/profile_host.py): more than the
~30 µs a decoding step spends on the GPU.

`launch` keeps Triton's own answer. The first call with a given key goes through `kernel[grid]`
(compiling if needed) and keeps the compiled kernel it returns; later calls with the same key
launch that kernel directly. The key holds everything Triton specialises on: every scalar argument
by value, each tensor's dtype and whether its address is 16-byte aligned, the constexprs, warps
and stages, and the device - so a cached launch runs the binary Triton would have picked. Scalars
vary per call only in rare paths (an int cache_seqlens); those keys miss, take Triton's path, and
the cache is emptied when it grows past MAX_ENTRIES. Under TRITON_INTERPRET=1, with launch hooks
installed (profilers) or with anything Triton's path does not return as a compiled kernel, every
call takes Triton's path.

`Prepared` is the same cache for a launch whose trailing arguments are fixed in advance (the
decoding plan's): their part of the key is hashed once, and each call keys only its own tensors
and strides.
"""

from __future__ import annotations

import itertools

import triton
from triton.tools.tensor_descriptor import TensorDescriptor

MAX_ENTRIES = 512  # per kernel


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host integers (triton.cdiv costs a constexpr-function call on the host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def current_stream(device: int) -> int:
    """The current CUDA stream of `device`, as Triton's own launch path reads it."""
    return triton.runtime.driver.active.get_current_stream(device)


def _tensor_key(t):
    """What Triton specialises a pointer or TMA descriptor argument on."""
    if t is None:
        return None
    if isinstance(t, TensorDescriptor):
        return ("desc", t.base.dtype, tuple(t.block_shape), t.padding)
    return (t.dtype, t.data_ptr() % 16 == 0)


def launch(kernel, grid, tensors: tuple, scalars: tuple, num_warps: int, num_stages: int,
           launch_pdl: bool = False, **constexprs):
    """kernel[grid](*tensors, *scalars, **constexprs, num_warps=..., num_stages=...), cached.

    tensors: the kernel's leading pointer arguments (None for an absent optional tensor), scalars:
    the int/float arguments after them, in signature order; every constexpr by keyword. Each call
    site passes the same Python type at each position (an int never becomes a float or a bool).
    launch_pdl: launch as a programmatic dependent of the previous kernel in the stream (sm_90+;
    the kernel must gdc_wait before it reads what that kernel writes).
    """
    hooks = triton.knobs.runtime
    options = dict(num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if launch_pdl else {}))
    if not tensors[0].is_cuda or hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls:
        return kernel[grid](*tensors, *scalars, **constexprs, **options)
    device = tensors[0].get_device()
    key = (device, num_warps, num_stages, launch_pdl, scalars, tuple(constexprs.items()),
           tuple(map(_tensor_key, tensors)))
    _cached_launch(kernel, key, grid, tensors, scalars, constexprs, options, device)


def _cached_launch(kernel, key, grid, tensors, scalars, constexprs, options, device) -> None:
    """Launch the compiled kernel kept under key, or go through Triton once and keep it."""
    cache = kernel.__dict__.get("_flashtile_launches")  # {key: (compiled, constexprs in signature order)}
    if cache is None:
        cache = kernel._flashtile_launches = {}
    hit = cache.get(key)
    if hit is None:
        compiled = kernel[grid](*tensors, *scalars, **constexprs, **options)
        if isinstance(compiled, triton.compiler.CompiledKernel):
            names = [p.name for p in kernel.params]
            tail = names[len(tensors) + len(scalars):]
            if len(cache) >= MAX_ENTRIES:
                cache.clear()
            cache[key] = (compiled, tuple(constexprs[n] for n in tail))
        return
    compiled, tail = hit
    g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
    compiled.run(g0, g1, g2, current_stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *tensors, *scalars, *tail)


_fixed_ids: dict = {}  # the fixed part of a Prepared launch's key -> a small int standing for it
_next_fixed_id = itertools.count()


class Prepared:
    """A launch whose trailing arguments are fixed (a decoding plan's): the call adds the leading
    tensors and scalars, launch(kernel, grid, tensors + fixed tensors, scalars + fixed scalars, ...).

    The fixed part of the cache key (about 60 scalars, constexprs and tensor keys for the decoding
    kernel) is hashed once, when the launch is prepared, and stands in the key as one int: a call
    hashes only its own arguments (building and hashing launch()'s whole key cost ~6 us per call
    on a CPU where the rest of a decoding call's host path costs ~10). Two launches prepared with
    equal fixed parts share the int, so they share compiled kernels. The fixed tensors are keyed
    once: their addresses must not change (nothing flashtile holds is resized in place).
    """

    def __init__(self, kernel, grid, tensors: tuple, scalars: tuple, num_warps: int, num_stages: int,
                 launch_pdl: bool = False, **constexprs):
        self.kernel, self.grid, self.tensors, self.scalars, self.constexprs = kernel, grid, tensors, scalars, constexprs
        self.options = dict(num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if launch_pdl else {}))
        fixed = (num_warps, num_stages, launch_pdl, scalars, tuple(constexprs.items()),
                 tuple(map(_tensor_key, tensors)))
        self._id = _fixed_ids.get(fixed)
        if self._id is None:
            if len(_fixed_ids) >= MAX_ENTRIES:
                _fixed_ids.clear()  # ids are never reused: keys of the dropped ones just stop hitting
            self._id = _fixed_ids[fixed] = next(_next_fixed_id)

    def __call__(self, tensors: tuple, scalars: tuple) -> None:
        every = tensors + self.tensors
        hooks = triton.knobs.runtime
        if not every[0].is_cuda or hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls:
            self.kernel[self.grid](*every, *scalars, *self.scalars, **self.constexprs, **self.options)
            return
        device = every[0].get_device()
        key = (self._id, device, scalars, tuple(map(_tensor_key, tensors)))
        _cached_launch(self.kernel, key, self.grid, every, scalars + self.scalars, self.constexprs, self.options,
                       device)
