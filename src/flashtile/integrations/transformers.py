"""flashtile as an attention implementation of Hugging Face transformers.

    from flashtile.integrations.transformers import register
    register()                                           # once per process; idempotent
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flashtile")
    model.set_attn_implementation("flashtile")           # or switch a model already loaded

transformers calls `attention_forward` in every attention layer with query (batch, heads, seqlen_q,
d) and key, value (batch, kv_heads, seqlen_k, d), the keys after the cache update, and takes back
(batch, seqlen_q, heads, d). What describes the batch decides which flashtile function runs:

- A 2-D padding mask (batch, seqlen_k), 1 = token: the only mask this implementation is given
  (`padding_mask`, registered as its mask function, never builds a dense one). Each row's keys are
  packed with flashtile.padding and run by flash_attn_varlen_func. Causal queries are the last
  seqlen_q positions of that mask, so they are packed by it too; a decoding step (seqlen_q = 1)
  and non-causal attention run every query row (cross-attention's mask covers only the keys).
  A decoding step (a few queries over more keys, as below) whose mask is left padding in every
  row, as generate makes of prompts of different lengths, runs flash_attn_with_kvcache with
  cache_leftpad instead: the cache is read in place, not packed (a copy of every key) per layer.
- Packed sequences, rows that hold several sequences end to end (DataCollatorWithFlattening): the
  keyword arguments cu_seq_lens_q and cu_seq_lens_k, or position_ids that restart. A sequence
  starts wherever a position does not follow the one before it by 1, the rule transformers' eager
  and sdpa masks use (its flash_attention_2 looks for the smallest position instead; the two agree
  when every sequence counts from 0).
- Otherwise flash_attn_func on the tensors as they are (their BHSD storage is read in place);
  but a few queries over more keys (a decoding step over the cache, up to DECODE_MAX_QUERIES rows
  per sequence, without dropout and with no graph to build: those kernels have no backward) run
  flash_attn_with_kvcache over the keys as the cache: its split-KV kernels spread one sequence's
  keys over the GPU, where flash_attn_func's programs (one per query block and head) would read
  them one program per head.

Masks are aligned to the bottom-right corner (flash-attn's rule): queries at the end of a cache see
every key before them, so prefill, decoding and chunked prefill need nothing more. GQA/MQA run
without repeating key/value heads. The module's options are read as transformers' eager attention
reads them:

- causal: the `is_causal` argument when the model passes one, else module.is_causal.
- scaling -> softmax_scale (None: headdim ** -0.5); softcap (Gemma-2's attn_logit_softcapping).
- dropout: applied only while module.training, as eager does.
- under torch.autocast, query, key and value run in autocast's dtype, as SDPA does there (a model
  under autocast hands over q and k in float32 after RoPE, v in bfloat16).
- sliding_window w: a query sees the keys fewer than w positions before it (and after it, without
  causal), which is window_size = (w - 1, 0), or (w - 1, w - 1) without causal. Every transformers
  model aligns its eager mask to this (Mistral, Gemma-2: kv > q - w; ModernBERT passes w = its
  half-window + 1), and so does its flash_attention_2.
- s_aux, the per-head attention sinks (h,) of gpt-oss (its module.sinks, and of the other models
  that pass s_aux, every transformers version that has them) -> learnable_sink, on every route
  above: one more logit in each row's softmax denominator that carries no value, as their eager
  attention appends and drops a sink column. Passed in its own dtype, so that an fp32 parameter's
  gradient stays fp32 (transformers' flash path casts it to the query's dtype, which FA3 needs).

Raised, never dropped: a mask that is not a 2-D padding mask (a 4-D mask given to the model, which
transformers passes through unchanged: use attn_implementation="sdpa" for it), output_attentions=True
(flashtile never materialises the attention weights; the second return value is always None),
sinks under another name than s_aux, and additive position biases. What this implementation
cannot see, like transformers' own flash implementations: extra mask patterns a model builds with
its own mask functions (the bidirectional image-token blocks of PaliGemma and Gemma-3 with images,
for one); the pattern here is causal or not, the sliding window and the padding.

transformers >= 5 takes every implementation whose name contains "flash" for a flash-attn library
and preloads its functions when a model is made (modeling_flash_attention_utils.
lazy_import_flash_attention); for a name it does not know it asks the Hub-kernel loader, which
finds nothing for "flashtile" (not a repository id, so no download either) and the model fails to
build. register() therefore has that loader answer "flashtile" with the flashtile package, whose
flash_attn_func, flash_attn_varlen_func and flash_attn_with_kvcache take flash-attn 2.x's
arguments, which is what transformers expects of such a module; every other name goes on to
transformers' loader unchanged.

transformers >= 5.3 also lets a model list the flash implementations that compute it
(_compatible_flash_implementations) and replaces any other "...flash..." name by the first of the
list when a model is made or switched: gpt-oss lists FA3/FA4 kernels only (the ones that take its
sinks), so "flashtile" would turn into "kernels-community/vllm-flash-attn3", a Hub download. Those
lists name kernels with flash-attn's arguments plus the sink, which flashtile takes too, so
register() has transformers' check add "flashtile" to a model's list (that instance's) when the list
holds only such kernels (SINK_KERNELS); a model that lists anything else keeps transformers' choice.
transformers 5.0 to 5.2 instead refuse every "...flash..." name but vllm-flash-attn3 in GptOssConfig:
gpt-oss runs "flashtile" on 4.55 to 4.57 and from 5.3.

This module imports transformers only inside register() and imports no triton.
"""

