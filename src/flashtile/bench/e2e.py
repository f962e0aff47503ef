"""`flashtile bench e2e`: flashtile inside whole models, against SDPA and eager attention.

The model: Llama-3.2-1B's shape with a 32k vocabulary and random weights (16 layers, hidden 2048,
SwiGLU 8192, 32 query / 8 key-value heads of 64 dims, untied embeddings: 1.10B parameters), bf16,
built two ways:
  gpt  flashtile.models.GPT, attn = flashtile | sdpa | eager
  hf   transformers' LlamaForCausalLM from a LlamaConfig, attn_implementation = flashtile
       (flashtile.integrations.transformers.register()) | sdpa | eager

Part `train`: one training step = forward, backward and a fused AdamW step on the bf16 weights,
at seqlen 2k / 8k / 16k with 16k tokens per step (batch = 16384 / seqlen), causal, no dropout.
The step time is the median of --steps steps after --warmup, each bracketed by a device sync.
  tokens/s  batch x seqlen / step time
  MFU       model FLOPs / step time / the GPU's dense bf16 peak (analysis.gpus: H100 SXM 989
            TFLOP/s); model FLOPs = 6 x matmul parameters x tokens (the nn.Linear weights: the
            embedding lookup is no matmul, the output layer is) + attention 6 x layers x batch x
            heads x seqlen^2 x head_dim (PaLM's 12 L H Q T per token, halved for causal); also
            against the bf16 matmul ceiling measured in the same run (`vs_matmul`).
  attention the attention alone at the step's shapes, forward + backward (do_bench median) x
            layers / step time; for every model the functions of flashtile.models.gpt
            (flash_attn_func; SDPA with enable_gqa; eager softmax(QK^T)V), so the hf rows' share is
            an estimate of what transformers' own attention call costs.
A row that runs out of memory is recorded as "oom" (eager attention at the longer seqlens).
"sdpa" is torch's own choice of SDPA backend (cuDNN's attention on the H100 with torch 2.11);
"sdpa-flash" pins its FlashAttention-2 backend (train and generate rows, both models).

Part `generate`: a random prompt of --contexts tokens (4k, 16k, 32k) for --batches sequences (1, 32)
is prefilled, then --warmup-tokens decoding steps run untimed and --new-tokens steps are timed
(greedy: argmax of the logits, on the device); tokens/s = batch x new tokens / their time.
  gpt flashtile        a flashtile KVCache; each step one Python forward (attend plans once per step)
  gpt flashtile-graph  the same step captured once in a CUDA graph and replayed (capture untimed)
  gpt flashtile-paged(-graph)  a PagedKVCache of 16-token pages (not in the default set)
  gpt sdpa | eager     a preallocated tensor cache, SDPA with enable_gqa / materialised scores
  hf sdpa              transformers' default: model.generate(do_sample=False) with its default
                       (dynamic) cache; steps timed by a logits processor that syncs the device
  hf flashtile | eager the same generate with that attn_implementation
The gpt rows prefill --prefill-chunk tokens per forward (through the cache: chunked prefill); the hf
rows prefill the whole prompt in one forward, as generate does. Prefill time is recorded, not
plotted. Peak memory is torch.cuda.max_memory_allocated over the row (weights included).

    python -m flashtile.bench.e2e --part train --model gpt --out benchmarks/results/h100
    python -m flashtile.bench.e2e --part generate --model hf --contexts 4096,16384 --out ...
writes e2e.json there (rows of an earlier e2e.json in that folder are kept, and replaced when a row
of the same part, model, implementation and shape runs again; the file is rewritten after every
row) and e2e.png from it; --plot-only redraws the plot. --tiny runs a 2-layer model at toy sizes
(on the CPU too, where flashtile runs its reference path): the test's and a smoke run's size.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

from flashtile.bench import harness

TRAIN_IMPLS = ("flashtile", "sdpa", "sdpa-flash", "eager")
GEN_IMPLS = {"gpt": ("flashtile", "flashtile-graph", "flashtile-paged", "flashtile-paged-graph", "sdpa", "sdpa-flash",
                     "eager"),
             "hf": ("flashtile", "sdpa", "sdpa-flash", "eager")}
TRAIN_DEFAULT = ("flashtile", "sdpa", "eager")
GEN_DEFAULT = {"gpt": ("flashtile", "flashtile-graph", "sdpa"), "hf": ("flashtile", "sdpa")}
BASELINE = "sdpa"  # the ratios' denominator, per model and shape


@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder's sizes."""
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA_1B = Shape(vocab=32000, hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8)
TINY = Shape(vocab=256, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
DEFAULTS = dict(seqlens=[2048, 8192, 16384], tokens=16384, contexts=[4096, 16384, 32768], batches=[1, 32],
                new_tokens=64, warmup_tokens=8, prefill_chunk=4096, steps=8, warmup=3)
TINY_DEFAULTS = dict(seqlens=[32, 64], tokens=128, contexts=[32, 64], batches=[1, 2], new_tokens=4, warmup_tokens=1,
                     prefill_chunk=16, steps=2, warmup=1)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

def build_gpt(shape: Shape, attn: str, device, dtype, max_len: int):
    from flashtile.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=shape.vocab, block_size=max_len, n_layer=shape.layers, n_head=shape.heads,
                       n_kv_head=shape.kv_heads, n_embd=shape.hidden, mlp_hidden=shape.intermediate,
                       tie_embeddings=False, attn=attn)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs
        return GPT(config).to(device=device, dtype=dtype)


