"""Host side of every launcher: integer helpers and a Triton launch that skips the per-call binder.

`kernel[grid](*args)` re-derives the compiled kernel on every call: it specialises each argument
(about 50 for the decoding kernel), builds a cache key from the result, looks the kernel up and
only then launches. On the H100 machine's host that took 34 µs per call for the decoding kernel
(52 µs through @triton.heuristics), the launch itself 7 µs (scripts/profile_host.py): more than the
~30 µs a decoding step spends on the GPU.

`Prepared` keeps Triton's own answer. The first call with a given key goes through `kernel[grid]`
(compiling if needed) and keeps the compiled kernel it returns; later calls with the same key
launch that kernel directly. The key holds every scalar argument by value, each tensor's dtype and
whether its address is 16-byte aligned, the constexprs, warps, stages and register cap, and the
device. A call whose scalars changed (a cache that grew by a token: its length and strides) looks
again by what Triton specialises a scalar on - an int's type by range (int32, uint64, int64),
whether it is 1, whether 16 divides it; a float's type - before it takes Triton's path (tens of
µs): so a cached launch runs the binary Triton would have picked. The cache is emptied when it grows past
MAX_ENTRIES. Under TRITON_INTERPRET=1, with launch hooks installed (profilers) or with anything
Triton's path does not return as a compiled kernel, every call takes Triton's path.

A Prepared launch's trailing arguments are fixed in advance (a decoding plan's, or all of them
in a prefill call's Plan): their part of the key is hashed once, and each call keys only its own
tensors and scalars. A `Plan` is a Prepared launch whose tensors come from a call's tensors by
slot, made once per description of a call (shapes, strides, dtypes, alignments, options).

A Gluon kernel's TMA descriptors go in as `Box`es: the descriptor's fields without its checks.
Triton's path gets real descriptors made from them (checked there, once per key); a cached launch
hands the Box itself to the launcher, which reads the same fields to encode the descriptor.
"""

from __future__ import annotations

import itertools
from typing import Callable, NamedTuple, Optional

import torch
import triton
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
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


class Box:
    """A Gluon TMA descriptor's arguments (gluon.nvidia.hopper.TensorDescriptor: base tensor, shape,
    strides, block shape, shared layout; zero padding) without the descriptor's checks, which cost
    more host time than a cached launch (~10 us on the H100 machine's host). `descriptor()` makes
    the checked descriptor for Triton's path; the compiled launcher takes the Box as it is (it reads
    base, shape, strides and padding). Each launch site builds its Boxes from tensors that the real
    descriptor accepts for the first call with that key (16-byte aligned base and strides, a
    contiguous last dimension: ops.host.tma_ok), and `key` (dtype, block shape, layout) is what
    Triton specialises a descriptor on."""

    __slots__ = ("base", "shape", "strides", "block_shape", "layout", "key")
    padding = "zero"

    def __init__(self, base: torch.Tensor, shape, strides, block_shape: tuple, layout):
        self.base, self.shape, self.strides, self.block_shape, self.layout = base, shape, strides, block_shape, layout
        self.key = ("box", base.dtype, block_shape, layout)

    @property
    def is_cuda(self) -> bool:
        return self.base.is_cuda

    def get_device(self) -> int:
        return self.base.get_device()

    def descriptor(self) -> GluonTensorDescriptor:
        return GluonTensorDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape),
                                     self.layout)


def _tensor_key(t):
    """What Triton specialises a pointer or TMA descriptor argument on."""
    if t is None:
        return None
    if type(t) is Box:
        return t.key
    if isinstance(t, TensorDescriptor):
        return ("desc", t.base.dtype, tuple(t.block_shape), t.padding)
    return (t.dtype, t.data_ptr() % 16 == 0)


def _for_triton(tensors: tuple) -> tuple:
    """The tensor arguments as Triton's own path takes them: each Box as its checked descriptor."""
    return tuple(t.descriptor() if type(t) is Box else t for t in tensors)


def _scalar_classes(scalars: tuple) -> tuple:
    """What Triton specialises each scalar argument on: an int's type (int32, uint64 or int64, by
    its range), whether 16 divides it and whether it is 1; a float only by its type; a bool or None
    by value. (One comprehension: this runs over ~60 scalars whenever a plan is made.)"""
    return tuple((x & 15 == 0, x == 1, -2147483648 <= x < 2147483648, x >= 9223372036854775808) if type(x) is int
                 else float if type(x) is float else x for x in scalars)


