"""Tile sweep for the prefill kernels on the GPU: which tiles for the forward and the backward.

Replaces configs.forward_config or configs.backward_config with one candidate at a time and times
the forward or the whole backward at bf16, batch x seqlen = 16k, nheads x d = 2048, causal and not.
Backward candidates are one-launch grids (F: dK/dV rows, keys, dQ rows, keys, warps, stages) or two
launches (S: a dK/dV BlockConfig and a dQ BlockConfig); each candidate's gradients are compared
with the first candidate's (the configs in use when the list was written) before it is timed.
Prints a table and writes sweep_<kernels>_d<ds>_s<seqlens>.json (after every row) to the folder
given as the first argument, with each compiled kernel's registers and spills.

    PYTHONPATH=src python scripts/sweep_prefill.py OUTDIR [d,d,...] [seqlen,seqlen,...] [forward,backward] [dropout_p]

With dropout_p > 0 every candidate runs with dropout (one fixed seed) and the backward's candidates
come from DROPOUT_CANDIDATES.
"""

import os
import sys

import torch

from flashtile.bench import harness
from flashtile.ops import backward, configs, forward, prefill
from flashtile.ops.configs import BackwardConfig, BlockConfig

C = BlockConfig


def F(m1, n1, m2, n2, warps, stages):
    return BackwardConfig(C(m1, n1, warps, stages), C(m2, n2, warps, stages), True)


def S(dkdv, dq, tma=False, chunk=1, dq_chunk=1, dq_tma=False, pdl=False):
    return BackwardConfig(C(*dkdv), C(*dq), False, dkdv_tma=tma, dq_tma=dq_tma, head_chunk=chunk,
                          dq_head_chunk=dq_chunk, pdl=pdl)


def variants(cfg):
    """cfg without and with PDL for the dK/dV launch."""
    return [cfg, cfg._replace(pdl=True)]


CANDIDATES = {
    "forward": {
        64: [C(128, 64, 4, 3), C(128, 64, 8, 3), C(128, 128, 8, 3), C(128, 128, 8, 2), C(64, 64, 4, 3),
             C(128, 32, 4, 4), C(64, 128, 4, 3), C(128, 128, 4, 3)],
        128: [C(128, 64, 8, 3), C(128, 128, 8, 3), C(128, 64, 4, 3), C(64, 64, 4, 3), C(128, 32, 4, 3),
              C(128, 128, 8, 2), C(64, 128, 4, 3), C(128, 64, 8, 4)],
        256: [C(64, 64, 4, 2), C(128, 64, 8, 2), C(64, 32, 4, 3), C(128, 32, 8, 3), C(64, 64, 8, 2),
              C(128, 64, 8, 3), C(64, 32, 8, 2)],
    },
    # the first of each list (per causal) is the reference for the gradient check. dK/dV tiles
    # with BLOCK_N >= 64 spill at d=128, but the spill-free BLOCK_N = 32 ones measured 1.5-2.5x
    # slower (sweep_dkdv_d64-128_s4096.json), so the lists stay near the spilling ones
    "backward": {
        64: {False: variants(S((32, 128, 4, 3), (64, 64, 4, 3), dq_tma=True)),
             True: variants(S((32, 128, 4, 3), (128, 64, 8, 3), chunk=4, dq_tma=True))},
        128: {False: variants(S((64, 64, 4, 2), (128, 64, 8, 3), True, dq_tma=True)),
              True: variants(S((64, 64, 4, 2), (128, 64, 8, 3), True, chunk=16, dq_chunk=16, dq_tma=True))},
        256: {False: [S((32, 32, 4, 2), (64, 32, 4, 1)), F(32, 32, 64, 32, 4, 2), S((64, 64, 8, 1), (64, 64, 8, 1)),
                      S((32, 64, 8, 1), (128, 32, 8, 1)), S((16, 64, 4, 2), (64, 32, 4, 2))],
              True: [S((64, 64, 8, 1), (64, 32, 4, 1)), F(32, 32, 64, 32, 4, 2), S((32, 32, 4, 2), (64, 64, 8, 1)),
                     S((32, 64, 8, 1), (128, 32, 8, 1)), S((16, 64, 4, 2), (64, 32, 4, 2))]},
    },
}
# dK/dV tiles with few spills once the Philox temporaries join the accumulators (ptxas -v, sm_90,
# HAS_DROPOUT: d=128 (64, 64, 4, 2) with TMA 880 bytes, (32, 64, 4, 2) 76, (32, 128, 8, 2) 96,
# (64, 128, 8, 1) 104; d=64 (32, 128, 4, 3) 888, (32, 128, 8, 3) 48)
DROPOUT_CANDIDATES = {
    64: {c: [S((32, 128, 4, 3), (64, 64, 4, 3), dq_tma=True), S((32, 128, 8, 3), (64, 64, 4, 3), dq_tma=True),
             S((32, 64, 4, 3), (64, 64, 4, 3), dq_tma=True), S((32, 128, 8, 3), (128, 64, 8, 3), dq_tma=True)]
         for c in (False, True)},
    128: {c: [S((64, 64, 4, 2), (128, 64, 8, 3), True, dq_tma=True), S((32, 64, 4, 2), (128, 64, 8, 3), True, dq_tma=True),
              S((32, 128, 8, 2), (128, 64, 8, 3), True, dq_tma=True), S((64, 128, 8, 1), (128, 64, 8, 3), True, dq_tma=True),
              S((32, 64, 4, 2), (64, 64, 4, 3), True, dq_tma=True)]
          for c in (False, True)},
}
PATCH = {"forward": "forward_config", "backward": "backward_config"}
# the Hopper kernels' dispatch, switched off while a Triton candidate runs (it would take the calls on sm_90)
HOPPER_PATCH = {"forward": "hopper_forward_config", "backward": "hopper_backward_config"}
DROPOUT_P = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0


