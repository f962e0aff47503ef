"""Flash-Decoding kernels on the GPU: the interpreter cases at real sizes, bf16 too, 128k contexts.

Same check as the interpreter tests (tests/decode_check.py): 2x rule against the float64 oracle,
outputs and split partials poisoned, cache changed exactly at the appended slots.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from decode_check import check_kvcache, make_cache

from flashtile import DecodePlan, flash_attn_with_kvcache, merge_attention_states
from flashtile.bench.harness import capture
from flashtile.reference.decoding import merge
from flashtile.testing import assert_2x

pytestmark = pytest.mark.cuda

DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                                 ids=["fp16", "bf16", "fp32"])

# (b, sq, h, hk, d, capacity, s_new)
SHAPES = {
    "seed-gqa8-d128": (4, 1, 16, 2, 128, 4096, 1),
    "llama-gqa4-d128": (8, 1, 32, 8, 128, 2048, 1),
    "mqa-d64": (3, 1, 8, 1, 64, 3000, 1),
    "mha-d80": (2, 1, 4, 4, 80, 1000, 1),
    "gqa2-d256": (2, 1, 4, 2, 256, 1500, 1),
    "spec4-gqa8-d128": (2, 4, 16, 2, 128, 2000, 4),
    "chunk64-gqa4-d64": (2, 64, 8, 2, 64, 1024, 64),  # 256 packed rows: four M blocks
    "odd-d40-no-append": (2, 3, 6, 3, 40, 777, 0),
}


@DTYPES
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_contiguous(shape, dtype):
    check_kvcache(*shape, dtype, "cuda")


@DTYPES
@pytest.mark.parametrize("page_size", [16, 48, 64, 256])
def test_paged(page_size, dtype):
    check_kvcache(4, 1, 16, 2, 128, 4096, 1, dtype, "cuda", page_size=page_size)
    check_kvcache(2, 3, 8, 2, 64, 1024, 3, dtype, "cuda", page_size=page_size, causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("page_size", [None, 16, 64], ids=["contiguous", "page16", "page64"])
def test_long_context_128k(page_size, dtype):
    """Seed 004's longest row: one sequence, 16 q / 2 kv heads, 131072 keys."""
    _, lse = check_kvcache(1, 1, 16, 2, 128, 131072, 1, dtype, "cuda", page_size=page_size,
                           lengths=[131071])  # the heuristic: 264 splits
    _, one_lse = check_kvcache(1, 1, 16, 2, 128, 131072, 1, dtype, "cuda", page_size=page_size,
                               lengths=[131071], num_splits=1)  # one program per kv head
    torch.testing.assert_close(lse, one_lse, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_num_splits_agree(dtype):
    results = [check_kvcache(3, 1, 16, 2, 128, 8192, 1, dtype, "cuda", lengths=[8191, 5000, 1],
                             num_splits=n) for n in (1, 2, 7, 64, 300, 0)]
    for out, lse in results[1:]:
        torch.testing.assert_close(out.float(), results[0][0].float(), atol=1e-2, rtol=0)
        torch.testing.assert_close(lse, results[0][1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("num_splits", [2, 7, 32, 64])
def test_fused_merge_on_the_gpu(num_splits, monkeypatch):
    """The split kernel's last program merges (fused) as the combine kernel does, whichever program
    arrives last: 50 runs bitwise equal to the first (the merge reads the partials in split order),
    the arrival counters zero after each, and runs on two streams at once (one set of counters
    each) equal to it too."""
    from flashtile.ops import configs

    torch.manual_seed(0)
    b, h, hk, d, capacity = 6, 16, 2, 128, 8192
    k_cache, v_cache, _ = make_cache(b, capacity, hk, d, torch.float16, "cuda", None, b)
    lengths = [8192, 5000, 1, 0, 4097, 300]
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
    results = {}
    for combine in ("fused", "kernel"):
        monkeypatch.setattr(configs, "DECODE_FUSED_MAX_SPLITS", 1 << 30 if combine == "fused" else 0)
        plan = DecodePlan(b, h, k_cache.shape, lengths, dtype=torch.float16, device="cuda", num_splits=num_splits)
        assert plan._launch.fused == (combine == "fused")
        results[combine] = plan.run(q, k_cache, v_cache, return_softmax_lse=True)
    torch.testing.assert_close(results["fused"][0].float(), results["kernel"][0].float(), atol=2e-3, rtol=0)
    torch.testing.assert_close(results["fused"][1], results["kernel"][1], atol=1e-5, rtol=0)

    monkeypatch.setattr(configs, "DECODE_FUSED_MAX_SPLITS", 1 << 30)
    plan = DecodePlan(b, h, k_cache.shape, lengths, dtype=torch.float16, device="cuda", num_splits=num_splits)
    first = plan.run(q, k_cache, v_cache)
    for _ in range(50):
        assert torch.equal(plan.run(q, k_cache, v_cache), first)
    assert all(not c.any() for _, _, c in plan._launch.scratch.values())
    # each stream has its own partials and counters, so streams may overlap: the plan's runs and
    # flash_attn_with_kvcache's (whose plans are cached too)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = []
    torch.cuda.synchronize()
    for stream in streams:
        with torch.cuda.stream(stream):
            outs.append([plan.run(q, k_cache, v_cache) for _ in range(10)] +
                        [flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=num_splits)
                         for _ in range(10)])
    torch.cuda.synchronize()
    assert all(torch.equal(o, first) for run in outs for o in run)
    assert len(plan._launch.scratch) == 3


FEATURES = {
    "rotary-gptj-causal": dict(rotary=(128, True), causal=True),
    "rotary-neox-partial": dict(rotary=(64, False)),
    "window": dict(window=(100, 0), causal=True),
    "softcap": dict(softcap=30.0),
    "alibi-bh": dict(alibi="bh", causal=True),
    "leftpad": dict(leftpad=True, causal=True),
    "batch-idx": dict(batch_idx=True),
    "int-seqlens-strided-q": dict(int_seqlens=True, q_strided=True),
    "paged-leftpad-rotary": dict(page_size=16, leftpad=True, rotary=(32, True), causal=True),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", FEATURES.values(), ids=FEATURES.keys())
def test_features(case, dtype):
    check_kvcache(3, 2, 16, 2, 128, 2048, 2, dtype, "cuda", **case)


# (b, sq, h, hk, capacity), d = 128 and no new keys unless given: what ops.decode_sm90._split_kernel_warps takes (at most 16
# query rows a KV head, and b x hk <= the SMs or rows of >= 8 tiles; configs.decode_warp_tiles). "rows300": more
# programs than an H100 has SMs, two resident on an SM
WARP_SHAPES = {"gqa8": (4, 1, 16, 2, 4096), "gqa4": (8, 1, 32, 8, 2048), "mha": (3, 1, 8, 8, 1000),
               "spec2-gqa8-16-rows": (2, 2, 16, 2, 2000), "mqa8": (5, 1, 8, 1, 777),
               "rows300": (150, 1, 16, 2, 1100)}
WARP_CASES = {
    **{name: dict(shape=shape) for name, shape in WARP_SHAPES.items()},
    **{f"page{p}": dict(shape=WARP_SHAPES["gqa8"], page_size=p) for p in (16, 48, 64, 256)},
    "page16-causal-spec": dict(shape=WARP_SHAPES["spec2-gqa8-16-rows"], page_size=16, causal=True),
    "splits1": dict(shape=WARP_SHAPES["gqa8"], num_splits=1),
    "splits3-fused": dict(shape=WARP_SHAPES["gqa4"], num_splits=3),
    "splits64-combine": dict(shape=WARP_SHAPES["gqa8"], num_splits=64),
    "window": dict(shape=WARP_SHAPES["spec2-gqa8-16-rows"], window=(100, 0), causal=True),
    "softcap": dict(shape=WARP_SHAPES["gqa8"], softcap=30.0),
    "alibi-bh": dict(shape=WARP_SHAPES["spec2-gqa8-16-rows"], alibi="bh", causal=True),
    "leftpad": dict(shape=WARP_SHAPES["gqa8"], leftpad=True),
    "batch-idx": dict(shape=WARP_SHAPES["gqa4"], batch_idx=True),
    "int-seqlens-strided-q": dict(shape=WARP_SHAPES["gqa8"], int_seqlens=True, q_strided=True),
    "sink": dict(shape=WARP_SHAPES["gqa8"], sink=True, plan="tensor"),
    "sink-fused": dict(shape=WARP_SHAPES["gqa4"], sink=True, num_splits=4),
    "plan-list": dict(shape=WARP_SHAPES["gqa4"], plan="list"),
    "strided-cache": dict(shape=WARP_SHAPES["gqa8"], cache_strided=True),
    "d64-gqa4": dict(shape=WARP_SHAPES["gqa4"], d=64),
    "d64-page16-causal-spec": dict(shape=WARP_SHAPES["spec2-gqa8-16-rows"], d=64, page_size=16, causal=True),
    "d64-page48": dict(shape=WARP_SHAPES["gqa8"], d=64, page_size=48),  # 32 keys a warp: a page index a key
    "d64-splits3-fused": dict(shape=WARP_SHAPES["mqa8"], d=64, num_splits=3),
    "d64-splits64-combine": dict(shape=WARP_SHAPES["gqa8"], d=64, num_splits=64),
    "append": dict(shape=WARP_SHAPES["gqa8"], s_new=1),
    "append-spec2-causal": dict(shape=WARP_SHAPES["spec2-gqa8-16-rows"], s_new=2, causal=True),
    "append-page16-splits8": dict(shape=WARP_SHAPES["gqa4"], s_new=1, page_size=16, num_splits=8),
    "append-rotary-gptj-plan": dict(shape=WARP_SHAPES["gqa8"], s_new=1, rotary=(128, True), causal=True,
                                    plan="tensor"),
    "append-rotary-neox-partial-d64": dict(shape=WARP_SHAPES["gqa4"], d=64, s_new=1, rotary=(32, False)),
    "append-rotary-neox-leftpad-spec2": dict(shape=WARP_SHAPES["spec2-gqa8-16-rows"], s_new=2, rotary=(128, False),
                                             leftpad=True, causal=True),
    "rows300-empty-rows": dict(shape=WARP_SHAPES["rows300"], lengths=[(37 * i) % 1100 if i % 3 else 0
                                                                      for i in range(150)]),
    "rows300-splits3-fused": dict(shape=WARP_SHAPES["rows300"], num_splits=3),
    "rows300-splits16-combine": dict(shape=WARP_SHAPES["rows300"], num_splits=16),
    "rows300-page16-append-rotary": dict(shape=WARP_SHAPES["rows300"], page_size=16, s_new=1, rotary=(128, True),
                                         causal=True),
    # (not with a window: its rows would be short, and take _split_kernel)
    "rows300-batch-idx-leftpad": dict(shape=WARP_SHAPES["rows300"], batch_idx=True, leftpad=True, causal=True),
    "rows300-d64-page48-sink-plan": dict(shape=WARP_SHAPES["rows300"], d=64, page_size=48, sink=True, plan="tensor"),
    "rows300-spec2-16-rows-append": dict(shape=(150, 2, 16, 2, 1100), s_new=2, causal=True),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", WARP_CASES.values(), ids=WARP_CASES.keys())
def test_warp_kernel(case, dtype, monkeypatch):
    """_split_kernel_warps (the Gluon split kernel) against the float64 oracle, on each path it has;
    a cache whose rows it cannot copy whole (strided-cache) runs _split_kernel in the same plan.
    Each call's choice between the two (decode_attention asks _whole_rows of a plan that has both)
    is recorded: on sm_90 every call of a case took the Gluon kernel, or (strided-cache) none did."""
    from flashtile.ops import decoding

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon split kernel runs on sm_90")
    whole_rows, chose = decoding._whole_rows, []
    monkeypatch.setattr(decoding, "_whole_rows", lambda cache: chose.append(whole_rows(cache)) or chose[-1])
    case = dict(case)
    b, sq, h, hk, capacity = case.pop("shape")
    d, s_new = case.pop("d", 128), case.pop("s_new", 0)
    check_kvcache(b, sq, h, hk, d, capacity, s_new, dtype, "cuda", **case)
    assert chose and all(x != case.get("cache_strided", False) for x in chose), chose


MEMCHECK_CASE = """
import torch, flashtile
torch.manual_seed(0)
for d, page in ((128, 16), (64, 16), (64, 48)):
    # one sequence of 5 pages: the last 64- (d=128) or 128-key tile (d=64) reaches past its 5 table slots
    cap = 5 * page
    k = torch.randn(6, page, 2, d, device="cuda", dtype=torch.float16)
    table = torch.tensor([[4, 0, 3, 1, 2]], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 1, 16, d, device="cuda", dtype=torch.float16)
    lens = torch.tensor([cap - 3], dtype=torch.int32, device="cuda")
    flashtile.flash_attn_with_kvcache(q, k, k.clone(), cache_seqlens=lens, block_table=table)
torch.cuda.synchronize()
print("ok")
"""


def test_warp_kernel_reads_nothing_past_the_page_table():
    """The Gluon split kernel under compute-sanitizer's memcheck, every tensor its own allocation
    (PYTORCH_NO_CUDA_MEMORY_CACHING): a page table of 5 slots whose last tile of keys reaches past
    them must not read a slot past the lengths (it once did, unmasked, for the tile's last warps)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon split kernel runs on sm_90")
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(sanitizer):
        pytest.skip("no compute-sanitizer")
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    run = subprocess.run([sanitizer, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-c",
                          MEMCHECK_CASE], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, (run.stdout[-3000:], run.stderr[-3000:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("num_splits", [1, 3, 133, 600])
def test_merge(num_splits, dtype):
    out_partial = torch.randn(num_splits, 4, 32, 128, device="cuda").to(dtype)
    lse_partial = 3 * torch.randn(num_splits, 4, 32, device="cuda")
    empty = torch.rand(num_splits, 4, 32, device="cuda") < 0.3
    lse_partial[empty] = float("-inf")
    out_partial[empty] = float("nan")
    out, lse = merge_attention_states(out_partial, lse_partial)
    ref_out, ref_lse = merge(out_partial.double(), lse_partial.double())
    w = torch.exp(lse_partial - lse_partial.logsumexp(0).nan_to_num(neginf=0.0)).to(dtype)
    base = (w[..., None] * out_partial.nan_to_num(0.0)).sum(0)
    assert_2x("out", out, ref_out, base)
    assert_2x("lse", lse, ref_lse, lse_partial.logsumexp(0))


def test_kvcache_helpers_on_gpu():
    from flashtile import PagedKVCache

    cache = PagedKVCache(64, 16, 2, 2, 128, num_layers=1, dtype=torch.bfloat16, device="cuda")
    outs = []
    for step in range(3):
        q = torch.randn(2, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
        kv = [torch.randn(2, 1, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        outs.append(cache.attend(q, *kv, causal=True))
        cache.advance(1)
    assert cache.seqlens.tolist() == [3, 3] and torch.isfinite(outs[-1]).all()


def test_cuda_graph_capture():
    """With index tensors on the GPU nothing reads them on the host, so one decoding step can be
    captured in a CUDA graph and replayed (how decode loops hide Python's launch overhead)."""
    torch.manual_seed(0)
    q = torch.randn(4, 1, 16, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(4, 1, 2, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    k_cache, v_cache = (torch.randn(4, 4096, 2, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    seqlens = torch.tensor([4000, 17, 3000, 1], dtype=torch.int32, device="cuda")
    graph, out = capture(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens))
    q.copy_(torch.randn_like(q))
    graph.replay()
    want = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=seqlens)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


# ---- DecodePlan, overflow and the host path on the GPU -----------------------------------------

@pytest.mark.parametrize("page_size", [None, 16, 64], ids=["contiguous", "page16", "page64"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_plan_matches_the_call_and_the_oracle(page_size, dtype):
    for lengths_from in ("list", "tensor"):
        check_kvcache(4, 1, 16, 2, 128, 4096, 1, dtype, "cuda", page_size=page_size, plan=lengths_from)
        check_kvcache(3, 2, 16, 2, 128, 2048, 2, dtype, "cuda", page_size=page_size, plan=lengths_from,
                      leftpad=True, causal=True, rotary=(128, True))


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("num_splits", [1, 0, 64], ids=["one-split", "heuristic", "combine-kernel"])
def test_plan_run_in_a_cuda_graph(page_size, num_splits):
    """plan.run reads nothing on the host: captured once, replayed on new q, k, v and cache
    contents (copied into the captured tensors), it equals an eager run of the same plan on copies
    of the same inputs, bit for bit, and appends the same keys. With 64 splits the merge is the
    combine kernel, on sm_90 a programmatic dependent launch of the split kernel, in the graph too."""
    torch.manual_seed(0)
    b, h, hk, d, capacity = 4, 16, 2, 128, 4096
    lengths = [4000, 17, 3000, 0]
    k_cache, v_cache, table = make_cache(b, capacity, hk, d, torch.float16, "cuda", page_size, b)
    plan = DecodePlan(b, h, k_cache.shape, lengths, dtype=torch.float16, device="cuda", seqlen_new=1,
                      block_table=table, causal=True, num_splits=num_splits)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(b, 1, hk, d, device="cuda", dtype=torch.float16) for _ in range(2))
    graph, out = capture(lambda: plan.run(q, k_cache, v_cache, k, v))
    for _ in range(3):
        for t in (q, k, v, k_cache, v_cache):
            t.copy_(torch.randn_like(t))
        k_eager, v_eager = k_cache.clone(), v_cache.clone()
        graph.replay()
        want = plan.run(q, k_eager, v_eager, k, v)
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)
    assert torch.isfinite(out).all()


def _overflow_cases():
    """(name, flash_attn_with_kvcache kwargs, message) of every overflow path, on CUDA tensors."""
    dev = dict(device="cuda")
    q = torch.randn(2, 1, 4, 64, **dev).half()
    k, v = torch.randn(2, 2, 2, 64, **dev).half(), torch.randn(2, 2, 2, 64, **dev).half()
    contiguous = dict(q=q, k_cache=torch.randn(3, 128, 2, 64, **dev).half(),
                      v_cache=torch.randn(3, 128, 2, 64, **dev).half(), k=k, v=v)
    paged = dict(contiguous, k_cache=torch.randn(10, 16, 2, 64, **dev).half(),
                 v_cache=torch.randn(10, 16, 2, 64, **dev).half(),
                 block_table=torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1]], dtype=torch.int32, **dev))

    def lens(*n):
        return torch.tensor(n, dtype=torch.int32, **dev)

    return {
        "contiguous-append": (dict(contiguous, cache_seqlens=lens(5, 127)), "k_cache holds 128"),
        "contiguous-attend": (dict(contiguous, k=None, v=None, cache_seqlens=lens(129, 0)), "k_cache holds 128"),
        "paged-append": (dict(paged, cache_seqlens=lens(63, 3)), "block_table reaches 64"),
        "paged-attend": (dict(paged, k=None, v=None, cache_seqlens=lens(65, 3)), "block_table reaches 64"),
        "paged-unallocated": (dict(paged, cache_seqlens=lens(3, 31)), "block_table[1, 2] = -1"),
        "batch-idx": (dict(contiguous, cache_seqlens=lens(5, 3), cache_batch_idx=lens(0, 3)), "cache_batch_idx[1] = 3"),
        "batch-idx-same": (dict(contiguous, cache_seqlens=lens(5, 3), cache_batch_idx=lens(2, 2)),
                           "would both append into sequence 2"),
        "leftpad": (dict(contiguous, cache_seqlens=lens(5, 3), cache_leftpad=lens(0, 4)), "cache_leftpad[1] = 4"),
        "leftpad-paged": (dict(paged, cache_seqlens=lens(5, 3), cache_leftpad=lens(-1, 0)), "cache_leftpad[0] = -1"),
    }


def test_overflow_raises_and_writes_nothing():
    for name, (kw, message) in _overflow_cases().items():
        before = kw["k_cache"].clone(), kw["v_cache"].clone()
        with pytest.raises(ValueError, match=re.escape(message)):
            flash_attn_with_kvcache(**kw)
        torch.cuda.synchronize()
        assert torch.equal(kw["k_cache"], before[0]) and torch.equal(kw["v_cache"], before[1]), name


def test_overflow_written_in_place_is_caught():
    """The first layer of a step plans (one device read of the lengths), later layers reuse the
    plan without reading anything; a length written in place is read and checked again."""
    kw, message = _overflow_cases()["paged-append"]
    kw["cache_seqlens"] = torch.tensor([10, 3], dtype=torch.int32, device="cuda")
    flash_attn_with_kvcache(**kw)
    torch.cuda.set_sync_debug_mode("error")  # any device -> host read now raises
    try:
        flash_attn_with_kvcache(**kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    kw["cache_seqlens"] += 53  # 63 + 2 > 64: on the device, in place
    before = kw["k_cache"].clone()
    with pytest.raises(ValueError, match=message):
        flash_attn_with_kvcache(**kw)
    assert torch.equal(kw["k_cache"], before)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_generate_steps_never_read_the_device(kind):
    """KVCache knows its lengths on the host: planning a step (reserving pages included) and running
    every layer never waits for the GPU (torch's sync debug mode raises on any device read)."""
    from flashtile import KVCache, PagedKVCache

    if kind == "paged":
        cache = PagedKVCache(64, 16, 4, 2, 128, num_layers=4, dtype=torch.float16, device="cuda")
    else:
        cache = KVCache(4, 512, 2, 128, num_layers=4, dtype=torch.float16, device="cuda")
    inputs = [(torch.randn(4, 1, 16, 128, device="cuda", dtype=torch.float16),
               *(torch.randn(4, 1, 2, 128, device="cuda", dtype=torch.float16) for _ in range(2))) for _ in range(4)]
    for layer in range(4):  # compiles the kernels (Triton reads the device while compiling)
        cache.attend(*inputs[layer], layer=layer, causal=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(40):
            for layer in range(4):
                cache.attend(*inputs[layer], layer=layer, causal=True)
            cache.advance(1 if step % 3 else [1, 2, 1, 3])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cache.seqlens.tolist() == cache.lengths


@pytest.mark.parametrize("d,page_size", [(128, 16), (64, 48)], ids=["d128-page16", "d64-page48"])
def test_unchecked_pages_in_a_cuda_graph(d, page_size):
    """test_unchecked_indices_in_a_cuda_graph over a paged cache (the Gluon split kernel on sm_90: a
    page index a warp at d=128, a page index a key at d=64 with 48-token pages): replayed after
    writing out-of-range lengths and page indices in place, nothing outside the pool is read into
    the output or written (NaN guard pages around it), and the valid rows still equal an eager call."""
    torch.manual_seed(0)
    b, h, hk, per_seq = 4, 16, 2, 8
    pages = b * per_seq
    whole_k = torch.full((pages + 2, page_size, hk, d), float("nan"), device="cuda", dtype=torch.float16)
    whole_v = whole_k.clone()
    k_cache, v_cache = whole_k[1:-1], whole_v[1:-1]
    k_cache.copy_(torch.randn_like(k_cache)), v_cache.copy_(torch.randn_like(v_cache))
    table = torch.randperm(pages, device="cuda").view(b, per_seq).int()
    seqlens = torch.tensor([100, 5 * page_size + 3, 7, 1], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(b, 1, hk, d, device="cuda", dtype=torch.float16) for _ in range(2))
    kw = dict(cache_seqlens=seqlens, block_table=table, num_splits=2)
    graph, out = capture(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw))
    seqlens.copy_(torch.tensor([100, 5 * page_size + 3, 2**31 - 1, -2**31], dtype=torch.int32))
    table[2].copy_(torch.tensor([-1, pages, 10**6, -2**31, 2**31 - 1, 0, 1, 2], dtype=torch.int32))
    table[3].fill_(pages + 1)
    k_ref, v_ref, table_ref = k_cache.clone(), v_cache.clone(), table[:2].clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert whole_k[[0, -1]].isnan().all() and whole_v[[0, -1]].isnan().all()
    want = flash_attn_with_kvcache(q[:2], k_ref, v_ref, k[:2], v[:2], cache_seqlens=seqlens[:2], block_table=table_ref,
                                   num_splits=2)
    torch.testing.assert_close(out[:2], want, atol=0, rtol=0)


def test_unchecked_indices_in_a_cuda_graph():
    """Captured with valid lengths, replayed after writing out-of-range values in place (nothing is
    checked on replay): the kernels clamp - no NaN from the guard rows around the cache, no write
    outside it, and the valid rows still equal an eager call."""
    torch.manual_seed(0)
    b, h, hk, d, capacity, guard = 4, 16, 2, 128, 1024, 64
    whole_k = torch.full((b + 2, capacity + 2 * guard, hk, d), float("nan"), device="cuda", dtype=torch.float16)
    whole_v = whole_k.clone()
    k_cache, v_cache = whole_k[1:-1, guard:-guard], whole_v[1:-1, guard:-guard]
    k_cache.copy_(torch.randn_like(k_cache)), v_cache.copy_(torch.randn_like(v_cache))
    seqlens = torch.tensor([100, 900, 5, 7], dtype=torch.int32, device="cuda")
    batch_idx = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device="cuda")
    leftpad = torch.zeros(4, dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(b, 1, hk, d, device="cuda", dtype=torch.float16) for _ in range(2))
    kw = dict(cache_seqlens=seqlens, cache_batch_idx=batch_idx, cache_leftpad=leftpad, num_splits=2)
    graph, out = capture(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw))
    seqlens.copy_(torch.tensor([100, 900, 2**31 - 1, -2**31], dtype=torch.int32))
    batch_idx.copy_(torch.tensor([0, 1, 7, -3], dtype=torch.int32))
    leftpad.copy_(torch.tensor([0, 0, -2**31, 2**31 - 1], dtype=torch.int32))
    inside = torch.zeros(whole_k.shape[:2], dtype=torch.bool, device="cuda")
    inside[1:-1, guard:-guard] = True
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert whole_k[~inside].isnan().all() and whole_v[~inside].isnan().all()
    assert (out[2:] == 0).all()  # cache_batch_idx outside k_cache: no keys
    want = flash_attn_with_kvcache(q[:2], k_ref, v_ref, k[:2], v[:2], cache_seqlens=seqlens[:2],
                                   cache_batch_idx=batch_idx[:2], cache_leftpad=leftpad[:2], num_splits=2)
    torch.testing.assert_close(out[:2], want, atol=0, rtol=0)