def _stride_positions(kernel, n_tensors: int) -> tuple:
    """Positions, among a launch's scalars, of the kernel's stride arguments (named stride_*) but
    those it declares always aligned (aligned_strides: a kernel whose copies need them to be
    multiples of 16, which its launch site guarantees)."""
    cached = kernel.__dict__.get("_flashtile_strides")
    if cached is None or cached[0] != n_tensors:
        names, aligned = kernel.arg_names[n_tensors:], kernel.__dict__.get("aligned_strides", ())
        positions = tuple(i for i, n in enumerate(names) if n.startswith("stride_") and n not in aligned)
        cached = kernel._flashtile_strides = (n_tensors, positions)
    return cached[1]


def for_strides(kernel, n_tensors: int, scalars: tuple):
    """kernel itself when every stride argument is 1 or a multiple of 16, else its twin that
    specialises no stride on its divisibility by 16 (a stride of 1 still is: contiguity).

    Triton compiles a kernel per divisibility of each int argument. A stride that grows with a
    length (a batch stride, the head stride of a (batch, heads, seq, d) tensor) is a multiple of
    16 at every length when the strides it multiplies are; when one of those is not (a head dim
    such as 40 or 111), the length decides it, and each new length could compile the kernel again,
    for nothing: rows that are not 16-byte aligned are read element by element either way. The twin
    is the same function jitted once more with do_not_specialize_on_alignment on its strides."""
    positions = _stride_positions(kernel, n_tensors)
    if all(scalars[i] & 15 == 0 or scalars[i] == 1 for i in positions):
        return kernel
    twin = kernel.__dict__.get("_flashtile_unaligned")
    if twin is None:
        names = [kernel.arg_names[n_tensors + i] for i in positions]
        if hasattr(kernel, "kwargs"):  # the interpreter's function keeps the decorator's arguments
            twin = type(kernel)(kernel.fn, **{**kernel.kwargs, "do_not_specialize_on_alignment": names})
        else:
            twin = type(kernel)(kernel.fn, do_not_specialize=kernel.do_not_specialize,
                                do_not_specialize_on_alignment=names, debug=kernel.debug, noinline=kernel.noinline)
        kernel._flashtile_unaligned = twin
    return twin


def _cached_launch(kernel, key, grid, tensors, scalars, constexprs, options, device, stream=None, general=None):
    """Launch the compiled kernel kept under key, or under general() (the key with each scalar's
    specialisation in place of its value), or go through Triton once and keep it under both;
    stream: the current stream of device, when the caller has it. Returns what the cache keeps for
    the launch, (run, function, head, tail, boxes), or None when Triton's path did not give a
    compiled kernel."""
    # {key: (run, function, head, the constexprs in signature order, boxes)}
    cache = kernel.__dict__.get("_flashtile_launches")
    if cache is None:
        cache = kernel._flashtile_launches = {}
    hit = cache.get(key)
    if hit is None:
        general_key = general()
        hit = cache.get(general_key)
        if hit is None:
            compiled = for_strides(kernel, len(tensors), scalars)[grid](*_for_triton(tensors), *scalars, **constexprs,
                                                                        **options)
            if isinstance(compiled, triton.compiler.CompiledKernel):
                names = [p.name for p in kernel.params]
                tail = names[len(tensors) + len(scalars):]
                if len(cache) >= MAX_ENTRIES - 1:
                    cache.clear()
                run, function, head, boxes = _direct(compiled)
                hit = cache[key] = cache[general_key] = (run, function, head, tuple(constexprs[n] for n in tail), boxes)
                return hit
            return None
        if len(cache) >= MAX_ENTRIES:
            cache.clear()
        cache[key] = hit
    run, function, head, tail, boxes = hit
    g0, g1, g2 = _grid3(grid)
    run(g0, g1, g2, current_stream(device) if stream is None else stream, function, *head,
        *_pointers(tensors, boxes), *scalars, *tail)
    return hit


def _grid3(grid) -> tuple:
    """A launch grid as the compiled launcher takes it: three dimensions."""
    return (tuple(grid) + (1, 1))[:3]


