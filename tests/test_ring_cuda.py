"""Ring attention on GPUs: one rank's NCCL group against flash_attn_func, every simulated rank's
schedule on one GPU (bench ring's code path) against one kernel call, and with two GPUs a real
NCCL ring (P2P on the side stream) against the float64 oracle."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ring_check import Case, check, worker

import flashtile
from flashtile import distributed
from flashtile.bench import ring as bench
from flashtile.distributed import ring, unshard_sequence

pytestmark = pytest.mark.cuda


def test_one_rank_nccl_is_one_call(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        gen = torch.Generator("cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(2, 1024, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
                         for _ in range(4))
        results = []
        for fn in (distributed.ring_flash_attn_func, flashtile.flash_attn_func):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out, lse, _ = fn(*leaves, causal=True, window_size=(300, 0), return_attn_probs=True)
            results.append([out, lse, *torch.autograd.grad(out, leaves, dout)])
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
            if name == "dq":  # the Hopper backward's TMA reductions add dQ in whatever order programs finish
                torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-2)
            else:
                assert torch.equal(a, b), name
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("causal, layout", [(False, "zigzag"), (True, "zigzag"), (True, "contiguous")])
def test_simulated_schedules_equal_one_call(causal, layout):
    """bench ring's schedules (the ring's loops, K/V from a list) on the GPU: the gathered output and
    dQ (complete on each rank; its dK/dV are partial by construction) against one kernel call."""
    problem = bench.Problem(8192, 16, 128, causal, torch.bfloat16, "cuda")
    s = bench.Schedule(problem, 4, layout)
    for r in range(4):
        s.forward(r)
    assert s.max_err() <= 4 * torch.finfo(torch.bfloat16).eps * float(problem.out.float().abs().max())
    dq = [ring.backward_pass(s.rings[r], s.dout[r], s.q[r], *s.kv[r], *s.outs[r], s.transports[r])[0]
          for r in range(4)]
    ref = problem.backward()[0].float()
    got = unshard_sequence(dq, layout=layout)
    assert float((got - ref).abs().max()) <= 8 * torch.finfo(torch.bfloat16).eps * float(ref.abs().max())


CASES = {
    "causal-gqa": Case(1, 2048, heads=(8, 2), headdim=128, causal=True),
    "full-contiguous": Case(2, 2048, heads=(8, 8), headdim=64, layout="contiguous"),
    "window-sink": Case(3, 2048, heads=(4, 2), headdim=128, causal=True, window=(300, 0), sink=True),
    "dropout-causal": Case(4, 1024, heads=(4, 2), headdim=64, causal=True, dropout_p=0.2, batch=1),
    "varlen-causal": Case(5, None, heads=(8, 2), headdim=128, causal=True, lengths=(1024, 256, 2048)),
}


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory):
    # NVLink multicast (NVLS) off, as the GPU machines need: the spawned ranks inherit these
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")
    out = tmp_path_factory.mktemp("ring_nccl")
    mp.spawn(worker, (2, str(out / "init"), CASES, str(out), False, "cuda"), nprocs=2)
    return {name: [torch.load(out / f"{name}-{r}.pt") for r in range(2)] for name in CASES}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name", CASES)
def test_two_gpus(two_gpus, name):
    check(CASES[name], 2, two_gpus[name], rng_device="cuda")
