"""Host side of the Hopper forward on the CPU: which calls the dispatch gives it (configs) and
which tensors it can address (forward_sm90.refusal, backward_sm90.refusal). The kernel itself: test_codegen.py
(compiled for sm_90a here) and test_hopper_cuda.py (on the H100)."""

import pytest
import torch

from flashtile.ops import backward_sm90, configs, forward_sm90, prefill

CUDA = torch.device("cuda")


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_dispatch(sm90, monkeypatch):
    """The Hopper forward by head dim, dtype and flags: no argument names a length, so no length can
    pick another kernel (test_recompile.py checks the launches themselves)."""
    bf16 = torch.bfloat16
    assert configs.hopper_forward_config(128, bf16, CUDA, causal=True) is not None
    # d=64 runs three consumer warpgroups (192-row tiles), causal or not, with dropout too
    assert configs.hopper_forward_config(64, bf16, CUDA, causal=False).block_m == 192
    assert configs.hopper_forward_config(64, bf16, CUDA, causal=True).block_m == 192
    assert configs.hopper_forward_config(128, bf16, CUDA, causal=False).block_m == 128
    # with softcap a causal d=64 forward measured level with the Triton kernel, or slower: it keeps that one
    assert configs.hopper_forward_config(64, bf16, CUDA, causal=True, softcap=True) is None
    assert configs.hopper_forward_config(64, bf16, CUDA, causal=False, softcap=True)
    assert configs.hopper_forward_config(128, bf16, CUDA, causal=True, softcap=True)
    # head dims from 33 to 256 run at the next of 64 / 128 / 256 (configs.hopper_head_dim), where
    # the Triton kernel's accesses are scalar (configs.hopper_takes) or slower; d=48, which that
    # kernel reads whole, keeps d=64's softcap cut
    assert configs.hopper_forward_config(96, bf16, CUDA, causal=True).block_m == 128
    assert configs.hopper_forward_config(48, bf16, CUDA, causal=False).block_m == 192
    assert configs.hopper_forward_config(48, bf16, CUDA, causal=True, softcap=True) is None
    assert configs.hopper_forward_config(40, bf16, CUDA, causal=True, softcap=True)
    assert configs.hopper_forward_config(160, bf16, CUDA, causal=True).block_n == 64
    for d in (16, 32, 264):  # unmasked Triton tiles; past the Hopper kernels
        assert configs.hopper_forward_config(d, bf16, CUDA, causal=True) is None
    assert configs.hopper_forward_config(256, bf16, CUDA, causal=True).block_n == 64
    assert configs.hopper_forward_config(128, torch.float32, CUDA, causal=True) is None
    assert configs.hopper_forward_config(128, bf16, torch.device("cpu"), causal=True) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    configs._capability.cache_clear()
    try:
        assert configs.hopper_forward_config(128, bf16, CUDA, causal=True) is None
    finally:
        configs._capability.cache_clear()


def test_head_dims_the_hopper_kernels_compute_at(sm90):
    """configs.hopper_head_dim: the next of 64 / 128 / 256, None past 256; hopper_takes draws the
    dispatch's line at 32 (the Triton kernels' whole 32-column tiles) and 256."""
    cases = {1: 64, 33: 64, 64: 64, 65: 128, 96: 128, 128: 128, 129: 256, 200: 256, 256: 256, 257: None}
    assert {d: configs.hopper_head_dim(d) for d in cases} == cases
    taken = [d for d in (8, 16, 32, 33, 40, 48, 256, 264) if configs.hopper_takes(d, torch.bfloat16, CUDA)]
    assert taken == [33, 40, 48, 256]
    assert not configs.hopper_takes(96, torch.float32, CUDA) and not configs.hopper_takes(96, torch.bfloat16, torch.device("cpu"))


def qkv(b=2, s=256, h=4, d=128):
    return [torch.randn(b, s, h, d, dtype=torch.bfloat16) for _ in range(3)]


def test_supports_plain_strided_layouts():
    q, k, v = qkv()
    assert forward_sm90.refusal(q, k, v, torch.empty_like(q), 1.0, None, None) is None
    bhsd = torch.randn(2, 4, 256, 128, dtype=torch.bfloat16).transpose(1, 2)
    assert forward_sm90.refusal(bhsd, k, v, torch.empty_like(q), 1.0, None, None) is None


