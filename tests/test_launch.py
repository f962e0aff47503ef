"""ops._launch: the cached launch reuses Triton's compiled kernel only for an identical key."""

from types import SimpleNamespace

import pytest
import triton

from flashtile.ops import _launch


def launch(kernel, grid, tensors, scalars, num_warps, num_stages, launch_pdl=False, maxnreg=None, **constexprs):
    """A launch with every argument the call's: a Prepared launch with nothing fixed."""
    return _launch.Prepared(kernel, grid, (), (), num_warps, num_stages, launch_pdl, maxnreg, **constexprs)(
        tensors, scalars)


class FakeTensor:
    def __init__(self, ptr, dtype="f16"):
        self.ptr, self.dtype = ptr, dtype
        self.is_cuda = True

    def get_device(self):
        return 0

    def data_ptr(self):
        return self.ptr


class FakeKernel:
    """Stands in for a JITFunction: kernel[grid](...) records the call and returns a 'compiled
    kernel' whose run() records direct launches."""

    def __init__(self, names):
        self.params = [SimpleNamespace(name=n) for n in names]
        self.arg_names = list(names)
        self.triton_calls, self.direct_calls = [], []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.triton_calls.append((grid, args, kwargs))
            compiled = object.__new__(triton.compiler.CompiledKernel)
            compiled._run = lambda *a: self.direct_calls.append(a)
            compiled.function, compiled.packed_metadata = "fn", "meta"
            return compiled
        return call


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(_launch, "current_stream", lambda device: 77)
    # signature: X, Y, n, scale, then the constexprs in an order unlike the call's keywords
    return FakeKernel(["X", "Y", "n", "scale", "B", "A"])


def test_second_call_launches_the_compiled_kernel_directly(kernel):
    x, y = FakeTensor(1024), FakeTensor(2048)
    launch(kernel, (3, 2), (x, y), (5, 0.5), 4, 2, A=1, B=True)
    assert len(kernel.triton_calls) == 1 and kernel.direct_calls == []
    grid, args, kwargs = kernel.triton_calls[0]
    assert grid == (3, 2) and args == (x, y, 5, 0.5)
    assert kwargs == dict(A=1, B=True, num_warps=4, num_stages=2)
    x2, y2 = FakeTensor(4096), FakeTensor(8192)  # other tensors, same key
    launch(kernel, (7,), (x2, y2), (5, 0.5), 4, 2, A=1, B=True)
    assert len(kernel.triton_calls) == 1
    # grid padded to 3 dims, stream, handles, no hooks, then the arguments in signature order
    assert kernel.direct_calls == [(7, 1, 1, 77, "fn", "meta", None, None, None, x2, y2, 5, 0.5, True, 1)]


@pytest.mark.parametrize("change", ["misaligned", "dtype", "scalar-one", "scalar-divisible", "scalar-int64",
                                    "constexpr", "warps", "absent"])
def test_any_specialisation_change_goes_back_through_triton(kernel, change):
    x, y = FakeTensor(1024), FakeTensor(2048)
    call = dict(tensors=(x, y), scalars=(5, 0.5), warps=4, consts=dict(A=1, B=True))
    launch(kernel, (1,), call["tensors"], call["scalars"], call["warps"], 2, **call["consts"])
    if change == "misaligned":
        call["tensors"] = (x, FakeTensor(2048 + 8))
    elif change == "dtype":
        call["tensors"] = (x, FakeTensor(2048, "bf16"))
    elif change.startswith("scalar"):  # what Triton specialises an int on: == 1, 16 | n, int32 or not
        call["scalars"] = ({"scalar-one": 1, "scalar-divisible": 32, "scalar-int64": 2**31}[change], 0.5)
    elif change == "constexpr":
        call["consts"] = dict(A=2, B=True)
    elif change == "warps":
        call["warps"] = 8
    else:
        call["tensors"] = (x, None)
    launch(kernel, (1,), call["tensors"], call["scalars"], call["warps"], 2, **call["consts"])
    assert len(kernel.triton_calls) == 2 and kernel.direct_calls == []


def test_scalar_values_triton_does_not_specialise_on_launch_directly(kernel):
    """Another int of the same specialisation (not 1, 16 does not divide it, int32) and another
    float launch the kernel compiled for the first values, with the new values; the new key is
    kept, so a third call hashes only its values."""
    x, y = FakeTensor(1024), FakeTensor(2048)
    launch(kernel, (1,), (x, y), (5, 0.5), 4, 2, A=1, B=True)
    launch(kernel, (1,), (x, y), (7, 0.25), 4, 2, A=1, B=True)
    assert len(kernel.triton_calls) == 1
    assert kernel.direct_calls == [(1, 1, 1, 77, "fn", "meta", None, None, None, x, y, 7, 0.25, True, 1)]
    assert len(kernel._flashtile_launches) == 3  # (5, 0.5), its specialisation, (7, 0.25)
    launch(kernel, (1,), (x, y), (2**31 - 1, 0.25), 4, 2, A=1, B=True)
    assert len(kernel.triton_calls) == 1 and len(kernel.direct_calls) == 2


