"""Train flashtile's small GPT on Shakespeare's sonnets, character by character, sample from it,
and plot the loss curve (flashtile.models.train holds the loop; run with --help for the options).
Needs tqdm and matplotlib: pip install "flashtile[bench]".

    python examples/gpt/train.py --plot examples/gpt/loss_cpu.png               # CPU: ~1-2 minutes
    python examples/gpt/train.py --attn sdpa --device cuda --steps 2000 --n-layer 6 --n-embd 384 \
        --n-head 6 --n-kv-head 2 --block-size 256 --batch-size 64 --lr 1e-3 --plot loss_gpu.png
"""

import sys

from flashtile.models.train import main

if __name__ == "__main__":
    sys.exit(main())