def test_refuses_what_tma_cannot_read():
    q, k, v = qkv()
    out = torch.empty_like(q)
    shared_k = k[:1].expand_as(k)  # stride 0 over the batch
    assert forward_sm90.refusal(q, shared_k, v, out, 1.0, None, None) is not None
    base = torch.empty(q.numel() + 1, dtype=q.dtype)
    shifted = base[1:].view(q.shape)  # 2 bytes past 16-byte alignment
    assert shifted.data_ptr() % 16 != 0
    assert forward_sm90.refusal(shifted, k, v, out, 1.0, None, None) is not None
    odd = torch.randn(2, 256, 4, 130, dtype=torch.bfloat16)[..., :128]  # head stride of 260 bytes
    assert forward_sm90.refusal(q, odd, v, out, 1.0, None, None) is not None
    assert forward_sm90.refusal(q, k, v, out.transpose(-1, -2).contiguous().transpose(-1, -2), 1.0, None, None) is not None
    # a head dim whose rows are not a multiple of 16 bytes (d=100: 200) stays with the Triton kernel;
    # d=40 (80 bytes) is computed at 64 by the Hopper kernels
    assert forward_sm90.refusal(*qkv(d=100), torch.empty(2, 256, 4, 100, dtype=torch.bfloat16), 1.0, None, None) is not None
    assert forward_sm90.refusal(*qkv(d=40), torch.empty(2, 256, 4, 40, dtype=torch.bfloat16), 1.0, None, None) is None


def packed(paged: bool = False):
    """A checked packed batch of two sequences (q, k, v, varlen), k/v in 16-token pages if paged."""
    from flashtile import _checks

    q, k, v = (torch.randn(288, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 144, 288], dtype=torch.int32)
    if paged:
        k, v = (t.view(18, 16, 4, 128) for t in (k, v))
        table = torch.arange(18, dtype=torch.int32).view(2, 9)
        return q, k, v, _checks.check_varlen(q, k, v, cu, cu, 144, 144, None, table)
    return q, k, v, _checks.check_varlen(q, k, v, cu, cu, 144, 144, None, None)


@pytest.mark.parametrize("modifier", ["negative scale", "paged varlen"])
def test_refuses_score_modifiers(modifier):
    """A page table (packed batches without one it takes), and a negative scale: its row max is
    taken on the raw products (or on capped scores, which rise with them) and scaled after, which
    a negative scale would turn into the row min. (Dropout, softcap, ALiBi and sinks it takes:
    test_hopper_cuda.py's test_dropout, test_softcap, test_alibi and test_sink.)"""
    q, k, v = qkv()
    args = dict(qk_scale=1.0, varlen=None)
    if modifier == "paged varlen":
        q, k, v, varlen = packed(paged=True)
        args["varlen"] = varlen
    args.update({"negative scale": dict(qk_scale=-0.1), "paged varlen": {}}[modifier])
    assert forward_sm90.refusal(q, k, v, torch.empty_like(q), **args, alibi_slopes=None) is not None


def test_alibi_positions_the_hopper_kernels_take():
    """ALiBi reaches the Hopper kernels while every position of their blocks is below 2^22
    (alibi_sm90's integer-add conversion); longer sequences keep the Triton kernels
    (test_hopper_cuda.py's test_alibi_longest_keys on the H100)."""
    from flashtile.ops.mods import ALIBI_MAX_POSITION, alibi_refusal

    def qk(rows, keys, packed=False):  # shapes only
        if packed:
            return torch.empty(rows, 4, 64, device="meta"), torch.empty(keys, 1, 64, device="meta")
        return torch.empty(2, rows, 4, 64, device="meta"), torch.empty(2, keys, 1, 64, device="meta")

    slopes = torch.rand(4)
    limit = ALIBI_MAX_POSITION - 256
    assert ALIBI_MAX_POSITION == 2 ** 22
    assert alibi_refusal(None, *qk(2 ** 30, 2 ** 30), None) is None
    assert alibi_refusal(slopes, *qk(128, limit), None) is None
    assert alibi_refusal(slopes, *qk(128, limit + 1), None) is not None
    assert alibi_refusal(slopes, *qk(limit + 1, 128), None) is not None
    # a packed batch by its totals, whatever its max_seqlen says
    assert alibi_refusal(slopes, *qk(limit, 128, packed=True), "varlen") is None
    assert alibi_refusal(slopes, *qk(128, limit + 1, packed=True), "varlen") is not None


