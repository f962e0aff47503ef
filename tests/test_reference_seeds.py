"""The seeds' worked examples, run through the references.

Seed 000 walks the online softmax of [3.01, 0.09, 2.48, 1.95] in two blocks; seed 002 prints an FA2
loop that a reader found wrong and a corrected version of it.
"""

import math

import pytest
import torch
from reference_cases import HBMWrites

from flashtile.reference import fa1, fa2


def test_seed000_online_softmax_in_two_blocks():
    """FA1 with B_c = 2 on one query whose scores are [3.01, 0.09, 2.48, 1.95] (v = identity, so O is
    the softmax row). After block 1 HBM holds m, l; after block 2, l * O is the seed's f(x)."""
    row = [3.01, 0.09, 2.48, 1.95]
    q = torch.tensor([1.0, 0, 0, 0], dtype=torch.float64).view(1, 1, 1, 4)
    k = torch.zeros(1, 4, 1, 4, dtype=torch.float64)
    k[0, :, 0, 0] = torch.tensor(row, dtype=torch.float64)  # q . k_j = row[j]
    v = torch.eye(4, dtype=torch.float64).view(1, 4, 1, 4)
    sram = 4 * 4 * 8 * 2  # B_c = ceil(M / 4d) = 2 keys per block in float64
    rec = HBMWrites()
    out, l, m = fa1.forward(q, k, v, softmax_scale=1.0, sram_bytes=sram, counter=rec)
    (_, l1, m1), (O2, l2, m2) = rec.writes[1], rec.writes[2]  # after block 1, after block 2

    # the seed's numbers, to the digits it prints (it truncates: 0.0539 -> 0.053, 1.0539 -> 1.053)
    assert m1.item() == 3.01
    assert l1.item() == pytest.approx(1.053, abs=1e-3)  # l(1) = 1 + e^{0.09 - 3.01}
    assert m2.item() == 3.01  # the max did not change
    f = (l2[..., None] * O2).flatten()  # the numerators f(x), rescaled to the new max
    assert f[0].item() == pytest.approx(1.0, abs=1e-15) and f[1].item() == pytest.approx(0.053, abs=1e-3)
    correction = f[2].item()  # e^{2.48 - 3.01}: block 2's own max entry, rescaled
    assert correction == pytest.approx(0.59, abs=5e-3)
    assert (f[2] + f[3]).item() / correction == pytest.approx(1.59, abs=5e-3)  # 1 + e^{-0.53}
    assert l2.item() == pytest.approx(1.99, abs=5e-3)  # 1.053 + 0.59 x 1.59
    assert out[0, 0, 0, 0].item() == pytest.approx(0.5028, abs=5e-5)  # softmax(3.01) = 50.28%
    total = sum(math.exp(x) for x in row)
    assert out[0, 0, 0].tolist() == pytest.approx([math.exp(x) / total for x in row], abs=1e-15)


def _seed002_loop(Q, K, V, Br, Bc, corrected):
    """Seed 002's FA2 loop (N x d tensors, no softmax scale, EPSILON in l as printed). corrected=False
    is the article's version, which never stores l_i and m_i back inside the KV loop."""
    EPSILON = 1e-10
    O_blocks = []
    for Qi in torch.split(Q, Br, dim=0):
        Oi = torch.zeros_like(Qi)
        li = torch.zeros(Qi.shape[0], 1, dtype=Q.dtype)
        mi = torch.full((Qi.shape[0], 1), -1e10, dtype=Q.dtype)
        for Kj, Vj in zip(torch.split(K, Bc, dim=0), torch.split(V, Bc, dim=0)):
            S_ij = Qi @ Kj.T
            mi_new = torch.maximum(S_ij.max(dim=-1, keepdim=True).values, mi)
            P_ij_hat = torch.exp(S_ij - mi_new)
            l_block_ij = P_ij_hat.sum(dim=-1, keepdim=True) + EPSILON
            li_new = torch.exp(mi - mi_new) * li + l_block_ij
            Oi = torch.exp(mi - mi_new) * Oi + P_ij_hat @ Vj
            if corrected:
                li, mi = li_new, mi_new
        O_blocks.append(Oi / li_new)
    return torch.cat(O_blocks)


def test_seed002_corrected_fa2_loop_equals_softmax_qkt_v():
    gen = torch.Generator().manual_seed(456)
    N, d = 6, 2
    Q, K, V = (torch.randn(N, d, generator=gen, dtype=torch.float64) for _ in range(3))
    want = torch.softmax(Q @ K.T, dim=-1) @ V  # the commenter's check, Od
    corrected = _seed002_loop(Q, K, V, 2, 2, corrected=True)
    torch.testing.assert_close(corrected, want, rtol=0, atol=1e-9)  # EPSILON perturbs l by 3e-10
    assert not torch.allclose(_seed002_loop(Q, K, V, 2, 2, corrected=False), want, atol=1e-5)
    out, _ = fa2.forward(Q.view(1, N, 1, d), K.view(1, N, 1, d), V.view(1, N, 1, d), softmax_scale=1.0,
                         block_m=2, block_n=2)
    torch.testing.assert_close(out.view(N, d), want, rtol=0, atol=1e-14)