def test_cache_is_bounded(kernel, monkeypatch):
    monkeypatch.setattr(_launch, "MAX_ENTRIES", 3)
    x = FakeTensor(1024)
    for n in range(5):
        launch(kernel, (1,), (x, x), (n, 0.5), 4, 2, A=1, B=True)
    assert len(kernel._flashtile_launches) <= 3


def test_launch_hooks_take_tritons_path(kernel):
    x = FakeTensor(1024)
    hook = lambda *a: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(2):
            launch(kernel, (1,), (x, x), (1, 0.5), 4, 2, A=1, B=True)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(kernel.triton_calls) == 2 and kernel.direct_calls == []


def test_integer_helpers():
    assert [_launch.cdiv(a, 16) for a in (0, 1, 16, 17)] == [0, 1, 1, 2]
    assert [_launch.next_pow2(n) for n in (0, 1, 2, 3, 16, 17, 111)] == [1, 1, 2, 4, 16, 32, 128]
    assert all(_launch.next_pow2(n) == triton.next_power_of_2(n) for n in range(1, 600))


def test_prepared_launch_keys_only_its_own_arguments(kernel):
    """A Prepared launch: the call's tensors and scalars go first, the fixed ones after; the first
    call goes through Triton, later ones with the same call arguments launch directly; another
    Prepared with an equal fixed part shares the compiled kernel, one with a different one does not."""
    x, y, fixed = FakeTensor(1024), FakeTensor(2048), FakeTensor(4096)
    kernel.params = [SimpleNamespace(name=n) for n in ("X", "Y", "Z", "n", "scale", "B", "A")]
    first = _launch.Prepared(kernel, (3,), (fixed,), (0.5,), 4, 2, A=1, B=True)
    first((x, y), (5,))
    assert len(kernel.triton_calls) == 1 and kernel.triton_calls[0][1] == (x, y, fixed, 5, 0.5)
    first((FakeTensor(8192), y), (5,))
    _launch.Prepared(kernel, (3,), (FakeTensor(4096 * 3),), (0.5,), 4, 2, A=1, B=True)((x, y), (5,))
    assert len(kernel.triton_calls) == 1 and len(kernel.direct_calls) == 2
    # grid, stream, handles, then the call's tensors, the fixed ones, the scalars, the constexprs
    assert kernel.direct_calls[0][:4] == (3, 1, 1, 77) and kernel.direct_calls[0][10:] == (y, fixed, 5, 0.5, True, 1)
    # values Triton does not specialise on: a call's int, a fixed float (the next step's plan)
    first((x, y), (6,))
    _launch.Prepared(kernel, (3,), (fixed,), (0.25,), 4, 2, A=1, B=True)((x, y), (7,))
    assert len(kernel.triton_calls) == 1 and kernel.direct_calls[-1][10:] == (y, fixed, 7, 0.25, True, 1)
    for call in (lambda: first((x, FakeTensor(2048 + 8)), (5,)),  # alignment of a call tensor
                 lambda: first((x, y), (16,)),  # a call scalar that 16 divides
                 lambda: _launch.Prepared(kernel, (3,), (fixed,), (0.5,), 4, 2, A=2, B=True)((x, y), (5,)),
                 lambda: _launch.Prepared(kernel, (3,), (FakeTensor(4096 + 4),), (0.5,), 4, 2, A=1, B=True)((x, y), (5,))):
        before = len(kernel.triton_calls)
        call()
        assert len(kernel.triton_calls) == before + 1


@pytest.mark.parametrize("scratch", [0, 256], ids=["no-scratch", "global-scratch"])
def test_a_kernel_without_scratch_is_launched_by_the_c_function(monkeypatch, scratch):
    """Triton's launcher object allocates scratch and calls its C function with its flags; with no
    scratch to allocate, the cached launch calls the C function with those flags itself."""
    calls = []

    class Launcher:  # the fields of triton.backends.nvidia.driver.CudaLauncher that matter here
        global_scratch_size, profile_scratch_size = scratch, 0
        launch_cooperative_grid, launch_pdl = False, True

        def launch(self, *args):
            calls.append(("c", args))

        def __call__(self, *args):
            calls.append(("wrapper", args))

    class Kernel(FakeKernel):
        def __getitem__(self, grid):
            def call(*args, **kwargs):
                self.triton_calls.append((grid, args, kwargs))
                compiled = object.__new__(triton.compiler.CompiledKernel)
                compiled._run, compiled.function, compiled.packed_metadata = Launcher(), "fn", "meta"
                return compiled
            return call

    monkeypatch.setattr(_launch, "current_stream", lambda device: 77)
    kernel, x = Kernel(["X", "Y", "n", "scale", "B", "A"]), FakeTensor(1024)
    for _ in range(2):
        launch(kernel, (2,), (x, x), (5, 0.5), 4, 2, A=1, B=True)
    assert len(kernel.triton_calls) == 1
    if scratch:
        assert calls == [("wrapper", (2, 1, 1, 77, "fn", "meta", None, None, None, x, x, 5, 0.5, True, 1))]
    else:
        assert calls == [("c", (2, 1, 1, 77, "fn", False, True, None, None, "meta", None, None, None, x, x, 5, 0.5,
                                True, 1))]