def test_supports_packed_batches():
    """Packed (varlen) batches run the Hopper kernels, forward and backward: the copy engine reads
    them as one sequence of all the rows and the kernels find each sequence (test_hopper_cuda.py's
    varlen tests on the H100)."""

    q, k, v, varlen = packed()
    assert forward_sm90.refusal(q, k, v, torch.empty_like(q), 1.0, varlen, None) is None
    assert backward_sm90.refusal(q, k, v, torch.randn_like(q), None, torch.empty_like(k), torch.empty_like(v), 0.1,
                                 varlen, None, False) is None


# ---------------------------------------------------------------------------------------------
# The Hopper backward (ops.backward_sm90._bwd_kernel_sm90): dispatch, what it takes, and that asking
# for a deterministic backward reaches it.
# ---------------------------------------------------------------------------------------------


def test_backward_dispatch(sm90, monkeypatch):
    bf16 = torch.bfloat16
    for d in (64, 128, 256):
        for dtype in (bf16, torch.float16):
            assert configs.hopper_backward_config(d, dtype, CUDA) == configs.hopper_backward_tiles(d)
            assert (configs.hopper_backward_config(d, dtype, CUDA, dropout=True)
                    == configs.hopper_backward_tiles(d, dropout=True))
            assert (configs.hopper_backward_config(d, dtype, CUDA, softcap=True)
                    == configs.hopper_backward_tiles(d, softcap=True))
    # the cap's derivative beside a 128-row S^T would spill: d=64 takes 64-row blocks with softcap
    assert configs.hopper_backward_tiles(64).block_m == 128 and configs.hopper_backward_tiles(64, softcap=True).block_m == 64
    # the dQ product deferred to the next step: d=64 always; d=128 without a right bound, any-order dQ
    assert all(configs.hopper_backward_defer_dq(64, right, det) for right in (False, True) for det in (False, True))
    assert configs.hopper_backward_defer_dq(128, False, False)
    assert not any(configs.hopper_backward_defer_dq(128, right, det) for right, det in ((True, False), (False, True)))
    assert not configs.hopper_backward_defer_dq(256, False, False)
    # dQ split between the consumers by rows: 128-row Q blocks with a right bound or ordered additions
    assert all(configs.hopper_backward_dq_by_rows(128, right, det) for right, det in ((True, False), (False, True)))
    assert not configs.hopper_backward_dq_by_rows(128, False, False) and not configs.hopper_backward_dq_by_rows(64, True, True)
    assert configs.hopper_backward_split_d(256) and not configs.hopper_backward_split_d(128)
    for d, dp in ((96, 128), (192, 256), (40, 64)):  # computed at the next of 64 / 128 / 256
        assert configs.hopper_backward_config(d, bf16, CUDA) == configs.hopper_backward_tiles(dp)
    for d in (16, 32, 264):
        assert configs.hopper_backward_config(d, bf16, CUDA) is None
    assert configs.hopper_backward_config(128, torch.float32, CUDA) is None
    assert configs.hopper_backward_config(128, bf16, torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert configs.hopper_backward_config(128, bf16, CUDA) is None


def test_backward_head_chunks_fit_the_l2(monkeypatch):
    """The Hopper backward's launch order (configs.hopper_backward_head_chunk): at d=128 with a right
    bound on the keys, as many (batch, K/V head) rows per chunk, a power of two, as have their Q,
    dO and fp32 dQ (8 bytes a row and column) in the L2 together, at most 64; one row at a time
    (the plain grid) elsewhere, but for the ordered (deterministic) kernel, which takes the chunks
    without a right bound at every head dim too."""
    monkeypatch.setattr(configs, "l2_bytes", lambda device: 50 * 2**20)
    chunk = configs.hopper_backward_head_chunk.__wrapped__  # past its cache, which may hold the real L2's answers
    seqlens = (128, 1024, 2048, 4096, 8192, 16384, 65536)
    assert [chunk(128, s, 1, True, CUDA) for s in seqlens] == [64, 32, 16, 8, 4, 2, 1]
    assert chunk(128, 4096, 4, True, CUDA) == 2  # a K/V head's row carries its 4 query heads
    assert chunk(128, 10**7, 1, True, CUDA) == 1
    assert chunk(128, 4096, 1, False, CUDA) == chunk(64, 4096, 1, True, CUDA) == chunk(256, 4096, 1, True, CUDA) == 1
    assert [chunk(d, 4096, 1, c, CUDA, True) for d in (64, 128) for c in (False, True)] == [16, 1, 8, 8]


def test_forward_head_chunks_fit_the_l2(monkeypatch):
    """The Hopper forward's tile order (configs.hopper_forward_head_chunk): at d=64 with a right bound
    on the keys, as many query heads per chunk, a power of two, as have their K and V (4 bytes a key
    and column, shared by a K/V head's query heads) in the L2 together, at most 64; one head at a time
    elsewhere."""
    monkeypatch.setattr(configs, "l2_bytes", lambda device: 50 * 2**20)
    chunk = configs.hopper_forward_head_chunk.__wrapped__
    seqlens = (1024, 4096, 8192, 16384, 262144)
    assert [chunk(64, s, 1, True, CUDA) for s in seqlens] == [64, 32, 16, 8, 1]
    assert chunk(64, 16384, 4, True, CUDA) == 32  # four query heads share a K/V head's bytes
    assert chunk(64, 4096, 1, False, CUDA) == chunk(128, 4096, 1, True, CUDA) == 1


@pytest.mark.parametrize("refused", ["none", "negative scale", "paged varlen", "expanded k", "misaligned dk"])
def test_backward_supports(refused):

    q, k, v = qkv()
    dout, dk, dv = torch.randn_like(q), torch.empty_like(k), torch.empty_like(v)
    args = dict(softmax_scale=0.1, varlen=None)
    if refused == "expanded k":
        k = k[:1].expand_as(k)
    elif refused == "misaligned dk":
        dk = torch.empty(dk.numel() + 1, dtype=dk.dtype)[1:].view(dk.shape)
    elif refused == "paged varlen":  # (the API gathers the pages before a backward)
        q, k, v, args["varlen"] = packed(paged=True)
        dout, dk, dv = torch.randn_like(q), torch.empty_like(k), torch.empty_like(v)
    elif refused != "none":
        args["softmax_scale"] = -0.1
    why = backward_sm90.refusal(q, k, v, dout, None, dk, dv, **args, alibi_slopes=None, accumulate_dq=False)
    assert (why is None) == (refused == "none")
    if refused in ("expanded k", "misaligned dk"):  # the reason names the tensor
        assert f"TMA cannot address {refused.split()[1]}" in why


@pytest.mark.parametrize("d", [16, 256])
@pytest.mark.parametrize("how", ["default", "deterministic=True", "torch.use_deterministic_algorithms"])
def test_deterministic_reaches_the_hopper_backward(monkeypatch, how, d):
    """flash_attn_func's deterministic (and torch's global switch) reach the Hopper backward's
    launch, whose dQ then adds in a fixed order; a deterministic call at a head dim the kernel
    computes at 256 (SPLIT_D, dQ in no fixed order) keeps the Triton programs. Run on the CPU with
    the dispatch forced and the launch replaced by a recorder that raises with its deterministic."""
    import flashtile

    class Launched(Exception):
        pass

    def record(env, cfg, softmax_scale, window, softcap, varlen, dropout, accumulate_dq, deterministic, zero_grads):
        raise Launched(deterministic)

    monkeypatch.setattr(configs, "hopper_backward_config", lambda d, *a, **kw: configs.hopper_backward_tiles(d))
    monkeypatch.setattr(backward_sm90, "plan", record)
    q, k, v = (torch.randn(1, 40, 2, d, dtype=torch.float16, requires_grad=True) for _ in range(3))
    if how == "torch.use_deterministic_algorithms":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    out = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=how == "deterministic=True")
    dout = torch.randn_like(out)  # (out.sum()'s would be expanded: stride 0, which TMA cannot read)
    deterministic = how != "default"
    if deterministic and d == 256:
        out.backward(dout)
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    else:
        with pytest.raises(Launched) as launched:
            out.backward(dout)
        assert launched.value.args[0] is deterministic