def hf_available() -> str | None:
    """None when transformers can be imported, else why not."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        return f"transformers is not installed ({e})"
    return None


def build_hf(shape: Shape, attn: str, device, dtype, max_len: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if attn == "flashtile":
        from flashtile.integrations.transformers import register

        register()
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=max_len,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device=device, dtype=dtype)


def build(model_name: str, shape: Shape, attn: str, device, dtype, max_len: int):
    return (build_gpt if model_name == "gpt" else build_hf)(shape, attn, device, dtype, max_len)


def matmul_params(model) -> int:
    """Weights that multiply activations: every nn.Linear's (the output layer's included)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def model_flops(shape: Shape, mm_params: int, batch: int, seqlen: int) -> float:
    """Forward + backward FLOPs of one causal training step (no recomputation counted)."""
    attention = 6 * shape.layers * batch * shape.heads * seqlen**2 * shape.head_dim
    return 6 * mm_params * batch * seqlen + attention


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device, warmup: int, reps: int) -> float:
    """Median wall-clock ms of fn() over reps runs after warmup, each bracketed by a device sync
    (for steps of 10s of ms or more; short kernels go through attention_ms's do_bench)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def attention_ms(attn: str, shape: Shape, batch: int, seqlen: int, device, dtype) -> float:
    """One causal attention call at a training step's shapes, forward + backward, median ms."""
    from flashtile.models.gpt import ATTENTION_FUNCTIONS

    fn = ATTENTION_FUNCTIONS[attn]
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(batch, seqlen, shape.heads, shape.head_dim, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(batch, seqlen, shape.kv_heads, shape.head_dim, device=device, dtype=dtype, generator=gen)
            for _ in range(2))
    do = torch.randn_like(q)
    for t in (q, k, v):
        t.requires_grad_(True)

    def fwd_bwd():
        fn(q, k, v).backward(do)

    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fwd_bwd, grad_to_none=[q, k, v], return_mode="median"))
    return median_ms(fwd_bwd, device, 1, 3)


