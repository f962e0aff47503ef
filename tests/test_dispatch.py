"""ops.dispatch: which kernel a call runs and why (flashtile.explain, FLASHTILE_EXPLAIN), on the
CPU: the dispatch of an H100 is asked with configs told they are on one (nothing runs there)."""

import pytest
import torch

import flashtile
from flashtile.ops import configs, dispatch, prefill


@pytest.fixture
def h100(monkeypatch):
    """The dispatch as on an H100, for CPU tensors (nothing launches in these tests)."""
    monkeypatch.setattr(configs, "on_gpu", lambda device: True)
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))


def qkv(d=128, dtype=torch.bfloat16, b=2, s=256, h=4, hk=4):
    return (torch.randn(b, s, h, d, dtype=dtype), torch.randn(b, s, hk, d, dtype=dtype),
            torch.randn(b, s, hk, d, dtype=dtype))


def test_hopper_by_default(h100):
    why = flashtile.explain(*qkv(), causal=True)
    assert why.forward.kernel == why.backward.kernel == "hopper" and not why.forward.refused
    assert str(why) == ("forward: hopper: sm_90, bfloat16, head dim 128\n"
                        "backward: hopper: sm_90, bfloat16, head dim 128")


@pytest.mark.parametrize("case, passes, reason", [
    ("float32", "both", "takes float16 and bfloat16, not float32"),
    ("d=16", "both", "head dim 16 <= 32 runs faster on the Triton kernels"),
    ("expanded k", "both", "TMA cannot address k"),
    ("misaligned q", "both", "TMA cannot address q"),
    ("negative scale", "both", "needs a positive softmax_scale"),
    ("capped causal d=64", "forward", "configs.hopper_forward_config keeps the Triton kernel for these flags"),
    ("deterministic d=256", "backward", "a deterministic dQ has no fixed order"),
    ("sm_80", "both", "needs sm_90 (this GPU is sm_80)"),
])
def test_refusals_say_why(h100, monkeypatch, case, passes, reason):
    """Each reason the Hopper kernels refuse a call is named, for the pass it concerns; the other
    pass still takes them."""
    d = {"d=16": 16, "capped causal d=64": 64, "deterministic d=256": 256}.get(case, 128)
    q, k, v = qkv(d, torch.float32 if case == "float32" else torch.bfloat16)
    kw = dict(causal=True)
    if case == "expanded k":
        k = k[:1].expand_as(k)
    elif case == "misaligned q":
        q = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    elif case == "negative scale":
        kw["softmax_scale"] = -0.1
    elif case == "capped causal d=64":
        kw["softcap"] = 30.0
    elif case == "deterministic d=256":
        kw["deterministic"] = True
    elif case == "sm_80":
        monkeypatch.setattr(configs, "capability", lambda device: (8, 0))
    why = flashtile.explain(q, k, v, **kw)
    for name in ("forward", "backward"):
        choice = getattr(why, name)
        if passes in ("both", name):
            assert choice.kernel == "triton" and choice.refused[0][0] == "hopper"
            assert reason in choice.refused[0][1], choice
            assert reason in str(choice)
        else:
            assert choice.kernel == "hopper", choice


def test_cpu_kernels_and_the_reference():
    """On the CPU (this session runs under TRITON_INTERPRET=1) the kernels are interpreted; with
    use_backend('reference') the PyTorch reference runs, and explain says so for both passes."""
    q, k, v = qkv(64, torch.float16)
    why = flashtile.explain(q, k, v)
    assert why.forward.kernel == why.backward.kernel == "interpreter"
    assert why.forward.refused == (("hopper", "needs a CUDA device, not cpu"),)
    with flashtile.use_backend("reference"):
        why = flashtile.explain(q, k, v)
    assert why.forward == why.backward and why.forward.kernel == "reference"
    assert dispatch.backend("cpu", "auto", False).kernel == "reference"
    assert dispatch.backend("cuda", "auto", False).kernel == "triton"


def test_explain_checks_its_arguments():
    q, k, v = qkv(64, torch.float16)
    with pytest.raises(ValueError, match="softcap"):
        flashtile.explain(q, k, v, softcap=-1.0)


def test_environment_variable_prints_each_new_plan(monkeypatch, capsys):
    """FLASHTILE_EXPLAIN=1: a call prints its passes' choices when it is planned, once per
    description of the call (a second call of the same shape replays its plans silently)."""
    monkeypatch.setenv("FLASHTILE_EXPLAIN", "1")
    q, k, v = (t.requires_grad_() for t in qkv(32, torch.float16, b=1, s=40, h=2, hk=2))
    for _ in range(2):
        flashtile.flash_attn_func(q, k, v, causal=True).backward(torch.randn(1, 40, 2, 32, dtype=torch.float16))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("flashtile forward (1, 40, 2, 32) x (1, 40, 2, 32) float16 window=(None, 0): "
                               "interpreter")
    assert lines[1].startswith("flashtile backward ") and "not hopper: needs a CUDA device" in lines[1]


def test_choice_is_cached_per_description(h100, monkeypatch):
    """The choice is a pure function of its arguments, asked once per plan: equal arguments give
    the one cached answer; a replaced config function (configs.generation) asks again."""
    q, k, v = qkv()
    first = prefill.forward_choice(q, k, v, torch.empty_like(q), 0.1, (None, 0), 0.0, None, None, None)
    assert prefill.forward_choice(q, k, v, torch.empty_like(q), 0.1, (None, 0), 0.0, None, None, None) is first
    monkeypatch.setattr(configs, "hopper_forward_config", lambda *a, **kw: None)
    again = prefill.forward_choice(q, k, v, torch.empty_like(q), 0.1, (None, 0), 0.0, None, None, None)
    assert again[0].kernel == "triton"


@pytest.mark.interpret
def test_backward_plan_of_one_tensor_in_three_slots():
    """A backward planned for flash_attn_func(x, x, x) (one tensor as q, k and v) is right for a
    later call of the same shapes with three tensors: the plan tells its slots apart."""
    from flashtile.reference import naive

    x = torch.randn(1, 24, 2, 16, dtype=torch.float32, requires_grad=True)
    flashtile.flash_attn_func(x, x, x, causal=True).sum().backward()
    q, k, v = (torch.randn(1, 24, 2, 16, dtype=torch.float32, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 24, 2, 16)
    flashtile.flash_attn_func(q, k, v, causal=True).backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    naive.attention(q64, k64, v64, causal=True)[0].backward(dout.double())
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_hopper_backward_adds_into_the_callers_dq_on_every_call():
    """accumulate_dq (ring attention's dQ sum) where the Hopper kernel adds straight into the
    caller's float32 dq: the plan takes dq from the call's dq slot. It once took it from a slot
    that only the planning call's tensors filled, so every call launched with None there once
    plans were made on distinct() copies (seen on the H100: ring attention and accumulate_dq's
    tests). Recorded as on an H100, nothing runs."""
    from compile_keys import recording

    from flashtile.ops import prefill

    q, k, v, dout = (torch.randn(1, 256, 2, 128, dtype=torch.bfloat16) for _ in range(4))
    scale, window = 128 ** -0.5, (None, 0)
    with recording(as_h100=True) as rec:
        out, lse = prefill.attention_forward(q, k, v, scale, window)
        for _ in range(2):
            dq = torch.zeros(q.shape, dtype=torch.float32)
            got = prefill.attention_backward(dout, q, k, v, out, lse, scale, window, dq=dq, accumulate_dq=True)
            assert got[0] is dq
    assert rec.kernels() >= {"_fwd_kernel_sm90", "_bwd_kernel_sm90"}, rec.kernels()
