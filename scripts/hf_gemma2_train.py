"""transformers' Gemma2ForCausalLM training with softcapped, partly windowed attention: flashtile
against transformers' eager attention and FlexAttention, tokens/s and peak memory (issue 12; the
Hopper kernels' softcap, issue 16).

    PYTHONPATH=src python scripts/hf_gemma2_train.py [SEQLENS] [IMPLS] [--tiny]

Gemma-2-2B's attention and widths with random weights, bf16: hidden 2304, 8 query / 4 key-value heads
of 256 dims, attention logits capped at 50 (softcap), every other layer a 4096-token sliding
window, final logits capped at 30; 8 layers instead of 26 and a 32k vocabulary instead of 256k,
so that eager attention fits at 8k. SDPA is not a peer: transformers' SDPA path drops the cap.
A step = forward, backward and a fused AdamW update over 8192 tokens (batch 8192 / seqlen),
median of 6 steps after 3 (bench e2e's median_ms); each implementation in its own process (a
model built once per process, FlexAttention's compilation not shared), and the first step's loss
from the same weights and tokens, so the three can be compared. Prints one line per
(implementation, seqlen). --tiny: 2 small layers at 64 tokens (the CPU smoke run).
"""

import json
import subprocess
import sys

import torch

SEQLENS = (2048, 4096, 8192)
IMPLS = ("eager", "flashtile", "flex_attention")  # eager first: the others' lines give their ratio to it
TOKENS = 8192


def build(attn: str, tiny: bool, device):
    from transformers import AutoModelForCausalLM, Gemma2Config

    if attn == "flashtile":
        from flashtile.integrations.transformers import register

        register()
    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, sliding_window=32) if tiny else \
        dict(vocab_size=32000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=256, sliding_window=4096)
    config = Gemma2Config(**sizes, query_pre_attn_scalar=sizes["head_dim"], attn_logit_softcapping=50.0,
                          final_logit_softcapping=30.0, max_position_embeddings=16384, tie_word_embeddings=False,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32).train()


def child(attn: str, seqlens, tiny: bool) -> None:
    from flashtile.bench import e2e

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build(attn, tiny, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    tokens = 128 if tiny else TOKENS
    for seqlen in seqlens:
        gen = torch.Generator(device).manual_seed(seqlen)
        ids = torch.randint(3, model.config.vocab_size, (tokens // seqlen, seqlen), device=device, generator=gen)
        row = dict(impl=attn, seqlen=seqlen, batch=ids.shape[0])
        try:
            with torch.no_grad():
                row["first_loss"] = float(model(input_ids=ids, labels=ids).loss)

            def step():
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                model.zero_grad(set_to_none=True)

            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            ms = e2e.median_ms(step, device, 1 if tiny else 3, 1 if tiny else 6)
            row.update(ms=ms, tok_s=ids.numel() / ms * 1e3)
            if device.type == "cuda":
                row["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        except torch.OutOfMemoryError:
            row["error"] = "oom"
        except Exception as e:  # a path transformers refuses: record it, go on
            row["error"] = repr(e)[:200]
        model.zero_grad(set_to_none=True)
        print("ROW", json.dumps(row), flush=True)


def main() -> None:
    argv = [a for a in sys.argv[1:] if a != "--tiny"]
    tiny = "--tiny" in sys.argv
    if argv and argv[0] == "--child":
        return child(argv[1], [int(s) for s in argv[2].split(",")], tiny)
    seqlens = argv[0] if argv else ",".join(map(str, (32, 64) if tiny else SEQLENS))
    impls = argv[1].split(",") if len(argv) > 1 else IMPLS
    base = {}
    for attn in impls:
        run = subprocess.run([sys.executable, __file__, "--child", attn, seqlens] + (["--tiny"] if tiny else []),
                             capture_output=True, text=True)
        rows = [json.loads(line[4:]) for line in run.stdout.splitlines() if line.startswith("ROW ")]
        if run.returncode != 0 and not rows:
            rows = [dict(impl=attn, error=run.stderr.strip().splitlines()[-1][:200] if run.stderr else "failed")]
        for r in rows:
            if "ms" not in r:
                print(f"{r['impl']:15s} seqlen {r.get('seqlen', '-')}: {r.get('error')}", flush=True)
                continue
            if attn == "eager":
                base[r["seqlen"]] = r
            vs = f"  {base[r['seqlen']]['ms'] / r['ms']:.2f}x eager" if r["seqlen"] in base else ""
            mem = f"  peak {r['peak_gb']:.1f} GB" if "peak_gb" in r else ""
            print(f"{r['impl']:15s} {r['batch']} x {r['seqlen']:5d}: {r['ms']:8.1f} ms a step, {r['tok_s']:8.0f} "
                  f"tok/s{vs}{mem}  first loss {r['first_loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
