"""Where a transformers decoding step spends its time: flashtile against SDPA's FlashAttention-2.

    PYTHONPATH=src python scripts/profile_hf_decode.py [--context 4096] [--steps 32] [--out DIR]

Llama-3.2-1B's shape (bench e2e's LLAMA_1B), random bf16 weights, batch 1: a prompt of `context`
tokens, then greedy steps the way generate() takes them (the attention mask grown by one each
step, transformers' DynamicCache), each step synced and timed. Per implementation: ms per step
(median of three blocks of `steps`), the host time inside the attention function per call (wall
time of the call, no sync: the steps are host-bound at batch 1), and a cProfile of one block, top
entries by own time. The two implementations alternate twice in one process, so a drift of the
host's speed shows as a difference between their rounds.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import os
import pstats
import statistics
import time

import torch

from flashtile.ops import decoding


def timed(fn, spent: list):
    """fn, with the wall time of each call appended to spent."""
    def attention(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)
    return attention


def decode_steps(model, ids, mask, past, steps: int, device) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """`steps` greedy steps from the last token of ids; returns each step's seconds."""
    times = []
    token = ids[:, -1:]
    for _ in range(steps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        mask = torch.cat((mask, mask.new_ones(mask.shape[0], 1)), dim=1)
        logits = model(input_ids=token, attention_mask=mask, past_key_values=past, use_cache=True).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times, token, mask


def pieces(context: int, say) -> None:
    """Host time of one layer's decoding call, piece by piece: transformers' call of each
    implementation, then flashtile's layers down to the launch (back-to-back calls, no sync, so a
    piece's wall time per call is its host cost while the GPU keeps up)."""
    from types import SimpleNamespace

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import flashtile
    from flashtile import api
    from flashtile.bench.harness import wall_us
    from flashtile.integrations.transformers import attention_forward

    dev, dt = torch.device("cuda"), torch.bfloat16
    query = torch.randn(1, 32, 1, 64, device=dev, dtype=dt)
    key, value = (torch.randn(1, 8, context, 64, device=dev, dtype=dt) for _ in range(2))
    module = SimpleNamespace(is_causal=True, training=False, num_key_value_groups=4)
    extra = dict(position_ids=torch.tensor([[context - 1]], device=dev), cache_position=None)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    options = dict(softmax_scale=0.125, causal=True, window_size=(-1, -1), softcap=0.0)
    call_args = (None, None, None, None, 0.125, True, (-1, -1), 0.0, None, None, None, True, 0)
    plan = api._plan_of_call(q, k, v, None, None, call_args)
    launch = plan._launch
    out = torch.empty(1, 1, 32, 64, device=dev, dtype=dt)

    rows = {}

    def row(name, fn):
        rows[name] = fn

    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # the SDPA rows run its FlashAttention-2
        row("transformers sdpa_attention_forward (sdpa-flash)",
            lambda: sdpa_attention_forward(module, query, key, value, None, scaling=0.125, **extra))
        row("torch sdpa alone (flash, enable_gqa)", lambda: torch.nn.functional.scaled_dot_product_attention(
            query, key, value, scale=0.125, enable_gqa=True))
        row("flashtile attention_forward",
            lambda: attention_forward(module, query, key, value, None, scaling=0.125, **extra))
        row("flashtile.flash_attn_with_kvcache", lambda: flashtile.flash_attn_with_kvcache(q, k, v, **options))
        row("api._plan_of_call (cached plan)", lambda: api._plan_of_call(q, k, v, None, None, call_args))
        row("DecodePlan.run", lambda: plan.run(q, k, v))
        row("decoding.decode_attention", lambda: decoding.decode_attention(launch, q, k, v, want_lse=False))

        def guard():
            with api._device_guard(q):
                pass

        row("torch.cuda.device(q.device) enter + exit", guard)
        # a decoding step over transformers' DynamicCache: the first layer meets a cache one key
        # longer than the last step's, so it plans again (the other layers find that plan)
        longer = torch.randn(1, 8, context + 4096, 64, device=dev, dtype=dt).transpose(1, 2)
        steps = itertools.count()

        def new_plan():
            n = context + next(steps) % 4096
            return api.DecodePlan._for_call(q, longer[:, :n], 0, *call_args)

        def new_plan_and_run():
            n = context + next(steps) % 4096
            api.DecodePlan._for_call(q, longer[:, :n], 0, *call_args).run(q, longer[:, :n], longer[:, :n])

        row("a new plan (DecodePlan._for_call, cache 1 key longer)", new_plan)
        row("a new plan and its first run", new_plan_and_run)
        row("torch.empty (the output)", lambda: torch.empty(1, 1, 32, 64, device=dev, dtype=dt))
        row("3 x transpose", lambda: (query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)))
        row("out[..., :64]", lambda: out[..., :64])
        say(f"pieces (one layer, batch 1, {context} keys, 32 / 8 heads, d=64, bf16; {launch.num_splits} splits, "
            f"fused merge {launch.fused}); us per call, 5 rounds of 2000 calls each, round robin:")
        times = {name: [] for name in rows}
        for _ in range(5):
            for name, fn in rows.items():
                times[name].append(wall_us(fn, 2000, warmup=100))
        for name, ts in times.items():
            say(f"  {name:52s} min {min(ts):6.1f}  " + " ".join(f"{t:6.1f}" for t in ts))
        profiled = {"flashtile attention_forward": lambda: attention_forward(
            module, query, key, value, None, scaling=0.125, **extra), "a new plan and its first run": new_plan_and_run}
        for name, fn in profiled.items():
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(1000):
                fn()
            profile.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
            say(f"cProfile of 1000 calls of {name}, by own time:\n{text.getvalue()}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", default=None, help="directory for profile_hf_decode.txt")
    parser.add_argument("--pieces-only", action="store_true", help="only the host time of one layer's pieces")
    parser.add_argument("--trace", action="store_true", help="also torch.profiler tables of 4 steps each")
    args = parser.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AttentionInterface, DynamicCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from flashtile.bench.e2e import LLAMA_1B, build_hf

    device = torch.device("cuda")
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch 1, context {args.context}"]

    def say(text):
        lines.append(text)
        print(text, flush=True)

    pieces(args.context, say)
    models, spent = {}, {}
    for attn in () if args.pieces_only else ("flashtile", "sdpa"):
        models[attn] = build_hf(LLAMA_1B, attn, device, torch.bfloat16, args.context + 8 * args.steps).eval()
        spent[attn] = []
        AttentionInterface.register(attn, timed(ALL_ATTENTION_FUNCTIONS[attn], spent[attn]))
    prompt = torch.randint(LLAMA_1B.vocab, (1, args.context), device=device)
    for round_ in range(2):
        for attn, model in models.items():
            with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                past = DynamicCache(config=model.config)
                mask = torch.ones_like(prompt)
                model(input_ids=prompt, attention_mask=mask, past_key_values=past, use_cache=True)
                _, token, mask = decode_steps(model, prompt, mask, past, 8, device)  # warm-up
                layers = model.config.num_hidden_layers
                blocks, first, others, per_step = [], [], [], []
                for _ in range(3):
                    spent[attn].clear()
                    times, token, mask = decode_steps(model, token, mask, past, args.steps, device)
                    blocks.append(statistics.median(times) * 1e3)
                    steps = [spent[attn][i:i + layers] for i in range(0, len(spent[attn]), layers)]
                    first.append(statistics.median(step[0] for step in steps) * 1e6)
                    others.append(statistics.median(t for step in steps for t in step[1:]) * 1e6)
                    per_step.append(statistics.median(sum(step) for step in steps) * 1e3)
                name = attn if attn == "flashtile" else "sdpa-flash"
                def cols(values, digits):
                    return " ".join(f"{t:.{digits}f}" for t in values)

                say(f"round {round_} {name:10s}: ms/step {cols(blocks, 2)}; attention ms/step {cols(per_step, 2)}; "
                    f"first layer's call us {cols(first, 0)}, the others' {cols(others, 0)} (medians)")
                if round_ == 1 and args.trace:
                    from torch.profiler import ProfilerActivity
                    from torch.profiler import profile as trace

                    with trace(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        decode_steps(model, token, mask, past, 4, device)
                    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12)
                    say(f"torch.profiler {name}, 4 steps, by GPU time:\n{table}")
                    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
                    say(f"torch.profiler {name}, 4 steps, by CPU time:\n{table}")
                if round_ == 1:
                    profile = cProfile.Profile()
                    profile.enable()
                    decode_steps(model, token, mask, past, args.steps, device)
                    profile.disable()
                    text = io.StringIO()
                    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
                    say(f"cProfile {name}, {args.steps} steps, by own time:\n{text.getvalue()}")
            del past
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile_hf_decode.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