def _peak_gb(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _free() -> None:
    """Collect what the last row left (an exception's frames hold its tensors until now)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Part 1: training
# ---------------------------------------------------------------------------------------------

def train_row(model_name: str, attn: str, seqlen: int, args, shape: Shape, device, dtype, peak_flops=None,
              matmul_tflops=None) -> dict:
    """One training row's measurements (the caller records errors). peak_flops: the GPU's datasheet
    FLOP/s (for MFU); matmul_tflops: the matmul ceiling measured in this run."""
    batch = max(1, args.tokens // seqlen)
    _reset_peak(device)
    model = build(model_name, shape, attn, device, dtype, seqlen)
    model.train()
    mm = matmul_params(model)
    opt = None
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randint(shape.vocab, (batch, seqlen), device=device, generator=gen)

    def step():
        if model_name == "gpt":
            loss = model(x, x)[1]
        else:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)

    ms = median_ms(step, device, args.warmup, args.steps)
    row = dict(batch=batch, params=sum(p.numel() for p in model.parameters()), matmul_params=mm, step_ms=ms,
               tokens_per_s=batch * seqlen / ms * 1e3, peak_gb=_peak_gb(device))
    flops = model_flops(shape, mm, batch, seqlen)
    row["tflops"] = flops / ms * 1e-9
    if peak_flops:
        row["mfu"] = flops / (ms * 1e-3) / peak_flops
    if matmul_tflops:
        row["vs_matmul"] = row["tflops"] / matmul_tflops
    del model, opt, x
    _free()
    try:
        row["attention_ms"] = attention_ms(attn, shape, batch, seqlen, device, dtype)
        row["attention_fraction"] = row["attention_ms"] * shape.layers / ms
    except torch.OutOfMemoryError:
        row["attention_ms"] = "oom"
    return row


# ---------------------------------------------------------------------------------------------
# Part 2: generation
# ---------------------------------------------------------------------------------------------

def gen_gpt_row(model, impl: str, context: int, batch: int, args, device) -> dict:
    """Prefill a random prompt into a fresh cache, then time decoding steps of `model` (a GPT)."""
    attn = impl.split("-")[0]
    model.attn = attn
    gen = torch.Generator(device).manual_seed(context + batch)
    prompt = torch.randint(model.config.vocab_size, (batch, context), device=device, generator=gen)
    steps = args.warmup_tokens + args.new_tokens
    _reset_peak(device)
    cache = model.make_cache(batch, context + steps, paged="paged" in impl)
    _sync(device)
    start = time.perf_counter()
    with _any_sdpa_backend():  # a pinned sdpa-flash has no kernel for the later chunks' bottom-right mask
        logits = model.prefill(prompt, cache, chunk=args.prefill_chunk)
    _sync(device)
    prefill_s = time.perf_counter() - start
    step = model.decoder(cache, use_cuda_graph=impl.endswith("graph"), max_steps=steps)  # capture: untimed
    tok = logits.argmax(-1, keepdim=True)
    for _ in range(args.warmup_tokens):
        tok = step(tok).argmax(-1, keepdim=True)
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.new_tokens):
        tok = step(tok).argmax(-1, keepdim=True)
    _sync(device)
    decode_s = time.perf_counter() - start
    row = dict(prefill_s=prefill_s, ms_per_step=decode_s / args.new_tokens * 1e3,
               tokens_per_s=batch * args.new_tokens / decode_s, peak_gb=_peak_gb(device))
    del cache, step, logits
    return row


def gen_hf_row(model, context: int, batch: int, args, device) -> dict:
    """transformers' generate (greedy, its default cache), timed per step by a logits processor."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        """Called once per generated token, after that step's forward: the device is synced and
        the time kept."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            _sync(device)
            self.times.append(time.perf_counter())
            return scores

    gen = torch.Generator(device).manual_seed(context + batch)
    prompt = torch.randint(model.config.vocab_size, (batch, context), device=device, generator=gen)
    steps = args.warmup_tokens + args.new_tokens
    clock = StepClock()
    _reset_peak(device)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps + 1,
                         min_new_tokens=steps + 1, do_sample=False, pad_token_id=0,
                         logits_processor=LogitsProcessorList([clock]))
    t = clock.times  # t[0]: after the prefill; t[i]: after decoding step i
    if out.shape[1] != context + steps + 1 or len(t) != steps + 1:
        raise RuntimeError(f"generate made {out.shape[1] - context} tokens in {len(t)} steps, expected {steps + 1}")
    decode_s = t[-1] - t[args.warmup_tokens]
    return dict(prefill_s=t[0] - start, ms_per_step=decode_s / args.new_tokens * 1e3,
                tokens_per_s=batch * args.new_tokens / decode_s, peak_gb=_peak_gb(device))


# ---------------------------------------------------------------------------------------------
# The run: rows, the result file (merged with an earlier one), progress lines
# ---------------------------------------------------------------------------------------------

def row_key(row: dict) -> tuple:
    """What a row measured: a later row with the same key replaces it (model size included, so a
    --tiny or --layers run does not replace full-size rows)."""
    shape = (row["seqlen"],) if row["part"] == "train" else (row["batch"], row["context"])
    return (row.get("hidden"), row.get("layers"), row["part"], row["model"], row["impl"], *shape)


