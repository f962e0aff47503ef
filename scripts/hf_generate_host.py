"""transformers' generate with attn_implementation="flashtile" against SDPA-flash: where the host
time of a decoding step goes (issue 12), on the GPU machine.

    PYTHONPATH=src python scripts/hf_generate_host.py [CONTEXT] [ROUNDS]

The Llama-3.2-1B shape of bench e2e (random weights, bf16), batch 1, a prompt of CONTEXT tokens
(default 4096). Per implementation, ROUNDS (default 3) alternating rounds of: ms per decoding step
(a 65-token generate minus a 1-token one, over 64), the host time spent inside the attention
function and the mask function per step (their registered entries wrapped with a timer: in place,
between the model's other layers, not in a loop of their own), and Python function calls of a
9-token generate (cProfile). Then the device synchronisations (torch.cuda.set_sync_debug_mode)
of one training step (forward + backward, 2 x 2048 tokens) and of an 11-token generate with
flashtile, grouped by where they happen.
"""

import contextlib
import cProfile
import pstats
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtile.bench import e2e, harness

DEVICE = torch.device("cuda")
spent: dict = {}


def _timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return out
    wrapper._timed = True
    return wrapper


def _wrap_entries() -> None:
    """Time the registered attention and mask functions of flashtile and sdpa (again after a model
    build, which registers flashtile's afresh)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for key in ("flashtile", "sdpa"):
        for interface, tag in ((AttentionInterface, "attention"), (AttentionMaskInterface, "mask")):
            fn = interface._global_mapping[key]
            if not getattr(fn, "_timed", False):
                interface._global_mapping[key] = _timed(tag, fn)


def generate(model, prompt, n: int):
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)


def host_rounds(context: int, rounds: int) -> None:
    for _ in range(rounds):
        for impl in ("flashtile", "sdpa-flash"):
            model = e2e.build_hf(e2e.LLAMA_1B, impl.split("-")[0], DEVICE, torch.bfloat16, context + 300).eval()
            _wrap_entries()
            prompt = torch.randint(32000, (1, context), device=DEVICE)
            pin = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if impl == "sdpa-flash" else contextlib.nullcontext()
            with pin, torch.no_grad():
                generate(model, prompt, 4)
                took = {}
                for n in (1, 65):
                    spent.clear()
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    generate(model, prompt, n)
                    torch.cuda.synchronize()
                    took[n] = (time.perf_counter() - start, dict(spent))
                per_step = {k: (took[65][1].get(k, 0.0) - took[1][1].get(k, 0.0)) / 64 * 1e3
                            for k in ("attention", "mask")}
                profile = cProfile.Profile()
                profile.enable()
                generate(model, prompt, 9)
                profile.disable()
            print(f"{impl:10s} context {context}: {(took[65][0] - took[1][0]) / 64 * 1e3:6.2f} ms a step, attention "
                  f"{per_step['attention']:.3f} ms, mask {per_step['mask']:.3f} ms of it; "
                  f"{pstats.Stats(profile).total_calls} Python calls in a 9-token generate", flush=True)
            del model
            torch.cuda.empty_cache()


def syncs(context: int) -> None:
    model = e2e.build_hf(e2e.LLAMA_1B, "flashtile", DEVICE, torch.bfloat16, context + 300)

    def count(label, fn):
        fn()
        calls = harness.synchronisations(fn)
        print(f"{label}: {sum(calls.values())} synchronisations")
        for where, n in sorted(calls.items(), key=lambda kv: -kv[1])[:6]:
            print(f"  {n:4d}  {where}")

    ids = torch.randint(32000, (2, 2048), device=DEVICE)
    model.train()
    count("flashtile training step (forward + backward, 2 x 2048)", lambda: model(ids, labels=ids).loss.backward())
    model.eval()
    prompt = torch.randint(32000, (1, context), device=DEVICE)
    with torch.no_grad():
        count(f"flashtile generate, {context} + 11 tokens", lambda: generate(model, prompt, 11))


def main() -> None:
    context = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    host_rounds(context, rounds)
    syncs(context)


if __name__ == "__main__":
    main()
