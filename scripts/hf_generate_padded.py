"""transformers' generate over a left-padded batch (prompts of different lengths, as a batched
generate makes them): ms per decoding step, on the GPU machine (issue 12).

    PYTHONPATH=src python scripts/hf_generate_padded.py BATCH CONTEXT IMPLS [TAG] [ROUNDS]

The Llama-3.2-1B shape of bench e2e (random weights, bf16). Row i of the BATCH x CONTEXT prompt
has its first i * CONTEXT / (2 * BATCH) tokens masked as padding. IMPLS: comma list of flashtile,
sdpa (torch's own pick; its FlashAttention-2 backend takes no mask, so sdpa-flash cannot run
here). Per implementation, ROUNDS (default 2) rounds in this process, each a 33-token generate
minus a 1-token one, over 32, after a 4-token warm-up generate. TAG labels the lines (e.g. the
tree, when two trees alternate in separate processes).
"""

import sys
import time

import torch

from flashtile.bench import e2e


def generate(model, prompt, mask, n: int):
    return model.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0)


def main() -> None:
    batch, context, impls = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    tag = sys.argv[4] if len(sys.argv) > 4 else ""
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    device = torch.device("cuda")
    for _ in range(rounds):
        for impl in impls:
            model = e2e.build_hf(e2e.LLAMA_1B, impl, device, torch.bfloat16, context + 300).eval()
            gen = torch.Generator(device).manual_seed(0)
            prompt = torch.randint(1, 32000, (batch, context), device=device, generator=gen)
            mask = torch.ones_like(prompt)
            for i in range(batch):
                pad = i * context // (2 * batch)
                mask[i, :pad] = 0
                prompt[i, :pad] = 0

            with torch.no_grad():
                generate(model, prompt, mask, 4)
                took = {}
                for n in (1, 33):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    generate(model, prompt, mask, n)
                    torch.cuda.synchronize()
                    took[n] = time.perf_counter() - start
            print(f"{tag} {impl:10s} batch {batch} x {context} left-padded: {(took[33] - took[1]) / 32 * 1e3:7.2f} "
                  f"ms a step", flush=True)
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
