"""`flashtile demo`: every attention implementation this machine can run, on one small workload,
checked against the float64 oracle and printed as one table.

The workload is embedded (b=1, h=4 query heads over 2 kv heads, d=64, causal): a prefill (N queries
over N keys) and a decode step (1 query over N keys) for each N and dtype. Each implementation is an
entry of `implementations()`: a callable plus the reason it cannot run here (None when it can).
The Triton kernels come from the public API; without a GPU they run under the Triton interpreter,
which this module switches on (TRITON_INTERPRET=1) before anything imports triton.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from flashtile import analysis, testing
from flashtile.reference import decoding, fa1, fa2, naive

SEQLENS = [128, 256, 512]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPES_RUN = ["float32", "float16"]
REPEATS = 3
BATCH, HEADS, KV_HEADS, HEADDIM = 1, 4, 2, 64
NUM_SPLITS = 4  # Flash-Decoding splits of the demo's decode step
# the interpreter runs each program in numpy: a prefill takes ~1 s at N=128, a decode ~0.15 s
INTERPRETER_MAX_SEQLEN = {"prefill": 128, "decode": 512}
ATOL = 1e-5  # the 2x rule's tiny atol (testing.assert_2x)


@dataclass(frozen=True)
class Impl:
    name: str
    phase: str  # "prefill": N queries over N keys; "decode": the last query over N keys
    run: Callable  # (q, k, v) BSHD -> out (b, sq, h, d); causal, bottom-right aligned
    model: Callable | None  # (sq, sk, d, element size) -> analysis.Cost of one (batch, head)
    why_not: str | None  # None when it can run here, else the reason
    max_seqlen: int | None = None  # the interpreter's limit
    baseline: bool = False  # plain torch in the input dtype: what the 2x rule compares against


def _use_interpreter_without_gpu() -> tuple[str, str | None]:
    """Switch the Triton interpreter on for a CPU-only machine. Returns (how Triton runs here, None)
    or (the same, the reason it cannot run)."""
    if torch.cuda.is_available():
        return f"CUDA ({torch.cuda.get_device_name()})", None
    if "triton" in sys.modules and "TRITON_INTERPRET" not in os.environ:
        why = "triton was imported before the demo could set TRITON_INTERPRET=1"
        return f"unavailable: {why}", why
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] != "1":
        why = f"no GPU, and TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} is set"
        return f"unavailable: {why}", why
    limits = ", ".join(f"{phase} N <= {n}" for phase, n in INTERPRETER_MAX_SEQLEN.items())
    return f"Triton interpreter (TRITON_INTERPRET=1, numpy; {limits})", None


def implementations(triton_why_not: str | None) -> list[Impl]:
    """The registry: references always run; Triton entries when the API has them and Triton runs."""
    from flashtile import api  # after _use_interpreter_without_gpu: api may import triton

    cuda = torch.cuda.is_available()
    max_n = {phase: None for phase in INTERPRETER_MAX_SEQLEN} if cuda else INTERPRETER_MAX_SEQLEN
    sram = fa1.A100_SRAM_BYTES

    def triton_reason(fn: str) -> str | None:
        return f"flashtile.api has no {fn} yet" if not hasattr(api, fn) else triton_why_not

    def on_triton(fn):
        def run(q, k, v):
            with api.use_backend("triton"):  # never a silent fall back to the reference path
                return fn(q, k, v)
        return run

    def kvcache(q, k, v):
        seqlens = torch.full((k.shape[0],), k.shape[1], dtype=torch.int32, device=k.device)
        return api.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True, num_splits=NUM_SPLITS)

    def sdpa(causal):
        def run(q, k, v):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            return out.transpose(1, 2)
        return run

    def fa2_model(sq, sk, d, e):
        return analysis.fa2(sq, sk, d, e, fa2.BLOCK_M, fa2.BLOCK_N, causal=True)

    def decoding_model(sq, sk, d, e):
        return analysis.decoding(sq, sk, d, e, NUM_SPLITS, fa2.BLOCK_M, fa2.BLOCK_N, causal=True)

    def plain_torch(q, k, v):
        return naive.attention(q, k, v, causal=True)[0]

    no_gpu = None if cuda else "needs a CUDA GPU (the comparison with torch runs on GPUs)"
    return [
        Impl("torch, S and P in memory", "prefill", plain_torch, analysis.standard, None, baseline=True),
        Impl("reference.fa1", "prefill",
             lambda q, k, v: fa1.forward(q, k, v, causal=True, sram_bytes=sram)[0],
             lambda sq, sk, d, e: analysis.fa1(sq, sk, d, e, fa1.block_sizes(sram, d, e)[1]), None),
        Impl("reference.fa2", "prefill", lambda q, k, v: fa2.forward(q, k, v, causal=True)[0],
             fa2_model, None),
        Impl("triton flash_attn_func", "prefill",
             on_triton(lambda q, k, v: api.flash_attn_func(q, k, v, causal=True)), fa2_model,
             triton_reason("flash_attn_func"), max_n["prefill"]),
        Impl("torch SDPA", "prefill", sdpa(True), None, no_gpu),
        Impl("torch, S and P in memory", "decode", plain_torch, analysis.standard, None, baseline=True),
        Impl("reference.decoding", "decode",
             lambda q, k, v: decoding.attention(q, k, v, NUM_SPLITS, causal=True)[0], decoding_model, None),
        Impl("triton flash_attn_with_kvcache", "decode", on_triton(kvcache), decoding_model,
             triton_reason("flash_attn_with_kvcache"), max_n["decode"]),
        Impl("torch SDPA", "decode", sdpa(False), None, no_gpu),  # one query: is_causal would hide keys
    ]


def _measure(fn, repeats: int, cuda: bool):
    """(output, median ms over `repeats` calls, peak CUDA bytes the last call allocated or None).

    On a GPU one extra first call (compilation, autotuning) is left out of the timing.
    """
    out, times, peak = None, [], None
    for _ in range(repeats + int(cuda)):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        result = fn()
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        times.append((time.perf_counter() - start) * 1e3)
        out = result if out is None else out
    return out, statistics.median(times[int(cuda):]), peak


@dataclass
class Row:
    dtype: str
    phase: str
    n: int
    impl: Impl
    err: float | None
    verdict: str  # "baseline", "ok", "FAIL" or "ERROR"
    ms: float | None
    mem_mb: float | None
    hbm_mb: float | None
    failure: str = ""


def _run_case(dtype: str, phase: str, n: int, impls: list[Impl], repeats: int, cuda: bool, gen,
              bar) -> list[Row]:
    """Run one (dtype, phase, N) for the given entries; one Row each, failures kept, never raised."""
    device = "cuda" if cuda else "cpu"
    q, k, v = (testing.randn(BATCH, n, heads, HEADDIM, dtype=DTYPES[dtype], device=device, generator=gen)
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    if phase == "decode":
        q = q[:, -1:]  # the newest token's query, over all N keys
    oracle = naive.attention(q, k, v, causal=True, compute_dtype=torch.float64)[0]
    rows, baseline = [], None  # each phase lists its baseline entry first
    bh = BATCH * HEADS
    for impl in impls:
        label = f"{impl.name} {dtype} {phase} N={n}"
        cost = impl.model(q.shape[1], n, HEADDIM, q.element_size()) if impl.model else None
        hbm_mb = bh * cost.hbm_bytes / 1e6 if cost else None
        bar.update(1)
        try:
            interpreted = not cuda and impl.max_seqlen is not None  # only the interpreter sets a limit
            out, ms, peak = _measure(lambda: impl.run(q, k, v), 1 if interpreted else repeats, cuda)
        except Exception as e:  # a kernel still in the works must not hide the other rows
            rows.append(Row(dtype, phase, n, impl, None, "ERROR", None, None, hbm_mb,
                            f"{label}: {type(e).__name__}: {e}"))
            continue
        failure, verdict = "", "baseline" if impl.baseline else "ok"
        if impl.baseline:
            baseline = out
        else:
            try:
                testing.assert_2x(label, out, oracle, baseline, atol=ATOL)
            except AssertionError as e:
                failure, verdict = str(e), "FAIL"
        mem = peak if cuda else (bh * cost.scratch_bytes if cost else None)
        rows.append(Row(dtype, phase, n, impl, testing.max_err(out, oracle), verdict, ms,
                        None if mem is None else mem / 1e6, hbm_mb, failure))
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return format("-", ">" + spec.split(".")[0]) if x is None else format(x, spec)


def run(seqlens=SEQLENS, dtypes=DTYPES_RUN, repeats=REPEATS, file=None) -> int:
    """Run the demo; print the table to `file` (stdout). Returns 0 when every check passed, else 1."""
    from tqdm import tqdm

    file = file or sys.stdout
    triton_mode, triton_why_not = _use_interpreter_without_gpu()
    impls = implementations(triton_why_not)
    cuda = torch.cuda.is_available()
    runnable = [i for i in impls if i.why_not is None]
    plan = [(dtype, phase, n, [i for i in runnable if i.phase == phase and (i.max_seqlen or n) >= n])
            for dtype in dtypes for phase in ("prefill", "decode") for n in seqlens]
    gen = torch.Generator(device="cuda" if cuda else "cpu").manual_seed(0)
    rows = []
    with tqdm(total=sum(len(p[3]) for p in plan), desc="flashtile demo", disable=None, file=sys.stderr,
              leave=False) as bar:
        for dtype, phase, n, todo in plan:
            rows += _run_case(dtype, phase, n, todo, repeats, cuda, gen, bar)

    device = f"cuda ({torch.cuda.get_device_name()})" if cuda else f"cpu ({torch.get_num_threads()} threads)"
    mem_note = ("peak CUDA memory the call allocated (output included), measured" if cuda else
                "HBM the algorithm needs beyond inputs and outputs, from the IO model (no allocator to "
                "measure on a CPU)")
    print(f"flashtile demo on {device}, torch {torch.__version__}; Triton: {triton_mode}", file=file)
    print(f"workload: b={BATCH}, {HEADS} query heads over {KV_HEADS} kv heads, d={HEADDIM}, causal; "
          f"prefill = N queries over N keys, decode = the last query over N keys", file=file)
    print("error:   max |out - float64 oracle|; check: within 2x the error of plain torch in the same "
          f"dtype + {ATOL:g} (the 2x rule)", file=file)
    print(f"time:    median of {repeats} calls (interpreter: 1 call), ms", file=file)
    print(f"mem MB:  {mem_note}", file=file)
    print(f"HBM MB:  bytes between HBM and SRAM by the IO model (flashtile analyze), all "
          f"{BATCH * HEADS} heads; triton rows use the reference's tiles", file=file)
    header = f"{'dtype':<9}{'phase':<8}{'N':>5}  {'implementation':<31}{'error':>9}  {'check':<9}" \
             f"{'time ms':>9}{'mem MB':>9}{'HBM MB':>9}"
    print(header, file=file)
    print("-" * len(header), file=file)
    for r in rows:
        print(f"{r.dtype:<9}{r.phase:<8}{r.n:>5}  {r.impl.name:<31}{_fmt(r.err, '9.2e')}  {r.verdict:<9}"
              f"{_fmt(r.ms, '9.2f')}{_fmt(r.mem_mb, '9.3f')}{_fmt(r.hbm_mb, '9.3f')}", file=file)

    ran = [f"{i.name} ({i.phase})" for i in impls if any(r.impl is i for r in rows)]
    print(f"\nran: {', '.join(ran)}", file=file)
    for i in impls:
        if i.why_not is not None:
            print(f"not run: {i.name} ({i.phase}): {i.why_not}", file=file)
        elif i.max_seqlen is not None and any(n > i.max_seqlen for n in seqlens):
            print(f"limited: {i.name} ({i.phase}) ran for N <= {i.max_seqlen} only (interpreter)", file=file)
    failures = [r.failure for r in rows if r.failure]
    for f in failures:
        print(f"FAIL {f}", file=file)
    print("all checks passed" if not failures else f"{len(failures)} check(s) failed", file=file)
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------
# `flashtile demo --model`: the attention paths inside a whole model
# ---------------------------------------------------------------------------------------------

MODEL_ATTN = ("eager", "sdpa", "flashtile")  # eager first: the reference of the logit differences
MODEL_SIZES = {  # (GPTConfig fields, training batch x seqlen, generation batch, prompt, new tokens)
    "cpu": (dict(n_layer=4, n_embd=128, n_head=4, n_kv_head=2, block_size=256), (8, 128), (4, 32, 64)),
    "cuda": (dict(n_layer=12, n_embd=768, n_head=12, n_kv_head=4, block_size=2048), (8, 1024), (8, 512, 256)),
}
MODEL_ATOL = 1e-4  # float32 logits of the three paths (the CPU run); bf16 on a GPU is reported only


@dataclass
class ModelRow:
    attn: str
    cache: str
    logit_diff: float
    train_ms: float | None  # on the first row of each attention path only
    train_mb: float | None  # peak CUDA memory of the training step
    tokens_per_s: float
    gen_mb: float | None  # peak CUDA memory of the generation
    agree: int  # leading greedy tokens equal to eager's


def _timed(fn, cuda: bool):
    """(fn(), seconds, peak CUDA MB or None)."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start, torch.cuda.max_memory_allocated() / 1e6 if cuda else None


