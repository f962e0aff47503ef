"""attn_implementation="flashtile" in Hugging Face transformers: tiny models built from configs
(nothing downloaded), fp32 on the CPU, against transformers' own eager attention.

Logits are compared on the real (non-padding) tokens only; greedy generation token for token;
training by loss and every parameter's gradient. The models run flashtile's reference path (the
session sets TRITON_INTERPRET=1, so it is forced) except in the one `interpret` test, which runs
the Triton kernels under the interpreter.
"""

import socket
import subprocess
import sys

import pytest
import torch
from packaging.version import Version

transformers = pytest.importorskip("transformers")

import flashtile  # noqa: E402
from flashtile.integrations import transformers as hf  # noqa: E402

hf.register()

RTOL, ATOL = 1e-4, 1e-5
VOCAB = 128
# Weights larger than transformers' default (0.02) so that attention is far from uniform and
# every mask difference (a window one key too wide, a padding key seen) moves the logits.
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, initializer_range=0.2, attention_dropout=0.0)


def _config(name: str):
    if name == "llama":
        return transformers.LlamaConfig(**COMMON)
    if name == "mistral":  # every layer slides, over fewer keys than the prompts hold
        return transformers.MistralConfig(**COMMON, sliding_window=4)
    if name == "gemma2":  # sliding and full layers alternate; scores capped by tanh
        return transformers.Gemma2Config(**COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=30.0)
    if name == "gpt_oss":  # attention sinks; sliding and full layers alternate; a mixture of 4 experts, 2 per token
        _skip_without_gpt_oss()
        return transformers.GptOssConfig(**COMMON, head_dim=16, sliding_window=4, num_local_experts=4,
                                         num_experts_per_tok=2)
    raise ValueError(name)


def _skip_without_gpt_oss():
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no gpt-oss (4.55 added it)")
    if Version("5.0") <= Version(transformers.__version__) < Version("5.3"):
        pytest.skip(f"transformers {transformers.__version__}'s GptOssConfig refuses every '...flash...' "
                    f"attention but kernels-community/vllm-flash-attn3 (5.0 to 5.2)")


MODELS = ["llama", "mistral", "gemma2", "gpt_oss"]


@pytest.fixture(autouse=True)
def _reference_backend():
    """The plain-PyTorch path (the session's TRITON_INTERPRET=1 would otherwise pick the interpreter)."""
    with flashtile.use_backend("reference"):
        yield


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection (a Hub lookup, a kernel download) fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _model(name: str, attn: str = "flashtile"):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(name), attn_implementation=attn).eval()
    _spread_sinks(model)
    return model


