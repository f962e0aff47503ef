"""One prefill backward (or forward) at a benchmark shape, for a profiler to look at.

    ncu -k regex:_bwd_kernel_sm90 -c 1 --section ... python scripts/profile_backward.py D SEQLEN [--causal]
    python scripts/profile_backward.py D SEQLEN [--causal] [--fa4] --kernels
    ncu -k regex:_fwd_kernel_sm90 --launch-skip 1 -c 1 ... \
        python scripts/profile_backward.py D SEQLEN [--causal] [--fa4] --forward

bf16, 16k tokens, heads x d = 2048 (the prefill benchmark's shapes); the forward and the backward
run twice (compilation, then the launch the profiler takes with -c 1 after --launch-skip 1).
--fa4 runs FlashAttention-4's instead (flash_attn.cute, its default backward). --kernels prints
each kernel of three more backward passes with its CUDA time (torch.profiler), i.e. how the
backward's time splits between the main kernel and the launches around it. --forward runs three
forwards and nothing else (no autograd graph).
"""

import sys

import torch


def main() -> None:
    d, s = int(sys.argv[1]), int(sys.argv[2])
    causal = "--causal" in sys.argv
    b, h = 16384 // s, 2048 // d
    forward_only = "--forward" in sys.argv
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda", requires_grad=not forward_only)
               for _ in range(3))
    if "--fa4" in sys.argv:
        from flash_attn.cute import flash_attn_func

        def attention():
            return flash_attn_func(q, k, v, causal=causal)[0]
    else:
        import flashtile

        def attention():
            return flashtile.flash_attn_func(q, k, v, causal=causal)
    if forward_only:
        for _ in range(3):
            attention()
        torch.cuda.synchronize()
        return
    dout = torch.randn_like(q)
    out = attention()
    for _ in range(2):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    if "--kernels" not in sys.argv:
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total = sum(e.device_time for e in events) / 3
    print(f"d={d} s={s} causal={causal} {'fa4' if '--fa4' in sys.argv else 'flashtile'}: "
          f"{total / 1e3:.3f} ms of kernels per backward")
    for e in events[:len(events) // 3]:
        print(f"  {e.device_time / 1e3:8.3f} ms  {e.name[:110]}")


if __name__ == "__main__":
    main()
