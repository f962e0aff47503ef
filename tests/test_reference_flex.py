"""reference.flex, FlexAttention written out densely, against torch's own flex_attention (CPU,
float64, forward: torch's has no CPU backward) on attention-gym's standard mods, and its gradients
(those of tensors a mod captures included) by gradcheck."""

import warnings

import pytest
import torch

import flashtile
from flashtile.reference import flex

flex_attention = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, S, D = 2, 4, 200, 16
WINDOW = 48


def _mods():
    """name -> (score_mod, mask_mod): attention-gym's standard ones, each as written for torch."""
    torch.manual_seed(0)
    prefix = torch.tensor([37, 120])  # prefix-LM: per-sequence bidirectional prefix
    doc = torch.cumsum(torch.rand(B, S) < 0.03, dim=1)  # document ids per (sequence, position)
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float64) / H)
    table = torch.randn(H, 2 * S - 1, dtype=torch.float64)

    def causal(b, h, q, k):
        return q >= k

    return {
        "causal": (None, causal),
        "sliding-window": (None, lambda b, h, q, k: (q >= k) & (q - k <= WINDOW)),
        "prefix-lm": (None, lambda b, h, q, k: (k <= prefix[b]) | (q >= k)),
        "document": (None, lambda b, h, q, k: (doc[b, q] == doc[b, k]) & (q >= k)),
        "dilated-window": (None, lambda b, h, q, k: (q >= k) & (q - k <= 4 * WINDOW) & ((q - k) % 4 == 0)),
        "alibi": (lambda s, b, h, q, k: s - slopes[h] * (q - k).abs(), causal),
        "softcap": (lambda s, b, h, q, k: 20.0 * torch.tanh(s / 20.0), None),
        "relative-bias": (lambda s, b, h, q, k: s + table[h, q - k + S - 1], None),
        # a made-up one: rows of head 1 past 150 see nothing (output 0, lse -inf)
        "empty-rows": (None, lambda b, h, q, k: (q >= k) & ~((h == 1) & (q >= 150))),
    }


def _torch(q, k, v, score_mod, mask_mod, **kw):
    block_mask = None
    if mask_mod is not None:
        block_mask = flex_attention.create_block_mask(mask_mod, B, H, q.shape[2], k.shape[2], device="cpu",
                                                      BLOCK_SIZE=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, lse = flex_attention.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                 return_lse=True, **kw)
    return out, lse, block_mask


@pytest.mark.parametrize("name", list(_mods()))
def test_matches_torch_flex_attention(name):
    score_mod, mask_mod = _mods()[name]
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(3))
    want, want_lse, block_mask = _torch(q, k, v, score_mod, mask_mod)
    got, lse = flex.attention(q, k, v, score_mod, block_mask)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)  # lse is float32
    if mask_mod is not None:  # the mask mod alone, without the block structure, is the same
        torch.testing.assert_close(flex.attention(q, k, v, score_mod, mask_mod=mask_mod)[0], want,
                                   atol=1e-10, rtol=1e-10)


def test_empty_rows_are_zero_with_lse_minus_inf():
    score_mod, mask_mod = _mods()["empty-rows"]
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(3))
    out, lse = flex.attention(q, k, v, score_mod, mask_mod=mask_mod)
    assert torch.equal(out[:, 1, 150:], torch.zeros_like(out[:, 1, 150:]))
    assert torch.isneginf(lse[:, 1, 150:]).all() and torch.isfinite(lse[:, 1, :150]).all()


def test_gqa_and_unequal_lengths_match_torch():
    q = torch.randn(B, H, 70, D, dtype=torch.float64)
    k, v = (torch.randn(B, 2, 230, D, dtype=torch.float64) for _ in range(2))
    mask_mod = _mods()["prefix-lm"][1]
    want, _, block_mask = _torch(q, k, v, None, mask_mod, enable_gqa=True, scale=0.3)
    got, _ = flex.attention(q, k, v, None, block_mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match="enable_gqa"):
        flex.attention(q, k, v)