def _model_rows(model, x, y, prompt, new_tokens, repeats, cuda) -> list[ModelRow]:
    """For each attention path of MODEL_ATTN, on the same weights: the logits of x, the median time
    of a training step on (x, y) (a copy of the model), and greedy generation from prompt with each
    cache it has."""
    import copy

    from flashtile.bench.e2e import median_ms

    rows, ref_logits, ref_tokens = [], None, None
    for attn in MODEL_ATTN:
        model.attn = attn
        model.eval()
        with torch.no_grad():
            logits = model(x)[0].float()
        if ref_logits is None:
            ref_logits = logits
        trainee = copy.deepcopy(model).train()
        opt = torch.optim.AdamW(trainee.parameters(), lr=1e-4)

        def step():
            trainee(x, y)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        train_ms, _, train_mb = _timed(lambda: median_ms(step, x.device, 1, repeats), cuda)
        del trainee, opt
        caches = {"tensor": {}} if attn != "flashtile" else {"KVCache": {}, "PagedKVCache": {"paged": True}}
        if attn == "flashtile" and cuda:
            caches["KVCache + CUDA graph"] = {"use_cuda_graph": True}
        for i, (name, options) in enumerate(caches.items()):
            model.generate(prompt, 2, temperature=0, **options)  # compile, warm up
            tokens, seconds, gen_mb = _timed(lambda: model.generate(prompt, new_tokens, temperature=0, **options), cuda)
            tokens = tokens[:, prompt.shape[1]:]
            if ref_tokens is None:
                ref_tokens = tokens
            same = (tokens == ref_tokens).all(dim=0).long()  # (new_tokens,): every sequence agrees there
            rows.append(ModelRow(attn, name, float((logits - ref_logits).abs().max()), train_ms if i == 0 else None,
                                 train_mb if i == 0 else None, tokens.numel() / seconds, gen_mb,
                                 int(same.cumprod(0).sum())))
    return rows


