"""`flashtile bench e2e` at toy sizes on the CPU: every row runs, the result file is merged across
runs and rewritten per row, errors and out-of-memory become rows, the FLOP count, the plot. The
hf rows need transformers (skipped without it). The real numbers come from a GPU."""

import json

import pytest
import torch

from flashtile.bench import e2e

TINY_RUN = ["--tiny", "--device", "cpu", "--seqlens", "32", "--tokens", "64", "--contexts", "24", "--batches", "1,2",
            "--no-plot"]


def _rows(path):
    with open(path) as f:
        return json.load(f)


def test_gpt_rows_at_tiny_size_then_a_partial_rerun_merges(tmp_path, capsys):
    assert e2e.main(TINY_RUN + ["--model", "gpt", "--out", str(tmp_path)]) == 0
    data = _rows(tmp_path / "e2e.json")
    rows = data["rows"]
    assert data["complete"] and len(data["runs"]) == 1
    assert data["runs"][0]["env"]["gpu"] == "cpu" and data["runs"][0]["optimizer"] == "adamw"
    train = {r["impl"]: r for r in rows if r["part"] == "train"}
    assert sorted(train) == sorted(e2e.TRAIN_DEFAULT)
    for r in train.values():
        assert "error" not in r, r
        assert r["batch"] == 2 and r["seqlen"] == 32 and r["step_ms"] > 0
        assert r["tokens_per_s"] == pytest.approx(64 / r["step_ms"] * 1e3)
        assert r["tflops"] == pytest.approx(e2e.model_flops(e2e.TINY, r["matmul_params"], 2, 32) / r["step_ms"] * 1e-9)
        assert 0 < r["attention_fraction"] and "mfu" not in r  # no peak known for a CPU
    gen = [r for r in rows if r["part"] == "generate"]
    assert sorted((r["impl"], r["batch"]) for r in gen) == [(i, b) for i in ("flashtile", "sdpa") for b in (1, 2)]
    for r in gen:
        assert "error" not in r, r
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["ms_per_step"] * 1e3)
    out = capsys.readouterr().out
    assert "[train] gpt flashtile" in out and "skipping the CUDA-graph rows: no GPU" in out

    # a second run of one part replaces its rows and keeps the others
    assert e2e.main(TINY_RUN + ["--model", "gpt", "--part", "generate", "--batches", "1", "--gen-impls", "sdpa,eager",
                                "--out", str(tmp_path)]) == 0
    data = _rows(tmp_path / "e2e.json")
    assert len(data["runs"]) == 2
    runs = {(r["part"], r["impl"], r["batch"] if r["part"] == "generate" else None): r["run"] for r in data["rows"]}
    assert runs[("generate", "sdpa", 1)] == 1 and runs[("generate", "sdpa", 2)] == 0
    assert runs[("generate", "eager", 1)] == 1 and runs[("train", "flashtile", None)] == 0
    assert len(data["rows"]) == 3 + 4 + 1


def test_hf_rows_at_tiny_size(tmp_path):
    pytest.importorskip("transformers")
    assert e2e.main(TINY_RUN + ["--model", "hf", "--batches", "2", "--impls", "sdpa,eager", "--gen-impls", "sdpa",
                                "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "e2e.json")["rows"]
    assert sorted((r["part"], r["impl"]) for r in rows) == [("generate", "sdpa"), ("train", "eager"), ("train", "sdpa")]
    for r in rows:
        assert "error" not in r, r
        assert r["model"] == "hf" and r["tokens_per_s"] > 0
    assert [r["matmul_params"] for r in rows if r["part"] == "train"][0] == sum(  # LlamaForCausalLM's Linears
        e2e.TINY.hidden * n for n in (e2e.TINY.hidden, 16 * 2, 16 * 2, e2e.TINY.hidden)) * 2 + \
        3 * e2e.TINY.hidden * e2e.TINY.intermediate * 2 + e2e.TINY.hidden * e2e.TINY.vocab


def test_hf_rows_with_flashtile_attention(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("flashtile.integrations.transformers")
    assert e2e.main(TINY_RUN + ["--model", "hf", "--batches", "2", "--impls", "flashtile", "--gen-impls", "flashtile",
                                "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "e2e.json")["rows"]
    assert len(rows) == 2 and all("error" not in r and r["impl"] == "flashtile" for r in rows), rows


def test_errors_and_out_of_memory_become_rows(tmp_path, monkeypatch):
    def train_row(model_name, attn, seqlen, *rest, **peaks):
        if attn == "eager":
            raise torch.OutOfMemoryError("CUDA out of memory")
        raise RuntimeError("no kernel")

    monkeypatch.setattr(e2e, "train_row", train_row)
    assert e2e.main(TINY_RUN + ["--model", "gpt", "--part", "train", "--out", str(tmp_path)]) == 0
    errors = {r["impl"]: r["error"] for r in _rows(tmp_path / "e2e.json")["rows"]}
    assert errors == {"flashtile": "RuntimeError: no kernel", "sdpa": "RuntimeError: no kernel", "eager": "oom"}


def test_model_flops_follow_palm_with_causal_attention():
    shape = e2e.LLAMA_1B
    assert shape.head_dim == 64
    mm = 10**9
    flops = e2e.model_flops(shape, mm, 8, 2048)
    assert flops == 6 * mm * 8 * 2048 + 12 * shape.layers * shape.hidden * 2048 * (8 * 2048) / 2


def test_plot_from_rows_with_errors(tmp_path):
    size = dict(hidden=2048, layers=16)
    rows = [dict(part="train", model="gpt", impl=i, seqlen=s, tokens_per_s=t, **size)
            for i, t in (("sdpa", 100.0), ("flashtile", 130.0)) for s in (2048, 8192)]
    rows += [dict(part="train", model="gpt", impl="eager", seqlen=8192, error="oom", **size),
             dict(part="generate", model="hf", impl="sdpa", batch=1, context=4096, tokens_per_s=50.0, **size),
             dict(part="generate", model="hf", impl="flashtile", batch=1, context=4096, tokens_per_s=60.0, **size),
             dict(part="generate", model="hf", impl="sdpa", batch=32, context=32768, error="oom", **size)]
    run = {"env": {"gpu": "test"}, "shape": size}
    (tmp_path / "e2e.json").write_text(json.dumps({"runs": [run], "rows": rows}))
    assert e2e.main(["--plot-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_1b_model_needs_a_gpu_or_tiny(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit):
        e2e.parse_args([])
    assert "--tiny" in capsys.readouterr().err
