"""Generated code of the prefill kernels for sm_90, compiled on the CPU (tests/codegen_check.py).

Masked loads and stores of whole rows must stay vectorised when the head dim is a power of two:
a mask that compared against the runtime head_dim made them 16-bit scalar accesses (192 loads and
128 stores in the dK/dV kernel at d=128), and fixing that (ops.masks.head_dim_mask) was the
project's largest single gain (docs/changelog.md, "Prefill: the Triton kernels").
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# the grids past one head dim or layout per feature: CI runs them (pytest -m exhaustive), the
# README's test command does not
EXHAUSTIVE = pytest.mark.exhaustive
_server = None  # one codegen_check.py --serve process per test process: torch and triton imported once


def memory_ops(kernel: str, d: int, *extra: str) -> dict:
    """codegen_check.py's report of one command line, compiled in the serving process (the test
    process runs triton's interpreter, where kernels cannot be compiled)."""
    global _server
    if _server is None or _server.poll() is not None:
        env = dict(os.environ, TRITON_INTERPRET="0")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(HERE, "..", "src"), env.get("PYTHONPATH")]))
        _server = subprocess.Popen([sys.executable, os.path.join(HERE, "codegen_check.py"), "--serve"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    _server.stdin.write(json.dumps([kernel, str(d), *extra]) + "\n")
    _server.stdin.flush()
    line = _server.stdout.readline()
    assert line, "codegen_check.py --serve ended"
    result = json.loads(line)
    if "error" in result and "ptxas" in result["error"] and "not found" in result["error"]:
        pytest.skip("no ptxas in this triton install")
    assert "error" not in result, result["error"][-2000:]
    return result


def scalar_16bit(ops: dict) -> int:
    return sum(n for op, n in ops.items() if op.endswith(".U16"))


@pytest.mark.parametrize("kernel", ["forward", "dkdv", "dq"])
def test_power_of_two_head_dim_loads_and_stores_are_vectorised(kernel):
    ops = memory_ops(kernel, 128)
    assert scalar_16bit(ops) == 0, ops
    assert any(op.endswith(".128") for op in ops), ops


@pytest.mark.parametrize("kernel", ["forward", "dkdv", "dq"])
@pytest.mark.parametrize("d", [pytest.param(48, marks=EXHAUSTIVE), 96])
def test_uneven_head_dim_multiple_of_16_is_vectorised(kernel, d):
    """Head dims between powers of two (padded to one by masks) compare against HEAD_DIM, a
    constexpr: a multiple of 16 keeps whole 16-byte accesses. Against the runtime head dim the
    forward at d=96 made 320 16-bit scalar loads and 64 stores and no cp.async (several times
    slower than the Hopper forward: docs/tuning.md)."""
    ops = memory_ops(kernel, d)
    assert scalar_16bit(ops) == 0, ops
    assert any(op.endswith(".128") for op in ops), ops


@pytest.mark.parametrize("d", [40, pytest.param(59, marks=EXHAUSTIVE)])
def test_head_dim_off_16_elements_detected_as_scalar(d):
    """The check can fail: a head stride (d) that 16 does not divide carries no alignment, so the
    accesses go element by element (codegen_check marks strides as a contiguous launch does)."""
    assert scalar_16bit(memory_ops("dkdv", d)) > 0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_hopper_forward_compiles_for_sm90(d, causal):
    """The Gluon forward compiles for sm_90a with its register split (two consumers at 240, or
    three at 160 at d=64; loader 24),
    inside the SM's 227 KB of shared memory, and with its wgmmas asynchronous: ptxas serialises
    them all (info C7514) when an accumulator is read while its product may still be in flight,
    which slowed the first kernel until its first S got its own wait (docs/changelog.md, "Prefill
    forward: the Hopper kernel"). Spills: at most 208 bytes, the persistent loop's per-tile scalars
    (a consumer stores them before a tile's first S and reloads them after it, once per tile; the
    K/V loop has none); the kernel before the persistent grid had none, and was slower at d=128
    (docs/tuning.md); 212 at d=128 since the output leaves through the copy engine (the tile's Q
    buffer, handed back after them, is one more such scalar). Each consumer's output rows go out as
    one bulk copy from its Q buffer (stores from registers, 4 bytes apiece, cost the forward most at
    short lengths: docs/tuning.md). At d=128 the two consumers take turns on the tensor cores
    through named barriers of 256 threads: in the PTX one wait and one pass in each consumer's block
    loop and the second consumer's first pass (faster at long lengths: docs/tuning.md); d=64 (three
    consumers) and d=256 have none, which is also what shows that the count can fail."""
    report = memory_ops("forward-sm90", d, *(["--causal"] if causal else []))
    assert report["spill_bytes"] <= 216, report
    assert report["bulk_stores"] >= 1, report
    assert report["named_barriers"] == ([2, 3] if d == 128 else [0, 0]), report
    assert not report["wgmma_serialised"], report
    assert {24, 160 if d == 64 else 240} <= set(report["setmaxnreg"]), report
    assert report["shared_bytes"] <= 227 * 1024, report


def test_hopper_forward_output_from_registers_without_a_descriptor():
    """An output the copy engine cannot address (O_TMA off: ops.host.tma_ok) is stored from
    registers: the check above can fail."""
    assert memory_ops("forward-sm90", 128, "--pointer-out")["bulk_stores"] == 0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_hopper_backward_compiles_for_sm90(d, causal):
    """The Gluon backward: asynchronous wgmmas (no C7514), the 240/24 register split, inside 227 KB
    of shared memory (at d=128 with 2 Q/dO stages: 198 KB, d=64 with 128-row Q blocks: 195 KB,
    d=256 with the head dim split between the warpgroups: 225 KB, no spills).
    Spills: at d=128 at most 36 bytes causal, the mask arithmetic of the masked steps (the STL/LDL
    pair sits in that branch of the SASS, not on the unmasked steps' path; 28 while the chunk of
    the launch order was a constexpr, compiled per length), 40 without the mask,
    whose dQ product waits until the next step (DEFER_DQ: its 32 registers beside S^T, dK and dV;
    8 bytes with each step ending in its dQ, which measured slower there: docs/tuning.md); at d=64
    at most 208, the loop's scalars (S^T and dP^T of a 128-row block take 64 registers each), stored
    and reloaded once per step around the exponentials: 128-row blocks with them measured faster
    than 64-row blocks without (docs/tuning.md). Where the dQ
    product waits until the next step (d=64, d=128 without a right bound), the consumers hand each
    other their dS^T through named barriers (a pass after the store, a wait before the product: as
    many of each; not with ALiBi, which spills more with them at d=64), elsewhere through ds_ready's
    mbarriers (named barriers measured slower at d=128 with each step ending in its dQ:
    docs/tuning.md)."""
    report = memory_ops("backward-sm90", d, *(["--causal"] if causal else []))
    assert report["spill_bytes"] <= {64: 208, 128: 36 if causal else 40, 256: 0}[d], report
    waits, passes = report["named_barriers"]
    named = d == 64 or (d == 128 and not causal)
    assert (waits > 0 and waits == passes) if named else waits == passes == 0, report
    assert not report["wgmma_serialised"], report
    assert {24, 240} <= set(report["setmaxnreg"]), report
    assert report["shared_bytes"] <= 227 * 1024, report


@pytest.mark.parametrize("d,causal", [(64, False), (128, False), (128, True), pytest.param(64, True, marks=EXHAUSTIVE)],
                         ids=["64-full", "128-full", "128-causal", "64-causal"])
def test_hopper_backward_compiles_deterministic(d, causal):
    """deterministic: the dQ writer partition has its acquire poll of the turn, its full bulk wait
    (cp.async.bulk.wait_group 0, not .read) and its release count, once each; the consumers keep
    the 240 registers and asynchronous wgmmas, and the handoff's barriers fit the shared memory.
    Compiled in the launch order it takes (configs.hopper_backward_head_chunk's ordered: chunks of
    rows without a right bound, and at d=128 causal), whose chunks' index arithmetic spills 40 bytes
    at d=128 non-causal (12 one row at a time; the any-order kernel 8), 20 causal; d=64 192 / 176
    with its dQ split by rows (configs.hopper_backward_dq_by_rows; 144 / 184 by columns)."""
    report = memory_ops("backward-sm90", d, "--deterministic", *(["--causal"] if causal else []))
    assert report["ordered"] == [1, 1, 1], report
    assert report["spill_bytes"] <= {64: 208, 128: 40}[d], report
    assert not report["wgmma_serialised"], report
    assert {24, 240} <= set(report["setmaxnreg"]), report
    assert report["shared_bytes"] <= 227 * 1024, report


@pytest.mark.parametrize("d,causal", [(64, False), (128, True)] + [pytest.param(*dc, marks=EXHAUSTIVE) for dc in
                                                                      ((64, True), (128, False), (256, False), (256, True))],
                         ids=["64-full", "128-causal", "64-causal", "128-full", "256-full", "256-causal"])
@pytest.mark.parametrize("kernel", ["forward-sm90", "backward-sm90"])
def test_hopper_kernels_compile_with_dropout(kernel, d, causal):
    """HAS_DROPOUT in both Hopper kernels: the Philox calls lay out so that the keep-mask reaches the
    wgmma accumulator's layout without moving data (dropout_keep_sm90, dropout_sign_sm90 and
    dropout_apply_sm90 assert their conversions trivial, so this compile fails otherwise), wgmmas
    still asynchronous. Spills: the calls' words per thread beside the tile. The forward carries P
    from block to block in the inputs' dtype with its mask applied (dropout_apply_sm90, which also
    converts P): d=128 28 bytes, 328 causal, stored and reloaded around the step that runs a tile's
    last P V under the next tile's first softmax (DEFER_PV; the block loop's loads are the 104 bytes
    causal it spilled before; 200 without dropout), d=64 (three consumer warpgroups) 24 causal (none
    before each warpgroup skipped the blocks its rows see nothing of, which was faster with dropout
    all the same: docs/changelog.md, "Prefill forward: the Hopper kernel"), d=256 none. The backward
    at d=128 120 / 132, loop invariants reloaded in the step (108 / 128 before its keep-mask moved
    into P's sign bit by integer ops, dropout_sign_sm90; causal 124 before the head-chunked launch
    order's index arithmetic, configs.hopper_backward_head_chunk; 176 since that chunk is an
    argument, so that no length compiles another kernel), 156 non-causal with the dQ product
    deferred to the next step (level in time with 120: docs/tuning.md); at d=64 with its 64-row
    dropout blocks none."""
    report = memory_ops(kernel, d, "--dropout", *(["--causal"] if causal else []))
    bound = {"forward-sm90": {64: 24, 128: 328, 256: 0}, "backward-sm90": {64: 0, 128: 176, 256: 8}}[kernel][d]
    assert report["spill_bytes"] <= bound, report
    assert not report["wgmma_serialised"], report
    assert {24, consumer_regs(kernel, d)} <= set(report["setmaxnreg"]), report
    assert report["shared_bytes"] <= 227 * 1024, report


def consumer_regs(kernel: str, d: int) -> int:
    """The registers of a consumer warpgroup: 160 in the d=64 forward's three
    (configs.hopper_forward_consumers), 240 in two and in the backward."""
    return 160 if (kernel, d) == ("forward-sm90", 64) else 240


# spill bounds of the score modifiers' tests below, by kernel and head dim
MODIFIER_SPILLS = {
    "--softcap": {"forward-sm90": {64: 44, 128: 208, 256: 24}, "backward-sm90": {64: 0, 128: 560, 256: 16}},
    "--alibi": {"forward-sm90": {64: 136, 128: 256, 256: 24}, "backward-sm90": {64: 528, 128: 448, 256: 68}},
}


@pytest.mark.parametrize("d", [pytest.param(64, marks=EXHAUSTIVE), 128, pytest.param(256, marks=EXHAUSTIVE)])
@pytest.mark.parametrize("kernel", ["forward-sm90", "backward-sm90"])
@pytest.mark.parametrize("modifier", ["--softcap", "--alibi"])
def test_hopper_kernels_compile_with_score_modifiers(modifier, kernel, d):
    """MODS.softcap and MODS.alibi in both Hopper kernels (alone, causal, with dropout, packed; ALiBi
    also capped): asynchronous wgmmas, the register split and shared memory of the kernels without
    them, and no int-to-float conversion per column of a block (alibi_sm90 makes those floats by an
    integer add; the PTX keeps at most 12, the rows', where one per column made 138 in the d=128
    ALiBi forward's SASS). With the flags off the SASS of both is the one before them (compared when
    each flag was added). Spills, softcap: the forward within its dense bound (24 bytes at d=256
    with dropout, 44 at d=64 with dropout, where it runs two consumer warpgroups); the backward at
    d=128 196 / 284 bytes, causal (156 non-causal before its dQ product waited for the next step),
    556 with dropout (the cap's derivative, 32 registers per thread from the exponentials to dV's
    operand, beside dK, dV and the dP^T in flight), none at d=64, whose softcap steps take 64-row Q
    blocks (1512 bytes with 128 rows). ALiBi: the forward within 256 bytes (216 at d=128 with
    dropout; 20 at d=256 and 132 at d=64 with dropout, which carries P in bf16), the backward up to
    528 at d=64 causal (496 before its dQ was split by rows, configs.hopper_backward_dq_by_rows),
    whose 128-row Q blocks measured faster than the 64-row ones (level causal) in spite of them
    (docs/tuning.md), and 448 at d=128 capped and causal (432 before the head-chunked launch order)."""
    extras = [[], ["--causal"], ["--causal", "--dropout"], ["--causal", "--varlen"]]
    for extra in extras + ([["--causal", "--softcap"]] if modifier == "--alibi" else []):
        report = memory_ops(kernel, d, modifier, *extra)
        assert report["spill_bytes"] <= MODIFIER_SPILLS[modifier][kernel][d], (extra, report)
        assert not report["wgmma_serialised"], (extra, report)
        assert {24, consumer_regs(kernel, d)} <= set(report["setmaxnreg"]), report
        assert report["shared_bytes"] <= 227 * 1024, report
        assert report["int_to_float"] <= 12, (extra, report)


@pytest.mark.parametrize("d", [pytest.param(64, marks=EXHAUSTIVE), 128, pytest.param(256, marks=EXHAUSTIVE)])
@pytest.mark.parametrize("kernel", ["forward-sm90", "backward-sm90"])
def test_hopper_kernels_compile_for_packed_batches(kernel, d):
    """IS_VARLEN in both Hopper kernels (causal, and with dropout): asynchronous wgmmas, the same
    register split and shared memory as the dense kernels. The dense kernels' SASS does not change
    with the flag off (its opcodes counted before and after). Spills: at most the dense
    bounds above, except the backward at d=64 (372 bytes causal: the sequence bounds and the
    pointer epilogue's registers beside the 128-row blocks' loop scalars), d=128 causal (120; 204 with
    dropout) and d=256 with dropout (16)."""
    for extra in (["--causal"], ["--causal", "--dropout"]):
        report = memory_ops(kernel, d, "--varlen", *extra)
        bound = {"forward-sm90": {64: 64, 128: 384, 256: 48},
                 "backward-sm90": {64: 384, 128: 208, 256: 16}}[kernel][d]
        assert report["spill_bytes"] <= bound, (extra, report)
        assert not report["wgmma_serialised"], (extra, report)
        assert {24, consumer_regs(kernel, d)} <= set(report["setmaxnreg"]), report
        assert report["shared_bytes"] <= 227 * 1024, report


@pytest.mark.parametrize("kernel,d,extra", [("forward-sm90", 96, ["--causal"]), ("forward-sm90", 40, []),
                                             ("backward-sm90", 96, ["--causal", "--varlen"]),
                                             ("backward-sm90", 160, ["--causal", "--varlen"])])
def test_hopper_kernels_compile_at_padded_head_dims(kernel, d, extra):
    """Head dims between 64, 128 and 256 compile to the kernels of the next of them
    (configs.hopper_head_dim) plus the masks at d of the pointer stores (the forward's output, a
    packed backward's dK / dV): the register split, shared memory and asynchronous wgmmas of
    those, and spills within their bounds above."""
    report = memory_ops(kernel, d, *extra)
    dp = 64 if d <= 64 else 128 if d <= 128 else 256
    bound = 208 if kernel == "forward-sm90" else {64: 384, 128: 208, 256: 16}[dp]
    assert report["spill_bytes"] <= bound, report
    assert not report["wgmma_serialised"], report
    assert {24, consumer_regs(kernel, dp)} <= set(report["setmaxnreg"]), report
    assert report["shared_bytes"] <= 227 * 1024, report


@pytest.mark.parametrize("d", [pytest.param(64, marks=EXHAUSTIVE), 128, pytest.param(256, marks=EXHAUSTIVE)])
def test_hopper_forward_compiles_with_a_sink(d):
    """HAS_SINK in the Hopper forward (the sink folded into l and m before the epilogue): within
    the dense kernel's spill bound, wgmmas asynchronous; with the flag off the SASS is the one
    before the flag (compared when it was added)."""
    report = memory_ops("forward-sm90", d, "--causal", "--sink")
    assert report["spill_bytes"] <= 208, report
    assert not report["wgmma_serialised"], report


@pytest.mark.parametrize("page_size,flag", [(0, None), (16, None)] + [pytest.param(*c, marks=EXHAUSTIVE) for c in
                                                                      ((16, "--split"), (16, "--one-round"), (64, None))],
                         ids=["contiguous", "page16", "page16-split", "page16-one-round", "page64"])
def test_decoding_append_costs_the_loop_nothing(page_size, flag):
    """A decoding step that appends k/v (APPEND) compiles to the plain step's shared memory and
    registers: its new rows are written before the KV loop, which stays the plain one. Reading them
    inside the loop instead (a branch per tile, or a second phase of tiles) had cost Triton's
    pipelining: 102 KB of shared memory against 39 KB, or 150-212 registers against 84 at d=128,
    and slowed the step (docs/changelog.md, "Decoding"). Also
    with the one-page tiles of a launch that splits a 16-token-page cache and the 128-key tiles of
    an unsplit one of one round."""
    flags = (flag,) if flag else ()
    plain = memory_ops("decode", 128, str(page_size), *flags)
    append = memory_ops("decode", 128, str(page_size), "--append", *flags)
    assert plain["spill_bytes"] == append["spill_bytes"] == 0, (plain, append)
    assert append["shared_bytes"] == plain["shared_bytes"], (plain, append)
    assert append["regs"] <= plain["regs"], (plain, append)


@pytest.mark.parametrize("page_size", [0, pytest.param(16, marks=EXHAUSTIVE)], ids=["contiguous", "page16"])
def test_decoding_fused_merge_compiles_beside_the_loop(page_size):
    """The merge fused into the split kernel (its arrival count: one acq_rel atomic) compiles for
    sm_90 without spills and with the plain step's shared memory: the loop that streams the cache
    is untouched."""
    plain = memory_ops("decode", 128, str(page_size), "--split")
    fused = memory_ops("decode", 128, str(page_size), "--fused")
    assert fused["spill_bytes"] == 0 and fused["shared_bytes"] == plain["shared_bytes"], (plain, fused)
    assert fused["acq_rel_atomics"] == 1 and plain["acq_rel_atomics"] == 0, (plain, fused)


@pytest.mark.parametrize("d,page_size,flag", [(128, 0, None), (128, 0, "--fused"), (128, 0, "--launch-combine"),
                                               (128, 16, None)] + [pytest.param(*c, marks=EXHAUSTIVE) for c in (
                                               (128, 64, "--fused"), (64, 0, None), (64, 48, None))]
                         + [(128, 16, "--append"), (64, 0, "--append --rotary")]
                         + [pytest.param(*c, marks=EXHAUSTIVE) for c in (
                             (128, 0, "--rows16 --fused"), (64, 16, "--rows16 --append"))],
                         ids=["contiguous", "fused", "launch-combine", "page16", "page64-fused", "d64", "d64-page48",
                              "page16-append", "d64-append-rotary", "rows16-fused", "d64-rows16-page16-append"])
def test_decoding_warp_kernel_compiles(d, page_size, flag):
    """The Gluon split kernel (ops.decode_sm90._split_kernel_warps, each warp on keys of its own)
    compiles for sm_90 on every path plan() gives it: no spills, its 3-tile cp.async ring in 96 KB
    of shared memory at d=64 and 128 (the warps' states reuse the ring), with the append and rotary
    too, the fused
    merge's one acq_rel arrival, the combine kernel let start early."""
    flags = tuple(flag.split()) if flag else ()
    ops = memory_ops("decode", d, str(page_size), "--warps", *flags)
    assert ops["spill_bytes"] == 0 and ops["shared_bytes"] == 3 * 32 * 1024, ops  # 3 tiles of K and V, 32 KB each
    assert ops["acq_rel_atomics"] == ("--fused" in flags), ops
    assert ops["launches_dependents"] == ("--launch-combine" in flags), ops


def test_decoding_combine_waits_for_the_split_kernel():
    """On sm_90 a decoding call's combine kernel is a programmatic dependent launch of its split
    kernel (configs.supports_pdl): the split kernel lets it start once all its programs run,
    and the combine programs must wait for the split kernel's partials (griddepcontrol.wait) before
    they load any. Without the wait (PDL off) they would read partials being written."""
    assert memory_ops("decode", 128, "0", "--launch-combine")["launches_dependents"]
    assert not memory_ops("decode", 128, "0")["launches_dependents"]
    assert memory_ops("combine", 128, "--pdl")["waits_before_loads"]
    assert not memory_ops("combine", 128)["waits_before_loads"]


def _fingerprint(tmp_path, only: str) -> dict:
    """tests/sass_fingerprint.py's record of the calls whose names hold `only`, compiled in a process
    of its own (the test process runs triton's interpreter)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(HERE, "..", "src"), env.get("PYTHONPATH")]))
    out = tmp_path / "fingerprint.json"
    run = subprocess.run([sys.executable, os.path.join(HERE, "sass_fingerprint.py"), str(out), "--only", only],
                         capture_output=True, text=True, env=env)
    if "ptxas" in run.stderr and "not found" in run.stderr:
        pytest.skip("no ptxas in this triton install")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


@EXHAUSTIVE
def test_every_fingerprinted_call_compiles_for_sm90(tmp_path):
    """Every launch of the calls in tests/sass_fingerprint.py (dense, window, softcap, ALiBi,
    dropout, deterministic, fp32, varlen, decoding), made through the API as on an H100, compiles
    for sm_90 with the binder's own specialisation."""
    launches = _fingerprint(tmp_path, "")
    assert {"_fwd_kernel_sm90", "_bwd_kernel_sm90", "_fwd_kernel", "_bwd_kernel"} <= {
        row["kernel"] for rows in launches.values() for row in rows}, launches


def test_decoding_calls_compile_for_sm90(tmp_path):
    """Every launch of decoding calls made through the API as on an H100 (tests/sass_fingerprint.py:
    the real binder and specialisation, so the launch's unaligned twin too) compiles for sm_90. A
    speculative step's two query rows make the lse's head stride 2: the twin that no longer took
    any stride as a multiple of 16 left the Gluon warp kernel's cp.async copies of the cache at 2
    bytes, which ptxas refused (ops.decode_sm90's aligned_strides)."""
    launches = _fingerprint(tmp_path, "decode")
    assert launches["decode-d128-spec2-append"][0]["kernel"] == "_split_kernel_warps", launches
    assert all(row["spill_bytes"] == 0 for rows in launches.values() for row in rows), launches