def test_a_hit_passes_tensors_as_addresses_and_boxes_as_they_are(kernel):
    """On a cached hit a torch tensor goes to the launcher as its address (no data_ptr call and
    driver query per argument there); a Box goes as it is, and Triton's path gets its checked
    descriptor; a Box's key is its dtype, block shape and layout."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    from flashtile.ops.host import tma_box_layout

    base = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    layout = tma_box_layout(16, 64, torch.float16)

    def box():
        return _launch.Box(base, base.shape, base.stride(), (1, 16, 1, 64), layout)

    x, y = FakeTensor(1024), torch.zeros(8)
    for _ in range(2):
        launch(kernel, (1,), (x, y, box()), (5,), 4, None, maxnreg=128, A=1, B=True)
    (_, args, kwargs), = kernel.triton_calls
    assert isinstance(args[2], GluonTensorDescriptor) and args[2].block_shape == [1, 16, 1, 64]
    assert kwargs == dict(A=1, B=True, num_warps=4, maxnreg=128)  # no num_stages: a Gluon kernel's launch
    (hit,) = kernel.direct_calls
    assert hit[9] is x and hit[10] == y.data_ptr() and type(hit[11]) is _launch.Box
    assert box().key == box().key != _launch.Box(base, base.shape, base.stride(), (1, 32, 1, 64), layout).key
    launch(kernel, (1,), (x, y, box()), (5,), 4, None, maxnreg=96, A=1, B=True)
    assert len(kernel.triton_calls) == 2  # another register budget is another binary


def test_prepared_launch_binds_the_last_calls_arguments(kernel, monkeypatch):
    """A call with the last call's device, scalars and key launches through the bound arguments:
    the same launcher arguments as a cached hit, with this call's tensors (torch tensors as their
    addresses) and this call's current stream; any other call rebinds."""
    import torch

    streams = iter(range(100, 200))
    monkeypatch.setattr(_launch, "current_stream", lambda device: next(streams))
    kernel.params = [SimpleNamespace(name=n) for n in ("X", "Y", "Z", "n", "scale", "B", "A")]
    fixed = torch.zeros(4)
    prepared = _launch.Prepared(kernel, (3, 2), (fixed,), (0.5,), 4, 2, A=1, B=True)
    x, y = FakeTensor(1024), torch.zeros(8)
    prepared((x, y), (5,))
    assert len(kernel.triton_calls) == 1 and prepared._bound is not None
    y2 = torch.zeros(8)
    prepared((x, y2), (5,))
    prepared((x, y2), (5,), stream=42)
    prepared((x, y), (21,))  # a scalar value the key holds: the cache's hit (the same binary), bound anew
    prepared((x, y), (21,))
    assert len(kernel.triton_calls) == 1
    tail = (fixed.data_ptr(), 5, 0.5, True, 1)
    assert kernel.direct_calls[:2] == [(3, 2, 1, 101, "fn", "meta", None, None, None, x, y2.data_ptr(), *tail),
                                       (3, 2, 1, 42, "fn", "meta", None, None, None, x, y2.data_ptr(), *tail)]
    assert [c[3] for c in kernel.direct_calls[2:]] == [102, 103]
    assert kernel.direct_calls[2][4:] == kernel.direct_calls[3][4:] == (
        "fn", "meta", None, None, None, x, y.data_ptr(), fixed.data_ptr(), 21, 0.5, True, 1)
    assert prepared._bound[0] == (0, (21,), ((x.dtype, True), (torch.float32, True)))
    fixed.data = torch.ones(4)  # new storage under the same tensor: the launch reads its address now
    prepared((x, y), (21,))
    assert kernel.direct_calls[-1][11] == fixed.data_ptr() and len(kernel.triton_calls) == 1


