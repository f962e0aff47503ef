"""Compile every kernel that a set of API calls launches on an H100, without a GPU, and describe
what ptxas made of each: registers, spill bytes, shared memory and the SASS instruction mix.

    python tests/sass_fingerprint.py OUT.json [--only NAME_SUBSTRING]
    python tests/sass_fingerprint.py --compare OLD.json NEW.json

A refactoring of the kernels that must change neither results nor speed (issue 73) is checked by
running this before and after it: equal registers, spills, shared memory and instruction counts
per opcode mean the same machine code up to the order of parameters, so the same speed. The calls
go through the public API under compile_keys.recording(as_h100=True): each launch is compiled
exactly as Triton's JIT would compile it on sm_90 (same binder, same specialisation), so this tool
does not know any kernel's signature, and survives changes to them.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys

assert os.environ.get("TRITON_INTERPRET", "0") == "0", "compiling needs the real JIT: unset TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import compile_keys  # noqa: E402

import flashtile  # noqa: E402
from flashtile import api  # noqa: E402
from flashtile.ops import _launch  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BF16 = torch.bfloat16


def _qkv(b, sq, sk, h, hk, d, dtype=BF16, grad=True):
    q = torch.randn(b, sq, h, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(b, sk, hk, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(b, sk, hk, d, dtype=dtype, requires_grad=grad)
    return q, k, v


def _train(d, causal=False, h=8, hk=8, dtype=BF16, **kw):
    q, k, v = _qkv(2, 1024, 1024, h, hk, d, dtype)
    out = flashtile.flash_attn_func(q, k, v, causal=causal, **kw)
    out.backward(torch.ones_like(out))


def _varlen(d, causal=True):
    cu = torch.tensor([0, 300, 1024, 2048], dtype=torch.int32)
    q, k, v = (torch.randn(2048, 8, d, dtype=BF16, requires_grad=True) for _ in range(3))
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 1024, 1024, causal=causal)
    out.backward(torch.ones_like(out))


def _decode(d, paged=False, append=False, splits=0, dtype=torch.float16, b=4, sq=1, **kw):
    hk, h, cap = 2, 16, 4096
    page = 256 if paged else None
    if paged:
        kc = torch.randn(b * cap // page, page, hk, d, dtype=dtype)
        table = torch.arange(b * cap // page, dtype=torch.int32).view(b, -1)
    else:
        kc, table = torch.randn(b, cap, hk, d, dtype=dtype), None
    vc = torch.randn_like(kc)
    q = torch.randn(b, sq, h, d, dtype=dtype)
    new = dict(k=torch.randn(b, sq, hk, d, dtype=dtype), v=torch.randn(b, sq, hk, d, dtype=dtype)) if append else {}
    lens = torch.full((b,), 3000, dtype=torch.int32)
    flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, causal=True,
                                      num_splits=splits, **new, **kw)


def _decode_features(d, splits, b=4, dtype=torch.float16):
    """A decoding step with every feature of the split kernel: rotary, left padding, a batch index,
    a window, softcap, ALiBi and a sink, appending two rows."""
    rot = torch.randn(4096, d // 4)
    _decode(d, append=True, splits=splits, b=b, sq=2, dtype=dtype, rotary_cos=rot, rotary_sin=rot,
            cache_batch_idx=torch.arange(b, dtype=torch.int32).flip(0), cache_leftpad=torch.full((b,), 5, dtype=torch.int32),
            window_size=(512, 0), softcap=20.0, alibi_slopes=torch.rand(16), learnable_sink=torch.randn(16))


CALLS = {  # name -> the call; each launches one or more kernels
    "dense-d64": lambda: _train(64),
    "dense-d64-causal": lambda: _train(64, causal=True),
    "dense-d128": lambda: _train(128),
    "dense-d128-causal": lambda: _train(128, causal=True),
    "dense-d256-causal": lambda: _train(256, causal=True),
    "dense-d96-gqa": lambda: _train(96, causal=True, h=8, hk=2),
    "window-d128": lambda: _train(128, window_size=(256, 0)),
    "softcap-d128-causal": lambda: _train(128, causal=True, softcap=30.0),
    "alibi-d128-causal": lambda: _train(128, causal=True, alibi_slopes=torch.rand(8, dtype=torch.float32)),
    "alibi-d256-causal": lambda: _train(256, causal=True, alibi_slopes=torch.rand(8, dtype=torch.float32)),
    "dropout-d128-causal": lambda: _train(128, causal=True, dropout_p=0.1),
    "deterministic-d128-causal": lambda: _train(128, causal=True, deterministic=True),
    "fp32-d64-causal": lambda: _train(64, causal=True, dtype=torch.float32),
    "varlen-d128-causal": lambda: _varlen(128),
    "decode-d128": lambda: _decode(128),
    "decode-d128-paged-append": lambda: _decode(128, paged=True, append=True),
    "decode-d64-split": lambda: _decode(64, splits=8),
    "decode-d128-spec2-append": lambda: _decode(128, append=True, sq=2),
    "decode-d128-features": lambda: _decode_features(128, 1),
    "decode-d64-features-split": lambda: _decode_features(64, 4),
    "decode-d128-features-many": lambda: _decode_features(128, 0, b=64),
    "decode-d96-features-split": lambda: _decode_features(96, 4),  # the portable Triton split kernel from here on
    "decode-d256-paged-append": lambda: _decode(256, paged=True, append=True),
    "decode-fp32-d128-features": lambda: _decode_features(128, 0, dtype=torch.float32),
}


def _compile(kernel, tensors, scalars, constexprs, options):
    """Triton's compiled kernel for this launch on sm_90: what JITFunction.run would compile."""
    backend = make_backend(TARGET)
    kwargs = {**constexprs, **options}
    bound, specialization, opts = compile_keys._binder(kernel)(*_launch._for_triton(tuple(tensors)), *scalars, **kwargs)
    options, signature, const, attrs = kernel._pack_args(backend, kwargs, bound, specialization, opts)
    src = _source_type(kernel)(kernel, signature, const, attrs)
    return triton.compile(src, target=TARGET, options=options.__dict__)


