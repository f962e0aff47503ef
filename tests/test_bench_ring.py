"""`flashtile bench ring` on the CPU with tiny shapes: the simulated schedules run through the ring's
own loops on the reference path, their output checked against one call, the rows' bookkeeping
(per-rank FLOPs from the plan, efficiencies), --append, the plot and the table; of --nccl, the
refusal without GPUs, the plot (with torch's context-parallel rows) and --long's check of sampled
rows against float64 (two gloo ranks). The GPU numbers come from the H100 and 2 x H200 (the
modules' docstrings have the commands)."""

import json
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashtile
from flashtile.bench import ring as bench
from flashtile.distributed import ring

ARGS = ["--device", "cpu", "--dtype", "float32", "--nheads", "2", "--headdim", "16", "--reps", "1"]


def _main(tmp_path, *argv):
    with flashtile.use_backend("reference"):
        bench.main([*ARGS, "--out", str(tmp_path), *argv])
    with open(tmp_path / "ring_1gpu.json") as f:
        return json.load(f)


def test_rows_flops_and_files(tmp_path):
    data = _main(tmp_path, "--tokens", "32", "--worlds", "2,4")
    assert data["complete"]
    rows = {(r["world_size"], r["causal"], r["layout"]): r for r in data["rows"]}
    assert set(rows) == {(w, c, l) for w in (2, 4) for c, l in ((False, "zigzag"), (True, "zigzag"),
                                                                (True, "contiguous"))}
    h, d, s = 2, 16, 32
    for (world, causal, layout), r in rows.items():
        pairs = s * (s + 1) // 2 if causal else s * s  # every (query, key) pair seen, exactly once
        assert sum(r["rank_flops"]) == 4 * h * d * pairs
        assert len(r["rank_fwd_ms"]) == len(r["rank_bwd_ms"]) == len(r["rank_kernels_fwd_ms"]) == world
        assert r["max_err_vs_kernel"] < 1e-5
        assert r["efficiency"] > 0 and r["parallel_efficiency"] > 0 and r["kernels_efficiency"] > 0
        assert r["efficiency"] == pytest.approx((r["kernel_fwd_ms"] + r["kernel_bwd_ms"]) / (r["fwd_ms"] + r["bwd_ms"]))
    for world in (2, 4):  # zigzag: equal causal work; contiguous: the last rank's share grows with world
        assert rows[world, True, "zigzag"]["flops_imbalance"] == 1.0
        assert rows[world, True, "contiguous"]["flops_imbalance"] > 1.4
    table = (tmp_path / "ring_1gpu.md").read_text()
    assert "| 4 | 32 | causal | contiguous |" in table
    assert (tmp_path / "ring_1gpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_append_keeps_other_shapes(tmp_path):
    _main(tmp_path, "--tokens", "16", "--worlds", "2", "--no-breakdown", "--no-plot")
    data = _main(tmp_path, "--tokens", "32", "--worlds", "2", "--no-breakdown", "--no-plot", "--append",
                 "--masks", "causal")
    assert sorted((r["total_tokens"], r["causal"]) for r in data["rows"]) == \
        [(16, False), (16, True), (16, True), (32, True), (32, True)]
    assert not (tmp_path / "ring_1gpu.png").exists()
    with pytest.raises(SystemExit):
        _main(tmp_path, "--masks", "causal,sliding")


def test_a_wrong_schedule_is_not_timed(tmp_path, monkeypatch):
    """The schedules' gathered output is checked against the one call before anything is timed."""
    real = ring.forward_step
    monkeypatch.setattr(ring, "forward_step", lambda r, step, *a: None if step == 1 else real(r, step, *a))
    with pytest.raises(AssertionError, match="the schedules' output is"):
        _main(tmp_path, "--tokens", "16", "--worlds", "2", "--no-plot")


def test_nccl_mode_needs_the_gpus_and_plots_its_rows(tmp_path, monkeypatch):
    """--nccl W: refused with a message on a machine with fewer GPUs; ring.json's rows plot (the
    two-GPU numbers come from the H200 machine: ring_nccl's docstring and the README)."""
    from flashtile.bench import ring_nccl

    monkeypatch.setattr(ring_nccl.torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit, match="--nccl 2 needs 2 GPUs, this machine has 0"):
        bench.main(["--nccl", "2", "--out", str(tmp_path)])
    rows = [dict(impl=impl, world_size=2, backend="nccl", total_tokens=t, causal=c,
                 fwd_tflops_per_gpu=500.0 + t / 1024, single_fwd_tflops=600.0, bwd_tflops_per_gpu=450.0,
                 single_bwd_tflops=520.0, efficiency=0.9)
            for t in (32768, 65536) for c in (False, True) for impl in ("flashtile", "torch_cp")]
    with open(tmp_path / "ring.json", "w") as f:
        json.dump({"env": {"gpu": "test GPU"}, "rows": rows}, f)
    bench.main(["--nccl", "2", "--out", str(tmp_path), "--plot-only"])
    assert (tmp_path / "ring.png").stat().st_size > 0


def _check_rows_rank(rank, world, init, out):
    """One rank of the --long check on the CPU: the ring (reference path, fp16, causal GQA) on
    zigzag shards, its sampled rows checked; then one of them made wrong in dQ."""
    from flashtile.bench import ring_nccl
    from flashtile.distributed import ring_flash_attn_func, shard_sequence

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(0)
        full = [torch.randn(1, 256, h, 16, generator=gen).half() for h in (4, 2, 2, 4)]
        q, k, v, dout = (shard_sequence(t, rank, world, layout="zigzag") for t in full)
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        with flashtile.use_backend("reference"):
            o, lse, _ = ring_flash_attn_func(q, k, v, causal=True, layout="zigzag", return_attn_probs=True)
            o.backward(dout)
        rows = torch.tensor([0, 1, 32, 63, 64, 96, 126, 127])
        result = {"right": ring_nccl._check_rows(q, k, v, dout, o.detach(), lse, rank, world, rows)}
        q.grad[0, 127, 0, 0] += 0.25
        result["wrong"] = ring_nccl._check_rows(q, k, v, dout, o.detach(), lse, rank, world, rows)
        torch.save(result, f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_long_checks_rows_against_float64():
    """--long's check: out, LSE and dQ of sampled rows within the 2x rule of the baseline (the
    same rows in fp16, as reference.naive computes), and a wrong dQ element is seen."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_check_rows_rank, (2, f"{tmp}/init", f"{tmp}/errs"), nprocs=2)
        results = [torch.load(f"{tmp}/errs-{r}.pt") for r in range(2)]
    for result in results:
        for name, (err, base) in result["right"].items():
            assert 0 < base and err <= 2 * base + 1e-5, (name, err, base)
        assert result["wrong"]["dq"][0] >= 0.2 > 2 * result["wrong"]["dq"][1]