def _pointers(tensors, boxes: tuple | None = None) -> list:
    """Tensor arguments as the compiled launcher takes them on a cached hit: a plain tensor as its
    address. Given a tensor, the launcher calls its data_ptr and then asks the driver whether the
    address is device memory (cuPointerGetAttribute) on every launch; given an int it does neither.
    The key does not hold a tensor's device, so that question is the callers': every launch site's
    tensors come checked to be on the launch's device (_checks and the API) or made there. Anything
    else (None, a tensor subclass) goes as it is, and so does a TMA descriptor unless boxes
    (_unwrapped) says how the launcher wants it: encoded, then its shape and strides."""
    args = [t.data_ptr() if type(t) is torch.Tensor else t for t in tensors]
    if boxes is not None:
        for at, fill, swizzle, size, dtype, block in reversed(boxes):  # splice from the back: positions hold
            box = tensors[at]
            args[at:at + 1] = (fill(box.base.data_ptr(), swizzle, size, dtype, block, box.shape, box.strides,
                                    int(box.padding == "nan")), *box.shape, *box.strides)
    return args


def _direct(compiled) -> tuple:
    """(run, function, head, boxes): compiled's launch is run(grid x, y, z, stream, function, *head,
    *_pointers(arguments, boxes)). Triton's launcher object wraps its C launch function in Python that
    allocates the kernel's global and profile scratch; a kernel that needs neither is launched by the
    C function itself, with the launcher's flags and no scratch, which is what the wrapper passes it
    (and with TMA descriptor arguments, past the wrapper of those: _unwrapped)."""
    launcher = compiled.run  # loads the binary if that has not happened yet
    hooks = (compiled.packed_metadata, None, None, None)  # launch metadata, enter and exit hooks: none
    if getattr(launcher, "global_scratch_size", 1) == 0 and getattr(launcher, "profile_scratch_size", 1) == 0 \
            and callable(getattr(launcher, "launch", None)):
        run, boxes = _unwrapped(launcher.launch)
        return run, compiled.function, (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                                        *hooks), boxes
    return launcher, compiled.function, hooks, None


