"""flashtile.models: the GPT's three attention paths give the same logits and gradients, a packed
batch equals its sequences run alone, cached generation (KVCache, PagedKVCache, the tensor cache)
equals recomputing the whole sequence, dropout reaches the attention, training lowers the loss, and
the training script writes its loss curve.

On a CPU-only machine the session sets TRITON_INTERPRET=1 (conftest); a model makes hundreds of
attention calls, so these tests run flashtile's PyTorch reference path (the `interpret` test at the
end runs the kernels on a one-layer model, and the kernels have their own tests)."""

import numpy as np
import pytest
import torch

import flashtile
from flashtile.models import GPT, GPTConfig, TensorKVCache, get_batch, load_text
from flashtile.models.gpt import ATTENTION, causal_mask, sample
from flashtile.models.text import CharTokenizer, split

ATOL = 2e-5  # float32 logits of paths that round differently (observed: <= 5e-7)


@pytest.fixture(autouse=True)
def _reference_path(request):
    if "interpret" in request.keywords or "cuda" in request.keywords:
        yield
        return
    with flashtile.use_backend("reference"):
        yield


def _model(attn="flashtile", **kw):
    options = dict(vocab_size=61, block_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    options.update(kw)
    torch.manual_seed(0)
    return GPT(GPTConfig(attn=attn, **options)).eval()


def _assert_close(got, want, what, atol=ATOL):
    err = (got.float() - want.float()).abs()
    worst = int(err.argmax())
    assert err.max() <= atol, f"{what}: max |diff| {float(err.max()):.3g} > {atol} at flat index {worst}"


@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_and_gradients_agree_across_attention_paths(heads, tied):
    model = _model(n_head=heads[0], n_kv_head=heads[1], tie_embeddings=tied)
    idx = torch.randint(61, (2, 37))
    results = {}
    for attn in ATTENTION:
        model.attn = attn
        model.zero_grad()
        logits, loss = model(idx, idx)
        loss.backward()
        results[attn] = logits, {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_logits, ref_grads = results["eager"]
    for attn in ("flashtile", "sdpa"):
        logits, grads = results[attn]
        _assert_close(logits, ref_logits, f"{attn} logits")
        for name, g in grads.items():
            _assert_close(g, ref_grads[name], f"{attn} grad of {name}", atol=1e-5)


@pytest.mark.parametrize("attn", ATTENTION)
def test_packed_batch_equals_sequences_alone(attn):
    model = _model(attn)
    lengths = [1, 9, 30, 17]
    seqs = [torch.randint(61, (1, n)) for n in lengths]
    cu = torch.tensor([0, 1, 10, 40, 57], dtype=torch.int32)
    packed, _ = model(torch.cat(seqs, dim=1), cu_seqlens=cu)  # (1, 57, vocab)
    alone = torch.cat([model(s)[0] for s in seqs], dim=1)
    _assert_close(packed, alone, f"{attn} packed")
    if attn == "flashtile":  # max_seqlen given explicitly, as flash_attn_varlen_func takes it
        _assert_close(model(torch.cat(seqs, dim=1), cu_seqlens=cu, max_seqlen=30)[0], alone, "max_seqlen")


@pytest.mark.parametrize("attn, paged", [("flashtile", False), ("flashtile", True), ("sdpa", False),
                                         ("eager", False)], ids=["kvcache", "paged", "sdpa", "eager"])
def test_cached_decoding_equals_full_recompute(attn, paged):
    """Every step's logits against the whole sequence recomputed, then generate's greedy tokens.
    Batch 3 with 7-token prompts and 40 new tokens: the paged cache hands out its 16-token pages
    interleaved between the sequences."""
    model = _model(attn)
    prompt = torch.randint(61, (3, 7))
    new = 40
    cache = model.make_cache(3, 7 + new, paged=paged)
    assert isinstance(cache, flashtile.PagedKVCache if paged else flashtile.KVCache if attn == "flashtile"
                      else TensorKVCache)
    logits = model.prefill(prompt, cache)
    step = model.decoder(cache)
    seq = prompt
    with torch.no_grad():
        for i in range(new):
            _assert_close(logits, model(seq)[0][:, -1], f"step {i}")
            tok = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, tok], dim=1)
            logits = step(tok)
    assert cache.lengths == [7 + new] * 3
    if paged:
        assert sorted(set(cache.block_table[:, :3].flatten().tolist())) == list(range(9))  # 3 pages each
    greedy = model.generate(prompt, 25, temperature=0, paged=paged)
    assert torch.equal(greedy, model.generate(prompt, 25, temperature=0, use_cache=False))
    assert torch.equal(greedy[:, :7], prompt)