def _spread_sinks(model) -> None:
    """gpt-oss's sinks start as N(0, initializer_range): redrawn as N(0, 2) so that some heads give the
    sink most of their weight and others almost none (test_sinks_move_the_logits checks they matter)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.copy_(2 * torch.randn(module.sinks.shape))


def _padded_batch(side: str, lengths=(11, 6, 9)):
    """input_ids and attention_mask (batch, max(lengths)) padded on the given side."""
    n = max(lengths)
    ids = torch.randint(0, VOCAB, (len(lengths), n))
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for i, m in enumerate(lengths):
        if side == "right":
            mask[i, :m] = 1
        else:
            mask[i, n - m:] = 1
    return ids, mask


def _switch(model, attn: str):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(attn)
    else:  # transformers 4.53 switches through the config
        model.config._attn_implementation = attn


def _logits(model, attn: str, **inputs):
    _switch(model, attn)
    with torch.no_grad():
        return model(**inputs).logits


# --------------------------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------------------------

def test_import_needs_neither_transformers_nor_triton():
    """Importing the module imports neither; register() imports transformers (which itself may load
    triton through torch) but none of flashtile's kernels (ops.dispatch, which the API asks which
    backend runs a call, imports no triton)."""
    code = ("import sys, flashtile, flashtile.integrations.transformers as hf\n"
            "assert 'transformers' not in sys.modules and 'triton' not in sys.modules, 'imported too early'\n"
            "hf.register(); hf.register()\n"
            "from transformers import AttentionInterface\n"
            "from transformers.masking_utils import AttentionMaskInterface\n"
            "assert AttentionInterface._global_mapping['flashtile'] is hf.attention_forward\n"
            "assert AttentionMaskInterface._global_mapping['flashtile'] is hf.padding_mask\n"
            "kernels = [m for m in sys.modules if m.startswith('flashtile.ops.') and m != 'flashtile.ops.dispatch']\n"
            "assert not kernels, f'register imported the kernels: {kernels}'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_register_is_idempotent():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    hf.register()
    hf.register()
    assert AttentionInterface._global_mapping[hf.NAME] is hf.attention_forward
    assert AttentionMaskInterface._global_mapping[hf.NAME] is hf.padding_mask
    try:
        from transformers.integrations.hub_kernels import load_and_register_attn_kernel as loader
    except ImportError:
        loader = None
    if getattr(loader, "_flashtile", False):  # wrapped once, not once per call
        assert not getattr(loader.__wrapped__, "_flashtile", False)
    check = getattr(transformers.PreTrainedModel, "_check_and_adjust_attn_implementation", None)
    if getattr(check, "_flashtile", False):  # >= 5.3: wrapped once too
        assert not getattr(check.__wrapped__, "_flashtile", False)


def test_register_refuses_old_transformers(monkeypatch):
    # the module register() imports: building a model (transformers 5.17) leaves a new top-level
    # module object in sys.modules; its submodules stay the same
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.52.0")
    with pytest.raises(ImportError, match=r"transformers >= 4\.53.*found 4\.52\.0"):
        hf.register()


def test_from_config_from_pretrained_and_set_attn_implementation(tmp_path, no_network):
    model = _model("llama")
    assert model.config._attn_implementation == "flashtile"
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="flashtile").eval()
    assert loaded.config._attn_implementation == "flashtile"
    ids, mask = _padded_batch("left")
    want = _logits(loaded, "eager", input_ids=ids, attention_mask=mask)
    assert loaded.config._attn_implementation == "eager"
    got = _logits(loaded, "flashtile", input_ids=ids, attention_mask=mask)
    assert loaded.config._attn_implementation == "flashtile"
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=RTOL, atol=ATOL)


def test_padding_mask_is_2d_or_none():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(hf.padding_mask(kv_length=4, attention_mask=mask), mask)
    assert hf.padding_mask(kv_length=3, attention_mask=mask) is None            # a window past the padding
    assert torch.equal(hf.padding_mask(kv_length=6, attention_mask=mask), mask)  # a static cache's 6 slots
    assert hf.padding_mask(kv_length=4, attention_mask=None) is None


# --------------------------------------------------------------------------------------------
# logits against eager
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", MODELS)
def test_padded_batch_logits(name, side):
    model = _model(name)
    ids, mask = _padded_batch(side)
    got = _logits(model, "flashtile", input_ids=ids, attention_mask=mask)
    want = _logits(model, "eager", input_ids=ids, attention_mask=mask)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", MODELS)
def test_unpadded_batch_logits(name):
    model = _model(name)
    ids = torch.randint(0, VOCAB, (2, 10))
    torch.testing.assert_close(_logits(model, "flashtile", input_ids=ids), _logits(model, "eager", input_ids=ids),
                               rtol=RTOL, atol=ATOL)


def _packed(lengths, flash_kwargs: bool):
    """One row holding sequences of the given lengths, as DataCollatorWithFlattening makes it."""
    features = [{"input_ids": torch.randint(0, VOCAB, (n,)).tolist()} for n in lengths]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collator(features, return_tensors="pt")
    batch.pop("labels")
    return features, dict(batch)


# the keyword path (cu_seq_lens_q / _k) does not depend on the model: one model covers it
@pytest.mark.parametrize("name, flash_kwargs", [*((name, False) for name in MODELS), ("llama", True)],
                         ids=[*(f"{name}-position_ids" for name in MODELS), "llama-cu_seq_lens"])
def test_packed_sequences_logits(name, flash_kwargs):
    model = _model(name)
    features, batch = _packed((5, 9, 4), flash_kwargs)
    got = _logits(model, "flashtile", use_cache=False, **batch)[0]
    _switch(model, "eager")
    start = 0
    for f in features:
        ids = torch.tensor([f["input_ids"]])
        with torch.no_grad():
            want = model(input_ids=ids).logits[0]
        torch.testing.assert_close(got[start:start + len(want)], want, rtol=RTOL, atol=ATOL)
        start += len(want)
    assert start == got.shape[0]


# --------------------------------------------------------------------------------------------
# generation over transformers' caches
# --------------------------------------------------------------------------------------------

def _generate(model, attn: str, **kwargs):
    _switch(model, attn)
    out = model.generate(**kwargs, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                         output_logits=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("name", MODELS)
def test_generate_left_padded(name):
    model = _model(name)
    ids, mask = _padded_batch("left", lengths=(7, 3, 5))
    got, got_logits = _generate(model, "flashtile", input_ids=ids, attention_mask=mask)
    want, want_logits = _generate(model, "eager", input_ids=ids, attention_mask=mask)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name, full_layers", [("llama", 2), ("mistral", 0), ("gemma2", 1), ("gpt_oss", 1)])
def test_generate_unpadded_runs_the_decoding_kernels(name, full_layers, monkeypatch):
    """A batch without padding: a decoding step (one query over the cache) runs flash_attn_with_kvcache
    exactly when its layer's cache holds more than DECODE_MAX_QUERIES keys, flash_attn_func
    otherwise, and the tokens and logits equal eager's. The caches of the `full_layers` hold the
    20-token prompt and more; a sliding-window cache holds the window's last keys (Mistral's 4, the
    sliding layers of Gemma-2 and gpt-oss), but every key in transformers 4.55 (4.57 and 5.x cut it):
    those steps then run the decoding kernels too, the window applied there."""
    calls = []  # (function, seqlen_q, seqlen_k) of every call
    for fn in ("flash_attn_func", "flash_attn_with_kvcache"):
        real = getattr(hf, fn)
        monkeypatch.setattr(hf, fn, lambda q, k, *a, _fn=fn, _real=real, **kw:
                            calls.append((_fn, q.shape[1], k.shape[1])) or _real(q, k, *a, **kw))
    model = _model(name)
    ids = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    got, got_logits = _generate(model, "flashtile", input_ids=ids)
    want, want_logits = _generate(model, "eager", input_ids=ids)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=RTOL, atol=ATOL)
    steps = calls[model.config.num_hidden_layers:]  # 7 steps after the prefill
    assert len(steps) == 7 * model.config.num_hidden_layers and all(sq == 1 for _, sq, _ in steps)
    assert all((fn == "flash_attn_with_kvcache") == (sk > hf.DECODE_MAX_QUERIES) for fn, _, sk in steps), steps
    assert sum(fn == "flash_attn_with_kvcache" for fn, _, _ in steps) >= 7 * full_layers


@pytest.mark.parametrize("sq", [1, 4])
def test_few_queries_over_more_keys(sq):
    """Decoding-step shapes (a few queries over more keys): causal (bottom-right), sliding window,
    softcap, GQA, the module's scaling, against float64 attention."""
    b, h, hk, sk, d, w, cap = 2, 4, 2, 40, 16, 9, 2.0
    q, k, v = torch.randn(b, h, sq, d), torch.randn(b, hk, sk, d), torch.randn(b, hk, sk, d)
    out, _ = hf.attention_forward(_Attention(True), q, k, v, None, scaling=0.3, sliding_window=w, softcap=cap)
    i, j = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None, :]
    allowed = ((j <= i) & (i - j < w)).expand(b, sq, sk)
    k2, v2 = (t.repeat_interleave(h // hk, 1).double() for t in (k, v))
    s = cap * torch.tanh((q.double() @ k2.transpose(-1, -2)) * 0.3 / cap)
    p = torch.softmax(s.masked_fill(~allowed[:, None], float("-inf")), -1)
    torch.testing.assert_close(out, (p @ v2).transpose(1, 2).float(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss"])
def test_generate_static_cache(name):
    """A static cache holds more slots than tokens: the mask marks the ones in use (Gemma-2's sliding
    layers: a rolling buffer of the window's keys)."""
    model = _model(name)
    ids, mask = _padded_batch("left", lengths=(6, 4))
    got, got_logits = _generate(model, "flashtile", input_ids=ids, attention_mask=mask, cache_implementation="static")
    want, want_logits = _generate(model, "eager", input_ids=ids, attention_mask=mask, cache_implementation="static")
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------

def _loss_and_grads(model, attn: str, ids, mask):
    _switch(model, attn)
    model.zero_grad()
    labels = ids.masked_fill(mask == 0, -100)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_training_step(name: str, side: str):
    model = _model(name).train()
    ids, mask = _padded_batch(side)
    loss, grads = _loss_and_grads(model, "flashtile", ids, mask)
    want_loss, want_grads = _loss_and_grads(model, "eager", ids, mask)
    torch.testing.assert_close(loss, want_loss, rtol=RTOL, atol=ATOL)
    assert grads.keys() == want_grads.keys() and len(grads) == len(list(model.parameters()))
    for n in grads:
        torch.testing.assert_close(grads[n], want_grads[n], rtol=RTOL, atol=ATOL, msg=lambda m: f"{n}: {m}")
    return grads


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss"])
def test_training_step(name):
    grads = _check_training_step(name, "right")
    sinks = [g for n, g in grads.items() if n.endswith(".sinks")]
    assert len(sinks) == (2 if name == "gpt_oss" else 0) and all(g.abs().min() > 0 for g in sinks)


def test_training_step_under_autocast():
    """Under autocast a model hands over q, k in float32 (after RoPE) and v in bfloat16: all run
    in bfloat16, as SDPA does."""
    model = _model("llama").train()
    ids = torch.randint(0, VOCAB, (2, 10))
    losses = {}
    for attn in ("flashtile", "sdpa"):
        _switch(model, attn)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[attn] = model(input_ids=ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(losses["flashtile"], losses["sdpa"], rtol=1e-2, atol=0)
    losses["flashtile"].backward()
    assert all(p.grad.isfinite().all() for p in model.parameters())


def test_dropout_only_in_training():
    config = _config("llama")
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="flashtile")
    ids, mask = _padded_batch("left")
    keep = mask.bool()
    model.eval()
    torch.testing.assert_close(_logits(model, "flashtile", input_ids=ids, attention_mask=mask)[keep],
                               _logits(model, "eager", input_ids=ids, attention_mask=mask)[keep], rtol=RTOL, atol=ATOL)
    model.train()
    _switch(model, "flashtile")
    runs = []
    for _ in range(2):
        torch.manual_seed(1)
        runs.append(model(input_ids=ids, attention_mask=mask).logits.detach())
    assert torch.equal(runs[0], runs[1])  # torch's generator seeds the mask
    model.eval()
    assert (runs[0] - _logits(model, "flashtile", input_ids=ids, attention_mask=mask)).abs().max() > 0.1


# --------------------------------------------------------------------------------------------
# what is refused
# --------------------------------------------------------------------------------------------

def test_dense_mask_is_refused():
    model = _model("llama")
    ids = torch.randint(0, VOCAB, (2, 6))
    dense = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=r"attention_mask of shape \(2, 1, 6, 6\).*sdpa"):
        model(input_ids=ids, attention_mask=dense)


def test_causal_mask_shorter_than_the_queries_is_refused():
    """A 2-D mask marks the keys; with causal attention the queries are its last seqlen_q tokens,
    so a mask of fewer columns than queries is an error naming it, never misplaced rows."""
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = torch.randn(2, 2, 5, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    with pytest.raises(ValueError, match="attention_mask marks 3 tokens, fewer than the 5 queries"):
        hf.attention_forward(module.eval(), q, k, v, torch.ones(2, 3, dtype=torch.long))
    # a few queries over many keys take the decoding kernels: refused there too
    q, k, v = torch.randn(2, 2, 4, 16), torch.randn(2, 2, 64, 16), torch.randn(2, 2, 64, 16)
    with pytest.raises(ValueError, match="attention_mask marks 2 tokens, fewer than the 4 queries"):
        hf.attention_forward(module.eval(), q, k, v, torch.ones(2, 2, dtype=torch.long))


def test_output_attentions_is_refused():
    model = _model("llama")
    with pytest.raises(ValueError, match="output_attentions"):
        model(input_ids=torch.randint(0, VOCAB, (1, 5)), output_attentions=True)


class _Attention(torch.nn.Module):
    def __init__(self, is_causal: bool):
        super().__init__()
        self.is_causal = is_causal


def _dense(q, k, v, allowed, scale, sink=None):
    """Plain attention in float64: q (b, h, sq, d), k, v (b, hk, sk, dv), allowed (b, sq, sk) bool,
    sink None or (h,): a column of logits appended to the scores, dropped after the softmax (a row
    that sees no key gives 0). Returns (b, sq, h, dv) in float64."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1).double() for t in (k, v))
    s = (q.double() @ k.transpose(-1, -2)) * scale  # (b, h, sq, sk)
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    if sink is not None:
        s = torch.cat((s, sink.double()[None, :, None, None].expand(*s.shape[:3], 1)), -1)
    p = torch.softmax(s, -1)[..., :allowed.shape[-1]]
    return (p @ v).transpose(1, 2)


def test_unsupported_arguments_are_refused():
    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 3, 16)
    module = _Attention(True)
    for name in ("sinks", "position_bias"):  # sinks come as s_aux
        with pytest.raises(ValueError, match=name):
            hf.attention_forward(module, q, k, v, None, **{name: torch.zeros(4)})
    with pytest.raises(ValueError, match="is_causal"):
        hf.attention_forward(torch.nn.Linear(1, 1), q, k, v, None)
    with pytest.raises(ValueError, match="sliding_window"):
        hf.attention_forward(module, q, k, v, None, sliding_window=0)
    with pytest.raises(ValueError, match="cu_seq_lens"):
        cu = torch.tensor([0, 3], dtype=torch.int32)
        hf.attention_forward(module, q, k, v, torch.ones(1, 3, dtype=torch.bool), cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        hf.attention_forward(module, q, k, v, torch.ones(1, 5, dtype=torch.bool))


def test_dropout_needs_training_mode():
    """Models pass dropout=0 outside training themselves; a dropout given anyway is not applied."""
    q, k, v = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    module = _Attention(True).eval()
    out, _ = hf.attention_forward(module, q, k, v, None, dropout=0.5)
    torch.testing.assert_close(out, hf.attention_forward(module, q, k, v, None)[0], rtol=0, atol=0)
    module.train()
    assert (hf.attention_forward(module, q, k, v, None, dropout=0.5)[0] - out).abs().max() > 0.1


def test_cross_attention_with_key_padding():
    """Not causal, seqlen_q != seqlen_k, a mask over the keys only: every query row runs."""
    b, h, hk, sq, sk, d = 3, 4, 2, 5, 7, 16
    q, k, v = torch.randn(b, h, sq, d), torch.randn(b, hk, sk, d), torch.randn(b, hk, sk, d)
    mask = torch.rand(b, sk) > 0.3
    mask[:, 0] = True
    out, weights = hf.attention_forward(_Attention(False), q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == (b, sq, h, d)
    torch.testing.assert_close(out, _dense(q, k, v, mask[:, None, :].expand(b, sq, sk), 0.3).float(), rtol=RTOL,
                               atol=ATOL)


def test_bidirectional_sliding_window_and_smaller_value_dim():
    """Not causal with sliding_window w: keys fewer than w positions away on both sides; a value
    head dim below the query's (multi-head latent attention) is padded and cut back."""
    b, h, s, d, dv, w = 2, 2, 9, 16, 8, 3
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, h, s, d), torch.randn(b, h, s, dv)
    out, _ = hf.attention_forward(_Attention(False), q, k, v, None, sliding_window=w)
    i = torch.arange(s)
    allowed = ((i[:, None] - i[None, :]).abs() < w).expand(b, s, s)
    torch.testing.assert_close(out, _dense(q, k, v, allowed, d ** -0.5).float(), rtol=RTOL, atol=ATOL)


def test_decode_step_with_padded_cache():
    """seqlen_q = 1 over a left-padded cache with a sliding window: the last w real keys."""
    b, h, hk, sk, d = 2, 4, 1, 6, 16
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, hk, sk, d), torch.randn(b, hk, sk, d)
    mask = torch.tensor([[0, 0, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    out, _ = hf.attention_forward(_Attention(True), q, k, v, mask, sliding_window=3)
    allowed = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    torch.testing.assert_close(out, _dense(q, k, v, allowed[:, None, :], d ** -0.5).float(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("sq", [1, 4])
def test_decode_step_routes_by_padding_side(sq, monkeypatch):
    """A decoding step over a left-padded mask (each row: padding, then tokens; one row all padding;
    the mask shorter than the keys, as a static cache's) reads the cache in place through
    flash_attn_with_kvcache's cache_leftpad; a mask with padding anywhere else packs the keys
    (flash_attn_varlen_func). Both against float64 attention, causal, GQA, a sliding window."""
    calls = []
    for fn in ("flash_attn_varlen_func", "flash_attn_with_kvcache"):
        real = getattr(hf, fn)
        monkeypatch.setattr(hf, fn, lambda *a, _fn=fn, _real=real, **kw:
                            calls.append((_fn, kw.get("cache_leftpad"))) or _real(*a, **kw))
    b, h, hk, sk, n, d, w = 4, 4, 2, 24, 20, 16, 6
    q, k, v = torch.randn(b, h, sq, d), torch.randn(b, hk, sk, d), torch.randn(b, hk, sk, d)
    left = torch.zeros(b, n, dtype=torch.bool)
    for i, pad in enumerate((0, 3, 17, n)):  # the last row is padding only
        left[i, pad:] = True
    holes = left.clone()
    holes[0, 5] = False  # a token missing inside row 0: not left padding
    for mask, route in ((left, "flash_attn_with_kvcache"), (holes, "flash_attn_varlen_func")):
        calls.clear()
        out, _ = hf.attention_forward(_Attention(True), q, k, v, mask, scaling=0.3, sliding_window=w)
        assert [fn for fn, _ in calls] == [route]
        if route == "flash_attn_with_kvcache":
            assert calls[0][1].tolist() == [0, 3, 17, n]
        # query t sits at the row's slot n - sq + t; it sees the tokens at or before it, the last w
        i, j = torch.arange(sq)[:, None] + n - sq, torch.arange(sk)[None, :]
        allowed = (j <= i) & (i - j < w) & torch.nn.functional.pad(mask, (0, sk - n))[:, None, :]
        allowed &= torch.nn.functional.pad(mask, (0, sk - n))[:, n - sq:n, None]  # padding queries: no key
        want = _dense(q, k, v, allowed, 0.3).nan_to_num(0.0)  # the row of padding only: zeros
        torch.testing.assert_close(out, want.float(), rtol=RTOL, atol=ATOL)


def test_padded_batch_mask_read_once(monkeypatch):
    """The layers of a forward share one padding mask: the tokens it marks are found once (a GPU
    synchronisation), again after an in-place change; every layer's output equals float64 attention."""
    reads = []
    real = hf.packing
    monkeypatch.setattr(hf, "packing", lambda *a, **kw: reads.append(1) or real(*a, **kw))
    b, h, hk, s, d = 2, 4, 2, 9, 16
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, hk, s, d), torch.randn(b, hk, s, d)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[0, :3] = False
    i = torch.arange(s)
    for _ in range(2):  # the mask as made, then changed in place
        for _layer in range(3):
            out, _ = hf.attention_forward(_Attention(True), q, k, v, mask, scaling=0.3)
            allowed = (i[None, :, None] >= i[None, None, :]) & mask[:, None, :] & mask[:, :, None]
            torch.testing.assert_close(out, _dense(q, k, v, allowed, 0.3).nan_to_num(0.0).float(), rtol=RTOL,
                                       atol=ATOL)
        mask[1, :2] = False  # in place: the next round reads it again
    assert len(reads) == 2


def test_left_padding_read_once_per_mask():
    """The layers of a decoding step share one mask tensor: it is read once (the result is kept),
    and again after an in-place change; a mask that is not left padding gives None."""
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    first = hf._left_padding(mask, 2, 7)
    assert first[0] == 5 and first[1].tolist() == [2, 0] and first[1].dtype == torch.int32
    assert hf._left_padding(mask, 2, 7) is first
    mask[1, 0] = False
    assert hf._left_padding(mask, 2, 7)[1].tolist() == [2, 1]
    mask[1, 3] = False  # a hole
    assert hf._left_padding(mask, 2, 7) is None
    assert hf._left_padding(mask, 3, 7) is None and hf._left_padding(mask, 2, 4) is None  # shapes that do not fit


# --------------------------------------------------------------------------------------------
# attention sinks (gpt-oss: s_aux)
# --------------------------------------------------------------------------------------------

def _sink_case(route: str):
    """attention_forward's inputs for one route, with GQA and a window of 3, and the (b, sq, sk) bool
    pattern they describe: causal, bottom-right aligned."""
    b, h, hk, d, w = 2, 4, 2, 16, 3
    sq, sk = {"dense": (9, 9), "padded": (9, 9), "packed": (12, 12), "decode": (1, 40), "decode-padded": (1, 40)}[route]
    q, k, v = torch.randn(b, h, sq, d), torch.randn(b, hk, sk, d), torch.randn(b, hk, sk, d)
    i, j = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None, :]
    allowed = ((j <= i) & (i - j < w)).expand(b, sq, sk).clone()
    kwargs = dict(sliding_window=w)
    if route in ("padded", "decode-padded"):  # left padding: 4 and 0 pad tokens; padding query rows see no key
        mask = torch.ones(b, sk, dtype=torch.bool)
        mask[0, :4] = False
        allowed &= mask[:, None, :]
        kwargs["attention_mask"] = mask
    if route == "packed":  # row 0: sequences of 5 and 7 tokens; row 1: one of 12
        position_ids = torch.stack((torch.cat((torch.arange(5), torch.arange(7))), torch.arange(12)))
        seq = torch.stack((torch.tensor([0] * 5 + [1] * 7), torch.zeros(12, dtype=torch.long)))
        allowed &= seq[:, :, None] == seq[:, None, :]
        kwargs["position_ids"] = position_ids
    return q, k, v, allowed, kwargs


ROUTES = {"dense": "flash_attn_func", "padded": "flash_attn_varlen_func", "packed": "flash_attn_varlen_func",
          "decode": "flash_attn_with_kvcache", "decode-padded": "flash_attn_with_kvcache"}


@pytest.mark.parametrize("route", list(ROUTES))
def test_sinks_on_every_route(route, monkeypatch):
    """s_aux reaches the flashtile function of each route as learnable_sink; the output (rows that
    see no key: 0) and, on the training routes, the gradients of q, k, v and the sinks equal the
    float64 softmax with the sink column appended."""
    calls = []
    for fn in set(ROUTES.values()):
        real = getattr(hf, fn)
        monkeypatch.setattr(hf, fn, lambda *a, _fn=fn, _real=real, **kw: calls.append((_fn, kw.get("learnable_sink")))
                            or _real(*a, **kw))
    q, k, v, allowed, kwargs = _sink_case(route)
    sink = (2 * torch.randn(q.shape[1])).requires_grad_()
    training = not route.startswith("decode")
    inputs = [t.requires_grad_(training) for t in (q, k, v)]
    mask = kwargs.pop("attention_mask", None)
    with torch.set_grad_enabled(training):  # decoding steps: under generate's no_grad
        out, _ = hf.attention_forward(_Attention(True), *inputs, mask, scaling=0.3, s_aux=sink, **kwargs)
    assert [(fn, s is sink) for fn, s in calls] == [(ROUTES[route], True)]
    want = _dense(q, k, v, allowed, 0.3, sink)
    assert (want.abs().amax((-1, -2)) == 0).any() == (route == "padded")  # the padding rows of sequence 0
    torch.testing.assert_close(out, want.float(), rtol=RTOL, atol=ATOL)
    if training:
        do = torch.randn_like(out)
        got = torch.autograd.grad(out, [*inputs, sink], do)
        want = torch.autograd.grad(want, [*inputs, sink], do.double())
        for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
            torch.testing.assert_close(g, w.float(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_few_queries_with_gradients_skip_the_decoding_kernels(monkeypatch):
    """The decoding kernels have no backward: a few queries over more keys that need gradients (a
    training step over a cache, or just the sinks' parameter with grad enabled) run
    flash_attn_func, and every gradient arrives; under no_grad the same call runs the kernels."""
    calls = []
    for fn in ("flash_attn_func", "flash_attn_with_kvcache"):
        real = getattr(hf, fn)
        monkeypatch.setattr(hf, fn, lambda *a, _fn=fn, _real=real, **kw: calls.append(_fn) or _real(*a, **kw))
    q, k, v, allowed, kwargs = _sink_case("decode")
    sink = (2 * torch.randn(q.shape[1])).requires_grad_()
    out, _ = hf.attention_forward(_Attention(True), q, k, v, None, scaling=0.3, s_aux=sink, **kwargs)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, sink, do)[0]
    want = torch.autograd.grad(_dense(q, k, v, allowed, 0.3, sink), sink, do.double())[0]
    torch.testing.assert_close(got, want.float(), rtol=RTOL, atol=ATOL)
    with torch.no_grad():
        hf.attention_forward(_Attention(True), q, k, v, None, scaling=0.3, s_aux=sink, **kwargs)
    assert calls == ["flash_attn_func", "flash_attn_with_kvcache"]


def test_position_ids_read_once_per_tensor(monkeypatch):
    """A model hands one position_ids tensor to every layer of a forward. Reading it (on a GPU, a
    synchronisation) happens once for that tensor; again after an in-place change, for another
    tensor with equal values, and on every call for an inference tensor (no version counter). The
    packed sequences found are the same each time."""
    reads = []
    real = hf._sequence_starts
    monkeypatch.setattr(hf, "_sequence_starts", lambda *a: reads.append(1) or real(*a))
    q, k = torch.randn(2, 12, 4, 16), torch.randn(2, 12, 2, 16)
    pos = torch.stack((torch.cat((torch.arange(5), torch.arange(7))), torch.arange(12)))  # 5 + 7, and 12
    for _ in range(4):
        cu, cu_k, max_q, max_k = hf._packed_sequences(q, k, {"position_ids": pos})
        assert cu.tolist() == cu_k.tolist() == [0, 5, 12, 24] and max_q == max_k == 12
    assert len(reads) == 1
    pos[1] = torch.cat((torch.arange(6), torch.arange(6)))  # in place: row 1 now holds 6 + 6
    assert hf._packed_sequences(q, k, {"position_ids": pos})[0].tolist() == [0, 5, 12, 18, 24]
    assert len(reads) == 2
    assert hf._packed_sequences(q, k, {"position_ids": pos.clone()})[0].tolist() == [0, 5, 12, 18, 24]
    assert len(reads) == 3
    with torch.inference_mode():
        frozen = pos.clone()
    for _ in range(2):
        assert hf._packed_sequences(q, k, {"position_ids": frozen})[0].tolist() == [0, 5, 12, 18, 24]
    assert len(reads) == 5
    assert hf._packed_sequences(q, k, {"position_ids": torch.arange(12)[None]}) is None  # one sequence a row
    with pytest.raises(ValueError, match="cannot continue a cache"):  # checked on every call, cached or not
        hf._packed_sequences(q, torch.randn(2, 20, 2, 16), {"position_ids": pos})


def test_sinks_move_the_logits():
    """The model tests can fail: gpt-oss's eager logits without sinks (-inf) differ from those with
    them by far more than the tolerance, and flashtile follows each."""
    model = _model("gpt_oss")
    ids, mask = _padded_batch("left")
    keep = mask.bool()
    with_sinks = _logits(model, "eager", input_ids=ids, attention_mask=mask)[keep]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
    without = _logits(model, "eager", input_ids=ids, attention_mask=mask)[keep]
    assert (with_sinks - without).abs().max() > 100 * ATOL
    torch.testing.assert_close(_logits(model, "flashtile", input_ids=ids, attention_mask=mask)[keep], without,
                               rtol=RTOL, atol=ATOL)


def test_gpt_oss_keeps_flashtile():
    """transformers >= 5.3 replaces a "...flash..." name that a model's _compatible_flash_implementations
    lacks (gpt-oss: FA3/FA4 kernels) by the list's first: register() keeps "flashtile" there, for the
    model built and the one switched, without changing the class's list."""
    model = _model("gpt_oss", attn="eager")
    _switch(model, "flashtile")
    assert model.config._attn_implementation == "flashtile"
    assert _model("gpt_oss").config._attn_implementation == "flashtile"
    listed = getattr(type(model), "_compatible_flash_implementations", None)
    assert listed is None or hf.NAME not in listed


# --------------------------------------------------------------------------------------------
# the Triton kernels, under the interpreter
# --------------------------------------------------------------------------------------------

@pytest.mark.interpret
@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_padded_batch_logits_triton(name):
    model = _model(name)
    ids, mask = _padded_batch("left", lengths=(7, 4))
    with flashtile.use_backend("triton"):
        got = _logits(model, "flashtile", input_ids=ids, attention_mask=mask)
    want = _logits(model, "eager", input_ids=ids, attention_mask=mask)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=RTOL, atol=ATOL)


@pytest.mark.interpret
def test_training_step_triton():
    """gpt-oss's training step on the kernels: the sinks' gradient comes from the backward kernels."""
    with flashtile.use_backend("triton"):
        _check_training_step("gpt_oss", "left")


@pytest.mark.interpret
def test_generate_left_padded_triton(monkeypatch):
    """Llama (GQA) generating from a left-padded batch on the kernels: the decoding steps run the
    split-KV kernels with cache_leftpad, and the tokens and logits equal eager's."""
    calls = []
    real = hf.flash_attn_with_kvcache
    monkeypatch.setattr(hf, "flash_attn_with_kvcache", lambda *a, **kw: calls.append(kw.get("cache_leftpad"))
                        or real(*a, **kw))
    model = _model("llama")
    ids, mask = _padded_batch("left", lengths=(19, 12))
    with flashtile.use_backend("triton"):
        got, got_logits = _generate(model, "flashtile", input_ids=ids, attention_mask=mask)
    want, want_logits = _generate(model, "eager", input_ids=ids, attention_mask=mask)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=RTOL, atol=ATOL)
    assert calls and all(c is not None and c.tolist() == [0, 7] for c in calls)


@pytest.mark.interpret
def test_generate_unpadded_triton(monkeypatch):
    """gpt-oss's decoding steps over the cache on the split-KV kernels, with the sinks."""
    with flashtile.use_backend("triton"):
        test_generate_unpadded_runs_the_decoding_kernels("gpt_oss", 1, monkeypatch)
