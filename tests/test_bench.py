"""The benchmark drivers' bookkeeping, on the CPU: rows, FLOP formulas, per-row failures, the result
file rewritten after every row, --no-plot. Timing and kernels are replaced by fakes here; the real
numbers come from the GPU (scripts/gpu_check.sh bench)."""

import argparse
import json
import os

import pytest
import torch

from flashtile.bench import decode, harness, prefill, prefill_report

CEILINGS = {"copy_GBps": 3000.0, "matmul_bf16_TFLOPs": 700.0}


def _prefill_args(**kw):
    args = dict(dtype="bfloat16", peers=["flashtile", "sdpa-flash", "cudnn"],
                headdims=[64], seqlens=[1024], tokens=4096, flex_headdims=[128], flex_seqlens=[2048],
                sections=["dense"], dropout_p=0.1, dropout_seqlens=[1024], varlen_lengths=[128, 4096])
    args.update(kw)
    return argparse.Namespace(**args)


def test_prefill_rows_flops_failures_and_partial_file(tmp_path, monkeypatch):
    path = str(tmp_path / "prefill.json")
    names = {}

    def fake_impls(peers):
        table = {}
        for n in peers:
            def fn(q, k, v, causal):
                raise AssertionError("measure is faked")
            names[fn] = n
            table[n] = fn
        return table

    seen = []

    def fake_measure(fn, batch, seqlen, nheads, d, causal, dtype, ref_out=None):
        name = names[fn]
        if seen:  # every earlier row is already on disk
            with open(path) as f:
                data = json.load(f)
            assert data["complete"] is False and len(data["rows"]) == len(seen)
        seen.append((name, causal))
        assert (ref_out is None) == (name == "sdpa-flash")
        if name == "cudnn" and causal:
            raise RuntimeError("No available kernel")
        return 2.0, 4.0, 100.0, 0.0

    monkeypatch.setattr(prefill, "implementations", fake_impls)
    monkeypatch.setattr(prefill, "measure", fake_measure)
    monkeypatch.setattr(harness, "ceilings", lambda: CEILINGS)
    result = prefill.run(_prefill_args(), path)

    assert result["complete"] and len(result["rows"]) == 6 and len(seen) == 6
    errors = [r for r in result["rows"] if "error" in r]
    assert [(r["impl"], r["causal"]) for r in errors] == [("cudnn", True)]
    b, h, s, d = 4, 2048 // 64, 1024, 64
    for r in result["rows"]:
        if "error" in r:
            continue
        f = 4 * b * h * s * s * d / (2 if r["causal"] else 1)
        assert r["fwd_tflops"] == pytest.approx(f / 2.0e-3 / 1e12)
        assert r["bwd_tflops"] == pytest.approx(2.5 * f / 4.0e-3 / 1e12)
    with open(path) as f:
        assert len(json.load(f)["rows"]) == 6


@pytest.mark.parametrize("cudnn_dropout", [True, False], ids=["cudnn-dropout", "cudnn-without"])
def test_prefill_dropout_section_rows(tmp_path, monkeypatch, cudnn_dropout):
    """p = 0 and p = args.dropout_p rows for flashtile, SDPA-flash and cuDNN, the ratio on the
    second; a peer that fails with dropout is left out of the ratios (its p = 0 row stays)."""

    def fake_measure(fn, batch, seqlen, nheads, d, causal, dtype, ref_out=None):
        name, p = fn
        if name == "cudnn" and p > 0 and not cudnn_dropout:
            raise RuntimeError("No available kernel")
        return (2.5, 5.0, 10.0, None) if p > 0 else (2.0, 4.0, 10.0, None)

    monkeypatch.setattr(prefill, "measure", fake_measure)
    monkeypatch.setattr(prefill, "_with_dropout", lambda name, p: (name, p))
    monkeypatch.setattr(harness, "ceilings", lambda: CEILINGS)
    result = prefill.run(_prefill_args(sections=["dropout"]), str(tmp_path / "prefill.json"))
    rows = result["rows"]
    assert len(rows) == (12 if cudnn_dropout else 10) and {r["section"] for r in rows} == {"dropout"}
    ratios = [(r["impl"], r["fwd_bwd_vs_no_dropout"]) for r in rows if "fwd_bwd_vs_no_dropout" in r]
    impls = ["flashtile", "sdpa-flash"] + (["cudnn"] if cudnn_dropout else [])
    assert ratios == [(name, pytest.approx(1.25)) for _ in range(2) for name in impls]
    table = prefill_report._section_summary(result)
    assert "| 0.1 | flashtile | 64 | no | 1024 | 1.250x |" in table
    assert ("| 0.1 | cudnn | 64 | no | 1024 | 1.250x |" in table) == cudnn_dropout