def _unwrapped(run) -> tuple:
    """(the C launch, boxes) for a launch function `run` that Triton wrapped because the kernel takes
    TMA descriptors (its driver's wrap_handle_tensordesc): that wrapper walks every argument on every
    call to find the descriptors and encode them, and so cost the Hopper kernels' host path more
    than their own Python did (benchmarks/results/h200/host_profile_forward.txt). boxes: per
    descriptor argument, (its position, the driver's encoder, then the swizzle, element size, host
    dtype enum and box shape the wrapper would pass it), for _pointers. (run, None) where there is
    no such wrapper or it is not the one read here (another Triton, descriptors without metadata)."""
    code, cells = getattr(run, "__code__", None), getattr(run, "__closure__", None)
    if code is None or cells is None:
        return run, None
    free = dict(zip(code.co_freevars, (cell.cell_contents for cell in cells)))
    raw, at, metas = free.get("launcher"), free.get("tensordesc_indices"), free.get("tensordesc_meta")
    if not callable(raw) or not at or not metas or len(at) != len(metas) \
            or any(m is None or m.get("fp4_padded") for m in metas):
        return run, None
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    fill = triton.runtime.driver.active.utils.fill_tma_descriptor
    return raw, tuple((i, fill, m["swizzle"], m["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]],
                       m["block_size"]) for i, m in zip(sorted(at), metas))


_fixed_ids: dict = {}  # the fixed part of a Prepared launch's key -> a small int standing for it
_next_fixed_id = itertools.count()


def _fixed_id(fixed: tuple) -> int:
    """The small int that stands for `fixed` in the keys of Prepared launches."""
    n = _fixed_ids.get(fixed)
    if n is None:
        if len(_fixed_ids) >= MAX_ENTRIES:
            _fixed_ids.clear()  # ids are never reused: keys of the dropped ones just stop hitting
        n = _fixed_ids[fixed] = next(_next_fixed_id)
    return n


class Prepared:
    """A launch whose trailing arguments are fixed (a decoding plan's): the call adds the leading
    tensors and scalars: kernel[grid](*tensors, *fixed tensors, *scalars, *fixed scalars, ...), cached.

    The fixed part of the cache key (about 60 scalars, constexprs and tensor keys for the decoding
    kernel) is hashed once, when the launch is prepared, and stands in the key as one int: a call
    hashes only its own arguments (building and hashing launch()'s whole key cost ~6 us per call
    on a CPU where the rest of a decoding call's host path costs ~10). Two launches prepared with
    equal fixed parts share the int, so they share compiled kernels; so do, through the key by
    specialisation, two whose fixed scalars differ only in value (the plans of successive steps
    over a growing cache). The fixed tensors are keyed once: their addresses must not change
    (nothing flashtile holds is resized in place).

    The launch of the last call is also kept bound: its device, scalars and key, and the compiled
    launcher's arguments but for the stream and the tensors' addresses, which each call reads. A
    call with the same three (the next layer of a decoding step) hands the launcher its arguments
    without a lookup: on the H100 machine's host the Prepared launch of the decoding kernel took
    16 us where the compiled launcher with its arguments ready took 7 (scripts/host_launches.py).
    """

    def __init__(self, kernel, grid, tensors: tuple, scalars: tuple, num_warps: int, num_stages: int | None,
                 launch_pdl: bool = False, maxnreg: int | None = None, **constexprs):
        """kernel[grid](*call's tensors, *tensors, *call's scalars, *scalars, **constexprs, ...).

        tensors: the kernel's trailing pointer and descriptor arguments (None for an absent optional
        tensor; a Gluon TMA descriptor as a Box), scalars: the int/float arguments after the call's,
        in signature order; every constexpr by keyword. Each call passes the same Python type at
        each position (an int never becomes a float or a bool). num_stages: None for a Gluon
        kernel (it pipelines by hand; the option does not apply). launch_pdl: launch as a
        programmatic dependent of the previous kernel in the stream (sm_90+; the kernel must
        gdc_wait before it reads what that kernel writes). maxnreg: the registers a thread may take
        (Gluon's warp-specialised kernels), None for the compiler's choice."""
        self.kernel, self.grid, self.tensors, self.scalars, self.constexprs = kernel, grid, tensors, scalars, constexprs
        self.options = dict(num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
                            **({"launch_pdl": True} if launch_pdl else {}), **({} if maxnreg is None else
                                                                              {"maxnreg": maxnreg}))
        self._rest = (num_warps, num_stages, launch_pdl, maxnreg, tuple(constexprs.items()),
                      tuple(map(_tensor_key, tensors)))
        self._id = _fixed_id((scalars, *self._rest))
        self._class_id = None  # the fixed part by specialisation, at the first call that needs it
        self._grid3 = _grid3(grid)
        self._bound = None  # ((device, scalars, key), run, (function, *head), (*fixed scalars, *tail), boxes)

    def __call__(self, tensors: tuple, scalars: tuple, stream=None, key=None) -> None:
        """Launch with these leading tensors and scalars. stream: the current CUDA stream of their
        device, when the caller has looked it up already; key: the leading tensors' part of the
        cache key, when the caller builds it for less (it must tell apart every dtype and 16-byte
        alignment they can have), else each tensor's dtype and alignment."""
        every = tensors + self.tensors
        hooks = triton.knobs.runtime
        if not every[0].is_cuda or hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls:
            all_scalars = scalars + self.scalars
            for_strides(self.kernel, len(every), all_scalars)[self.grid](*_for_triton(every), *all_scalars,
                                                                          **self.constexprs, **self.options)
            return
        device = every[0].get_device()
        if key is None:
            key = tuple(map(_tensor_key, tensors))
        if stream is None:
            stream = current_stream(device)
        call, bound = (device, scalars, key), self._bound
        if bound is not None and bound[0] == call:
            _, run, head, tail, boxes = bound
            g0, g1, g2 = self._grid3
            # every address read now: a fixed tensor keeps its key, but its storage may move (t.data = ...)
            run(g0, g1, g2, stream, *head, *_pointers(every, boxes), *scalars, *tail)
            return
        hit = _cached_launch(self.kernel, (self._id, device, scalars, key), self.grid, every, scalars + self.scalars,
                             self.constexprs, self.options, device, stream,
                             general=lambda: ("class", self._general_id(), device, _scalar_classes(scalars), key))
        if hit is not None:
            run, function, head, tail, boxes = hit
            self._bound = (call, run, (function, *head), (*self.scalars, *tail), boxes)

    def _general_id(self) -> int:
        if self._class_id is None:
            self._class_id = _fixed_id(("class", _scalar_classes(self.scalars), *self._rest))
        return self._class_id


MAX_PLANS = 1024  # per launcher
_plan_caches: list = []  # every launcher's plans (new_plans), for clear_plans


def new_plans() -> dict:
    """A launcher's cache of plans, {its plan key: its plan}."""
    plans: dict = {}
    _plan_caches.append(plans)
    return plans


def clear_plans() -> None:
    """Forget every launcher's plans: the next calls plan again (tests that replace a launcher's
    internals do this first; replacing a config function needs nothing: configs.generation)."""
    for plans in _plan_caches:
        plans.clear()


def distinct(env: list) -> list:
    """env with a tensor that occurs twice (flash_attn_func(x, x, x), one cu_seqlens for queries
    and keys) made a view of its own where it occurs again: a plan built on it tells the slots
    apart, so that it is right for a call whose tensors there differ."""
    seen, out = set(), []
    for t in env:
        if t is not None:
            if id(t) in seen:
                t = t.view_as(t)
            seen.add(id(t))
        out.append(t)
    return out


def remember(plans: dict, key, plan):
    """plans[key] = plan, the dict emptied first when it holds MAX_PLANS (a program cycling through
    more call shapes than that plans them again)."""
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = plan
    return plan


class Plan(NamedTuple):
    """One kernel launch planned for a description of a call (its shapes, strides, dtypes,
    alignments and options: what every launch argument but the tensors' addresses follows from),
    and replayed for each call that matches it: the kernel's scalars, constexprs and grid are fixed
    in a Prepared launch, and each tensor argument comes from the call's tensors (`env`, a list in
    the launcher's order) by slot: an index into env, or (Box or TensorDescriptor, index, its other
    arguments) for a TMA descriptor over that tensor. key: the tensor arguments' part of the launch
    cache key, which the plan's description fixes (dtypes, 16-byte alignment, box shapes).
    arguments: env -> the tensor arguments, one expression made from the slots (a call's host
    path runs it, not a loop over them)."""

    launch: Optional[Prepared]
    slots: tuple
    key: tuple
    arguments: Optional[Callable] = None

    @classmethod
    def nothing(cls) -> "Plan":
        """A call with nothing to launch (no rows)."""
        return cls(None, (), ())

    @classmethod
    def of(cls, env: list, kernel, grid, tensors: tuple, scalars: tuple, num_warps: int, num_stages: int | None,
           maxnreg: int | None, constexprs: dict, launch_pdl: bool = False) -> "Plan":
        """The plan of launch(kernel, grid, tensors, scalars, ...) whose tensors (or descriptors'
        bases) are all elements of env, found by identity: env as distinct() made it, so that no
        two of its slots hold one object."""
        where = {id(t): i for i, t in enumerate(env) if t is not None}

        def slot(t):
            if t is None:
                return None
            if type(t) is Box:
                return Box, where[id(t.base)], t.shape, t.strides, t.block_shape, t.layout
            if type(t) is TensorDescriptor:
                return TensorDescriptor, where[id(t.base)], t.shape, t.strides, t.block_shape
            return where[id(t)]

        slots = tuple(map(slot, tensors))
        return cls(Prepared(kernel, grid, (), scalars, num_warps, num_stages, launch_pdl, maxnreg, **constexprs),
                   slots, tuple(map(_tensor_key, tensors)), _arguments(slots))

    def run(self, env: list, stream=None) -> None:
        """Launch with the tensors of env (a call that matches the plan's description)."""
        if self.launch is not None:
            self.launch(self.arguments(env), (), stream, self.key)


def _arguments(slots: tuple) -> Callable:
    """env -> the tuple of tensor arguments the slots describe, as one compiled tuple expression."""
    consts, items = {}, []
    for i, s in enumerate(slots):
        if s is None:
            items.append("None")
        elif type(s) is int:
            items.append(f"env[{s}]")
        else:
            consts[f"make{i}"], consts[f"args{i}"] = s[0], s[2:]
            items.append(f"make{i}(env[{s[1]}], *args{i})")
    return eval(f"lambda env: ({', '.join(items)},)", consts)
