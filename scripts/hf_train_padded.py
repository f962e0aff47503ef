"""transformers' LlamaForCausalLM training on a padded batch with attn_implementation="flashtile":
ms per step and the step's device synchronisations, on the GPU machine (issue 12).

    PYTHONPATH=src python scripts/hf_train_padded.py BATCH SEQLEN [TAG]

The Llama-3.2-1B shape of bench e2e (random weights, bf16), a step = forward, backward and a fused
AdamW update over BATCH x SEQLEN tokens, row i left-padded by i * SEQLEN / (2 * BATCH) tokens
(padding labels -100). Prints the median ms of 8 steps after 3 (bench e2e's median_ms), tokens/s
of real tokens, and the synchronisations of one more step (torch.cuda.set_sync_debug_mode),
grouped by where they happen. TAG labels the line (the tree, when trees alternate).
"""

import sys

import torch

from flashtile.bench import e2e, harness


def main() -> None:
    batch, seqlen = int(sys.argv[1]), int(sys.argv[2])
    tag = sys.argv[3] if len(sys.argv) > 3 else ""
    device = torch.device("cuda")
    model = e2e.build_hf(e2e.LLAMA_1B, "flashtile", device, torch.bfloat16, seqlen).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator(device).manual_seed(0)
    ids = torch.randint(1, 32000, (batch, seqlen), device=device, generator=gen)
    mask = torch.ones_like(ids)
    for i in range(batch):
        mask[i, :i * seqlen // (2 * batch)] = 0
    labels = ids.masked_fill(mask == 0, -100)

    def step():
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        model.zero_grad(set_to_none=True)

    ms = e2e.median_ms(step, device, 3, 8)
    syncs = harness.synchronisations(step)
    print(f"{tag} batch {batch} x {seqlen} left-padded: {ms:7.1f} ms a step, {int(mask.sum()) / ms * 1e3:8.0f} tok/s "
          f"of real tokens; {sum(syncs.values())} synchronisations a step", flush=True)
    for where, n in sorted(syncs.items(), key=lambda kv: -kv[1])[:4]:
        print(f"    {n:4d}  {where}", flush=True)


if __name__ == "__main__":
    main()