def test_prefill_softcap_section_rows(tmp_path, monkeypatch):
    """Capped rows of flashtile, its Triton kernels and FlexAttention (FA4 skipped when it does not
    import), each checked against the Triton kernels, then flashtile without a cap; the table's
    ratios."""
    times = {("flashtile", 50.0): (1.0, 2.0), ("flashtile-triton", 50.0): (2.0, 4.0), ("flex", 50.0): (3.0, 6.0),
             ("flashtile", 0.0): (0.8, 1.6)}

    def fake_measure(fn, batch, seqlen, nheads, d, causal, dtype, ref_out=None):
        assert (ref_out is None) == (fn[1] == 0)
        return (*times[fn], 10.0, 0.0)

    monkeypatch.setattr(prefill, "_fa4", lambda: None)
    monkeypatch.setattr(prefill, "measure", fake_measure)
    monkeypatch.setattr(prefill, "_with_softcap", lambda name, cap, fa4=None: (name, cap))
    monkeypatch.setattr(harness, "ceilings", lambda: CEILINGS)
    result = prefill.run(_prefill_args(sections=["softcap"], softcap=50.0, softcap_headdims=[128],
                                       softcap_seqlens=[4096]), str(tmp_path / "prefill.json"))
    rows = result["rows"]
    assert [(r["impl"], r["softcap"]) for r in rows[:4]] == list(times)
    assert len(rows) == 8 and {r["section"] for r in rows} == {"softcap"}
    table = "\n".join(prefill_report._section_summary(result))
    assert "| 50.0 | 128 | no | 4096 | 137 / 69 / 46 | 172 / 86 / 57 | 2.00x faster | 1.250x |" in table, table


def test_prefill_alibi_section_rows(tmp_path, monkeypatch):
    """ALiBi rows of flashtile, its Triton kernels, SDPA with a bias mask and FlexAttention, each
    checked against the Triton kernels, then flashtile without ALiBi; the table's ratios. The
    slopes: 2^(-8 (i + 1) / h)."""
    times = {("flashtile", True): (1.0, 2.0), ("flashtile-triton", True): (2.0, 4.0), ("sdpa-bias", True): (4.0, 8.0),
             ("flex", True): (3.0, 6.0), ("flashtile", False): (0.9, 1.8)}

    def fake_measure(fn, batch, seqlen, nheads, d, causal, dtype, ref_out=None):
        assert (ref_out is None) == (not fn[1])
        return (*times[fn], 10.0, 0.0)

    monkeypatch.setattr(prefill, "measure", fake_measure)
    monkeypatch.setattr(prefill, "_with_alibi", lambda name, on: (name, on))
    monkeypatch.setattr(harness, "ceilings", lambda: CEILINGS)
    result = prefill.run(_prefill_args(sections=["alibi"], alibi_headdims=[128], alibi_seqlens=[4096]),
                         str(tmp_path / "prefill.json"))
    rows = result["rows"]
    assert [(r["impl"], r["alibi"]) for r in rows[:5]] == list(times)
    assert len(rows) == 10 and {r["section"] for r in rows} == {"alibi"}
    table = "\n".join(prefill_report._section_summary(result))
    assert "| yes | 128 | no | 4096 | 137 / 69 / 46 / 34 | 172 / 86 / 57 / 43 | 2.00x faster | 1.111x |" in table, table
    assert prefill.alibi_slopes(8, "cpu").tolist() == [2.0 ** -i for i in range(1, 9)]


def test_varlen_lengths_and_interpolation():
    lengths = prefill.varlen_lengths(16384, 128, 4096)
    assert sum(lengths) == 16384 and all(1 <= n <= 4096 for n in lengths) and min(lengths[:-1]) >= 128
    assert prefill.varlen_lengths(16384, 128, 4096) == lengths  # seeded
    points = {128: 100.0, 256: 200.0, 1024: 300.0}
    assert prefill._interp_log2(points, 181) == pytest.approx(100.0 + 100.0 * 0.5, rel=1e-2)
    assert prefill._interp_log2(points, 512) == pytest.approx(250.0)
    assert prefill._interp_log2(points, 64) == 100.0 and prefill._interp_log2(points, 4096) == 300.0