@pytest.mark.parametrize("attn", ATTENTION)
def test_chunked_prefill_equals_one_prefill(attn):
    model = _model(attn)
    prompt = torch.randint(61, (2, 23))
    caches = [model.make_cache(2, 30) for _ in range(2)]
    whole = model.prefill(prompt, caches[0])
    chunked = model.prefill(prompt, caches[1], chunk=5)
    _assert_close(chunked, whole, "last logits")
    tok = whole.argmax(-1, keepdim=True)
    _assert_close(model.decoder(caches[1])(tok), model.decoder(caches[0])(tok), "the next step")


def test_sampling_follows_the_generator_and_top_k():
    model = _model()
    prompt = torch.randint(61, (2, 5))
    runs = [model.generate(prompt, 12, temperature=0.9, top_k=3, generator=torch.Generator().manual_seed(7))
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    logits = torch.randn(4, 61)
    picks = torch.cat([sample(logits, 1.0, top_k=3, generator=torch.Generator().manual_seed(s)) for s in range(20)], 1)
    top3 = logits.topk(3).indices
    assert all(int(t) in top3[b].tolist() for b in range(4) for t in picks[b])
    assert torch.equal(sample(logits, 0), logits.argmax(-1, keepdim=True))


@pytest.mark.parametrize("attn", ATTENTION)
def test_attention_dropout_applies_in_training_only(attn):
    model = _model(attn, dropout=0.5)
    idx = torch.randint(61, (2, 24))
    with torch.no_grad():
        evaluated = model(idx)[0]
        model.train()
        torch.manual_seed(1)
        first = model(idx)[0]
        torch.manual_seed(1)
        again = model(idx)[0]
        second = model(idx)[0]
    assert not torch.allclose(first, evaluated, atol=1e-3)  # the probabilities were dropped
    assert not torch.allclose(first, second, atol=1e-3)  # a fresh mask per call
    assert torch.equal(first, again)  # drawn from torch's generator: torch.manual_seed reproduces it


@pytest.mark.parametrize("attn", ATTENTION)
def test_training_steps_lower_the_loss(attn):
    text = load_text()
    tok = CharTokenizer(text)
    model = _model(attn, vocab_size=tok.vocab_size).train()
    x, y = get_batch(tok.encode(text), 4, 32, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] > 3.5  # ~ln(67) at random weights
    assert losses[-1] < losses[0] - 1.0, losses


def test_bad_uses_raise_clear_errors():
    model = _model()
    prompt = torch.randint(61, (1, 90))
    with pytest.raises(ValueError, match="exceeds block_size"):
        model.generate(prompt, 10)
    with pytest.raises(ValueError, match="exceed block_size"):
        model(torch.randint(61, (1, 97)))
    with pytest.raises(ValueError, match="needs attn='flashtile' on CUDA"):
        model.generate(prompt[:, :5], 3, use_cuda_graph=True)
    with pytest.raises(TypeError, match="a TensorKVCache"):
        model.attn = "sdpa"
        model(prompt[:, :5], cache=_model().make_cache(1, 10))
    with pytest.raises(ValueError, match="paged caches are flashtile's"):
        model.make_cache(1, 10, paged=True)
    with pytest.raises(ValueError, match="attn must be one of"):
        model.attn = "flash"
    with pytest.raises(ValueError, match="multiple of n_kv_head"):
        GPTConfig(n_head=4, n_kv_head=3)
    for bad, match in ((dict(n_head=0), "n_head must be a positive int, got 0"),
                       (dict(n_kv_head=0), "n_kv_head must be a positive int"),
                       (dict(n_layer=2.0), "n_layer must be a positive int"),
                       (dict(dropout=2.0), r"dropout must be in \[0, 1\)")):
        with pytest.raises(ValueError, match=match):
            GPTConfig(**bad)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got -3"):
        model.generate(prompt[:, :5], -3)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        model.generate(prompt[:, :5], 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k must be None or an int >= 1, got 0"):
        model.generate(prompt[:, :5], 2, top_k=0)
    assert GPTConfig(n_head=np.int64(4), n_kv_head=np.int64(2)).n_head == 4  # numpy ints are ints
    with pytest.raises(ValueError, match="cache overflow"):
        cache = model.make_cache(1, 4)
        model(prompt[:, :5], cache=cache)


def test_causal_mask_is_bottom_right_and_per_sequence():
    assert causal_mask(2, 5, "cpu").int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    seq = torch.tensor([0, 0, 1, 1, 1])
    assert causal_mask(5, 5, "cpu", seq).int().tolist() == [
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


def test_text_and_loader():
    text = load_text("sonnets")
    assert 15_000 < len(text) < 60_000 and "Shall I compare thee to a summer's day?" in text
    tok = CharTokenizer(text)
    data = tok.encode(text)
    assert tok.decode(data[:40]) == text[:40] and tok.vocab_size == len(set(text))
    train, val = split(data)
    assert len(train) + len(val) == len(data) and len(val) == len(data) - int(0.9 * len(data))
    x, y = get_batch(data, 3, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 16) and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="no text named"):
        load_text("no-such-text")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("€")


def test_train_script_trains_samples_and_plots(tmp_path, capsys):
    from flashtile.models import train

    png = tmp_path / "loss.png"
    assert train.main(["--steps", "6", "--eval-interval", "3", "--eval-batches", "1", "--n-layer", "1",
                       "--n-embd", "32", "--batch-size", "2", "--block-size", "32", "--sample-tokens", "12",
                       "--warmup", "2", "--device", "cpu", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "6 steps in" in out and "--- sample" in out and "Shall I compare thee" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,match", [(["--top-k", "0"], "--top-k: must be >= 1"),
                                        (["--temperature", "-1"], "--temperature: must be >= 0")])
def test_train_script_checks_its_sampling_arguments_first(argv, match, capsys):
    from flashtile.models import train

    with pytest.raises(SystemExit):
        train.parse_args(argv)
    assert match in capsys.readouterr().err


@pytest.mark.interpret
def test_triton_kernels_in_the_model_interpreted():
    """The Triton kernels (under the interpreter) in a one-layer model: prefill logits against eager,
    then a few decoding steps over a paged cache against the full recompute."""
    model = _model(n_layer=1, n_embd=32, n_head=2, n_kv_head=1, block_size=32)
    idx = torch.randint(61, (1, 17))
    with flashtile.use_backend("triton"):
        logits = model(idx)[0]
        model.attn = "eager"
        _assert_close(logits, model(idx)[0], "prefill")
        model.attn = "flashtile"
        assert torch.equal(model.generate(idx, 3, temperature=0, paged=True),
                           model.generate(idx, 3, temperature=0, use_cache=False))


@pytest.mark.cuda
@pytest.mark.parametrize("paged", [False, True], ids=["kvcache", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graph_decoding_equals_eager_steps(paged, dtype):
    """Captured decoding steps replay the plan at each new length: logits of every step equal the
    uncaptured steps' (same kernels, same split counts up to rounding), and so do greedy tokens."""
    model = _model(block_size=256).to(device="cuda", dtype=dtype)
    prompt = torch.randint(61, (3, 50), device="cuda")
    new = 120  # past a page boundary every 16 tokens, and past the prompt's split plan
    caches = [model.make_cache(3, 50 + new, paged=paged) for _ in range(2)]
    logits = [model.prefill(prompt, c) for c in caches]
    eager = model.decoder(caches[0])
    graph = model.decoder(caches[1], use_cuda_graph=True, max_steps=new)
    atol = 1e-4 if dtype == torch.float32 else 2e-2
    for i in range(new):
        _assert_close(logits[1], logits[0], f"step {i}", atol=atol)
        tok = logits[0].argmax(-1, keepdim=True)
        logits = [eager(tok), graph(tok).clone()]
    assert caches[0].lengths == caches[1].lengths == [50 + new] * 3
    if dtype == torch.float32:
        assert torch.equal(model.generate(prompt, 40, temperature=0, paged=paged, use_cuda_graph=True),
                           model.generate(prompt, 40, temperature=0, use_cache=False))
