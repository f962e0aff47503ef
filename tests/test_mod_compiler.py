"""ops.mod_compiler: user score and mask mods traced into Triton device functions, run under the
interpreter on a block of scores as the kernels call them (q_idx down the rows, kv_idx along the
columns, and transposed as the dK/dV pass holds them), against the mod itself evaluated by torch on
broadcast index tensors, its derivative and the captured tensors' gradients against autograd's."""

import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from flashtile.ops import mod_compiler
from flashtile.ops.mod_compiler import ModCompileError, compile_mods, grad_buffer, table_entries

M, N, B_IDX, H_IDX = 32, 32, 1, 2  # square: the transposed block stores at the same places


@triton.jit
def _evaluate(S, G, Out, DS, Data, b, h, sq, sk, M: tl.constexpr, N: tl.constexpr, TRANSPOSED: tl.constexpr,
              SCORE: tl.constexpr, GRAD: tl.constexpr, MASK: tl.constexpr):
    """Each mod of one block at positions (q, kv) as a kernel's block step holds them."""
    rows = tl.arange(0, M)[:, None]
    cols = tl.arange(0, N)[None, :]
    if TRANSPOSED:  # the dK/dV pass: keys down the rows
        q, kv = tl.arange(0, N)[None, :], tl.arange(0, M)[:, None]
        at = cols * M + rows
    else:
        q, kv = rows, cols
        at = rows * N + cols
    valid = (q < sq) & (kv < sk)
    if SCORE is not None:
        s = tl.load(S + at)
        tl.store(Out + at, SCORE(s, b, h, q, kv, Data))
        if GRAD is not None:
            tl.store(DS + at, GRAD(s, b, h, q, kv, Data, tl.load(G + at), valid))
    else:
        tl.store(Out + at, MASK(b, h, q, kv, Data).to(tl.float32))


def _run(score_mod=None, mask_mod=None, transposed=False, sq=M, sk=N, device="cpu"):
    """(out, dscore, {capture: grad}) from the compiled mods, and the same from torch; the mods' captures
    on device."""
    mods = compile_mods(score_mod, mask_mod, 0, need_grad=True)
    grads = {i: grad_buffer(t) for i, t in enumerate(mods.captures) if mods.grad_at[i] >= 0}
    data = torch.tensor(table_entries(mods, grads) or [0], dtype=torch.int64, device=device)
    s, g = torch.randn(M, N, device=device) * 3, torch.randn(M, N, device=device)
    out, ds = (torch.full((M, N), float("nan"), device=device) for _ in range(2))
    _evaluate[(1,)](s, g, out, ds, data, B_IDX, H_IDX, sq, sk, M, N, transposed, mods.score, mods.score_grad,
                    mods.mask)
    q, kv = torch.arange(M, device=device)[:, None], torch.arange(N, device=device)[None, :]
    b, h = torch.tensor(B_IDX, device=device), torch.tensor(H_IDX, device=device)
    if score_mod is None:
        return out.bool(), torch.broadcast_to(mask_mod(b, h, q, kv), (M, N))
    leaves = [t for t in mods.captures if t.requires_grad]
    sr = s.clone().requires_grad_()
    ref = torch.broadcast_to(score_mod(sr, b, h, q, kv), (M, N))
    valid = ((q < sq) & (kv < sk)).float()
    ref_grads = torch.autograd.grad(ref, [sr, *leaves], g * valid, allow_unused=True)
    got_grads = [grads[i] for i in sorted(grads)]
    return (out, ds, got_grads), (ref.detach(), ref_grads[0], list(ref_grads[1:]))


def _close(a, b, tol=1e-5):
    same_inf = torch.isinf(a) & torch.isinf(b) & (a.sign() == b.sign())
    assert torch.where(same_inf, 0.0, (a - b).abs()).max() <= tol * (1 + b[~same_inf].abs().max())