def test_prefill_no_plot_writes_table_only(tmp_path, capsys):
    rows = [dict(impl=impl, d=128, causal=False, seqlen=4096, batch=4, nheads=16, fwd_ms=1.0,
                 bwd_ms=2.0, fwd_tflops=tf, bwd_tflops=tf / 2, peak_mem_mb=10.0, max_err_vs_sdpa_flash=0.0)
            for impl, tf in (("flashtile", 400.0), ("sdpa-flash", 320.0), ("cudnn", 600.0))]
    env = dict(gpu="test", torch="x", triton="y", date="today", command="cmd")
    harness.write_result(str(tmp_path / "prefill.json"), dict(env=env, ceilings=CEILINGS, dtype="bfloat16",
                                                              tokens=16384, rows=rows))
    prefill.main(["--out", str(tmp_path), "--plot-only", "--no-plot"])
    assert sorted(os.listdir(tmp_path)) == ["prefill.json", "prefill.md"]
    table = (tmp_path / "prefill.md").read_text()
    assert "| 128 | no | 4096 | 400 / 320 / 600 | 1.25x | 0.67x |" in table


def _dense_row(impl, d, causal, seqlen, fwd, bwd, mem=10.0):
    return dict(impl=impl, d=d, causal=causal, seqlen=seqlen, batch=16384 // seqlen, nheads=2048 // d,
                fwd_ms=1.0, bwd_ms=2.0, fwd_tflops=fwd, bwd_tflops=bwd, peak_mem_mb=mem, max_err_vs_sdpa_flash=0.0)


def test_prefill_summary_and_plot_with_fa4_and_triton_rows(tmp_path):
    """Every new peer in the table and the plots; "vs best of cuDNN, FA4" is flashtile over the
    faster of the two at that shape (FA4-det is not in the best: it is FA4's slower, like-for-like mode),
    and a peer without a row at some shape leaves "-" instead of dropping flashtile's row."""
    tf = {  # (d, causal) -> impl -> (fwd, bwd) TFLOP/s at seqlen 4096
        (128, False): {"flashtile": (500.0, 300.0), "flashtile-triton": (450.0, 300.0), "sdpa-flash": (350.0, 250.0),
                       "cudnn": (480.0, 400.0), "fa4": (560.0, 380.0), "fa4-det": (555.0, 290.0),
                       "flashtile-det": (500.0, 270.0)},  # deterministic=True ran at this shape only
        (128, True): {"flashtile": (420.0, 240.0), "flashtile-triton": (350.0, 240.0), "sdpa-flash": (300.0, 200.0),
                      "fa4": (400.0, 250.0), "fa4-det": (398.0, 220.0)},  # cuDNN failed here
    }
    rows = [_dense_row(impl, d, causal, 4096, *v) for (d, causal), impls in tf.items() for impl, v in impls.items()]
    rows.append(dict(impl="cudnn", d=128, causal=True, seqlen=4096, error="No available kernel"))
    env = dict(gpu="test", torch="x", triton="y", date="today", command="cmd")
    path = str(tmp_path / "prefill.json")
    harness.write_result(path, dict(env=env, ceilings=CEILINGS, dtype="bfloat16", tokens=16384, rows=rows))

    table = prefill_report.summary(path)
    head, rule, non_causal, causal = table.splitlines()[:4]
    cols = [c.strip() for c in head.strip("|").split("|")]
    assert cols[3] == "fwd flashtile / FA2 / cuDNN / FA4 / FA4-det / flashtile-det / Triton (TFLOP/s)"
    assert rule.count("---") == len(cols) == 20
    cells = dict(zip(cols, (c.strip() for c in non_causal.strip("|").split("|"))))
    assert cells[cols[3]] == "500 / 350 / 480 / 560 / 555 / 500 / 450"
    assert cells["bwd vs flashtile-det"] == f"{300 / 270:.2f}x"
    assert cells["fwd vs FA4"] == f"{500 / 560:.2f}x" and cells["fwd vs Triton"] == f"{500 / 450:.2f}x"
    assert cells["fwd vs best of cuDNN, FA4"] == f"{500 / 560:.2f}x (FA4)" == "0.89x (FA4)"
    assert cells["bwd vs best of cuDNN, FA4"] == f"{300 / 400:.2f}x (cuDNN)" == "0.75x (cuDNN)"
    assert cells["bwd vs FA4-det"] == f"{300 / 290:.2f}x"
    cells = dict(zip(cols, (c.strip() for c in causal.strip("|").split("|"))))
    assert cells["fwd vs cuDNN"] == "-" and cells["fwd vs best of cuDNN, FA4"] == f"{420 / 400:.2f}x (FA4)"
    bwd = cells["bwd flashtile / FA2 / cuDNN / FA4 / FA4-det / flashtile-det / Triton"]
    assert bwd == "240 / 200 / - / 250 / 220 / - / 240"
    assert prefill_report.best_peer({("cudnn", 64, False, 1): {"fwd_tflops": 1.0}}, (64, False, 2), "fwd") is None

    names = [os.path.basename(p) for p in prefill_report.plot(path, str(tmp_path))]
    assert names == ["prefill.png", "prefill_memory.png"]
    assert all((tmp_path / n).stat().st_size > 0 for n in names)