def test_prepared_launch_rebinds_on_another_key_or_device(kernel):
    """The bound launch serves only a call whose tensors have the bound dtypes and alignments and
    whose device is the bound one: another goes through the cache (here: through Triton)."""
    kernel.params = [SimpleNamespace(name=n) for n in ("X", "Y", "Z", "n", "scale", "B", "A")]
    prepared = _launch.Prepared(kernel, (3,), (FakeTensor(4096),), (0.5,), 4, 2, A=1, B=True)
    x, y = FakeTensor(1024), FakeTensor(2048)
    prepared((x, y), (5,))
    other_device = FakeTensor(1024)
    other_device.get_device = lambda: 1
    for call in ((FakeTensor(1024 + 8), y), (FakeTensor(1024, "bf16"), y), (other_device, y)):
        before = len(kernel.triton_calls)
        prepared(call, (5,))
        assert len(kernel.triton_calls) == before + 1
        assert prepared._bound[0][0] == call[0].get_device()


def test_descriptors_reach_the_launcher_as_tritons_wrapper_passes_them(monkeypatch):
    """A kernel with TMA descriptor arguments: Triton wraps its C launch in Python that encodes each
    descriptor (driver.wrap_handle_tensordesc). The cached launch calls the C launch itself and
    encodes the Boxes in _pointers: the launcher must get the same arguments either way."""
    from triton.backends.nvidia import driver

    def fill(ptr, swizzle, size, dtype, block, shape, strides, padding):  # the driver's cuTensorMapEncodeTiled
        return ("map", ptr, swizzle, size, dtype, tuple(block), tuple(shape), tuple(strides), padding)

    monkeypatch.setattr(triton.runtime.driver, "_active", SimpleNamespace(utils=SimpleNamespace(
        fill_tma_descriptor=fill)))
    received = []
    signature = {0: "*bf16", 1: "tensordesc<bf16[1, 64, 1, 128]>", 2: "i32", 3: "tensordesc<fp16[1, 128, 1, 64]>",
                 4: "fp32"}
    metas = [dict(swizzle=3, elem_size=2, elem_type=9, block_size=[1, 64, 1, 128], fp4_padded=False),
             dict(swizzle=2, elem_size=2, elem_type=8, block_size=[1, 128, 1, 64], fp4_padded=False)]
    wrapped = driver.wrap_handle_tensordesc(lambda *a: received.append(a), signature, metas)
    run, boxes = _launch._unwrapped(wrapped)
    assert run is not wrapped and [b[0] for b in boxes] == [1, 3]

    def box(ptr, shape, rows):
        strides = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
        return _launch.Box(FakeTensor(ptr), shape, strides, (1, rows, 1, shape[3]), None)

    x, q, k = FakeTensor(512), box(1024, (2, 300, 4, 128), 64), box(4096, (2, 500, 2, 64), 128)
    base = tuple(range(driver._BASE_ARGS_FORMAT_LEN))
    wrapped(*base, x, q, 7, k, 0.5)
    run(*base, *_launch._pointers((x, q, 7, k, 0.5), boxes))
    assert len(received) == 2 and received[0] == received[1]
    assert received[0][len(base):] == (x, ("map", 1024, 3, 2, 8, (1, 64, 1, 128), (2, 300, 4, 128),
                                           (153600, 512, 128, 1), 0), 2, 300, 4, 128, 153600, 512, 128, 1, 7,
                                       ("map", 4096, 2, 2, 10, (1, 128, 1, 64), (2, 500, 2, 64),
                                        (64000, 128, 64, 1), 0),
                                       2, 500, 2, 64, 64000, 128, 64, 1, 0.5)
    # a launch function without that wrapper is taken as it is
    assert _launch._unwrapped(print) == (print, None)
    plain = driver.wrap_handle_tensordesc(print, {0: "*fp32"}, None)
    assert _launch._unwrapped(plain) == (print, None)


@triton.jit(do_not_specialize=["n"])
def _strided_kernel(X, stride_xb, stride_xd, n):
    pass


def test_unaligned_strides_take_a_twin_that_does_not_specialise_them():
    """for_strides: strides all 1 or multiples of 16 keep the kernel (Triton specialises them, which
    vectorises aligned rows); otherwise a twin of the same function with no stride specialised on
    its divisibility, made once, keeps every do_not_specialize of the kernel's."""
    assert _launch.for_strides(_strided_kernel, 1, (4096, 1, 7)) is _strided_kernel
    twin = _launch.for_strides(_strided_kernel, 1, (40 * 17, 1, 7))
    assert twin is not _strided_kernel and _launch.for_strides(_strided_kernel, 1, (40 * 19, 1, 8)) is twin
    kwargs = twin.kwargs if hasattr(twin, "kwargs") else dict(
        do_not_specialize=twin.do_not_specialize, do_not_specialize_on_alignment=twin.do_not_specialize_on_alignment)
    assert kwargs["do_not_specialize_on_alignment"] == ["stride_xb", "stride_xd"]
    assert list(kwargs["do_not_specialize"]) == ["n"]