def _describe(row: dict) -> str:
    if row["part"] == "train":
        where = f"seqlen {row['seqlen']:6d}" + (f" x {row['batch']}" if "batch" in row else "")
    else:
        where = f"batch {row['batch']:3d} context {row['context']:6d}"
    head = f"[{row['part']}] {row['model']:3s} {row['impl']:21s} {where}"
    if "error" in row:
        return f"{head}: {row['error']}"
    if row["part"] == "train":
        extra = f"  MFU {row['mfu']:.1%}" if "mfu" in row else ""
        attn = row.get("attention_fraction")
        extra += f"  attention {attn:.1%}" if isinstance(attn, float) else f"  attention {row.get('attention_ms')}"
        body = f"{row['step_ms']:9.1f} ms/step {row['tokens_per_s']:10.0f} tok/s{extra}"
    else:
        body = (f"{row['tokens_per_s']:9.1f} tok/s ({row['ms_per_step']:7.2f} ms/step; prefill "
                f"{row['prefill_s']:6.2f} s)")
    if row.get("peak_gb") is not None:
        body += f"  peak {row['peak_gb']:.1f} GB"
    return f"{head}: {body}"


class Results:
    """e2e.json: the runs that made it and their rows, rewritten after every row."""

    def __init__(self, path: str | None, run: dict):
        self.path = path
        self.data = {"runs": [], "rows": []}
        if path and os.path.exists(path):
            with open(path) as f:
                self.data = json.load(f)
        self.run_index = len(self.data["runs"])
        self.data["runs"].append(run)
        self.data["complete"] = False

    def add(self, row: dict) -> None:
        row["run"] = self.run_index
        key = row_key(row)
        self.data["rows"] = [r for r in self.data["rows"] if row_key(r) != key] + [row]
        print(_describe(row), flush=True)
        self.save()

    def save(self) -> None:
        if self.path:
            harness.write_result(self.path, self.data, quiet=True)


