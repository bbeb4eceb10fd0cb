"""The prefill node's in-process side: the full-precision prefill and what it ships.

`prefill` runs the forward pass and keeps, per layer, the prompt KV that layer needs (`PromptCapture`: all P
positions for full attention, the last min(P, W) for a sliding window W) and the last position's logits.
`InProcessLoader` encodes that KV and delivers it to a LynxCache in this process on a step-count or
bandwidth-simulated schedule (anchor first); the network path (lynx_hf.transfer) is the other way to fill a cache.
`from_prefill`, `from_kv` and `add_turn` build or extend a LynxCache from such a prefill (they are LynxCache's
classmethods of the same names, registered in `PREFILL_SIDE`). A turn's new positions computed on the decode side
itself: `cache.conversation.extend_here`."""
from __future__ import annotations

import inspect
import threading
import warnings

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .arch import (layer_windows, media_inputs, media_key, refuse_encoder_decoder, refuse_media_positions,
                   window_positions)
from .cache import LynxCache  # noqa: F401 — lynx_hf.LynxCache: imported from here, so its constructors are registered
from .cache.conversation import encoded_key
from .cache.lynx_cache import PREFILL_SIDE, refuse_spec_config
from .config import LynxQuantConfig
from .errors import ConfigError
from .link import LinkEmulator
from .loader import Loader
from .quant import SplitKV, encode
from .width import WidthPolicy, resolve, step_times


