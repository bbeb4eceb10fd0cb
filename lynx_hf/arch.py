"""What a model's shape says, with no cache and no transport: per-layer attention windows, the prompt KV's geometry
on the wire, the logits width, and a fingerprint of the weights. Every other module asks here instead of reading
model configs itself."""
from __future__ import annotations

import hashlib
import json

import torch
from transformers.cache_utils import get_layer_types_and_kwargs


def layer_windows(config) -> list[int | None]:
    """Per decoder layer: None (full attention) or its sliding window W, as Transformers' own caches read the config.
    Raises ValueError at once for layers a transferred prompt cannot serve (linear-attention / SSM state, chunked
    attention, KV shared between layers)."""
    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    out = []
    for i, (t, kw) in enumerate(zip(types, kwargs)):
        if t == "full_attention":
            out.append(None)
        elif t == "sliding_attention":
            out.append(int(kw["sliding_window"]))
        else:
            raise ValueError(f"LynxCache supports full and sliding-window attention layers; layer {i} of this "
                             f"{getattr(config, 'model_type', 'model')} is {t!r}")
    return out


def window_positions(prompt_len: int, window: int | None) -> int:
    """Prompt positions a layer's window keeps: all P for full attention, the last min(P, W) for a sliding window W.
    (What the decode side already *holds* of a conversation is another thing: REQUEST's `held`.)"""
    return prompt_len if window is None else min(prompt_len, window)


def head_dim(config) -> int:
    c = config.get_text_config(decoder=True)
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def logits_width(model) -> int:
    """Columns of the model's logits (the output embedding's rows; the config's vocab_size without one)."""
    emb = model.get_output_embeddings()
    return int(emb.weight.shape[0]) if emb is not None else int(model.config.get_text_config().vocab_size)


MAX_PROMPT = 131072  # the longest prompt a prefill server takes, whatever the model says


def max_prompt_tokens(model) -> int:
    """The longest prompt a prefill server takes (and a decode client sends): the model's context
    (max_position_embeddings), at most MAX_PROMPT."""
    n = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return min(MAX_PROMPT, n) if isinstance(n, int) and n > 0 else MAX_PROMPT


def context_budget(context: int, prompt_len: int, max_new_tokens: int) -> int:
    """The tokens a generation of a `prompt_len`-token prompt may produce: at most `max_new_tokens`, and the whole
    sequence inside the model's `context` (prompt_len + n <= context: a verification pass may run the last token's
    position), except that a prompt of the whole context still gets its one next token (its logits need no
    position past the prompt). One rule for the decode client, the prefill server (which refuses prompt_len >
    context) and sessions in this process (`session.LocalLink`); `speculative_generate` itself equals plain
    `generate`, which runs on past max_position_embeddings (RoPE scaling may extend a model's range)."""
    if prompt_len > context:
        raise ValueError(f"a prompt of {prompt_len} tokens exceeds this model's context of {context} tokens")
    return min(max_new_tokens, max(1, context - prompt_len))


def kv_geometry(model) -> dict:
    """What the model's prompt KV looks like on the wire: the PROMPT frame declares it and the decode side requires
    it to equal its own model's before allocating anything."""
    c = model.config.get_text_config(decoder=True)
    windows = layer_windows(model.config)
    return {"num_layers": len(windows), "windows": windows, "batch": 1, "kv_heads": c.num_key_value_heads,
            "head_dim": head_dim(model.config), "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "vocab": logits_width(model)}


def refuse_encoder_decoder(model) -> None:
    """LynxCache holds a decoder-only model's self-attention KV; an encoder-decoder's decoder also attends to its
    encoder's output (cross-attention), which no transfer carries."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(f"LynxCache serves decoder-only models: this {getattr(cfg, 'model_type', 'model')} is an "
                         f"encoder-decoder (its decoder also attends to the encoder's output, which a transferred KV "
                         f"does not carry); use plain generate, or the model's causal-LM decoder alone")


MEDIA_PREFIXES = ("pixel_", "image_", "video_", "input_features", "audio_", "feature_attention_mask",
                  "second_per_grid_ts")


def media_key(media: dict) -> str | None:
    """A digest of media inputs (names, shapes, dtypes, bytes): the cache compares generate's with its prefill's."""
    if not media:
        return None
    h = hashlib.sha256()
    for k in sorted(media):
        v = media[k]
        h.update(k.encode())
        if isinstance(v, torch.Tensor):
            h.update(f"{tuple(v.shape)}{v.dtype}".encode())
            h.update(v.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() if v.numel() else b"")
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


def media_inputs(kwargs: dict) -> dict:
    """The non-text model inputs among generate's / a forward's keyword arguments (images, video, audio)."""
    return {k: v for k, v in kwargs.items() if k.startswith(MEDIA_PREFIXES) and v is not None}


def refuse_media_positions(model, media: dict) -> None:
    """Models whose positions depend on the images (M-RoPE: Qwen2-VL and kin keep rope deltas from the prompt that a
    decode step needs) cannot continue from a transferred prompt with media yet."""
    if not media:
        return
    inner = getattr(model, "model", None)
    if hasattr(model, "get_rope_index") or hasattr(inner, "get_rope_index"):
        raise ValueError(f"LynxCache cannot serve this {getattr(model.config, 'model_type', 'model')} with "
                         f"{', '.join(sorted(media))}: its positions depend on the image (M-RoPE rope deltas), which "
                         f"the decode side would need as well; text-only prompts work")


PROVENANCE = ("_name_or_path", "architectures",
              "transformers_version")  # where the model was loaded from, not what it is


def fingerprint(model) -> str:
    """Identifies the model's architecture and weights: its config, and every parameter's name, shape, a strided
    sample of its values, and two integer sums over the bits of all its values as float32 (one pass over the weights,
    so any change shows), exact in any order: the same weights give the same fingerprint on any device and thread
    count (float sums would not: their rounding follows the reduction order). The config is taken without where
    the model was loaded from (`PROVENANCE`; a GGUF file's de-quantization note), so the same model loaded from two
    install paths, or from its GGUF file and from the converted copy, has one fingerprint."""
    config = json.loads(model.config.to_json_string(use_diff=False))
    for key in PROVENANCE:
        config.pop(key, None)
    if (config.get("quantization_config") or {}).get("quant_method") == "gguf":
        config.pop("quantization_config")  # GGUF weights arrive de-quantized: the parameters below say it all
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(flat[:: max(1, flat.numel() // 64)][:64].float().cpu().numpy().tobytes())
        s1 = s2 = 0
        for part in flat.split(1 << 22):  # bounded temporaries; per part |sums| < 2^53: no overflow
            x = part.float().view(torch.int32)
            s1 += int(x.sum(dtype=torch.int64))
            s2 += int(((x & 0xFFFF) * ((x >> 16) & 0x7FFF)).sum(dtype=torch.int64))  # each product < 2^31
        h.update(f"{s1 % 2**64}:{s2 % 2**64}".encode())
    return h.hexdigest()[:32]
