"""What each kernel launch would compile on an H100, without a GPU: the keys of Triton's JIT cache.

`recording()` replaces every launch of flashtile's kernels (ops._launch.Prepared, through which
every launcher goes) by a recorder (nothing runs) and, for
each, computes the key Triton's JIT cache would look the kernel up by on sm_90: the kernel's name
plus the specialisation of every argument (a pointer's dtype and 16-byte alignment; an int's type
and whether 16 divides it or it is 1, unless the kernel says do_not_specialize; each constexpr's
value) and the launch options. Two launches with equal keys run one compiled binary; a key not
seen before is a compilation. With `as_h100=True` the dispatch also believes it runs on an H100
(configs.on_gpu and configs.capability answer so), so the Hopper kernels and the tiles chosen for the GPU are
what gets keyed, on CPU tensors.
"""

from __future__ import annotations

import contextlib

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from flashtile.ops import _launch, configs, decoding, forward_sm90

_BACKEND = None
_BINDERS: dict = {}


def _binder(kernel):
    """Triton's argument binder of kernel for sm_90 (an interpreted kernel is keyed as the JIT
    function it would be on the GPU)."""
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = make_backend(GPUTarget("cuda", 90, 32))
    binder = _BINDERS.get(id(kernel))
    if binder is None:
        jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
        binder = _BINDERS[id(kernel)] = create_function_from_signature(jit.signature, jit.params, _BACKEND)
    return binder


def key_of(kernel, tensors, scalars, constexprs, options) -> tuple:
    """The JIT cache key of one launch on sm_90: (kernel name, specialisation, options)."""
    _, specialization, _ = _binder(kernel)(*_launch._for_triton(tuple(tensors)), *scalars, **constexprs)
    name = getattr(kernel, "__name__", None) or kernel.fn.__name__
    return name, repr(specialization), tuple(sorted(options.items()))


class Recorder:
    """The keys of the launches made inside recording(), in order; `keys` as a set."""

    def __init__(self):
        self.launches: list = []

    @property
    def keys(self) -> set:
        return set(self.launches)

    def kernels(self) -> set:
        return {k[0] for k in self.launches}


def _clear_config_caches():
    """The configs' answers are cached per device: forget them when what a device is changes."""
    for value in vars(configs).values():
        if hasattr(value, "cache_clear"):
            value.cache_clear()


@contextlib.contextmanager
def recording(as_h100: bool = False):
    rec = Recorder()

    def prepared_call(self, tensors, scalars, stream=None, key=None):
        every, all_scalars = tensors + self.tensors, scalars + self.scalars
        kernel = _launch.for_strides(self.kernel, len(every), all_scalars)
        rec.launches.append(key_of(kernel, every, all_scalars, self.constexprs, self.options))

    saved = [(_launch.Prepared, "__call__", _launch.Prepared.__call__)]
    if as_h100:
        saved += [(configs, "capability", configs.capability), (configs, "on_gpu", configs.on_gpu),
                  (forward_sm90, "tile_counter", forward_sm90.tile_counter),
                  (decoding, "current_stream", decoding.current_stream)]
    try:
        _launch.Prepared.__call__ = prepared_call
        if as_h100:
            _clear_config_caches()
            configs.capability = lambda device: (9, 0)
            configs.on_gpu = lambda device: True
            forward_sm90.tile_counter = lambda device: torch.zeros(1, dtype=torch.int32, device=device)
            decoding.current_stream = lambda device: 0
        yield rec
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        if as_h100:
            _clear_config_caches()