def run_model(repeats=REPEATS, file=None) -> int:
    """Print the model comparison; 0 when (in float32) every path matches eager, else 1."""
    from flashtile import api
    from flashtile.models import GPT, GPTConfig, get_batch, load_text
    from flashtile.models.text import CharTokenizer

    file = file or sys.stdout
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sizes, (batch, seqlen), (gen_batch, prompt_len, new_tokens) = MODEL_SIZES[device]
    dtype = torch.bfloat16 if cuda else torch.float32
    text = load_text()
    tok = CharTokenizer(text)
    data = tok.encode(text)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, **sizes)).to(device=device, dtype=dtype)
    x, y = get_batch(data, batch, seqlen, gen, device)
    prompt = get_batch(data, gen_batch, prompt_len, gen, device)[0]
    # on the CPU, flashtile's PyTorch reference path: the Triton interpreter would take minutes
    backend = api.use_backend("auto" if cuda else "reference")
    with backend:
        rows = _model_rows(model, x, y, prompt, new_tokens, repeats, cuda)

    c = model.config
    where = f"cuda ({torch.cuda.get_device_name()})" if cuda else f"cpu ({torch.get_num_threads()} threads)"
    print(f"flashtile demo --model on {where}, torch {torch.__version__}; flashtile: "
          f"{'Triton kernels' if cuda else 'its PyTorch reference path (no GPU)'}", file=file)
    print(f"model:    flashtile.models.GPT, {model.num_params() / 1e6:.2f}M parameters, {c.n_layer} layers, "
          f"d={c.n_embd}, {c.n_head} query / {c.n_kv_head} kv heads, {str(dtype).removeprefix('torch.')}, "
          f"random weights, characters of the sonnets", file=file)
    print(f"logits:   max |logits - eager's| on a batch of {batch} x {seqlen} (the same weights)", file=file)
    print(f"train:    one step (forward, backward, AdamW) on {batch} x {seqlen} tokens, median of {repeats}, ms",
          file=file)
    print(f"generate: {gen_batch} prompts of {prompt_len} tokens + {new_tokens} greedy tokens, prefill included, "
          f"tokens/s; agree: leading tokens equal to eager's", file=file)
    if cuda:
        print("peak MB:  torch.cuda.max_memory_allocated during the training step / the generation", file=file)
    header = f"{'attention':<11}{'cache':<22}{'max |dlogit|':>13}{'train ms':>10}{'gen tok/s':>11}{'agree':>9}" \
             + (f"{'train MB':>10}{'gen MB':>9}" if cuda else "")
    print(header, file=file)
    print("-" * len(header), file=file)
    for r in rows:
        print(f"{r.attn:<11}{r.cache:<22}{_fmt(r.logit_diff, '13.2e')}{_fmt(r.train_ms, '10.1f')}"
              f"{_fmt(r.tokens_per_s, '11.0f')}{f'{r.agree}/{new_tokens}':>9}"
              + (_fmt(r.train_mb, '10.0f') + _fmt(r.gen_mb, '9.0f') if cuda else ""), file=file)
    if cuda:
        print("(bfloat16: the paths round differently, so their logits and greedy tokens may part; not checked)",
              file=file)
        return 0
    bad = [r for r in rows if r.logit_diff > MODEL_ATOL or r.agree != new_tokens]
    for r in bad:
        print(f"FAIL {r.attn} ({r.cache}): logits differ by {r.logit_diff:.2e} (> {MODEL_ATOL:g}) or greedy "
              f"tokens part after {r.agree}", file=file)
    print("all paths agree" if not bad else f"{len(bad)} path(s) disagree", file=file)
    return 1 if bad else 0