def _score_mods(device="cpu"):
    torch.manual_seed(1)
    slopes = torch.rand(4, device=device, requires_grad=True)
    table = torch.randn(4, 2 * 64 - 1, device=device, requires_grad=True)
    per_batch = torch.randn(3, 4, device=device, requires_grad=True)
    return {
        "softcap": lambda s, b, h, q, k: 20.0 * torch.tanh(s / 20.0),
        "alibi, learnable slopes": lambda s, b, h, q, k: s - slopes[h] * (q - k).abs(),
        "relative bias, learnable table": lambda s, b, h, q, k: s + table[h, q - k + 63],
        "causal by score": lambda s, b, h, q, k: torch.where(q >= k, s, -float("inf")),
        "per (batch, head) scale": lambda s, b, h, q, k: s * torch.sigmoid(per_batch[b, h]),
        "mixed": lambda s, b, h, q, k: torch.clamp(s, -4.0, 4.0) * 0.5 + torch.exp(-(q - k).abs() / 8.0)
        + torch.sqrt(s * s + 1.0) - torch.maximum(s, torch.zeros_like(s)) + (s ** 2) / 10 + s.abs() * 0.3,
        "integer arithmetic": lambda s, b, h, q, k: s + ((q - k) // 3) * 0.25 + torch.remainder(q - k, 5) * 0.125,
    }


@pytest.mark.interpret
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("name", list(_score_mods()))
def test_score_mod_values_derivative_and_captured_gradients(name, transposed):
    (out, ds, grads), (ref, ref_ds, ref_grads) = _run(_score_mods()[name], transposed=transposed, sq=13, sk=29)
    valid = (torch.arange(M)[:, None] < 13) & (torch.arange(N)[None, :] < 29)
    _close(out, ref)
    _close(torch.where(valid, ds, 0.0), ref_ds)  # the kernels' dS is 0 outside (P is)
    assert len(grads) == len(ref_grads)
    for got, want in zip(grads, ref_grads):
        _close(got, want, 1e-4)  # sums of a block, in another order


def _mask_mods(device="cpu"):
    prefix = torch.tensor([5, 9, 12], device=device)
    doc = torch.tensor([0] * 7 + [1] * 11 + [2] * 14, device=device)
    tree = torch.rand(M, N, device=device) < 0.4  # a speculative-decoding tree: which draft token sees which
    return {
        "causal": lambda b, h, q, k: q >= k,
        "sliding window": lambda b, h, q, k: (q >= k) & (q - k <= 6),
        "prefix-lm": lambda b, h, q, k: (k <= prefix[b]) | (q >= k),
        "document": lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k),
        "dilated window": lambda b, h, q, k: (q >= k) & (q - k <= 12) & ((q - k) % 3 == 0),
        "tree": lambda b, h, q, k: tree[q, k],
        "paligemma prefix + causal": lambda b, h, q, k: (k < 6) & (q < 6) | (q >= k),
        "chunked": lambda b, h, q, k: (q // 8 == k // 8) & (q >= k),
        "per head": lambda b, h, q, k: (h == 2) & (q >= k) | (h != 2),
        "not": lambda b, h, q, k: ~(q < k) & torch.logical_not(k == 3),
    }


@pytest.mark.interpret
@pytest.mark.parametrize("name", list(_mask_mods()))
def test_mask_mods(name):
    got, want = _run(mask_mod=_mask_mods()[name])
    assert torch.equal(got, want)


@pytest.mark.interpret
def test_indices_past_a_captured_tensor_are_clamped():
    """Block padding reaches past the lengths: an index past a captured tensor reads its last
    element (the score there is masked anyway), a negative one counts from the end, as torch's;
    nothing is read out of bounds."""
    short = torch.arange(5, dtype=torch.float32) + 1.0
    mods = compile_mods(lambda s, b, h, q, k: s * 0.0 + short[q - k], None, 0, need_grad=False)
    data = torch.tensor(table_entries(mods, {}), dtype=torch.int64)
    out = torch.empty(M, N)
    _evaluate[(1,)](torch.zeros(M, N), torch.zeros(M, N), out, out, data, 0, 0, M, N, M, N, False, mods.score, None,
                    None)
    idx = torch.arange(M)[:, None] - torch.arange(N)[None, :]
    idx = torch.where(idx < 0, idx + 5, idx).clamp(0, 4)
    assert torch.equal(out, short[idx])


def test_same_structure_compiles_once():
    """New captured values, a new tensor of the same dtype and rank, or new lengths reuse the
    device function; a new constant or dtype makes a new one."""
    def bias_mod(table, c=1.0):
        return lambda s, b, h, q, k: s * c + table[h, q]

    first = compile_mods(bias_mod(torch.randn(4, 40)), None, 0, need_grad=False)
    again = compile_mods(bias_mod(torch.randn(8, 100)), None, 0, need_grad=False)
    assert again.score is first.score
    assert compile_mods(bias_mod(torch.randn(4, 40), 2.0), None, 0, need_grad=False).score is not first.score
    assert compile_mods(bias_mod(torch.randn(4, 40).half()), None, 0, need_grad=False).score is not first.score


def test_generated_names_carry_the_structure_hash():
    """Triton keys a constexpr function by its name: two structures never share one."""
    a = compile_mods(lambda s, b, h, q, k: s + 1.0, None, 0, need_grad=False)
    b = compile_mods(lambda s, b, h, q, k: s + 2.0, None, 0, need_grad=False)
    assert a.score.__name__ != b.score.__name__ and a.key in a.score.__name__


def test_unsupported_operation_is_named():
    with pytest.raises(ModCompileError, match="cumsum"):
        compile_mods(lambda s, b, h, q, k: s + torch.cumsum(q, 0), None, 0, need_grad=False)


def test_data_dependent_control_flow_is_refused():
    def branchy(s, b, h, q, k):
        return s if q > k else -s

    with pytest.raises(ModCompileError, match="branchy"):
        compile_mods(branchy, None, 0, need_grad=False)


def test_a_capture_used_whole_is_refused():
    table = torch.randn(4, 8)
    with pytest.raises(ModCompileError, match="index every dimension"):
        compile_mods(lambda s, b, h, q, k: s + table.sum(), None, 0, need_grad=False)


def test_table_layout_follows_the_start():
    """A mask mod's captures after the score mod's; entries start where the caller's end."""
    x, y = torch.randn(3, 5), torch.randn(7)
    mods = compile_mods(lambda s, b, h, q, k: s + x[h, q], lambda b, h, q, k: y[k] > 0, 10, need_grad=False)
    assert mods.captures[0] is x and mods.captures[1] is y
    assert table_entries(mods, {}) == [x.data_ptr(), 3, 5, 5, 1, y.data_ptr(), 7, 1]
    assert mod_compiler.CompiledMods._fields[-1] == "key"


def _compile_every_mod_for_sm90() -> int:
    """Compile _evaluate with each mod above (value, derivative, mask; both orientations) for sm_90
    through Triton's whole pipeline to a cubin. Run without the interpreter (a process of its own)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"S": "*fp32", "G": "*fp32", "Out": "*fp32", "DS": "*fp32", "Data": "*i64", "b": "i32", "h": "i32",
                 "sq": "i32", "sk": "i32", **dict.fromkeys(["M", "N", "TRANSPOSED", "SCORE", "GRAD", "MASK"],
                                                          "constexpr")}
    count = 0
    for name, fn in [*_score_mods().items(), *_mask_mods().items()]:
        score = name in _score_mods()
        mods = compile_mods(fn if score else None, None if score else fn, 0, need_grad=True)
        for transposed in (False, True):
            constexprs = dict(M=M, N=N, TRANSPOSED=transposed, SCORE=mods.score, GRAD=mods.score_grad, MASK=mods.mask)
            compiled = triton.compile(ASTSource(_evaluate, signature, constexprs), target=GPUTarget("cuda", 90, 32))
            assert compiled.asm["cubin"]
            count += 1
    return count


def test_every_mod_compiles_for_sm90():
    """The generated functions are real Triton, not only what the interpreter accepts."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(here, "..", "src"), here, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", "import test_mod_compiler as t; print(t._compile_every_mod_for_sm90())"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) == 2 * (len(_score_mods()) + len(_mask_mods()))


@pytest.mark.cuda
def test_every_mod_on_the_gpu():
    """The same checks with the kernels' real code on a GPU: values, derivative, captured gradients
    (atomic adds) and masks."""
    for name, mod in _score_mods("cuda").items():
        (out, ds, grads), (ref, ref_ds, ref_grads) = _run(mod, sq=13, sk=29, device="cuda")
        valid = (torch.arange(M, device="cuda")[:, None] < 13) & (torch.arange(N, device="cuda")[None, :] < 29)
        _close(out, ref, 1e-4)
        _close(torch.where(valid, ds, 0.0), ref_ds, 1e-4)
        for got, want in zip(grads, ref_grads, strict=True):
            _close(got, want, 1e-4)
    for name, mod in _mask_mods("cuda").items():
        got, want = _run(mask_mod=mod, device="cuda")
        assert torch.equal(got, want), name
