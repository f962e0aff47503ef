"""Compile the prefill kernels for sm_90 on the CPU and count their global loads/stores by width.

    python tests/codegen_check.py KERNEL D    (KERNEL in forward, dkdv, dq; prints JSON)

Triton compiles for a GPU target without a GPU (ptxas and cuobjdump ship in the triton wheel), so
properties of the generated code can be tested in CI. The arguments mirror a bf16 launch on
contiguous BSHD tensors: pointers and row strides 16-byte aligned, head-dim strides 1 (Triton
turns an int argument equal to 1 into a constant, as here). Runs in its own process because the
test session imports triton under TRITON_INTERPRET=1, where kernels cannot be compiled.
"""

import collections
import json
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashtile.ops import backward, configs, forward

KERNELS = {"forward": (forward._fwd_kernel, configs.BlockConfig(64, 64, 4, 3)),
           "dkdv": (backward._dkdv_kernel, configs.BlockConfig(64, 128, 8, 1)),
           "dq": (backward._dq_kernel, configs.BlockConfig(64, 64, 4, 2))}
FP32_POINTERS = ("Lse", "Delta")
FLOATS = ("qk_scale", "softcap", "softmax_scale")


def compile_sm90(kernel, cfg, d: int):
    names = [p.name for p in kernel.params]
    block_d = configs.padded_headdim(d)
    const = dict(Slopes=None, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_ALIBI=False,
                 EVEN_D=d == block_d, DOT_PRECISION="ieee", stride_slope_b=0, stride_slope_h=0)
    const.update({n: 1 for n in names if n.startswith("stride_") and n.endswith("d")})
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in const:
            signature[name] = "constexpr"
        elif name[0].isupper() or name in ("dO", "dK", "dV", "dQ"):
            signature[name] = "*fp32" if name in FP32_POINTERS else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in const.items() if n in names},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def global_memory_ops(compiled) -> dict:
    """{'LDG.E.128': n, 'LDG.E.U16': n, 'STG.E.128': n, ...} from the cubin's SASS."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    path = f"/tmp/flashtile_codegen_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)
    return dict(collections.Counter(re.findall(r"\b((?:LDG|STG|LDGSTS)\.[A-Z0-9_.]+)", sass)))


if __name__ == "__main__":
    kernel, cfg = KERNELS[sys.argv[1]]
    print(json.dumps(global_memory_ops(compile_sm90(kernel, cfg, int(sys.argv[2])))))
