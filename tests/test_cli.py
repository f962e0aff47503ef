"""The `flashtile` command: analyze (table, JSON, plot), bench dispatch, demo end to end, bad arguments."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from flashtile import cli


def _run_cli(*args):
    """`flashtile ARGS` in a fresh interpreter (nothing imported yet, TRITON_INTERPRET unset)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import sys; from flashtile.cli import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_analyze_json(capsys):
    assert cli.main(["analyze", "--seqlen", "2048", "--headdim", "128", "--dtype", "float32",
                     "--sram", "196608", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    n, d = 2048, 128
    for name in ("standard", "fa1", "fa2", "decoding"):
        assert {"flops", "hbm_bytes", "arithmetic_intensity", "roofline_s", "bound"} <= set(out[name])
    assert out["standard"]["flops"] == 4 * n * n * d
    assert out["standard"]["hbm_bytes"] == 4 * (4 * n * n + 4 * n * d)
    assert (out["fa1"]["block_r"], out["fa1"]["block_c"]) == (96, 96)
    assert out["decoding"]["flops"] == 4 * n * d
    assert out["inputs"]["gpu"]["name"] == "NVIDIA H100 SXM"


def test_analyze_table_and_plot(tmp_path, capsys):
    png = tmp_path / "io.png"
    assert cli.main(["analyze", "--seqlen", "4096", "--headdim", "64", "--sram", "196608", "--gpu", "a100",
                     "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    for name in ("standard", "fa1", "fa2", "decoding", "NVIDIA A100"):
        assert name in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


@pytest.mark.parametrize("argv, match", [
    pytest.param(["analyze", "--seqlen", "-5", "--headdim", "64", "--sram", "1024"],
                 "--seqlen: must be a positive integer, got -5", id="negative-seqlen"),
    pytest.param(["analyze", "--seqlen", "abc", "--headdim", "64", "--sram", "1024"],
                 "--seqlen: must be a positive integer, got 'abc'", id="seqlen-not-int"),
    pytest.param(["analyze", "--seqlen", "64", "--headdim", "64", "--sram", "0"], "--sram", id="sram-0"),
    pytest.param(["analyze", "--seqlen", "64", "--headdim", "64", "--sram", "1024", "--dtype", "int8"],
                 "--dtype: invalid choice: 'int8'", id="unknown-dtype"),
    pytest.param(["analyze", "--seqlen", "64", "--headdim", "64", "--sram", "1024", "--gpu", "v100"],
                 "--gpu: invalid choice: 'v100'", id="unknown-gpu"),
    pytest.param(["analyze", "--seqlen", "64", "--headdim", "64"], "--sram", id="missing-sram"),
    pytest.param(["analyze", "--seqlen", str(1 << 40), "--headdim", "64", "--sram", "1024"],
                 "--seqlen: must be at most 2^30", id="seqlen-past-2^30"),
    pytest.param(["analyze", "--seqlen", "64", "--headdim", "64", "--sram", "1024", "--dtype", "float32",
                  "--gpu", "h100-measured"], "no float32 compute ceiling", id="measured-gpu-fp32"),
    pytest.param(["demo", "--seqlens", "0"], "--seqlens: must be a positive integer", id="demo-seqlen-0"),
    pytest.param(["demo", "--dtypes", "float8"], "--dtypes: invalid choice", id="demo-dtype"),
    pytest.param(["bench", "no_such_bench"], "no benchmark named 'no_such_bench'", id="bench-unknown"),
    pytest.param(["bench", "../etc"], "no benchmark named '../etc'", id="bench-path"),
    pytest.param(["bench", "harness"], "has no main", id="bench-not-a-benchmark"),
    pytest.param(["frobnicate"], "invalid choice: 'frobnicate'", id="unknown-command"),
    pytest.param([], "required", id="no-command"),
])
def test_bad_arguments_give_clear_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


def test_bench_calls_the_module_main_with_the_rest_of_the_arguments(monkeypatch):
    seen = []
    fake = types.ModuleType("flashtile.bench.fake_bench")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "flashtile.bench.fake_bench", fake)
    assert cli.main(["bench", "fake_bench", "--seqlen", "4096", "--causal"]) == 0
    assert seen == [["--seqlen", "4096", "--causal"]]


def test_parser_and_demo_module_do_not_import_triton():
    """`flashtile demo` sets TRITON_INTERPRET itself, which only works if triton is not loaded yet."""
    code = ("import sys; from flashtile import cli; cli.build_parser(); "
            "sys.exit('triton' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_demo_end_to_end():
    result = _run_cli("demo", "--seqlens", "32", "--dtypes", "float32", "--repeats", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for impl in ("torch, S and P in memory", "reference.fa1", "reference.fa2", "reference.decoding"):
        assert impl in out
    if torch.cuda.is_available():
        assert "torch SDPA" in out.split("ran:")[1].splitlines()[0]
    else:
        assert "Triton interpreter (TRITON_INTERPRET=1" in out  # the demo switched it on itself
        assert "not run: torch SDPA (prefill): needs a CUDA GPU" in out
    assert "all checks passed" in out


def test_demo_model_end_to_end():
    """`flashtile demo --model`: the GPT's three attention paths, logits against eager, a training
    step, generation with every cache; on a CPU in seconds (flashtile's reference path)."""
    result = _run_cli("demo", "--model", "--repeats", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    table = out.split("max |dlogit|")[1]
    for name in ("eager", "sdpa", "flashtile", "KVCache", "PagedKVCache"):
        assert name in table
    assert "max |dlogit|" in out and "gen tok/s" in out
    if torch.cuda.is_available():
        assert "KVCache + CUDA graph" in table
    else:
        assert "its PyTorch reference path (no GPU)" in out and "all paths agree" in out


@pytest.mark.parametrize("module", ["flashtile.cli", "flashtile"])
def test_python_dash_m_runs_the_command(module):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", module, "analyze", "--seqlen", "-5", "--headdim", "64"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "--seqlen: must be a positive integer" in r.stderr, (r.returncode, r.stderr)


def test_plot_to_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit) as e:
        cli.main(["analyze", "--seqlen", "64", "--headdim", "64", "--sram", "196608", "--plot",
                  str(tmp_path / "missing" / "io.png")])
    assert e.value.code == 2 and "argument --plot: cannot write" in capsys.readouterr().err