def _sdpa_backend(impl: str):
    """The SDPA backend an implementation pins: "sdpa-flash" runs torch's FlashAttention-2 kernels
    only; plain "sdpa" leaves the choice to torch (on the H100 with torch 2.11 that choice was
    cuDNN's attention for these GQA shapes: compare the rows' attention times with bench prefill)."""
    if impl != "sdpa-flash":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _any_sdpa_backend():
    """Every SDPA backend allowed again inside a row that pins one: the gpt rows' chunked prefill
    (untimed) attends a chunk's queries over the cached keys with an explicit bottom-right causal
    mask, which torch's FlashAttention-2 backend does not take."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.MATH])


def _measure(results: Results, row: dict, fn) -> None:
    """Fill row from fn() and record it, under the SDPA backend its implementation pins; out of
    memory or another error is the row's result. The memory of whatever fn left behind is given
    back before the next row."""
    try:
        with _sdpa_backend(row["impl"]):
            row.update(fn())
    except torch.OutOfMemoryError:
        row["error"] = "oom"
    except Exception as e:  # one failing configuration must not stop the others
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    results.add(row)
    _free()


def run(args, path: str | None = None) -> dict:
    """Every row the arguments ask for, into path (merged with the file there)."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shape = replace(TINY if args.tiny else LLAMA_1B, **({"layers": args.layers} if args.layers else {}))
    env = harness.environment() if device.type == "cuda" else _cpu_environment()
    if device.type == "cuda" and not args.tiny:
        env["ceilings"] = harness.ceilings()
        print(f"bf16 matmul ceiling {env['ceilings']['matmul_bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    from flashtile.analysis.gpus import GPUS

    gpu = GPUS.get(harness.gpu_slug()) if device.type == "cuda" else None
    peaks = dict(peak_flops=gpu.peak_flops(args.dtype) if gpu else None,
                 matmul_tflops=env.get("ceilings", {}).get("matmul_bf16_TFLOPs"))
    results = Results(path, dict(env=env, args=vars(args), shape=asdict(shape), optimizer=args.optimizer,
                                 peak_tflops=gpu and gpu.peak_flops(args.dtype) / 1e12, peak_source=gpu and gpu.source))
    models = list(args.model)
    if "hf" in models and hf_available():
        print(f"skipping the hf rows: {hf_available()}", flush=True)
        models.remove("hf")
    size = dict(hidden=shape.hidden, layers=shape.layers)  # in every row: see row_key
    for model_name in models:
        if "train" in args.part:
            for seqlen in args.seqlens:
                for impl in args.impls:
                    row = dict(part="train", model=model_name, impl=impl, seqlen=seqlen, **size)
                    _measure(results, row, lambda: train_row(model_name, impl.split("-")[0], seqlen, args, shape,
                                                             device, dtype, **peaks))
        if "generate" in args.part:
            run_generate(results, model_name, args, shape, device, dtype, size)
    results.data["complete"] = True
    results.save()
    return results.data


def run_generate(results: Results, model_name: str, args, shape: Shape, device, dtype, size: dict) -> None:
    """The generation rows of one model: the gpt model is built once and its attention switched per
    implementation; transformers' is built once per attn_implementation."""
    impls = [i for i in args.gen_impls or GEN_DEFAULT[model_name] if i in GEN_IMPLS[model_name]]
    if device.type != "cuda" and any(i.endswith("graph") for i in impls):
        print("skipping the CUDA-graph rows: no GPU", flush=True)
        impls = [i for i in impls if not i.endswith("graph")]
    max_len = max(args.contexts) + args.warmup_tokens + args.new_tokens + 1
    model, built = None, None
    for impl in impls:
        attn = impl.split("-")[0]
        rows = [dict(part="generate", model=model_name, impl=impl, batch=b, context=c, **size)
                for c in args.contexts for b in args.batches]
        wanted = "gpt" if model_name == "gpt" else attn
        if built != wanted:
            model, built = None, None
            _free()
            try:
                model, built = build(model_name, shape, attn, device, dtype, max_len).eval(), wanted
            except Exception as e:  # e.g. transformers without flashtile's integration
                for row in rows:
                    row["error"] = f"building the model: {type(e).__name__}: {e}"[:300]
                    results.add(row)
                continue
        for row in rows:
            if model_name == "gpt":
                _measure(results, row, lambda: gen_gpt_row(model, impl, row["context"], row["batch"], args, device))
            else:
                _measure(results, row, lambda: gen_hf_row(model, row["context"], row["batch"], args, device))
    model = None
    _free()


def _cpu_environment() -> dict:
    """harness.environment() without a GPU (and without importing triton, when it is not loaded)."""
    import datetime
    import platform

    triton = sys.modules.get("triton")
    return {"gpu": "cpu", "torch": torch.__version__, "triton": getattr(triton, "__version__", None),
            "cuda": None, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": harness.command_line()}


# ---------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------

def _bars(ax, groups: dict, impls: list, label_of, log: bool) -> None:
    """Grouped bars of tokens/s: a group per key of groups (key -> {impl: row}), a bar per impl,
    labelled with its ratio to the group's BASELINE row, or "oom" / "error" at the foot."""
    width = 0.8 / max(len(impls), 1)
    keys = sorted(groups)
    for i, impl in enumerate(impls):
        xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(keys))]
        heights = [groups[k][impl]["tokens_per_s"] if "tokens_per_s" in groups[k].get(impl, {}) else 0 for k in keys]
        ax.bar(xs, heights, width, label=impl)
        for x, h, key in zip(xs, heights, keys):
            row, base = groups[key].get(impl), groups[key].get(BASELINE, {})
            if row is None:
                continue
            if "error" in row:  # at the foot of the axis, where a log scale has no zero
                ax.text(x, 0.02, "oom" if row["error"] == "oom" else "error", transform=ax.get_xaxis_transform(),
                        ha="center", va="bottom", fontsize=6, rotation=90, color="C3")
            elif "tokens_per_s" in base:
                ax.annotate(f"{h / base['tokens_per_s']:.2f}x", (x, h), xytext=(0, 2), textcoords="offset points",
                            ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_xticks(range(len(keys)), [label_of(k) for k in keys], fontsize=7)
    if log:
        ax.set_yscale("log")
        values = [r["tokens_per_s"] for g in groups.values() for r in g.values() if r and "tokens_per_s" in r]
        if values:  # bars start well below the smallest, so their heights compare
            ax.set_ylim(min(values) / 4, max(values) * 3)
    else:
        ax.margins(y=0.15)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)