def _source_type(kernel):
    """The frontend that compiles kernel: Gluon's or Triton's."""
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource
        return GluonASTSource
    from triton.compiler import ASTSource
    return ASTSource


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def describe(compiled) -> dict:
    """Registers, spill bytes, shared memory and {opcode: count} of the kernel's SASS."""
    path = f"/tmp/flashtile_fingerprint_{os.getpid()}"
    with open(path + ".ptx", "w") as f:
        f.write(compiled.asm["ptx"])
    with open(path + ".cubin", "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        log = subprocess.run([_tool("ptxas"), "-v", "-arch=sm_90a", path + ".ptx", "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([_tool("cuobjdump"), "-sass", path + ".cubin"], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.remove(path + ".ptx")
        os.remove(path + ".cubin")
    spills = re.search(r"(\d+) bytes spill stores", log)
    opcode = r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)"  # after the address and any predicate
    ops = collections.Counter(m.split(".")[0] for m in re.findall(opcode, sass))
    return {"regs": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_bytes": int(spills.group(1)) if spills else 0, "shared": compiled.metadata.shared,
            "instructions": sum(ops.values()), "opcodes": dict(sorted(ops.items()))}


def fingerprint(names) -> dict:
    """{call name: [{kernel, description}, ...] in launch order}."""
    out = {}
    for name in names:
        launches = []

        def record(self, tensors, scalars, stream=None, key=None):
            every, all_scalars = tensors + self.tensors, scalars + self.scalars
            kernel = _launch.for_strides(self.kernel, len(every), all_scalars)
            launches.append((kernel, every, all_scalars, self.constexprs, self.options))

        with compile_keys.recording(as_h100=True):
            _launch.Prepared.__call__ = record
            saved = api.backend_for, api.interpreter_on
            api.backend_for, api.interpreter_on = (lambda t: "triton"), (lambda: True)  # kernels, CPU tensors
            try:
                CALLS[name]()
            finally:
                api.backend_for, api.interpreter_on = saved
        rows = []
        for kernel, tensors, scalars, constexprs, options in launches:
            kernel_name = getattr(kernel, "__name__", None) or kernel.fn.__name__
            rows.append({"kernel": kernel_name, **describe(_compile(kernel, tensors, scalars, constexprs, options))})
        out[name] = rows
        print(name, [(r["kernel"], r["regs"], r["spill_bytes"], r["instructions"]) for r in rows], flush=True)
    return out


def compare(old: dict, new: dict) -> int:
    """Print each difference between two fingerprints; the number of calls that differ."""
    differ = 0
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a is None or b is None:
            print(f"{name}: only in {'new' if a is None else 'old'}")
            differ += 1
            continue
        lines = []
        if len(a) != len(b):
            lines.append(f"  {len(a)} launches -> {len(b)}")
        for x, y in zip(a, b):
            for field in ("regs", "spill_bytes", "shared", "instructions"):
                if x[field] != y[field]:
                    lines.append(f"  {x['kernel']} -> {y['kernel']}: {field} {x[field]} -> {y[field]}")
            ops = {op: (x["opcodes"].get(op, 0), y["opcodes"].get(op, 0)) for op in set(x["opcodes"]) | set(y["opcodes"])}
            changed = {op: n for op, n in ops.items() if n[0] != n[1]}
            if changed:
                lines.append(f"  {x['kernel']}: opcodes {dict(sorted(changed.items()))}")
        print(f"{name}: {'same' if not lines else 'DIFFERS'}")
        print("\n".join(lines)) if lines else None
        differ += bool(lines)
    return differ


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        with open(sys.argv[2]) as f, open(sys.argv[3]) as g:
            sys.exit(1 if compare(json.load(f), json.load(g)) else 0)
    names = list(CALLS)
    if "--only" in sys.argv:
        names = [n for n in names if sys.argv[sys.argv.index("--only") + 1] in n]
    with open(sys.argv[1], "w") as f:
        json.dump(fingerprint(names), f, indent=1)
