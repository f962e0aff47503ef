"""Compile the prefill kernels for sm_90 on the CPU and count their global loads/stores by width.

    python tests/codegen_check.py KERNEL D [BLOCKS] [--flags NAME=VALUE,...] [--regs]   (prints JSON)
    python tests/codegen_check.py forward-sm90|backward-sm90 D [--causal] [--dropout] [--varlen] [--sink]
        (the Gluon Hopper kernels, --sink the forward only: ptxas's report)
    python tests/codegen_check.py decode D PAGE_SIZE [--append] [--launch-combine] [--fused] [--split] [--one-round] [--warps]
        [--rotary] [--rows16 | --rows32]
        (the decoding split kernel, fp16, 16 q / 2 kv heads, --fused with the merge of 64 splits in
        it, --split with the tiles of a launch that splits: registers, spills, shared memory,
        whether it lets a dependent launch start, atomics)
    python tests/codegen_check.py combine D --pdl   (the decoding combine kernel as a programmatic
        dependent launch: whether it waits for the launch before it ahead of every global load)
    python tests/codegen_check.py --serve   (command lines as JSON lists on stdin, reports on stdout)

KERNEL: forward, dkdv, dq (the backward's two kinds of programs in launches of their own; dq-delta
computing delta, dq-tma, dkdv-tma, dkdv-pdl) or backward (both kinds in one grid; backward-tma);
BLOCKS overrides the tiles, e.g. 64,128,8,3 for the forward, dK/dV
or dQ, 32,128,128,32,4,3 (dK/dV rows and keys, dQ rows and keys, warps, stages) for the backward.
With --regs it also reports registers and spill bytes per thread from ptxas -v. --flags sets
constexprs, e.g. IS_VARLEN=1,HAS_DROPOUT=1,PAGE_SIZE=16 (their tensors become pointers).

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

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashtile.ops import backward, backward_sm90, configs, decode, decode_sm90, forward, forward_sm90, host, sm90
from flashtile.ops.mods import Mods

B = configs.BlockConfig
KERNELS = {  # kernel, default tiles, the names they set
    "forward": (forward._fwd_kernel, B(64, 64, 4, 3), dict(BLOCK_M=0, BLOCK_N=1)),
    "dkdv": (backward._bwd_kernel, B(64, 128, 8, 1), dict(BLOCK_M1=0, BLOCK_N1=1, BLOCK_M2=0, BLOCK_N2=1)),
    "dq": (backward._bwd_kernel, B(64, 64, 4, 2), dict(BLOCK_M1=0, BLOCK_N1=1, BLOCK_M2=0, BLOCK_N2=1)),
    "backward": (backward._bwd_kernel, (64, 128, 128, 64, 8, 2),
                 dict(BLOCK_M1=0, BLOCK_N1=1, BLOCK_M2=2, BLOCK_N2=3)),
}
KERNELS["dkdv-tma"] = KERNELS["dkdv-pdl"] = KERNELS["dkdv"]
KERNELS["backward-tma"] = KERNELS["backward"]
KERNELS["dq-delta"] = KERNELS["dq-tma"] = KERNELS["dq"]
PARTS = {"dkdv": dict(DKDV=True, DQ=False), "dq": dict(DKDV=False, DQ=True),
         "backward": dict(DKDV=True, DQ=True), "forward": {}, "dkdv-tma": dict(DKDV=True, DQ=False),
         "dkdv-pdl": dict(DKDV=True, DQ=False, PDL=True), "dq-delta": dict(DKDV=False, DQ=True, WRITE_DELTA=True),
         "dq-tma": dict(DKDV=False, DQ=True), "backward-tma": dict(DKDV=True, DQ=True)}
DESCRIPTORS = ("Q_desc", "dO_desc", "K_desc", "V_desc")
FP32_POINTERS = ("Lse", "Delta", "Sink")
INT_POINTERS = {"CuSeqQ": "*i32", "CuSeqK": "*i32", "SeqUsedK": "*i32", "BlockTable": "*i32", "Rng": "*i64"}
FLOATS = ("qk_scale", "softcap", "softmax_scale", "dropout_scale")
# the optional tensors each flag reads: absent (constexpr None) unless the flag is on
FLAG_TENSORS = {"IS_VARLEN": ("CuSeqQ", "CuSeqK"), "HAS_SEQUSED": ("SeqUsedK",), "PAGE_SIZE": ("BlockTable",),
                "HAS_DROPOUT": ("Rng",), "HAS_SINK": ("Sink",)}


def compile_sm90(name: str, d: int, blocks=None, flags=None):
    kernel, default, fields = KERNELS[name]
    blocks = tuple(blocks or default)
    names = [p.name for p in kernel.params]
    block_d = configs.padded_headdim(d)
    const = dict(Slopes=None, HEAD_DIM=d, BLOCK_D=block_d, MODS=Mods(right=True), EVEN_D=d == block_d,
                 DOT_PRECISION="ieee", stride_slope_b=0,
                 stride_slope_h=0, **PARTS[name])
    const.update({field: blocks[i] for field, i in fields.items()})
    flags = {**dict(IS_VARLEN=False, HAS_SEQUSED=False, PAGE_SIZE=0, HAS_DROPOUT=False, HAS_SINK=False),
             **(flags or {})}
    const.update({n: v for n, v in flags.items() if n in names})
    for flag, tensors in FLAG_TENSORS.items():
        if not flags[flag]:
            const.update({t: None for t in tensors})
    const.update({n: 1 for n in names if n.startswith("stride_") and n.endswith("d")})
    tma = name.endswith("-tma")
    if "HEAD_CHUNK" in names:
        const["HEAD_CHUNK"] = 1
        const.setdefault("WRITE_DELTA", False)
        const.setdefault("PDL", False)
    descriptors = {}  # the descriptors this kind reads, and their box rows
    if "DKDV_TMA" in names:
        if tma and const["DKDV"]:
            descriptors.update(dict.fromkeys(("Q_desc", "dO_desc"), const["BLOCK_M1"]))
        if tma and const["DQ"]:
            descriptors.update(dict.fromkeys(("K_desc", "V_desc"), const["BLOCK_N2"]))
        const.update(DKDV_TMA=tma and const["DKDV"], DQ_TMA=tma and const["DQ"])
        const.update({n: None for n in DESCRIPTORS if n not in descriptors})
    signature, attrs = {}, {}
    for i, pname in enumerate(names):
        if pname in descriptors:
            signature[pname] = f"tensordesc<bf16[1,{descriptors[pname]},1,{block_d}]>"
        elif pname in const:
            signature[pname] = "constexpr"
        elif pname in INT_POINTERS:
            signature[pname] = INT_POINTERS[pname]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif pname[0].isupper() or pname in ("dO", "dK", "dV", "dQ"):
            signature[pname] = "*fp32" if pname in FP32_POINTERS else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif pname in FLOATS:
            signature[pname] = "fp32"
        else:
            signature[pname] = "i32"
            # as Triton specialises a contiguous BSHD launch: 16 divides the strides, except the
            # head stride (d itself) of a head dim that is not a multiple of 16
            if pname.startswith("stride_") and (d % 16 == 0 or not pname.endswith("h")):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in const.items() if n in names},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=blocks[-2], num_stages=blocks[-1]))


def compile_hopper_forward(d: int, causal: bool, dropout: bool = False, varlen: bool = False, sink: bool = False,
                           softcap: bool = False, alibi: bool = False, o_tma: bool = True):
    """ops.forward_sm90._fwd_kernel_sm90 as _launch_sm90 launches it for bf16 BSHD tensors (varlen: a
    packed batch without seqused_k; sink: an fp32 attention sink; softcap: capped scores; alibi:
    ALiBi slopes), its tiles in chunks of heads where configs.hopper_forward_head_chunk takes them
    (d=64, causal). d: the tensors' head dim, computed at configs.hopper_head_dim(d). o_tma: the
    output through the copy engine (an output TMA can address), else stored from registers."""
    from triton.experimental.gluon._runtime import GluonASTSource

    d, head_dim = configs.hopper_head_dim(d), d
    cfg = configs.hopper_forward_tiles(d)
    kernel = forward_sm90._fwd_kernel_sm90
    names = [p.name for p in kernel.params]
    consumers = configs.hopper_forward_consumers(d)
    flags = forward_sm90.ForwardFlags(
        HEAD_DIM=head_dim, NUM_STAGES=cfg.num_stages, Q_STAGES=configs.hopper_forward_q_stages(d), CONSUMERS=consumers,
        PERSISTENT=configs.hopper_forward_persistent(d), HEAD_CHUNKED=configs.hopper_forward_chunked(d, causal),
        IS_VARLEN=varlen, HAS_SEQUSED=False, HAS_DROPOUT=dropout, HAS_SINK=sink, O_TMA=o_tma,
        ROWSUM_MMA=not dropout and consumers == 3)
    const = dict(MODS=Mods(right=causal, softcap=softcap, alibi=alibi), CFG=flags, SeqUsedK=None)
    if not alibi:
        const["Slopes"] = None
    if not dropout:
        const["Rng"] = None
    if not varlen:
        const.update(CuSeqQ=None, CuSeqK=None)
    if not sink:
        const["Sink"] = None
    boxes = dict(q_desc=cfg.block_m // consumers, k_desc=cfg.block_n, v_desc=cfg.block_n, o_desc=cfg.block_m // consumers)
    signature = {}
    for n in names:
        if n in const:
            signature[n] = "constexpr"
        elif n in boxes:
            layout = host.tma_box_layout(boxes[n], d, torch.bfloat16)
            signature[n] = f"tensordesc<bf16[1, {boxes[n]}, 1, {d}],{layout!r}>"
        else:
            signature[n] = {"Out": "*bf16", "Lse": "*fp32", "TileCounter": "*i32", "Rng": "*i64", "qk_scale": "fp32",
                            "softcap": "fp32", "dropout_scale": "fp32", "CuSeqQ": "*i32", "CuSeqK": "*i32", "Sink": "*fp32",
                            "Slopes": "*fp32"}.get(n, "i32")
    src = GluonASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, maxnreg=forward_sm90.hopper_forward_maxnreg(consumers)))


def compile_hopper_backward(d: int, causal: bool, dropout: bool = False, varlen: bool = False, softcap: bool = False,
                            alibi: bool = False, deterministic: bool = False):
    """ops.backward_sm90._bwd_kernel_sm90 as _launch_sm90 launches it for bf16 BSHD tensors (varlen: a
    packed batch without seqused_k; softcap: capped scores; alibi: ALiBi slopes), its programs in
    chunks of (batch, K/V head) rows where configs.hopper_backward_chunked says so (the chunk is an
    argument). d: the tensors' head dim, computed at configs.hopper_head_dim(d). deterministic: dQ's
    additions in a fixed order (the dQ writer partition)."""
    d, head_dim = configs.hopper_head_dim(d), d
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = configs.hopper_backward_tiles(d, dropout, softcap)
    kernel = backward_sm90._bwd_kernel_sm90
    names = [p.name for p in kernel.params]
    flags = backward_sm90.BackwardFlags(
        HEAD_DIM=head_dim, NUM_STAGES=cfg.num_stages, DEFER_DQ=configs.hopper_backward_defer_dq(d, causal, deterministic),
        SPLIT_D=configs.hopper_backward_split_d(d), HEAD_CHUNKED=configs.hopper_backward_chunked(d, causal, deterministic),
        IS_VARLEN=varlen, HAS_SEQUSED=False, HAS_DROPOUT=dropout, DETERMINISTIC=deterministic)
    const = dict(MODS=Mods(right=causal, softcap=softcap, alibi=alibi), CFG=flags, SeqUsedK=None)
    if not deterministic:
        const["Turns"] = None
    if not alibi:
        const["Slopes"] = None
    if not dropout:
        const["Rng"] = None
    if not varlen:
        const.update(CuSeqQ=None, CuSeqK=None, DK=None, DV=None)
    boxes = backward_sm90.sm90_boxes(cfg, d, configs.hopper_backward_dq_by_rows(cfg.block_m, causal, deterministic))
    signature = {}
    for n in names:
        if n in const:
            signature[n] = "constexpr"
        elif n in boxes:
            rows, cols = boxes[n]
            dtype, name = (torch.float32, "fp32") if n == "dq_desc" else (torch.bfloat16, "bf16")
            layout = host.tma_box_layout(rows, cols, dtype)
            signature[n] = f"tensordesc<{name}[1, {rows}, 1, {cols}],{layout!r}>"
        elif n in ("lse_desc", "delta_desc"):
            signature[n] = f"tensordesc<fp32[{cfg.block_m}],{backward_sm90.ROW_LAYOUT!r}>"
        else:
            signature[n] = ("fp32" if n in ("qk_scale", "softcap", "dk_scale", "dropout_scale") else
                            "*i64" if n == "Rng" else "*i32" if n in ("CuSeqQ", "CuSeqK", "Turns") else
                            "*fp32" if n == "Slopes" else
                            "*bf16" if n in ("DK", "DV") else "i32")
    src = GluonASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, maxnreg=sm90.HOPPER_MAXNREG))


def compile_decode(d: int, page_size: int, append: bool, launch_combine: bool = False, fused: bool = False,
                   split: bool = False, one_round: bool = False, warps: bool = False, rotary: bool = False,
                   rows: int = 8):
    """ops.decode._split_kernel as plan() launches it for an fp16 decoding step over a cache with
    16 q / 2 kv heads (one query row, one split, or with `fused` 64 splits merged by the kernel):
    int32 cache_seqlens, a block table when paged, new k/v rows to append with `append`. A launch
    that splits (split, fused, launch_combine) takes configs.decode_config's split tiles, an unsplit
    one of one round of programs (one_round) its one-round tiles. warps: _split_kernel_warps (the
    Gluon kernel) with configs.decode_warp_tiles' tiles instead; rotary: q and the new keys rotated
    on all d dims (GPT-J pairs); rows: with warps, its tiles of 8, 16 or 32 rows (one, two or four
    query rows a head)."""
    cfg = configs.decode_config(8, d, torch.float16, page_size, torch.device("cuda"),
                                split=split or fused or launch_combine, one_round=one_round)
    kernel = decode._split_kernel
    if warps:
        cfg = configs.BlockConfig(rows, 4 * configs.DECODE_WARP_KEYS * 128 // d, 4,
                                  configs.DECODE_WARP_STAGES)
        kernel = decode_sm90._split_kernel_warps
    names = [p.name for p in kernel.params]
    block_d = configs.padded_headdim(d)
    flags = decode.DecodeFlags(GROUP=8, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                               PAGE_SIZE=page_size, ROTARY_DIM=d if rotary else 0, ROTARY_INTERLEAVED=rotary,
                               ROTARY_BY_ROW=False, DOT_PRECISION="ieee", EVEN_D=d == block_d, HAS_SEQLENS=True,
                               HAS_BATCH_IDX=False, HAS_LEFTPAD=False, FUSED_COMBINE=fused,
                               MERGE_UNROLL=configs.DECODE_MERGE_UNROLL, HAS_SINK=False, APPEND=append, BLOCK_T=1,
                               LAUNCH_COMBINE=launch_combine, STAGES=cfg.num_stages if warps else 0)
    const = dict(CFG=flags, MODS=Mods(), Sink=None, BatchIdx=None, LeftPad=None, Slopes=None)
    if not rotary:
        const.update(Cos=None, Sin=None)
    if not fused:
        const.update(OutF=None, LseF=None, Arrivals=None)
    if not page_size:
        const["BlockTable"] = None
    if not append:
        const.update(Knew=None, Vnew=None)
    const.update({n: 1 for n in names if n.startswith("stride_") and n.endswith("d")})
    signature, attrs = {}, {}
    for i, n in enumerate(names):
        if n in const:
            signature[n] = "constexpr"
        elif n[0].isupper():
            signature[n] = ("*i32" if n in ("Seqlens", "BlockTable", "Arrivals") else
                            "*fp32" if n in ("Lse", "LseF") or (fused and n == "Out") else "*fp16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[n] = "fp32" if n in ("qk_scale", "softcap") else "i32"
            if n.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    if warps:
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in const.items()},
                             attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg.num_warps))
    src = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def compile_combine(d: int, pdl: bool):
    """ops.decode._combine_kernel as decoding.prepare_combine launches it for fp16 partials of 64 splits."""
    cfg = configs.combine_config(64, d)
    kernel = decode._combine_kernel
    names = [p.name for p in kernel.params]
    const = dict(HEAD_DIM=d, BLOCK_S=cfg.block_s, BLOCK_D=cfg.block_d, HAS_SINK=False, PDL=pdl, Sink=None)
    signature = {n: "constexpr" if n in const else
                 {"OutP": "*fp16", "LseP": "*fp32", "Out": "*fp16", "Lse": "*fp32"}.get(n, "i32") for n in names}
    src = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg.num_warps))


def waits_before_loads(compiled) -> bool:
    """Whether the PTX waits for the launch it depends on (griddepcontrol.wait) before its first
    global load."""
    ptx = compiled.asm["ptx"]
    wait, load = ptx.find("griddepcontrol.wait"), ptx.find("ld.global")
    return 0 <= wait < load


def ptxas_report(compiled) -> dict:
    """ptxas -v on the kernel's PTX: spill bytes, whether it serialised the wgmmas (info C7514: an
    accumulator read while its product may be in flight; C7512: too few registers), the
    setmaxnreg values, the shared memory and the PTX's int-to-float conversions (which issue on
    the exponential unit)."""
    log = _ptxas_log(compiled)
    ptx = compiled.asm["ptx"]
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {"spill_bytes": int(spills.group(1)) if spills else 0, "wgmma_serialised": "C7514" in log or "C7512" in log,
            "setmaxnreg": sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
            "shared_bytes": compiled.metadata.shared, "int_to_float": len(re.findall(r"cvt\.rn\.f32\.[su]32", ptx))}


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _ptxas_log(compiled) -> str:
    """What ptxas -v -arch=sm_90a prints for the kernel's PTX."""
    path = f"/tmp/flashtile_codegen_{os.getpid()}.ptx"
    with open(path, "w") as f:
        f.write(compiled.asm["ptx"])
    try:
        return subprocess.run([_tool("ptxas"), "-v", "-arch=sm_90a", path, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    finally:
        os.remove(path)


def registers(compiled) -> dict:
    """{'regs': n, 'spill_bytes': n} from ptxas -v on the kernel's PTX."""
    log = _ptxas_log(compiled)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {"regs": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_bytes": int(spills.group(1)) if spills else 0}


def global_memory_ops(compiled) -> dict:
    """{'LDG.E.128': n, 'LDG.E.U16': n, 'STG.E.128': n, ...} from the cubin's SASS."""
    tool = _tool("cuobjdump")
    path = f"/tmp/flashtile_codegen_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)
    return dict(collections.Counter(re.findall(r"\b((?:LDG|STG|LDGSTS)\.[A-Z0-9_.]+)", sass)))


def report(argv: list) -> dict:
    """The JSON report of one command line (the module docstring's forms, without the program)."""
    if argv[0] == "decode":
        compiled = compile_decode(int(argv[1]), int(argv[2]), "--append" in argv, "--launch-combine" in argv,
                                  "--fused" in argv, "--split" in argv, "--one-round" in argv, "--warps" in argv,
                                  "--rotary" in argv, 32 if "--rows32" in argv else 16 if "--rows16" in argv else 8)
        return dict(registers(compiled), shared_bytes=compiled.metadata.shared,
                    launches_dependents="griddepcontrol.launch_dependents" in compiled.asm["ptx"],
                    acq_rel_atomics=compiled.asm["ptx"].count(".acq_rel.add"))
    if argv[0] == "combine":
        compiled = compile_combine(int(argv[1]), "--pdl" in argv)
        return dict(waits_before_loads=waits_before_loads(compiled))
    if argv[0] in ("forward-sm90", "backward-sm90"):
        options = ("--causal" in argv, "--dropout" in argv, "--varlen" in argv)
        if argv[0] == "forward-sm90":
            compiled = compile_hopper_forward(int(argv[1]), *options, sink="--sink" in argv,
                                              softcap="--softcap" in argv, alibi="--alibi" in argv,
                                              o_tma="--pointer-out" not in argv)
        else:
            compiled = compile_hopper_backward(int(argv[1]), *options, softcap="--softcap" in argv,
                                               alibi="--alibi" in argv, deterministic="--deterministic" in argv)
        result = ptxas_report(compiled)
        # bulk copies from shared memory to global memory (the forward's output rows through the copy engine)
        result["bulk_stores"] = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", compiled.asm["ptx"]))
        # hardware named barriers of the two consumers (ops.sm90.named_barrier_sm90): waits, passes
        result["named_barriers"] = [len(re.findall(r"bar\.sync\s+\S+,\s*256;", compiled.asm["ptx"])),
                                    len(re.findall(r"bar\.arrive\s+\S+,\s*256;", compiled.asm["ptx"]))]
        if "--deterministic" in argv:  # the dQ writer's acquire poll, release count and full bulk wait
            ptx = compiled.asm["ptx"]
            result["ordered"] = [ptx.count("ld.acquire.gpu"), ptx.count("red.release.gpu"),
                                 len(re.findall(r"cp\.async\.bulk\.wait_group 0;", ptx))]
        return result
    flags = {}
    if "--flags" in argv:
        i = argv.index("--flags")
        flags = {n: (int(x) if n == "PAGE_SIZE" else bool(int(x))) for n, x in (f.split("=") for f in argv[i + 1].split(","))}
        argv = argv[:i] + argv[i + 2:]
    args = [a for a in argv if a != "--regs"]
    compiled = compile_sm90(args[0], int(args[1]), [int(x) for x in args[2].split(",")] if len(args) > 2 else None,
                            flags)
    result = global_memory_ops(compiled)
    if "--regs" in argv:
        result.update(registers(compiled))
    return result


def serve() -> None:
    """One command line (a JSON list) per line of stdin, its report (or {"error": ...}) per line of
    stdout: the tests compile many kernels through one process, which imports torch and triton
    once."""
    import traceback

    for line in sys.stdin:
        try:
            out = report(json.loads(line))
        except Exception:  # the test that asked shows it
            out = {"error": traceback.format_exc()}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        print(json.dumps(report(sys.argv[1:])))