def plot(json_path: str, out_dir: str) -> str:
    """e2e.png: a panel per (part, model): training tokens/s per seqlen, decoding tokens/s per
    (batch, context); a bar per implementation, labelled with its ratio to the same model's SDPA."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    # the model size of the latest run (a --tiny or --layers run's rows do not mix with full-size ones)
    shape = data["runs"][-1].get("shape", {}) if data["runs"] else {}
    rows = sorted((r for r in data["rows"] if (r.get("hidden"), r.get("layers")) == (shape.get("hidden"),
                                                                                      shape.get("layers"))),
                  key=row_key)
    panels = [(part, model) for part in ("train", "generate") for model in ("gpt", "hf")
              if any(r["part"] == part and r["model"] == model for r in rows)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 4 * len(panels)), squeeze=False)
    env = data["runs"][-1]["env"] if data["runs"] else {}
    order = {"train": TRAIN_IMPLS, "generate": tuple(GEN_IMPLS["gpt"])}
    for ax, (part, model) in zip(axes[:, 0], panels):
        groups = {}
        for r in rows:
            if r["part"] == part and r["model"] == model:
                key = r["seqlen"] if part == "train" else (r["batch"], r["context"])
                groups.setdefault(key, {})[r["impl"]] = r
        impls = sorted({i for g in groups.values() for i in g}, key=lambda i: (i != BASELINE, order[part].index(i)))
        who = "flashtile.models.GPT" if model == "gpt" else "transformers LlamaForCausalLM"
        if part == "train":
            _bars(ax, groups, impls, lambda k: f"seqlen {k}", log=False)
            ax.set_title(f"{who}: training step (forward, backward, AdamW), tokens/s; labels: ratio to SDPA", fontsize=9)
        else:
            _bars(ax, groups, impls, lambda k: f"batch {k[0]}\ncontext {k[1]}", log=True)
            ax.set_title(f"{who}: decoding, tokens/s (log scale); labels: ratio to SDPA"
                         + (" (transformers' default generate)" if model == "hf" else ""), fontsize=9)
        ax.set_ylabel("tokens / s", fontsize=8)
    size = f"{shape['layers']} layers x {shape['hidden']}" if shape else "?"
    fig.suptitle(f"flashtile in a Llama-style model ({size}, random weights) — {env.get('gpu')}, torch "
                 f"{env.get('torch')}, triton {env.get('triton')}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    path = os.path.join(out_dir, "e2e.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(choices):
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {list(choices)}")
        return names
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="flashtile bench e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", type=_names(("train", "generate")), default=["train", "generate"],
                   help="train, generate or both (default)")
    p.add_argument("--model", type=_names(("gpt", "hf")), default=["gpt", "hf"], help="gpt, hf or both (default)")
    p.add_argument("--impls", type=_names(TRAIN_IMPLS), default=list(TRAIN_DEFAULT),
                   help=f"training: attention implementations, of {TRAIN_IMPLS} (default {TRAIN_DEFAULT})")
    p.add_argument("--gen-impls", type=_names(sorted(set(GEN_IMPLS["gpt"]) | set(GEN_IMPLS["hf"]))), default=None,
                   help=f"generation rows (default gpt {','.join(GEN_DEFAULT['gpt'])}; hf {','.join(GEN_DEFAULT['hf'])})")
    p.add_argument("--seqlens", type=_ints, help="training sequence lengths (default 2048,8192,16384)")
    p.add_argument("--tokens", type=int, help="tokens per training step (default 16384)")
    p.add_argument("--contexts", type=_ints, help="generation prompt lengths (default 4096,16384,32768)")
    p.add_argument("--batches", type=_ints, help="generation batch sizes (default 1,32)")
    p.add_argument("--new-tokens", type=int, help="timed decoding steps (default 64)")
    p.add_argument("--warmup-tokens", type=int, help="untimed decoding steps first (default 8)")
    p.add_argument("--prefill-chunk", type=int, help="gpt rows: prompt tokens per prefill forward (default 4096)")
    p.add_argument("--steps", type=int, help="timed training steps, the median is kept (default 8)")
    p.add_argument("--warmup", type=int, help="untimed training steps first (default 3)")
    p.add_argument("--layers", type=int, help="layers of the model (default 16; fewer to fit a time limit)")
    p.add_argument("--optimizer", choices=("adamw", "none"), default="adamw",
                   help="adamw: the step includes a fused AdamW update; none: forward + backward only")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="weights and activations (default bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy model at toy sizes (tests, smoke runs)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="result folder (default benchmarks/results/<gpu>)")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    for name, value in (TINY_DEFAULTS if args.tiny else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no GPU here (use --device cpu --tiny)")
    if not args.tiny and not args.device.startswith("cuda") and not args.plot_only:
        p.error("the 1B model needs a GPU: pass --tiny to run toy sizes on the CPU")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out or os.path.join("benchmarks", "results", harness.gpu_slug())
    path = os.path.join(out, "e2e.json")
    if not args.plot_only:
        if args.device == "cpu":
            import flashtile

            with flashtile.use_backend("reference"):  # never the Triton interpreter at model sizes
                run(args, path)
        else:
            run(args, path)
    if not args.no_plot:
        print(f"wrote {plot(path, out)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