def test_prefill_triton_peer_restores_the_hopper_dispatch(monkeypatch):
    """flashtile-triton measures under a context in which both Hopper dispatches answer None (the
    forward's and the backward's, which runs after the forward's call), and which puts the
    originals back when the block ends and when it raises."""
    from flashtile.ops import configs

    monkeypatch.setattr(configs, "hopper_forward_config", lambda *a, **kw: "forward tiles", raising=False)
    monkeypatch.setattr(configs, "hopper_backward_config", lambda *a, **kw: "backward tiles", raising=False)
    saved = configs.hopper_forward_config, configs.hopper_backward_config
    context = prefill.PEER_CONTEXTS["flashtile-triton"]
    with context():
        assert configs.hopper_forward_config(64) is None and configs.hopper_backward_config(64) is None
    assert (configs.hopper_forward_config, configs.hopper_backward_config) == saved
    with pytest.raises(RuntimeError, match="kernel failed"), context():
        raise RuntimeError("kernel failed")
    assert (configs.hopper_forward_config, configs.hopper_backward_config) == saved
    assert set(prefill.PEER_CONTEXTS) <= set(prefill.PEERS)


def test_prefill_fa4_skipped_without_flash_attn_cute(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # `from flash_attn.cute import ...` fails
    assert prefill._fa4() is None
    asked = list(prefill.PEERS)
    assert "fa4" in asked and "fa4-det" in asked  # in the default --peers
    assert prefill.available_peers(asked) == [p for p in asked if p not in ("fa4", "fa4-det")]
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "fa4, fa4-det skipped" in out
    assert prefill.available_peers(["flashtile", "cudnn"]) == ["flashtile", "cudnn"]
    assert capsys.readouterr().out == ""
    assert prefill.available_peers(asked, fa4=lambda *a, **kw: None) == asked  # FA4 present: kept


def test_prefill_dense_without_fa4_runs_the_other_peers(tmp_path, monkeypatch, capsys):
    """The default peers (flex aside) through run() with flash_attn.cute absent: no FA4 row and no
    error row, every peer but SDPA-flash checked against SDPA-flash."""
    import sys

    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    refs = []

    def fake_measure(fn, batch, seqlen, nheads, d, causal, dtype, ref_out=None):
        refs.append(ref_out is not None)
        return 2.0, 4.0, 100.0, 0.0

    monkeypatch.setattr(prefill, "measure", fake_measure)
    monkeypatch.setattr(harness, "ceilings", lambda: CEILINGS)
    peers = [p for p in prefill.PEERS if p != "flex"]
    result = prefill.run(_prefill_args(peers=peers), str(tmp_path / "prefill.json"))
    impls = [r["impl"] for r in result["rows"]]
    assert impls == ["flashtile", "flashtile-det", "flashtile-triton", "sdpa-flash", "cudnn", "mem-efficient"] * 2
    assert refs == [True, True, True, False, True, True] * 2
    assert not any("error" in r for r in result["rows"])
    assert "fa4, fa4-det skipped" in capsys.readouterr().out


def test_prefill_plot_with_no_successful_row(tmp_path):
    path = str(tmp_path / "prefill.json")
    harness.write_result(path, dict(env={}, ceilings=CEILINGS, dtype="bfloat16", tokens=16384,
                                    rows=[dict(impl="flashtile", d=64, causal=False, seqlen=512, error="x")]))
    assert prefill_report.plot(path, str(tmp_path)) == []


def test_decode_row_failure_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    path = str(tmp_path / "decode.json")

    def broken(q, k, v):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(decode, "DEVICE", "cpu")
    monkeypatch.setattr(decode, "ROTATION_BYTES", 1)
    monkeypatch.setattr(decode, "cases", lambda quick, sqs: [(2, 64, 4, 2, 1), (1, 128, 4, 2, 1), (1, 128, 4, 2, 4)])
    monkeypatch.setattr(decode, "implementations", lambda *a, **kw: {
        "eager": (decode._eager, None), "sdpa-gqa": (decode._sdpa_gqa, None), "flashtile": (broken, None)})
    monkeypatch.setattr(decode, "chosen_splits", lambda *a, **kw: 3)
    monkeypatch.setattr(harness, "wall_us", lambda call, n=50, warmup=0: 2.0)
    monkeypatch.setattr(harness, "bench_ms", lambda fn, warmup=25, rep=100: (fn(), 0.001)[1])
    monkeypatch.setattr(harness, "ceilings", lambda: CEILINGS)
    args = argparse.Namespace(dtype="float32", quick=True, impls=list(decode.IMPLS), tolerance=1e-3, sq=[4])
    result = decode.run(args, path)

    # sq = 4: the eager peer is not among SQ_IMPLS
    assert result["complete"] and [(r["impl"], r["sq"]) for r in result["rows"]][-2:] == [("sdpa-gqa", 4),
                                                                                         ("flashtile", 4)]
    assert len(result["rows"]) == 8
    assert [r["impl"] for r in result["rows"] if "error" in r] == ["flashtile"] * 3
    assert all(r["us"] == pytest.approx(1.0) for r in result["rows"] if "error" not in r)
    assert len(result["failed"]) == 3  # main() exits non-zero after writing the file
    with open(path) as f:
        assert len(json.load(f)["rows"]) == 8


def test_decode_cases():
    rows = decode.cases(False, [2, 16])
    assert rows[:len(decode.SEED_SHAPES)] == [(b, ctx, 16, 2, 1) for b, ctx in decode.SEED_SHAPES]
    n = len(decode.SEED_SHAPES)
    assert rows[n] == (*decode.LLAMA_SHAPE, 32, 8, 1)
    assert rows[n + 1:n + 3] == [(64, 1024, 16, 2, 1), (1, 32768, 32, 8, 1)]  # issue 11's table
    assert rows[n + 3:] == [(*s, sq) for s in decode.SQ_SHAPES for sq in (2, 16)]
    assert [r[-1] for r in decode.cases(True, [])] == [1, 1, 1]


def test_decode_sweep_of_the_warp_kernel_keeps_its_choice_and_splits():
    """--sweep-kernel warps: the sweep's tile (keys a warp, warps, stages) replaces the Gluon
    kernel's tiles, but where and with how many splits it runs stay configs.decode_warp_tiles'."""
    from flashtile.ops import configs

    def real(rows, d, dtype, device, kv_rows, max_keys, num_splits):
        return (configs.BlockConfig(8, 64, 4, 3), num_splits or 66) if kv_rows <= 132 else None

    tiles = decode._warp_tiles_as(real, (32, 8, 2))
    assert tiles(8, 128, None, None, 2, 131072, 0) == (configs.BlockConfig(8, 256, 8, 2), 66)
    assert tiles(8, 128, None, None, 2, 131072, 132) == (configs.BlockConfig(8, 256, 8, 2), 132)
    assert tiles(8, 128, None, None, 512, 256, 0) is None
    assert decode._warp_tiles_as(real, None)(8, 128, None, None, 2, 1, 0) == real(8, 128, None, None, 2, 1, 0)


@pytest.mark.interpret
def test_decode_rows_agree_on_cpu(tmp_path, monkeypatch):
    """The real implementations on tiny CPU shapes (kernels under the interpreter, timing faked):
    flashtile, the plan, the paged cache and the appending calls agree with the reference for one
    query row and for sq = 3 with the bottom-right causal mask, SDPA's CausalBias included; every
    plot is drawn."""
    path = str(tmp_path / "decode.json")
    monkeypatch.setattr(decode, "DEVICE", "cpu")
    monkeypatch.setattr(decode, "ROTATION_BYTES", 1)
    monkeypatch.setattr(decode, "HEADDIM", 32)
    monkeypatch.setattr(decode, "cases", lambda quick, sqs: [(2, 64, 16, 2, 1)] + [(2, 64, 16, 2, sq) for sq in sqs])
    monkeypatch.setattr(harness, "wall_us", lambda call, n=50, warmup=0: (call(), 2.0)[1])
    monkeypatch.setattr(harness, "bench_ms", lambda fn, warmup=25, rep=100: (fn(), 0.001)[1])
    monkeypatch.setattr(harness, "ceilings", lambda: CEILINGS)
    impls = ["sdpa-gqa", "flashtile", "flashtile-plan", "flashtile-page16", "sdpa-gqa-append", "flashtile-append",
             "flashtile-plan-append", "flashtile-page16-append"]
    args = argparse.Namespace(dtype="float32", quick=True, impls=impls, tolerance=1e-4, sq=[3])
    result = decode.run(args, path)

    assert result["failed"] == []
    errors = {(r["impl"], r["sq"]): r["max_err_vs_sdpa"] for r in result["rows"] if "max_err_vs_sdpa" in r}
    assert set(errors) == {("flashtile", 1), ("flashtile-plan", 1), ("flashtile-page16", 1), ("flashtile-append", 1),
                           ("flashtile-plan-append", 1), ("flashtile-page16-append", 1), ("flashtile", 3),
                           ("flashtile-plan", 3)}
    assert all(0 < e < 1e-4 for e in errors.values())
    assert all("us" in r and "loop_us" in r and "graph_error" in r for r in result["rows"])  # no CUDA graphs
    harness.write_result(path, result)
    names = [os.path.basename(p) for p in decode.plot(path, str(tmp_path))]
    assert names == ["decode_latency.png", "decode_bandwidth.png", "decode_sq.png"]


def test_profile_host_runs_every_row_on_the_cpu(tmp_path):
    """scripts/profile_host.py (issue 11's host-path pieces) on the CPU, launches stubbed: every row
    times, none fails (its stubs must follow the launch and check signatures)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "profile_host.txt"
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"))
    run = subprocess.run([sys.executable, os.path.join(root, "scripts", "profile_host.py"), str(out)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    text = out.read_text()
    assert "us/call" in text and "failed" not in text, text


def test_synchronisations_counts_where_they_happen(monkeypatch):
    """harness.synchronisations counts the sync-debug-mode warnings fn() raises by the caller that
    raised them, with the debug mode switched on around fn only (and off again if fn raises).
    torch's CUDA calls are stood in for on the CPU."""
    import warnings

    import torch

    modes = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def reads_the_device():
        warnings.warn("called a synchronizing CUDA operation", UserWarning)

    def step():
        for _ in range(3):
            reads_the_device()
        warnings.warn("called a synchronizing CUDA operation", UserWarning)

    found = harness.synchronisations(step)
    assert modes == [1, 0]
    assert sorted(found.values()) == [1, 3] and all(where.startswith("test_bench.py:") for where in found)
    assert any(where.startswith("test_bench.py:reads_the_device <- test_bench.py:step") for where in found)

    def fails():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        harness.synchronisations(fails)
    assert modes == [1, 0, 1, 0]


@pytest.mark.cuda
def test_replay_ms_times_the_graph_back_to_back():
    """harness.replay_ms, bench decode's device time: a graph of four 256 MB copies over distinct
    buffers (1 GB in all, past L2) takes four times one copy's graph, and one copy reads what
    do_bench gives it, to within the flush's cost and the spread of a busy GPU (do_bench's flush
    before each run, ~9 us on the H200, is ~7% of this copy's ~120 us)."""
    n = 256 * 2**20
    src = [torch.randn(n // 4, device="cuda") for _ in range(4)]
    dst = [torch.empty_like(s) for s in src]
    one, _ = harness.capture(lambda: dst[0].copy_(src[0]))
    four, _ = harness.capture(lambda: [d.copy_(s) for d, s in zip(dst, src)])
    t1, t4 = harness.replay_ms(one), harness.replay_ms(four)
    assert 3.6 < t4 / t1 < 4.4, (t1, t4)
    assert 0.85 < t1 / harness.bench_ms(one.replay) < 1.1


def test_prefill_small_section_rows_and_targets(tmp_path, monkeypatch):
    """The small section: a row per implementation and shape (flashtile with its host times), a
    peer that fails recorded with its error, and the summary's targets read from the rows: the
    forward loop against 1.1x its graph or SDPA's loop, forward + backward against FA4's and 1.25x
    SDPA-flash's."""
    from flashtile.bench import small

    monkeypatch.setattr(small, "SHAPES", ((8, 64, 2, 16, True), (4, 32, 2, 16, False)))
    monkeypatch.setattr(small, "VARLEN_SHAPES", ((8, 64, 2, 16, True),))
    monkeypatch.setattr(harness, "fa4_module", lambda: "fa4")
    timings = {"flashtile": (100.0, 95.0, 300.0), "sdpa-flash": (90.0, 88.0, 250.0), "fa4": (120.0, 90.0, 290.0)}

    def fake_impls(varlen, fa4):
        names = ["flashtile", "fa4"] if varlen else ["flashtile", "sdpa-flash", "fa4"]
        return {n: n for n in names}

    def fake_calls(name, inputs, dout):
        if name == "fa4" and inputs[0].dim() == 3:
            raise RuntimeError("no varlen kernel")
        loop, graph, both = timings[name]
        return ("fwd", loop, graph), ("fwd_bwd", both, both - 40)

    monkeypatch.setattr(small, "implementations", fake_impls)
    monkeypatch.setattr(small, "_calls", fake_calls)
    monkeypatch.setattr(small, "_loop_us", lambda call: call[1])
    monkeypatch.setattr(small, "_graph_us", lambda call: call[2])
    monkeypatch.setattr(small, "launches_stubbed", lambda: __import__("contextlib").nullcontext())
    monkeypatch.setattr(harness, "ceilings", lambda: CEILINGS)
    arange = torch.arange
    monkeypatch.setattr(torch, "randn", lambda *shape, **kw: torch.zeros(*shape))  # the inputs, on the CPU
    monkeypatch.setattr(torch, "arange", lambda *a, device=None, **kw: arange(*a, **kw))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    result = prefill.run(_prefill_args(sections=["small"]), str(tmp_path / "prefill.json"))
    rows = result["rows"]
    assert len(rows) == 3 + 3 + 2 and {r["section"] for r in rows} == {"small"}
    ours = [r for r in rows if r["impl"] == "flashtile"]
    assert all(r["host_fwd_us"] == 100.0 and r["host_bwd_us"] == 200.0 for r in ours)
    assert [r["error"] for r in rows if "error" in r] == ["RuntimeError('no varlen kernel')"]
    table = "\n".join(prefill_report._section_summary(result))
    # fwd loop 100 <= 1.1 x graph 95: met; fwd + bwd 300 > 1.25 x SDPA's 250 (312.5)? met, > FA4's 290: missed
    assert "| 8, 64, 2, 16 | 100 / 95 | 120 / 90 | 90 / 88 | 300 / 260 | 290 | 250 | 100 / 200 | met | missed |" in table
    # the packed rows beside SDPA on the same tokens as a dense batch
    assert "| varlen 8, 64, 2, 16 | 100 / 95 | - | 90 / 88 | 300 / 260 | - | 250 | 100 / 200 | met | met |" in table


def test_launches_stubbed_reaches_every_kernel_module(monkeypatch):
    """bench.small.launches_stubbed makes the cached launches of every kernel a no-op while it runs
    and restores them after: the portable and the Hopper kernels of each pass, the delta kernel
    and both split kernels (it once looked in forward, backward and decode only, so the Hopper
    kernels kept launching in the 'launches stubbed' rows)."""
    from flashtile.bench import small
    from flashtile.ops import backward, backward_sm90, decode, decode_sm90, forward, forward_sm90, preprocess

    def run(*args):
        raise AssertionError("a real launch inside launches_stubbed")

    kernels = [forward._fwd_kernel, forward_sm90._fwd_kernel_sm90, backward._bwd_kernel,
               backward_sm90._bwd_kernel_sm90, preprocess._delta_kernel, decode._split_kernel,
               decode_sm90._split_kernel_warps, decode._combine_kernel]
    for k in kernels:
        monkeypatch.setattr(k, "_flashtile_launches", {"key": (run, "function", (), (), None)}, raising=False)
    # an unaligned twin (for_strides) compiles through Triton only: its launches live in its kernel's cache
    monkeypatch.setattr(forward._fwd_kernel, "_flashtile_unaligned", object(), raising=False)
    with small.launches_stubbed():
        for k in kernels:
            k._flashtile_launches["key"][0]("grid", "stream")  # the no-op
    assert all(k._flashtile_launches["key"][0] is run for k in kernels)