def candidates(kernel, d, causal):
    if kernel == "backward" and DROPOUT_P > 0:
        return DROPOUT_CANDIDATES[d][causal]
    lists = CANDIDATES[kernel][d]
    return lists[causal] if kernel == "backward" else lists


def launch_times(fn, reps: int = 10) -> list:
    """Device milliseconds of each kernel launch that fn() makes, in launch order (medians over
    reps), from torch.profiler: the backward's dQ and dK/dV launches (or delta and one)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "_kernel" in e.name), key=lambda e: e.time_range.start)
    per_call = len(kernels) // reps
    times = [sorted(e.device_time for e in kernels[i::per_call])[reps // 2] / 1e3 for i in range(per_call)]
    return [round(t, 4) for t in times]


def time_config(kernel, cfg, d, causal, seqlen=4096, tokens=16384, reference=None):
    """(ms, TFLOP/s, registers and spills of the kernels this candidate compiled, gradients)."""
    b, h = tokens // seqlen, 2048 // d
    gen = torch.Generator(device="cuda").manual_seed(0)  # the same inputs for every candidate
    q, k, v, do = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(4))
    scale, window = d ** -0.5, (None, 0 if causal else None)
    dropout = (DROPOUT_P, torch.tensor([12345, 678], dtype=torch.int64, device="cuda")) if DROPOUT_P > 0 else None
    original, hopper = getattr(configs, PATCH[kernel]), getattr(configs, HOPPER_PATCH[kernel])
    setattr(configs, PATCH[kernel], lambda *a, **k: cfg)
    setattr(configs, HOPPER_PATCH[kernel], lambda *a, **k: None)
    jit = forward._fwd_kernel if kernel == "forward" else backward._bwd_kernel
    jit.__dict__.pop("_flashtile_launches", None)  # ops._launch's cache: this config's launches from here
    compiled_so_far = jit.device_caches[torch.cuda.current_device()][0]  # Triton's own: key -> CompiledKernel
    known = set(map(id, compiled_so_far.values()))
    grads, launch_ms = None, None
    try:
        out, lse = prefill.attention_forward(q, k, v, scale, window, dropout=dropout)
        if kernel == "forward":
            ms = harness.bench_ms(lambda: prefill.attention_forward(q, k, v, scale, window, dropout=dropout))
            f = 4 * b * h * seqlen * seqlen * d
        else:
            grads = prefill.attention_backward(do, q, k, v, out, lse, scale, window, dropout=dropout)
            if reference is not None:
                for name, got, ref in zip(("dq", "dk", "dv"), grads, reference):
                    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    if not err < 1e-2:  # bf16 outputs of the same sums in another order: ~4e-3
                        raise AssertionError(f"{name} differs from the reference candidate's: {err:.3g}")
            ms = harness.bench_ms(lambda: prefill.attention_backward(do, q, k, v, out, lse, scale, window, dropout=dropout))
            try:
                launch_ms = launch_times(lambda: prefill.attention_backward(do, q, k, v, out, lse, scale, window,
                                                                            dropout=dropout))
            except Exception as e:  # the profiler's event API moves between torch versions
                launch_ms = repr(e)[:200]
            f = 2.5 * 4 * b * h * seqlen * seqlen * d
    finally:
        setattr(configs, PATCH[kernel], original)
        setattr(configs, HOPPER_PATCH[kernel], hopper)
    compiled = [c for c in compiled_so_far.values() if id(c) not in known]  # what this candidate compiled
    regs = {"regs": [c.n_regs for c in compiled], "spills": [c.n_spills for c in compiled]}
    if launch_ms is not None:
        regs["launch_ms"] = launch_ms
    return ms, f / (2 if causal else 1) / ms * 1e-9, regs, grads


def label(cfg) -> str:
    if isinstance(cfg, BackwardConfig):
        a, b = cfg.dkdv, cfg.dq
        if cfg.fused:
            return f"F({a.block_m}, {a.block_n}, {b.block_m}, {b.block_n}, {a.num_warps}, {a.num_stages})"
        extra = ((", tma" if cfg.dkdv_tma else "") + (", dq_tma" if cfg.dq_tma else "")
            + (f", chunk={cfg.head_chunk}" if cfg.head_chunk > 1 else "")
                 + (f", dq_chunk={cfg.dq_head_chunk}" if cfg.dq_head_chunk > 1 else "")
                 + (", pdl" if cfg.pdl else ""))
        return f"S({tuple(a)}, {tuple(b)}{extra})"
    return str(tuple(cfg))


def main():
    out_dir = sys.argv[1]
    ds = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [64, 128]
    seqlens = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [4096]
    kernels = sys.argv[4].split(",") if len(sys.argv) > 4 else list(CANDIDATES)
    rows, env = [], harness.environment()
    name = (f"sweep_{'-'.join(kernels)}_d{'-'.join(map(str, ds))}_s{'-'.join(map(str, seqlens))}"
            + (f"_dropout{DROPOUT_P}" if DROPOUT_P > 0 else "") + ".json")
    path = os.path.join(out_dir, name)  # rewritten after every row
    for kernel in kernels:
        for d in ds:
            for seqlen in seqlens:
                for causal in (False, True):
                    reference = None
                    for cfg in candidates(kernel, d, causal):
                        try:
                            ms, tflops, regs, grads = time_config(kernel, cfg, d, causal, seqlen,
                                                                  reference=reference)
                            reference = grads if reference is None else reference
                        except Exception as e:
                            print(f"{kernel:8s} d={d} s={seqlen} causal={causal:d} {label(cfg)}: {repr(e)[:200]}",
                                  flush=True)
                            continue
                        rows.append(dict(kernel=kernel, d=d, seqlen=seqlen, causal=causal, label=label(cfg), config=cfg,
                                         ms=ms, tflops=tflops, **regs))
                        print(f"{kernel:8s} d={d:3d} s={seqlen:5d} causal={causal:d} {label(cfg):34s} "
                              f"{ms:7.3f} ms {tflops:6.1f} TFLOP/s {regs}", flush=True)
                        harness.write_result(path, {"env": env, "rows": rows}, quiet=True)
    best = {}
    for r in rows:
        key = (r["kernel"], r["d"], r["seqlen"], r["causal"])
        if key not in best or r["tflops"] > best[key]["tflops"]:
            best[key] = r
    for key, r in sorted(best.items()):
        print("BEST", key, r["label"], f"{r['tflops']:.1f}")


if __name__ == "__main__":
    main()
