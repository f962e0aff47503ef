"""Where a decoding kernel's time goes past the read floor: its loop's pieces on its own grid.

    PYTHONPATH=src python scripts/decode_probe.py [BATCHxCONTEXTxSPLITS,...]

Per shape (fp16, 2 KV heads of 128, 8 query rows a KV head), device time by CUDA-graph replay over
four rotating caches, all in one process:
- floor: bench decode's read floor (every byte once, many small programs);
- m0: programs on the split kernel's grid (splits, kv heads, batch) that stream their keys tile after
  tile (tl.load, pipelined by num_stages) and write one number;
- m1: the online softmax with tl.dot on 16 query rows (8 real), no masks, over the same keys; the 8
  rows' output in fp16 (2 KB a program);
- m2: m1 with the key range from a lengths tensor and masked loads, as the split kernel;
- m3: m1 with each warp on its own keys of a tile (a batched tl.dot), the warps' states merged once;
- flashtile: flash_attn_with_kvcache(cache_seqlens=..., num_splits=SPLITS), merge included.
Tiles are BLOCK_N x warps x stages; 64 x 4 x 2 is what the split kernel takes.
"""
import sys

import torch
import triton
import triton.language as tl

import flashtile
from flashtile.bench.decode import _read_floor

TILES = ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2))


@triton.jit
def probe(Q, K, V, Out, Lens, s, num_splits, stride_b, stride_n, stride_h, D: tl.constexpr, BLOCK_N: tl.constexpr,
          MODE: tl.constexpr, W: tl.constexpr = 1):
    """One program: keys [split x per_split, ...) of (batch, kv head) as the split kernel cuts them;
    MODE 0 streams them, 1 adds the online softmax of 16 query rows, 2 the lengths and masks."""
    split = tl.program_id(0)
    kh = tl.program_id(1)
    b = tl.program_id(2)
    base = b.to(tl.int64) * stride_b + kh * stride_h
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    rows = tl.arange(0, 16)
    program = (b * tl.num_programs(1) + kh) * tl.num_programs(0) + split
    n = s
    if MODE == 2:
        n = tl.load(Lens + b)
    per_split = tl.cdiv(tl.cdiv(n, BLOCK_N), num_splits) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n)
    if MODE == 0:
        total = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            ptr = base + (start + offs_n)[:, None] * stride_n + offs_d[None, :]
            total += tl.load(K + ptr).to(tl.float32) * tl.load(V + ptr).to(tl.float32)
        tl.store(Out + program * 8 * D, tl.sum(total))  # one number: no output traffic
    elif MODE == 3:
        # m1 with each of the W warps on its own BLOCK_N / W keys of a tile: a batched dot puts one
        # warp on each batch, so the row max and sum stay inside a warp and P feeds the P V product
        # from registers; the W running states merge once, after the loop
        KW: tl.constexpr = BLOCK_N // W
        q = tl.load(Q + (b * tl.num_programs(1) + kh) * 16 * D + rows[:, None] * D + offs_d[None, :],
                    mask=rows[:, None] < 8, other=0.0)
        q3 = tl.broadcast_to(q[None, :, :], [W, 16, D])
        m_i = tl.full([W, 16], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([W, 16], dtype=tl.float32)
        acc = tl.zeros([W, 16, D], dtype=tl.float32)
        keys = tl.arange(0, W)[:, None] * KW + tl.arange(0, KW)[None, :]
        for start in range(lo, hi, BLOCK_N):
            rows_kv = base + (start + keys) * stride_n
            k_t = tl.load(K + rows_kv[:, None, :] + offs_d[None, :, None])  # K^T as loaded: (W, D, KW)
            v = tl.load(V + rows_kv[:, :, None] + offs_d[None, None, :])
            qk = tl.dot(q3, k_t) * 0.125
            m_new = tl.maximum(m_i, tl.max(qk, 2))
            p = tl.exp2(qk - m_new[:, :, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 2)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, :, None])
            m_i = m_new
        m = tl.max(m_i, 0)
        scale = tl.exp2(m_i - m[None, :])
        out = tl.sum(acc * scale[:, :, None], 0) / tl.sum(l_i * scale, 0)[:, None]
        tl.store(Out + program * 8 * D + rows[:, None] * D + offs_d[None, :], out.to(tl.float16),
                 mask=rows[:, None] < 8)
    else:
        q = tl.load(Q + (b * tl.num_programs(1) + kh) * 16 * D + rows[:, None] * D + offs_d[None, :],
                    mask=rows[:, None] < 8, other=0.0)
        m_i = tl.full([16], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([16], dtype=tl.float32)
        acc = tl.zeros([16, D], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n
            ptr = base + pos[:, None] * stride_n + offs_d[None, :]
            if MODE == 2:
                ok = pos < hi
                k = tl.load(K + ptr, mask=ok[:, None], other=0.0)
                v = tl.load(V + ptr, mask=ok[:, None], other=0.0)
            else:
                k = tl.load(K + ptr)
                v = tl.load(V + ptr)
            qk = tl.dot(q, tl.trans(k)) * 0.125
            if MODE == 2:
                qk = tl.where(ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        # the 8 real rows in fp16, as the split kernel's final output (no splits) or half its fp32 partial
        tl.store(Out + program * 8 * D + rows[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(tl.float16),
                 mask=rows[:, None] < 8)


def graph_us(fn, bufs, rep=40):
    for i in range(3):
        fn(*bufs[i % 4])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(rep):
            fn(*bufs[i % 4])
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / rep)
    return min(times)


def main() -> None:
    spec = sys.argv[1] if len(sys.argv) > 1 else "256x256x1,16x4096x8,8x8192x16,1x65536x128,1x131072x132"
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for item in spec.split(","):
        b, s, splits = (int(x) for x in item.split("x"))
        hk, d = 2, 128
        bufs = [(torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16),
                 torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16)) for _ in range(4)]
        q = torch.randn(b * hk * 16 * d, device="cuda", dtype=torch.float16)
        q_api = torch.randn(b, 1, 8 * hk, d, device="cuda", dtype=torch.float16)
        lens = torch.full((b,), s, device="cuda", dtype=torch.int32)
        out = torch.empty(b * hk * splits * 8 * d, device="cuda", dtype=torch.float16)
        res = {"floor": graph_us(lambda k, v: _read_floor(None, k, v), bufs),
               "flashtile": graph_us(lambda k, v: flashtile.flash_attn_with_kvcache(
                   q_api, k, v, cache_seqlens=lens, num_splits=splits), bufs)}
        for mode in (0, 1, 2, 3):
            for bn, warps, stages in TILES:
                def run(k, v, mode=mode, bn=bn, warps=warps, stages=stages):
                    probe[(splits, hk, b)](q, k, v, out, lens, s, splits, k.stride(0), k.stride(1), k.stride(2), D=d,
                                           BLOCK_N=bn, MODE=mode, W=warps, num_warps=warps, num_stages=stages)
                res[f"m{mode} {bn}x{warps}x{stages}"] = graph_us(run, bufs)
        print(item, " ".join(f"{k}={v:.1f}" for k, v in res.items()), flush=True)
        del bufs


if __name__ == "__main__":
    main()
