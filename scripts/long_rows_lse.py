"""The Hopper forward's LSE and output against the Triton kernel's on rows that see 4M keys.

    PYTHONPATH=src python scripts/long_rows_lse.py

bf16, one batch, 128 query rows (causal, bottom-right: every row sees about all keys), 2 heads
over one K/V head, 2^22 - 256 keys (the longest whose ALiBi the Hopper kernels take), scale 0.1;
d 64 and 128, without ALiBi and with slopes 1e-6 / 3e-6 (the farthest keys' bias about -4 and
-13). Prints the LSE's mean and largest difference and the output's largest difference. Long rows
show error that grows with the number of key blocks: the row sums' accumulation (NOTES.md "ALiBi
on the Hopper kernels").
"""

import sys

import torch

sys.path.insert(0, "tests")
from prefill_check import make_qkv  # noqa: E402

from flashtile.ops import configs, forward  # noqa: E402
from flashtile.ops._common import ALIBI_MAX_POSITION  # noqa: E402


def main() -> None:
    sk = ALIBI_MAX_POSITION - 256
    slopes = torch.tensor([1e-6, 3e-6], device="cuda")
    saved = configs.hopper_forward_config
    for d in (64, 128):
        q, k, v = make_qkv(1, 128, sk, 2, 1, d, torch.bfloat16, "cuda")
        for sl in (None, slopes):
            configs.hopper_forward_config = lambda d, *a, **kw: configs.hopper_forward_tiles(d)
            out, lse = forward.attention_forward(q, k, v, 0.1, (None, 0), alibi_slopes=sl)
            configs.hopper_forward_config = lambda *a, **kw: None
            ref, ref_lse = forward.attention_forward(q, k, v, 0.1, (None, 0), alibi_slopes=sl)
            configs.hopper_forward_config = saved
            print(f"d={d} alibi={sl is not None}: lse hopper - triton mean {(lse - ref_lse).mean():.2e} "
                  f"max |.| {(lse - ref_lse).abs().max():.2e}; out max |.| {(out - ref).abs().max():.2e}", flush=True)
        del q, k, v


if __name__ == "__main__":
    main()