def test_ordered_backward_dispatch():
    """Where a deterministic backward takes the Hopper kernel in its fixed order: every head dim
    computed at 64 or 128, at every length; not at those computed at 256 (no fixed order there)."""
    assert all(configs.hopper_backward_ordered(d) for d in (40, 48, 64, 96, 128))
    assert not any(configs.hopper_backward_ordered(d) for d in (160, 256))


def test_forward_persistent():
    """Persistent where two Q buffers fit (d <= 128), a program per tile at d=256."""
    assert configs.hopper_forward_persistent(64) and configs.hopper_forward_persistent(128)
    assert not configs.hopper_forward_persistent(256)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("extras", ["plain", "every option"])
def test_hopper_plans_bind_the_kernels_arguments(sm90, monkeypatch, extras, d):
    """The Hopper launches' plans (forward and backward) take the kernel's pointer and descriptor
    arguments first, from the call's tensors by slot, then its scalars, one for each parameter in
    signature order, and every constexpr by name; each Box makes the checked descriptor Triton's
    path gets. The forward's consumer warpgroups and register cap follow its tile."""
    from flashtile.ops import _launch
    from flashtile.reference.dropout import draw_rng

    monkeypatch.setattr(configs, "on_gpu", lambda device: True)
    monkeypatch.setattr(configs, "hopper_forward_config", lambda d, *a, **kw: configs.hopper_forward_tiles(d))
    monkeypatch.setattr(forward_sm90, "tile_counter", lambda device: torch.zeros(1, dtype=torch.int32))
    q, k, v = qkv(b=2, s=256, h=4, d=d)
    out, lse, dout = torch.empty_like(q), torch.empty(2, 4, 256), torch.randn_like(q)
    dq, dk, dv, delta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty(2, 4, 256)
    plain = extras == "plain"
    dropout = None if plain else (0.1, draw_rng(torch.device("cpu")))
    slopes, sink, softcap = (None, None, 0.0) if plain else (torch.rand(4), torch.zeros(4), 30.0)
    env = prefill.forward_tensors(q, k, v, out, lse, slopes, None, dropout, sink)
    fwd = prefill._forward_plan(env, 0.1, (None, 0), softcap, None, dropout)
    bwd_env = prefill.backward_tensors(dout, q, k, v, out, lse, dq, dk, dv, delta, slopes, None, dropout)
    bwd = prefill._backward_plan(bwd_env, 0.1, (None, 0), softcap, None, dropout, False, False)
    launches = [(fwd, env), (bwd.launches[1], bwd_env)]
    assert [p.launch.kernel for p, _ in launches] == [forward_sm90._fwd_kernel_sm90, backward_sm90._bwd_kernel_sm90]
    for plan, call in launches:
        kernel, prepared = plan.launch.kernel, plan.launch
        tensors = tuple(None if s is None else call[s] if type(s) is int else s[0](call[s[1]], *s[2:])
                        for s in plan.slots)
        runtime = [p.name for p in kernel.params if not p.is_constexpr]
        constexprs = {p.name for p in kernel.params if p.is_constexpr}
        assert [p.is_constexpr for p in kernel.params] == [False] * len(runtime) + [True] * len(constexprs)
        assert len(tensors) + len(prepared.scalars) == len(runtime)
        assert set(prepared.constexprs) == constexprs
        assert all(t is None or isinstance(t, (torch.Tensor, _launch.Box)) for t in tensors)
        assert all(type(x) in (int, float) for x in prepared.scalars)
        assert (tensors[runtime.index("Slopes")] is None) == plain
        descriptors = [t for t in _launch._for_triton(tensors) if t is not None and not isinstance(t, torch.Tensor)]
        assert len(descriptors) == sum(n.endswith("_desc") for n in runtime)
    consumers = fwd.launch.constexprs["CFG"].CONSUMERS
    assert consumers == (3 if d == 64 else 2)
    assert fwd.launch.options["maxnreg"] == forward_sm90.hopper_forward_maxnreg(consumers)


