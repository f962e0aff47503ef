"""One prefill backward at a benchmark shape, for a profiler to look at.

    ncu -k regex:_bwd_kernel_sm90 -c 1 --section ... python scripts/profile_backward.py D SEQLEN [--causal]

bf16, 16k tokens, heads x d = 2048 (the prefill benchmark's shapes); the forward and the backward
run twice (compilation, then the launch the profiler takes with -c 1 after --launch-skip 1).
"""

import sys

import torch

from flashtile.ops import backward, forward


def main() -> None:
    d, s = int(sys.argv[1]), int(sys.argv[2])
    causal = "--causal" in sys.argv
    b, h = 16384 // s, 2048 // d
    q, k, v, dout = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    window = (None, 0) if causal else (None, None)
    for _ in range(2):
        out, lse = forward.attention_forward(q, k, v, d ** -0.5, window)
        backward.attention_backward(dout, q, k, v, out, lse, d ** -0.5, window)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