from __future__ import annotations

import functools

import torch
from packaging.version import Version

from flashtile._checks import per_version, upload
from flashtile.api import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flashtile.padding import packing, pad_input

NAME = "flashtile"
# The first release with masking_utils.AttentionMaskInterface, which lets an attention
# implementation choose its mask (older ones build a dense 4-D mask for any name not flash_attention_2)
MIN_TRANSFORMERS = "4.53"
DECODE_MAX_QUERIES = 16  # query rows per sequence that still run the decoding kernels (speculative steps)
# The flash implementations of the models' _compatible_flash_implementations lists (transformers
# >= 5.3: gpt-oss, granite_swa, mimo_v2_flash, ...) that flashtile stands in for: flash-attn's
# arguments and the sink (s_aux / learnable_sink), which transformers hands to each of them.
SINK_KERNELS = frozenset({"flash_attention_4", "kernels-community/vllm-flash-attn3",
                          "kernels-community/metal-flash-sdpa",
                          "kernels-community/aiter-flash-attn"})  # gpt-oss lists it from transformers 5.24


def register() -> None:
    """Make attn_implementation="flashtile" available to every transformers model in this process.

    Registers `attention_forward` with AttentionInterface and `padding_mask` with
    AttentionMaskInterface under "flashtile". Calling it again changes nothing. Raises ImportError
    when transformers is missing or older than MIN_TRANSFORMERS.
    """
    try:
        import transformers
    except ImportError as e:
        raise ImportError('flashtile.integrations.transformers needs transformers: pip install "flashtile[hf]"') from e
    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ImportError(f"flashtile.integrations.transformers needs transformers >= {MIN_TRANSFORMERS} "
                          f"(AttentionMaskInterface), found {transformers.__version__}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, padding_mask)
    _teach_flash_preload()
    _teach_compatible_lists()


def _teach_flash_preload() -> None:
    """Let transformers' preload of flash-attn functions (>= 5, see the module docstring) find
    flashtile's under NAME. Names it does not know it hands to integrations.hub_kernels.
    load_and_register_attn_kernel, which returns a module holding flash_attn_func,
    flash_attn_varlen_func (and, in later releases, flash_attn_with_kvcache): for NAME that module is
    flashtile itself, and transformers builds what it needs from it the way its release does. Every
    other name goes on to transformers' own function. Once per process."""
    try:
        from transformers.integrations import hub_kernels
        from transformers.utils.generic import is_flash_attention_requested
    except ImportError:  # transformers 4.x preloads only the flash_attention_N names
        return
    loader = getattr(hub_kernels, "load_and_register_attn_kernel", None)
    if loader is None or getattr(loader, "_flashtile", False) or \
            not is_flash_attention_requested(requested_attention_implementation=NAME):
        return

    @functools.wraps(loader)
    def load_and_register_attn_kernel(attn_implementation, *args, **kwargs):
        if attn_implementation == NAME:
            import flashtile

            return flashtile
        return loader(attn_implementation, *args, **kwargs)

    load_and_register_attn_kernel._flashtile = True
    hub_kernels.load_and_register_attn_kernel = load_and_register_attn_kernel


def _teach_compatible_lists() -> None:
    """Keep "flashtile" on a model whose _compatible_flash_implementations (transformers >= 5.3, see
    the module docstring) lists only SINK_KERNELS: PreTrainedModel._check_and_adjust_attn_implementation,
    which makes a model (__init__, from_pretrained) and switches it (set_attn_implementation), finds
    NAME in that model's list. The class's list is left as it is. Once per process."""
    from transformers import PreTrainedModel

    check = getattr(PreTrainedModel, "_check_and_adjust_attn_implementation", None)
    if check is None or getattr(check, "_flashtile", False) or \
            not hasattr(PreTrainedModel, "_compatible_flash_implementations"):
        return

    @functools.wraps(check)
    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        listed = getattr(self, "_compatible_flash_implementations", None)
        if attn_implementation == NAME and listed is not None and NAME not in listed and set(listed) <= SINK_KERNELS:
            self._compatible_flash_implementations = [*listed, NAME]  # transformers' fallback stays listed[0]
        return check(self, attn_implementation, *args, **kwargs)

    _check_and_adjust_attn_implementation._flashtile = True
    PreTrainedModel._check_and_adjust_attn_implementation = _check_and_adjust_attn_implementation


def padding_mask(*, kv_length: int, attention_mask: torch.Tensor | None = None, **kwargs):
    """The mask function of "flashtile" (AttentionMaskInterface): the 2-D padding mask of the
    kv_length keys this layer sees, (batch, kv_length) bool, or None when nothing is padded.
    transformers passes everything by keyword; the other arguments (batch_size, cache_position or
    q_length and offsets, mask_function, ...) differ between its versions and are not needed.

    attention_mask is the model's (batch, tokens so far) mask; a sliding-window cache holds only its
    last kv_length keys, so the mask is cut from the right. A static cache holds more keys than there
    are tokens: the mask is then shorter than the keys and marks the slots in use (attention_forward
    reads only those). The attention pattern itself (causal, sliding window) comes from the module.
    """
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:]
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface, computed by flashtile (see the module docstring).

    Arguments:
        module: the attention layer (is_causal and training are read from it).
        query: (batch, heads, seqlen_q, d); key, value: (batch, kv_heads, seqlen_k, d), heads %
            kv_heads == 0; float16 / bfloat16 / float32. value may have a smaller head dim than
            query (multi-head latent attention): it is padded with zeros and the output cut back.
        attention_mask: None, or the 2-D padding mask (batch, n) bool or int, 1 = token, for the
            first n <= seqlen_k keys (n < seqlen_k: a static cache's unused tail).
        scaling, dropout, sliding_window, softcap, is_causal: as the module docstring says.
        kwargs: s_aux, attention sinks (heads,) float32 / bfloat16 / float16, or None (gpt-oss);
            position_ids (batch or 1, seqlen_q), or cu_seq_lens_q / cu_seq_lens_k (offsets of
            the packed sequences in the flattened batch * seqlen rows) with optional
            max_length_q / max_length_k, for packed sequences; the rest of transformers' keyword
            arguments are not about attention and are not read.
    Returns:
        (out, None): out (batch, seqlen_q, heads, dv) in query's dtype; rows of padding queries
        (causal) are zero.
    """
    _reject_unsupported(attention_mask, kwargs)
    if is_causal is None:
        if not hasattr(module, "is_causal"):
            raise ValueError(f"{type(module).__name__} has no is_causal attribute and no is_causal argument "
                             f"was passed: flashtile needs to know whether the attention is causal")
        is_causal = module.is_causal
    is_causal = bool(is_causal)
    d, dv = query.shape[-1], value.shape[-1]
    if dv > d:
        raise ValueError(f"value's head dim ({dv}) must be at most query's ({d})")
    if dv < d:  # zero columns of v give zero output columns, cut off below
        value = torch.nn.functional.pad(value, (0, d - dv))
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # as SDPA under autocast: run in autocast's dtype
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (b, s, h, d) views
    dropout_p = float(dropout) if module.training else 0.0
    options = dict(softmax_scale=scaling, causal=is_causal, window_size=_window_size(sliding_window, is_causal),
                   softcap=float(softcap or 0.0))
    sink = kwargs.get("s_aux")
    if sink is not None:  # absent otherwise: calls without sinks are the same as before them
        options["learnable_sink"] = sink
    if is_causal and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 \
            and q.shape[1] > attention_mask.shape[1]:
        n, sq = attention_mask.shape[1], q.shape[1]
        raise ValueError(f"attention_mask marks {n} tokens, fewer than the {sq} queries: with causal attention the "
                         f"queries are the mask's last seqlen_q tokens, so it must have at least {sq} columns")
    left = None
    if attention_mask is not None and _decoding_step(q, k, v, dropout_p, sink):
        left = _left_padding(attention_mask, q.shape[0], k.shape[1])
    if left is not None:  # a decoding step over a left-padded cache: no key is copied
        out = flash_attn_with_kvcache(q, k, v, cache_seqlens=left[0], cache_leftpad=left[1], **options)
    elif attention_mask is not None:
        out = _padded(q, k, v, attention_mask, dict(options, dropout_p=dropout_p))
    else:
        packed = _packed_sequences(q, k, kwargs)
        if packed is None and _decoding_step(q, k, v, dropout_p, sink):
            out = flash_attn_with_kvcache(q, k, v, **options)
        elif packed is None:
            out = flash_attn_func(q, k, v, dropout_p=dropout_p, **options)
        else:
            b, sq, h = q.shape[:3]
            cu_q, cu_k, max_q, max_k = packed
            out = flash_attn_varlen_func(q.reshape(-1, h, d), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
                                         cu_q, cu_k, max_q, max_k, dropout_p=dropout_p, **options).view(b, sq, h, d)
    return (out if dv == d else out[..., :dv]), None


def _decoding_step(q, k, v, dropout_p: float, sink) -> bool:
    """Whether flash_attn_with_kvcache runs this call: a few queries over more keys (q (b, sq, h, d),
    k (b, sk, hk, d)), no dropout and nothing to differentiate. The decoding kernels have no
    backward: a forward that builds a graph (a training step over a cache; a sink parameter with
    grad enabled) stays on flash_attn_func, or its gradients would be lost."""
    if dropout_p != 0.0 or not q.shape[1] <= DECODE_MAX_QUERIES < k.shape[1]:
        return False
    return not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                             or sink is not None and sink.requires_grad))


def _reject_unsupported(attention_mask, kwargs: dict) -> None:
    """What this implementation cannot compute raises here, naming the argument."""
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise ValueError(f"attn_implementation={NAME!r} takes a 2-D padding mask (batch, seqlen_k) or None, got an "
                         f"attention_mask of shape {shape}: a dense (4-D) mask cannot be run without "
                         f"materialising the scores; use attn_implementation='sdpa' or 'eager' for it")
    if attention_mask is not None and (kwargs.get("cu_seq_lens_q") is not None or
                                       kwargs.get("cu_seq_lens_k") is not None):
        raise ValueError("got both a padding attention_mask and cu_seq_lens_q / cu_seq_lens_k (packed "
                         "sequences): pass one of them")
    if kwargs.get("output_attentions"):
        raise ValueError(f"attn_implementation={NAME!r} never materialises the attention weights: "
                         f"output_attentions=True needs attn_implementation='eager'")
    if kwargs.get("sinks") is not None:
        raise ValueError(f"attn_implementation={NAME!r} takes attention sinks as s_aux (transformers' name), "
                         f"got sinks")
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"attn_implementation={NAME!r} does not support position_bias (additive position "
                         f"biases); use attn_implementation='eager' or 'sdpa'")


def _window_size(sliding_window, causal: bool) -> tuple[int, int]:
    """transformers' sliding_window w -> flash-attn's window_size: keys fewer than w positions away."""
    if sliding_window is None:
        return (-1, -1)
    w = int(sliding_window)
    if w < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    return (w - 1, 0 if causal else w - 1)


def _left_padding(mask: torch.Tensor, b: int, sk: int):
    """(n, cache_leftpad) when every row of the padding mask (b, n <= sk) is padding and then tokens
    (left padding, what generate makes of prompts of different lengths): the keys of row i are
    cache slots cache_leftpad[i] .. n - 1, so flash_attn_with_kvcache reads them in place (int32,
    on the mask's device, its values on the host). None for any other mask, or when the mask
    cannot be read now (CUDA-graph capture, torch.compile tracing).

    Reading the mask synchronises with the GPU: done once per mask tensor and version (_once)."""
    if mask.dim() != 2 or mask.shape[0] != b or not 0 < mask.shape[1] <= sk or \
            torch.compiler.is_compiling() or mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return _once(mask, "left padding", lambda: _read_left_padding(mask))


def _read_left_padding(mask: torch.Tensor):
    """_left_padding's reading of the mask: one device-to-host copy of a (2, b) summary."""
    m = mask.to(torch.int8)
    ordered = (m[:, 1:] >= m[:, :-1]).all(1) if m.shape[1] > 1 else torch.ones(m.shape[0], dtype=torch.bool,
                                                                                device=m.device)
    host = torch.stack((ordered.to(torch.int32), (m == 0).sum(1, dtype=torch.int32))).cpu()
    if not bool(host[0].all()):
        return None
    leftpad = torch.empty(mask.shape[0], dtype=torch.int32, device=mask.device)
    upload(host[1].clone(), leftpad)  # queued, not waited for; the plan's checks read the host copy
    return mask.shape[1], leftpad


def _padded(q, k, v, mask: torch.Tensor, options: dict) -> torch.Tensor:
    """Attention of a padded batch through flash_attn_varlen_func: q (b, sq, h, d), k, v (b, sk, hk,
    d), mask (b, n <= sk) -> out (b, sq, h, d)."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    if mask.shape[0] != b or mask.shape[1] > sk:
        raise ValueError(f"attention_mask must have shape (batch, n) with batch = {b} and n <= seqlen_k = {sk} "
                         f"(the keys it marks), got {tuple(mask.shape)}")
    n = mask.shape[1]
    indices_k, cu_k, max_k = _packing(mask, n)
    k_packed, v_packed = (t[:, :n].reshape(b * n, *t.shape[2:]).index_select(0, indices_k) for t in (k, v))
    if options["causal"] and sq > 1:  # the queries are the last sq tokens of the mask
        indices_q, cu_q, max_q = _packing(mask, sq)
        q_packed = q.reshape(b * sq, h, d).index_select(0, indices_q)
        out = flash_attn_varlen_func(q_packed, k_packed, v_packed, cu_q, cu_k, max_q, max_k, **options)
        return pad_input(out, indices_q, b, sq)
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)  # every query row
    out = flash_attn_varlen_func(q.reshape(b * sq, h, d), k_packed, v_packed, cu_q, cu_k, sq, max_k, **options)
    return out.view(b, sq, h, d)


def _packing(mask: torch.Tensor, cols: int):
    """flashtile.padding.packing's (indices, cu_seqlens, max_seqlen) of mask[:, -cols:], computed
    once per mask tensor, version and cols: finding the tokens (and max_seqlen, a host read)
    synchronises with the GPU, and a model hands one mask to every layer of a forward."""
    return _once(mask, ("packing", cols), lambda: packing(mask[:, mask.shape[1] - cols:])[:3])


def _packed_sequences(q, k, kwargs: dict):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of the sequences packed in the
    flattened (batch * seqlen) rows, or None when each row is one sequence."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            raise ValueError("packed sequences need both cu_seq_lens_q and cu_seq_lens_k, got only "
                             f"{'cu_seq_lens_q' if cu_k is None else 'cu_seq_lens_k'}")
        cu_q, cu_k = cu_q.to(device=q.device, dtype=torch.int32), cu_k.to(device=q.device, dtype=torch.int32)
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = int(max_q) if max_q is not None else int((cu_q[1:] - cu_q[:-1]).max())
        max_k = int(max_k) if max_k is not None else int((cu_k[1:] - cu_k[:-1]).max())
        return cu_q, cu_k, max_q, max_k
    position_ids = kwargs.get("position_ids")
    b, sq = q.shape[:2]
    if position_ids is None or sq < 2:
        return None
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, b) or position_ids.shape[1] != sq:
        raise ValueError(f"position_ids must have shape ({b}, {sq}) or (1, {sq}) (batch, seqlen_q), got "
                         f"{tuple(position_ids.shape)}")
    found = _once(position_ids, ("sequence starts", b, q.device),
                  lambda: _sequence_starts(position_ids, b, sq, q.device))
    if found is None:
        return None
    if k.shape[1] != sq:
        raise ValueError(f"position_ids restart inside a row (packed sequences), but the keys ({k.shape[1]}) are "
                         f"more than the queries ({sq}): packed sequences cannot continue a cache")
    cu, max_len = found
    return cu, cu, max_len, max_len


def _once(t: torch.Tensor, what, compute):
    """compute() once per tensor t, version and `what` (_checks.per_version; every time for an
    inference tensor, which keeps no version counter). A model hands one mask and one position_ids
    tensor to every layer of a forward, and what the integration reads from them on the host (a
    GPU synchronisation each) is read once per forward, not once per layer."""
    return compute() if t.is_inference() else per_version(t, what, compute)


def _sequence_starts(position_ids, b: int, sq: int, device):
    """(cu_seqlens, max_seqlen) of the sequences that position_ids (1 or b, sq) lays out in the
    flattened (b * sq) rows, or None when each row is one sequence: a sequence starts at column 0
    and wherever a position does not follow the one before it by 1."""
    position_ids = position_ids.to(device).expand(b, sq)
    starts = torch.ones((b, sq), dtype=torch.bool, device=device)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if int(starts.sum()) == b:
        return None
    first = torch.nonzero(starts.flatten()).flatten().to(torch.int32)
    cu = torch.cat((first, first.new_full((1,), b * sq)))
    return cu, int((cu[1:] - cu[:-1]).max())