@pytest.mark.interpret
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_hopper_backward_plan_runs_its_delta_launch(sm90, monkeypatch, packed):
    """The Hopper backward's plan on the CPU, its delta launch run by the interpreter and the Gluon
    kernel's launch caught: the delta launch leaves the LSE in the log2 domain (+inf past each
    sequence's rows), delta = rowsum(dO * O) (0 past them) and zeroes the fp32 dQ sum it is given
    (poisoned here); the kernel gets those buffers and the call's tensors in their slots; dq is
    the caught dQ sum scaled (zero, as the kernel never ran)."""
    from flashtile._checks import Varlen
    from flashtile.ops import _launch

    monkeypatch.setattr(configs, "on_gpu", lambda device: True)
    caught = []
    real = _launch.Prepared.__call__

    def call(self, tensors, scalars, stream=None, key=None):
        if self.kernel is backward_sm90._bwd_kernel_sm90:
            caught.append(tensors)
        else:
            real(self, tensors, scalars, stream, key)

    monkeypatch.setattr(_launch.Prepared, "__call__", call)
    empty = torch.empty

    def poisoned(*shape, **kw):  # every buffer the call makes starts as NaN
        t = empty(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    h, d = 2, 64
    if packed:
        lengths = [70, 0, 129]
        q, k, v, out, dout = (torch.randn(sum(lengths), h, d, dtype=torch.float16) for _ in range(5))
        cu = torch.tensor([0, 70, 70, 199], dtype=torch.int32)
        varlen, lse = Varlen(cu, cu, 129, 129), torch.randn(h, sum(lengths))
    else:
        q, k, v, out, dout = (torch.randn(2, 129, h, d, dtype=torch.float16) for _ in range(5))
        varlen, lse = None, torch.randn(2, h, 129)
    lse[..., 3] = float("-inf")  # a row that saw no key
    delta = torch.full_like(lse, float("nan"))
    dq, dk, dv = prefill.attention_backward(dout, q, k, v, out, lse, 0.125, (None, 0), delta=delta, varlen=varlen)
    (tensors,) = caught
    names = [p.name for p in backward_sm90._bwd_kernel_sm90.params][:len(tensors)]
    got = dict(zip(names, tensors))
    lse2, delta2, dq_acc = got["lse_desc"].base, got["delta_desc"].base, got["dq_desc"].base
    assert dq_acc.shape == q.shape and dq_acc.dtype == torch.float32 and torch.equal(dq_acc, torch.zeros_like(dq_acc))
    assert got["q_desc"].base is q and got["do_desc"].base is dout and got["k_desc"].base is k
    rowsum = (dout.float() * out.float()).sum(-1)  # (b, s, h) or (total, h)
    want_delta = rowsum.transpose(-1, -2)  # the LSE's layout
    torch.testing.assert_close(delta, want_delta, atol=1e-3, rtol=1e-3)
    rows_pad = lse2.numel() // (h * (2 if not packed else 3))
    seqs = [(0, 129), (129, 258)] if not packed else [(0, 70), (70, 70), (70, 199)]
    for s, (lo, hi) in enumerate(seqs):
        for head in range(h):
            base = (s * h + head) * rows_pad
            n = hi - lo
            mine = lse[s, head] if not packed else lse[head, lo:hi]
            want = torch.where(mine == float("-inf"), float("inf"), mine * 1.4426950408889634)
            torch.testing.assert_close(lse2[base:base + n], want, atol=1e-5, rtol=1e-6)
            assert bool((lse2[base + n:base + rows_pad] == float("inf")).all())
            mine_delta = want_delta[s, head] if not packed else want_delta[head, lo:hi]
            torch.testing.assert_close(delta2[base:base + n], mine_delta, atol=1e-3, rtol=1e-3)
            assert bool((delta2[base + n:base + rows_pad] == 0).all())
    assert torch.equal(dq, torch.zeros_like(dq))