class PromptCapture(DynamicCache):
    """A DynamicCache for the prefill forward (in one pass or in chunks) that hands each layer's needed prompt KV to
    `on_layer(i, k, v, start)` as soon as the layer has produced it (k, v: [B, H_kv, n, D] for prompt positions
    [start, start + n) among the layer's held ones, the last held_i positions of the prompt, from `ship_from` on: a
    continued turn ships only what the decode side does not hold). `span(i, a, b)` reads positions [a, b) back from
    a full-attention layer's own KV (no copy); with `keep`, `kept_kv(i, start)` gives positions [start, end) of
    every layer for the prefill server's prefix cache — a full-attention layer's own KV, a sliding-window layer's
    passes as they came (its cache drops what leaves the window)."""

    def __init__(self, config, on_layer, prompt_len: int, ship_from: int = 0, keep: bool = False):
        super().__init__(config=config)
        self.on_layer, self.prompt_len, self.ship_from = on_layer, prompt_len, ship_from
        self.window = [window_positions(prompt_len, w) for w in layer_windows(config)]
        self.seen = [0] * len(self.window)
        self.keep = keep
        self.kept: list = [[] for _ in self.window]  # passes of layers `span` cannot read back (keep only)

    def whole(self, i: int) -> bool:
        """Whether layer i's own KV holds every position it has seen (a full-attention DynamicLayer)."""
        l = self.layers[i] if i < len(self.layers) else None
        return type(l) is DynamicLayer and l.is_initialized and l.keys.shape[-2] == self.seen[i]

    def span(self, i: int, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [a, b) of full-attention layer i, as views of its own KV ([B, H_kv, b - a, D])."""
        if not self.whole(i):
            raise ValueError(f"layer {i} does not keep every position it saw (a sliding window)")
        l = self.layers[i]
        return l.keys[:, :, a:b], l.values[:, :, a:b]

    def kept_kv(self, i: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [start, seen) of layer i (keep): views of its own KV, or its kept passes joined."""
        if self.whole(i):
            return self.span(i, start, self.seen[i])
        ks, vs = zip(*self.kept[i])
        k, v = torch.cat(ks, 2), torch.cat(vs, 2)
        first = self.seen[i] - k.shape[2]
        return k[:, :, start - first:], v[:, :, start - first:]

    def forget_kept(self) -> None:
        """Drop the kept passes so far (what was fed from the prefix cache is there already)."""
        self.kept = [[] for _ in self.window]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not 0 <= layer_idx < len(self.window):
            raise ValueError(f"LynxCache cannot hold this model's KV: it writes KV for cache layer {layer_idx} but has "
                             f"{len(self.window)} attention layers (KV per recurrent loop or shared across layers)")
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        s0, n = self.seen[layer_idx], key_states.shape[-2]  # this pass: prompt positions [s0, s0 + n)
        self.seen[layer_idx] = s0 + n
        if self.keep and not self.whole(layer_idx):
            self.kept[layer_idx].append((key_states, value_states))
        lo = max(s0, self.prompt_len - self.window[layer_idx], self.ship_from)
        if lo < s0 + n <= self.prompt_len:
            self.on_layer(layer_idx, key_states[:, :, lo - s0:], value_states[:, :, lo - s0:], lo)
        return out


def generate_mask(model, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The attention mask `generate` infers for a prompt given without one: pad tokens masked when the model's
    generation config has a pad_token_id that occurs in the prompt and is not an EOS id; else None (no padding)."""
    gc = model.generation_config
    pad, eos = gc.pad_token_id, gc.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    if pad is None or pad in eos or not bool((input_ids == pad).any()):
        return None
    return input_ids.ne(pad).long()


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **media):
    """Full-precision prefill: ([(K, V)] per layer, each [B, H_kv, held_i, D]; last-position logits [B, V] in the
    model's dtype) — the prefill node's own work, with the inputs `generate` gives its own prefill (position_ids
    from the mask, where the model takes them). Raises ValueError for a model that keeps no KV in a Transformers
    Cache (recurrent state, legacy tuples): there is nothing to transfer. `media`: the prompt's images / audio
    (pixel_values, ...), as the model's forward takes them."""
    windows = layer_windows(model.config)
    kv = {}
    cap = PromptCapture(model.config, lambda i, k, v, start: kv.__setitem__(i, (k, v)), input_ids.shape[1])
    kw = dict(media) if attention_mask is None else {**media, "attention_mask": attention_mask}
    if "position_ids" in inspect.signature(model.forward).parameters:
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        kw["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    name = getattr(model.config, "model_type", type(model).__name__)
    try:
        out = model(input_ids=input_ids, cache=cap, use_cache=True, logits_to_keep=1, **kw)
    except TypeError as e:
        raise ValueError(f"LynxCache cannot hold this {name}'s KV: its forward takes no Transformers cache ({e})") \
            from e
    if sorted(kv) != list(range(len(windows))):
        raise ValueError(f"LynxCache cannot hold this {name}'s KV: it wrote {len(kv)} of {len(windows)} layers' KV "
                         f"through a Transformers cache (recurrent state or a legacy cache format)")
    return [kv[i] for i in range(len(kv))], out.logits[:, -1]


def encode_layers(kv, config: LynxQuantConfig):
    """[(K, V)] → [(SplitKV_K, SplitKV_V)]."""
    n = len(kv)
    return [(encode(k, config, "key", layer=(i, n)), encode(v, config, "value", layer=(i, n)))
            for i, (k, v) in enumerate(kv)]


def anchor_only(split):
    """The anchor-stream view of a SplitKV (what travels first): same codes and metadata, no residual (and no
    correction)."""
    return SplitKV(split.config, split.kind, split.shape, split.dtype, split.anchor, None, split.meta, split.axis)


def steps_alias(steps: int | None, tokens: int | None) -> int | None:
    """`residual_after_steps`, or its deprecated alias `residual_after_tokens` (it always counted draft steps)."""
    if tokens is not None:
        if steps is not None:
            raise ConfigError("pass residual_after_steps or residual_after_tokens (its deprecated alias), not both")
        warnings.warn("residual_after_tokens is deprecated: it counts draft steps; use residual_after_steps",
                      DeprecationWarning, stacklevel=3)
        return tokens
    return steps


class InProcessLoader(Loader):
    """Delivers a local prefill's encoded KV: the anchor at once and the residual after `residual_after_steps`
    draft steps (None: at once), or both over a simulated link of `bandwidth_bps` bits/s (anchor first)."""

    def __init__(self, kv, config: LynxQuantConfig, residual_after_steps: int | None = None,
                 bandwidth_bps: float | None = None, latency_s: float = 0.0, *,
                 residual_after_tokens: int | None = None):
        residual_after_steps = steps_alias(residual_after_steps, residual_after_tokens)
        if residual_after_steps is not None and residual_after_steps < 0:
            raise ConfigError("residual_after_steps must be >= 0 or None")
        if bandwidth_bps is not None and bandwidth_bps <= 0:
            raise ConfigError("bandwidth_bps must be > 0")
        self.splits = encode_layers(kv, config)
        self.after, self.bw, self.latency = residual_after_steps, bandwidth_bps, latency_s
        self._released, self._thread = False, None
        self._stop = threading.Event()

    def attach(self, cache) -> "InProcessLoader":
        self.cache = cache
        cache.loader = self
        # each layer's KV ends at the prompt's last position: a sliding layer's starts at P - held
        self.starts = [cache.prompt_len - sk.shape[2] for sk, _ in self.splits]
        if self.bw is not None:
            self._thread = threading.Thread(target=self._link, name="lynx-inprocess-link", daemon=True)
            self._thread.start()
            return self
        self._anchors()
        if self.after is None or self.after == 0:
            self._residual()
        return self

    def _anchors(self):
        for i, (sk, sv) in enumerate(self.splits):
            self.cache.put_anchor(i, "key", self.starts[i], anchor_only(sk))
            self.cache.put_anchor(i, "value", self.starts[i], anchor_only(sv))

    def _residual(self):
        if self._released:
            return
        self._released = True
        for stream in ("residual", "correction"):
            for i, (sk, sv) in enumerate(self.splits):
                if getattr(sk, stream) is not None:
                    self.cache.put_residual(i, "key", self.starts[i], getattr(sk, stream), stream)
                    self.cache.put_residual(i, "value", self.starts[i], getattr(sv, stream), stream)

    def _link(self):
        """Anchor of every layer, then residual of every layer (then, exact mode, the corrections), over one link of
        `bw` bits/s (strict priority)."""
        link = LinkEmulator(self.bw, self.latency)
        ready = link.nic.clock()  # every segment is queued from the start: a late thread loses no link time
        try:
            for stream in ("anchor", "residual", "correction"):
                for i, (sk, sv) in enumerate(self.splits):
                    for kind, s in (("key", sk), ("value", sv)):
                        part = None if stream == "anchor" else getattr(s, stream)
                        if stream != "anchor" and part is None:
                            continue
                        n = s.nbytes("anchor") if part is None else part.numel()
                        if link.pace(n, self._stop, ready_at=ready):
                            return
                        if part is None:
                            self.cache.put_anchor(i, kind, self.starts[i], anchor_only(s))
                        else:
                            self.cache.put_residual(i, kind, self.starts[i], part, stream)
            self._released = True
        except Exception as e:  # noqa: BLE001 — any failure is surfaced to the decoding thread
            self.cache.fail(e)

    def on_draft(self, n: int) -> None:
        if self.bw is None and self.after is not None and n >= self.after:
            self._residual()

    def on_wait(self) -> None:
        if self.bw is None:
            self._residual()

    def close(self) -> None:
        self._stop.set()


# -- LynxCache's in-process constructors (registered as LynxCache.from_prefill / from_kv / add_turn) -----------------
def from_prefill(cls, model, input_ids: torch.Tensor, quant_config: LynxQuantConfig | None = None,
                 residual_after_steps: int | None = None, attention_mask: torch.Tensor | None = None,
                 spec_config=None, bandwidth_bps: float | None = None, *,
                 residual_after_tokens: int | None = None, **media):
    """Prefill locally in full precision, encode each layer's KV, and return (cache, first_token [B, 1]) with the
    prefill's logits in the cache (first_token is their argmax, for callers that append it themselves).
    Without attention_mask, pad tokens in the prompt are masked as `generate` masks them (pad_token_id of the
    model's generation config, when it is not an EOS id); generate must then get the same prompt and mask.
    The anchor lands at once; the residual after `residual_after_steps` draft steps (None: at once; the older
    name `residual_after_tokens` is a deprecated alias), or, with bandwidth_bps (bits/s), both stream over a
    simulated link in a background thread. `media`: the prompt's images / audio as the model takes them
    (pixel_values, image_sizes, ...): they run in the prefill, and generate must get the same ones or none."""
    refuse_encoder_decoder(model)
    refuse_spec_config(spec_config)
    other = sorted(set(media) - set(media_inputs(media)))
    if other:
        raise ValueError(f"from_prefill got unexpected arguments {other} (besides its own it takes a model's media "
                         f"inputs: pixel_values, image_sizes, image_grid_thw, input_features, ...)")
    refuse_media_positions(model, media)
    if attention_mask is None:  # as generate infers it: pad tokens (pad != eos) are masked
        attention_mask = generate_mask(model, input_ids)
    encoded, consumed = image_features(model, media)  # the prefill runs on them, as generate's own prefill does
    inputs = {k: v for k, v in media.items() if k not in consumed}
    if encoded:
        inputs["mm_encoder_outputs"] = encoded
    kv, logits = prefill(model, input_ids, attention_mask, **inputs)
    cache = from_kv(cls, model, input_ids.shape[1], kv, logits, quant_config, residual_after_steps, None,
                    bandwidth_bps, residual_after_tokens=residual_after_tokens)
    cache.conversation.expect_prompt(input_ids, attention_mask)
    cache.conversation.media_key = media_key(media_inputs(media))
    cache.conversation.encoded_key = encoded_key(encoded)
    return cache, logits.argmax(-1, keepdim=True)


@torch.no_grad()
def image_features(model, media: dict) -> tuple[dict, set]:
    """What Transformers' generate encodes ahead from `media` and passes its forwards as `mm_encoder_outputs` (a
    model's public `get_image_features` / `get_video_features`, given the inputs it names), and the inputs that took:
    the prefill runs on the same outputs, and a generate's images are compared with the prefill's through them once
    Transformers has consumed the pixels. ({}, set()) for other models."""
    if not media or "mm_encoder_outputs" not in inspect.signature(model.forward).parameters:
        return {}, set()
    out, consumed = {}, set()
    for modality in ("image", "video"):
        fn = getattr(model.base_model, f"get_{modality}_features", None)
        if fn is None or modality not in getattr(model, "input_modalities", ()):
            continue
        kw = {k: media[k] for k in inspect.signature(fn).parameters if k != "kwargs" and k in media}
        if any(k in kw for k in ("pixel_values", "pixel_values_images", "pixel_values_videos", "image_patches")):
            out[modality] = fn(**kw, return_dict=True)
            consumed |= set(kw)
    return out, consumed


def from_kv(cls, model, prompt_len: int, kv, logits: torch.Tensor, quant_config: LynxQuantConfig | None = None,
            residual_after_steps: int | None = None, spec_config=None, bandwidth_bps: float | None = None, *,
            residual_after_tokens: int | None = None):
    """A cache of a `prompt_len`-token prompt fed by an InProcessLoader from `prefill`'s output (the KV each layer
    needs, the last position's logits), e.g. to decode one prefill several times."""
    refuse_encoder_decoder(model)
    refuse_spec_config(spec_config)
    windows = layer_windows(model.config)
    if quant_config is not None and quant_config.anchor_bits == "auto":  # the width for this simulated link
        V = sum(k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3] for k, v in kv)  # values a position carries
        link = bandwidth_bps if (bandwidth_bps or 0) > 0 else None  # (InProcessLoader refuses a bad one below)
        policy = WidthPolicy(link, step_times(model, prompt_len) if link else None)
        choice = policy.choose(prompt_len, V, chunk=quant_config.chunk_size)
        quant_config = resolve(quant_config, choice)
    else:
        choice = None
    cache = cls(len(windows), prompt_len, quant_config, dtype=kv[0][0].dtype, device=kv[0][0].device,
                sliding_windows=windows).bind(model)
    cache.put_logits(logits)
    cache.trace.stats.width = None if choice is None else choice.as_dict()
    InProcessLoader(kv, cache.quant_config, residual_after_steps, bandwidth_bps,
                    residual_after_tokens=residual_after_tokens).attach(cache)
    return cache


def add_turn(model, cache, input_ids: torch.Tensor, residual_after_steps: int | None = None,
             bandwidth_bps: float | None = None) -> torch.Tensor:
    """The in-process prefill node's answer to a new turn of the conversation `cache` holds: it prefills
    `input_ids` [1, L] in full precision (as a prefill server recomputes what it never saw) and ships only the new
    positions [held, L), anchor first, with the last position's logits; the held KV stays. Then
    `model.generate(input_ids, cache=cache, custom_generate=speculative_generate)` drafts on the held prefix plus
    the new range's anchor and verifies once its residual lands (schedule as in `from_prefill`). Returns the
    first token [1, 1] (the logits' argmax)."""
    if cache.quant_config.exact:
        raise ValueError("exact mode continues a conversation on the decode side: call model.generate(ids, "
                         "cache=cache, custom_generate=lynx_hf.speculative_generate) with the whole conversation "
                         "(its new positions are computed over the held KV, as Transformers' own turns do)")
    cache.conversation.continue_turn(input_ids)
    kv, logits = prefill(model, input_ids)
    cache.conversation.begin_range(input_ids)
    P = cache.prompt_len
    kv = [(k[:, :, k.shape[2] - (P - l.store.offset):], v[:, :, v.shape[2] - (P - l.store.offset):])
          for (k, v), l in zip(kv, cache.layers)]  # each layer's positions of the range
    cache.put_logits(logits)
    InProcessLoader(kv, cache.quant_config, residual_after_steps, bandwidth_bps).attach(cache)
    return logits.argmax(-1, keepdim=True)


PREFILL_SIDE.update(from_prefill=from_prefill, from_kv=from_kv, add_turn=add_turn)
