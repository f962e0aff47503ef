"""Train the small GPT on the shipped sonnets, character by character, then sample from it.

    python examples/gpt/train.py --plot loss.png                 # CPU, tiny model, a few minutes
    python -m flashtile.models.train --attn sdpa --steps 500 --device cuda --plot loss.png

AdamW (betas 0.9 / 0.95, weight decay 0.1 on matrices), the learning rate warmed up linearly then
decayed by a cosine to a tenth, gradients clipped at norm 1. The validation loss (the last 10% of
the text) is estimated every --eval-interval steps. The loss curve goes to --plot as a PNG.
On CUDA the steps run under bf16 autocast; the sample is drawn in float32.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from flashtile.models.gpt import ATTENTION, GPT, GPTConfig
from flashtile.models.text import CharTokenizer, get_batch, load_text, split


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="train.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--attn", choices=ATTENTION, default="flashtile", help="attention (default: %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=128, help="tokens per training sequence")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-kv-head", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout in training")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=30, help="learning-rate warm-up steps")
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--text", default="sonnets", help="a text in flashtile/models/data/")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--prompt", default="Shall I compare thee")
    p.add_argument("--sample-tokens", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--plot", metavar="FILE.png", help="write the loss curve here")
    args = p.parse_args(argv)
    if args.top_k is not None and args.top_k < 1:  # checked before training, not after it
        p.error(f"argument --top-k: must be >= 1, got {args.top_k}")
    if not args.temperature >= 0:
        p.error(f"argument --temperature: must be >= 0 (0: greedy), got {args.temperature}")
    return args


def lr_at(step: int, args) -> float:
    """Linear warm-up to args.lr, then a cosine down to args.lr / 10 at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr / 10 + (args.lr - args.lr / 10) * 0.5 * (1 + math.cos(math.pi * t))


def optimizer(model: GPT, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (not on norms' weights)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


@torch.no_grad()
def evaluate(model, data, args, generator) -> float:
    model.eval()
    losses = [model(*get_batch(data, args.batch_size, args.block_size, generator, args.device))[1].item()
              for _ in range(args.eval_batches)]
    model.train()
    return sum(losses) / len(losses)


def train(args) -> dict:
    """Train and sample; returns the losses, the sample and the timings."""
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    text = load_text(args.text)
    tok = CharTokenizer(text)
    train_data, val_data = split(tok.encode(text))
    config = GPTConfig(vocab_size=tok.vocab_size, block_size=max(args.block_size, len(args.prompt) + args.sample_tokens),
                       n_layer=args.n_layer, n_head=args.n_head, n_kv_head=args.n_kv_head, n_embd=args.n_embd,
                       dropout=args.dropout, attn=args.attn)
    model = GPT(config).to(args.device)
    opt = optimizer(model, args.lr)
    autocast = torch.autocast("cuda", torch.bfloat16) if args.device.startswith("cuda") else torch.autocast(
        "cpu", enabled=False)
    batches = torch.Generator().manual_seed(args.seed)
    evals = torch.Generator().manual_seed(args.seed + 1)
    print(f"{model.num_params() / 1e6:.2f}M parameters, attn={args.attn}, device={args.device}, "
          f"{len(train_data)} training / {len(val_data)} validation characters, vocabulary {tok.vocab_size}",
          flush=True)

    history = {"step": [], "loss": [], "val_step": [], "val_loss": []}
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc="training", file=sys.stderr, dynamic_ncols=True)
    for step in bar:
        if step % args.eval_interval == 0:
            history["val_step"].append(step)
            history["val_loss"].append(evaluate(model, val_data, args, evals))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = get_batch(train_data, args.batch_size, args.block_size, batches, args.device)
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        history["step"].append(step)
        history["loss"].append(loss.item())
        bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", val=f"{history['val_loss'][-1]:.3f}")
    bar.close()
    history["val_step"].append(args.steps)
    history["val_loss"].append(evaluate(model, val_data, args, evals))
    seconds = time.perf_counter() - start

    model.eval()
    prompt = tok.encode(args.prompt)[None].to(args.device)
    out = model.generate(prompt, args.sample_tokens, temperature=args.temperature, top_k=args.top_k,
                         generator=torch.Generator(args.device).manual_seed(args.seed))
    sample = tok.decode(out[0].tolist())
    return dict(history=history, sample=sample, seconds=seconds, config=config, params=model.num_params())


def plot(result: dict, args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = result["history"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(h["step"], h["loss"], linewidth=0.6, alpha=0.4, color="C0")
    ema, smooth = h["loss"][0], []
    for x in h["loss"]:
        ema = 0.9 * ema + 0.1 * x
        smooth.append(ema)
    ax.plot(h["step"], smooth, color="C0", label="training loss (per step, and its moving average)")
    ax.plot(h["val_step"], h["val_loss"], "o-", color="C1", label="validation loss")
    c = result["config"]
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats per character)")
    ax.set_title(f"char-level GPT on {args.text}.txt: {result['params'] / 1e6:.2f}M params, {c.n_layer} layers, "
                 f"d={c.n_embd}, {c.n_head}/{c.n_kv_head} heads\nattn={args.attn}, {args.device}, batch "
                 f"{args.batch_size} x {args.block_size}, {args.steps} steps in {result['seconds']:.0f} s; final "
                 f"val {h['val_loss'][-1]:.3f}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = train(args)
    h = result["history"]
    print(f"{args.steps} steps in {result['seconds']:.1f} s; final training loss {h['loss'][-1]:.3f}, "
          f"validation loss {h['val_loss'][-1]:.3f}")
    print(f"--- sample (temperature {args.temperature}, top-k {args.top_k}) ---")
    print(result["sample"])
    if args.plot:
        plot(result, args, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