@pytest.mark.parametrize("mod", ["every-key", "no-key"])
def test_the_blocks_decide_before_the_mask_mod(mod):
    """The kernels' semantics (torch's GPU kernels, FA4's, this project's): a block in neither list
    is never read even where the mask mod says True, and a full block is read whole even where it
    says False. A causal BlockMask of 32-blocks given a mask mod that disagrees with it. (torch's
    CPU flex_attention applies the mask mod everywhere instead; for a BlockMask made from its mask
    mod, the only kind create_block_mask makes, the two agree.)"""
    q, k, v = (torch.randn(1, 1, 96, D, dtype=torch.float64) for _ in range(3))
    block_mask = flex_attention.create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, 96, 96, device="cpu",
                                                  BLOCK_SIZE=32)
    if mod == "every-key":
        block_mask.mask_mod = lambda b, h, qi, ki: qi >= 0  # diagonal blocks whole, none above them
        visible = lambda b, h, qi, ki: qi // 32 >= ki // 32  # noqa: E731
    else:
        block_mask.mask_mod = lambda b, h, qi, ki: qi < 0  # only the full blocks below the diagonal
        visible = lambda b, h, qi, ki: qi // 32 > ki // 32  # noqa: E731
    out, lse = flex.attention(q, k, v, block_mask=block_mask)
    want, want_lse = flex.attention(q, k, v, mask_mod=visible)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)


def test_gradients_of_inputs_and_captured_tensors():
    """The oracle's gradients are autograd's: gradcheck them, a learnable bias table included."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 24, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    table = torch.randn(2, 47, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, table):
        return flex.attention(q, k, v, lambda s, b, h, qi, ki: s + table[h, qi - ki + 23],
                              mask_mod=lambda b, h, qi, ki: qi >= ki)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, table))


def _same_block_mask(got, want):
    assert got.BLOCK_SIZE == want.BLOCK_SIZE and tuple(got.seq_lengths) == tuple(want.seq_lengths)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for num, name in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                      ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        rank = torch.arange(getattr(got, name).shape[-1])
        listed = rank < getattr(got, num)[..., None]  # past a row's count the indices mean nothing
        assert torch.equal(torch.where(listed, getattr(got, name), -1), torch.where(listed, getattr(want, name), -1)), name


@pytest.mark.parametrize("name", ["causal", "sliding-window", "prefix-lm", "document", "dilated-window",
                                  "empty-rows"])
@pytest.mark.parametrize("lengths", [(200, 200), (130, 300)], ids=["200x200", "130x300"])
@pytest.mark.parametrize("band", [1, 3 * B * H * 32 * 320, None], ids=["block", "3-rows", "default"])
def test_create_block_mask_equals_torchs(name, lengths, band, monkeypatch):
    """flashtile.create_block_mask gives torch's BlockMask, field for field, however the mask is
    cut into bands: a block at a time, three rows of blocks, or all of it."""
    import flashtile.flex

    mask_mod = _mods()[name][1]
    sq, sk = lengths
    if name == "document" and sq != sk:
        pytest.skip("document ids are per position of one length")
    want = flex_attention.create_block_mask(mask_mod, B, H, sq, sk, device="cpu", BLOCK_SIZE=32)
    if band is not None:
        monkeypatch.setattr(flashtile.flex, "BAND_ELEMENTS", band)
    got = flashtile.create_block_mask(mask_mod, B, H, sq, sk, device="cpu", BLOCK_SIZE=32)
    _same_block_mask(got, want)
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64) for n in (sq, sk, sk))
    torch.testing.assert_close(flex.attention(q, k, v, block_mask=got)[0], flex.attention(q, k, v, block_mask=want)[0],
                               atol=0, rtol=0)


def test_create_block_mask_broadcasts_and_checks():
    causal = _mods()["causal"][1]
    got = flashtile.create_block_mask(causal, None, None, 100, 100, device="cpu", BLOCK_SIZE=(16, 32))
    _same_block_mask(got, flex_attention.create_block_mask(causal, None, None, 100, 100, device="cpu",
                                                           BLOCK_SIZE=(16, 32)))
    with pytest.raises(ValueError, match="KV_LEN"):
        flashtile.create_block_mask(causal, 1, 1, 100, 0, device="cpu")
