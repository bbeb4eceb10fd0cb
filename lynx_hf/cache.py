"""`LynxCache`: a `transformers.Cache` whose prompt KV arrives as Lynx streams (anchor first, residual later).

Per layer it holds the encoded prompt segments (packed codes + metadata), the tier they are materialised at
(None → "anchor" → "full"), and a full-precision tail for tokens generated on the decode side. A full-attention
layer holds the whole prompt; a sliding-window layer of window W only its last min(P, W) positions, and its mask
sizes say so (`kv_offset`). Layers are filled piecewise by a loader from another thread (`put_anchor` /
`put_residual` / `put_logits`); the decoding thread polls readiness without blocking and switches tiers with
`set_tier`, which dequantizes the prompt once per change, never per step.

Two ways to decode from it:
  * `model.generate(prompt, cache=cache, custom_generate=lynx_hf.speculative_generate, ...)`: drafts on the anchor
    tier while the residual streams in, then verifies (generate.py). The first token comes from the prefill's
    last-position logits (`prefill_logits`), so it follows the caller's generation options.
  * `model.generate(prompt, cache=cache)`: plain Transformers decoding. Until its first forward the cache presents
    the prompt minus its last position, so `generate` re-runs that one position (as vLLM does when every prompt
    token is cached); the first forward waits for the residual and decodes on the full tier, no drafting.

Memory bound during decode, per layer: packed codes and metadata (≈ 8.5 bits/value of the held prompt, both
streams), one dequantized prompt in the model dtype ([B, H_kv, S_held, D] for K and for V; the full tier is decoded
into the anchor tier's buffers in place), and the tail ([B, H_kv, T, D] each). The forward pass's activations come
on top (measured against this bound in docs/performance.md). The cache knows nothing about sockets or sampling."""
from __future__ import annotations

import bisect
import threading
import time
import warnings

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from .config import LynxQuantConfig, SpecConfig
from .quant import SplitKV, codec, decode

KINDS = ("key", "value")
PLAIN_GENERATE_HINT = ("LynxCache: generate() without custom_generate waits for the residual stream and decodes on "
                       "the full tier. Pass custom_generate=lynx_hf.speculative_generate to draft on the anchor tier "
                       "while the residual streams in (same output).")


class LoaderError(RuntimeError):
    """The loader failed (peer gone, corrupted stream, timeout): the prompt KV will not be completed."""


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


class LynxLayer(CacheLayerMixin):
    """One layer: prompt positions [offset, P) from the streams, then the decode-side tail."""

    is_croppable = True
    supports_early_init = False

    def __init__(self, prompt_len: int, sliding_window: int | None = None):
        super().__init__()
        self.prompt_len, self.sliding_window = prompt_len, sliding_window
        self.is_sliding = sliding_window is not None
        self.held = prompt_len if sliding_window is None else min(prompt_len, sliding_window)
        self.offset = prompt_len - self.held  # absolute position of keys[..., 0, :]
        self.segments = {k: {} for k in KINDS}  # kind -> {start: SplitKV}, each covering [start, start + S_seg)
        self._starts = {k: [] for k in KINDS}   # kind -> sorted segment starts
        self._tokens = {k: 0 for k in KINDS}    # kind -> prompt tokens covered by anchors
        self._missing = 0                       # split segments whose residual has not arrived
        self.tier = None
        self.pending_full = False  # switch to the full tier at the next update (LynxCache.set_full_tier_per_layer)
        self.rerun = 0  # leading positions of the next update that the layer already holds (plain generate())

    # -- filled by the loader (under LynxCache's lock) --------------------------------------------------------------
    def put_anchor(self, kind: str, start: int, split: SplitKV) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        end = start + split.shape[2]
        if start < self.offset or end > self.prompt_len:
            raise ValueError(f"segment [{start}, {end}) lies outside the layer's prompt KV [{self.offset}, "
                             f"{self.prompt_len})")
        starts, segs = self._starts[kind], self.segments[kind]  # coverage is a set of disjoint intervals
        i = bisect.bisect_left(starts, start)
        for s0 in starts[max(i - 1, 0): i + 1]:  # only the neighbours can overlap
            if start < s0 + segs[s0].shape[2] and s0 < end:
                raise ValueError(f"{kind} segment [{start}, {end}) overlaps [{s0}, {s0 + segs[s0].shape[2]}) (duplicate?)")
        starts.insert(i, start)
        segs[start] = split
        self._tokens[kind] += split.shape[2]
        self._missing += codec(split.config).split and split.residual is None

    def put_residual(self, kind: str, start: int, residual: torch.Tensor) -> None:
        seg = self.segments[kind].get(start)
        if seg is None:
            raise ValueError(f"residual for {kind} at token {start} arrived before its anchor")
        if not codec(seg.config).split:
            raise ValueError(f"method {seg.config.method!r} has no residual stream")
        if seg.residual is not None:
            raise ValueError(f"duplicate residual segment for {kind} at token {start}")
        want = (*seg.shape[:3], seg.shape[3] // 2)
        if tuple(residual.shape) != want or residual.dtype != torch.uint8:
            raise ValueError(f"residual shape {tuple(residual.shape)} {residual.dtype}, expected {want} uint8")
        seg.residual = residual
        self._missing -= 1

    def _covered(self, kind: str) -> int:
        return self._tokens[kind]

    def anchors_complete(self) -> bool:
        return all(self._tokens[k] == self.held for k in KINDS)

    def residual_complete(self) -> bool:
        return self.anchors_complete() and self._missing == 0

    # -- tiers ------------------------------------------------------------------------------------------------------
    def _dequant(self, kind: str, tier: str) -> torch.Tensor:
        parts = [decode(self.segments[kind][s], tier) for s in self._starts[kind]]
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    def set_tier(self, tier: str, dtype: torch.dtype, device) -> None:
        """(Re)materialise the prompt region at `tier`, in place when the buffers exist: each segment decodes
        straight into its slice of keys / values when dtype and device agree (no second copy of the prompt KV)."""
        if self.is_initialized and all(seg.dtype == self.keys.dtype == dtype and seg.anchor.device == self.keys.device
                                       for kind in KINDS for seg in self.segments[kind].values()):
            for kind, buf in (("key", self.keys), ("value", self.values)):
                for s0 in self._starts[kind]:
                    seg = self.segments[kind][s0]
                    a = s0 - self.offset
                    decode(seg, tier, out=buf[:, :, a: a + seg.shape[2]])
            self.tier = tier
            return
        k = self._dequant("key", tier).to(device=device, dtype=dtype)    # k: [B, H_kv, held, D]
        v = self._dequant("value", tier).to(device=device, dtype=dtype)
        if not self.is_initialized:
            self.keys, self.values = k, v
            self.device, self.dtype = k.device, dtype
            self.is_initialized = True
        else:
            self.keys[:, :, : self.held] = k
            self.values[:, :, : self.held] = v
        self.tier = tier

    # -- CacheLayerMixin --------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        raise RuntimeError("LynxLayer is initialised by set_tier, not by a forward pass")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            raise RuntimeError("LynxCache: the prompt KV is not materialised yet (no tier set): wait for the anchors")
        if key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(f"LynxCache holds {self.keys.shape[0]} sequence(s) but the model ran "
                             f"{key_states.shape[0]}: num_beams > 1 and num_return_sequences > 1 are not supported")
        if self.rerun:  # the prompt's last position, re-run by generate(): the streamed KV stands
            key_states, value_states = key_states[..., self.rerun:, :], value_states[..., self.rerun:, :]
            self.rerun = 0
        self.keys = torch.cat([self.keys, key_states.to(self.keys.dtype)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.values.dtype)], dim=-2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Absolute length. Before the first forward: the prompt minus its last position (see the module doc)."""
        if not self.is_initialized:
            return self.prompt_len - 1
        return self.offset + self.keys.shape[-2] - self.rerun

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() - self.offset + query_length, self.offset

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Remove `-tokens_to_remove` tail tokens (negative, as Transformers' layers take it). Never the prompt."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = self.keys.shape[-2] + tokens_to_remove
        if keep < self.held:
            raise ValueError(f"cannot crop into the transferred prompt ({self.prompt_len} tokens) to "
                             f"{self.offset + keep}")
        self.keys = self.keys[..., :keep, :]
        self.values = self.values[..., :keep, :]

    def keep_tail(self, start: int, index: torch.Tensor) -> None:
        """Keep the absolute positions before `start`, then per row the positions start + index[b] ([B, k]), in that
        order; drop the rest (a verified tree path's KV, gathered in place)."""
        s = start - self.offset
        if s < self.held or s > self.keys.shape[-2]:
            raise ValueError(f"keep_tail start {start} outside the decode-side tail")
        i = index.to(self.keys.device)[:, None, :, None]                       # [B, 1, k, 1]
        i = i.expand(self.keys.shape[0], self.keys.shape[1], i.shape[2], self.keys.shape[3])
        self.keys = torch.cat([self.keys[..., :s, :], self.keys[..., s:, :].gather(2, i)], dim=-2)
        self.values = torch.cat([self.values[..., :s, :], self.values[..., s:, :].gather(2, i)], dim=-2)

    def reset(self) -> None:
        """Drop the decode-side tail; the transferred prompt stays."""
        if self.is_initialized:
            self.crop(self.held - self.keys.shape[-2])

    def _select(self, fn) -> None:
        for kind in KINDS:
            for seg in self.segments[kind].values():
                seg.anchor, seg.meta = fn(seg.anchor), {n: fn(t) for n, t in seg.meta.items()}
                if seg.residual is not None:
                    seg.residual = fn(seg.residual)
                seg.shape = (seg.anchor.shape[0], *seg.shape[1:])
        if self.is_initialized:
            self.keys, self.values = fn(self.keys), fn(self.values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))


class LynxCache(Cache):
    """Cache for a transferred prompt of `prompt_len` tokens: one LynxLayer per decoder layer, sliding where
    `sliding_windows[i]` is a window (see `layer_windows`; `LynxCache.for_model` reads them from a model)."""

    def __init__(self, num_layers: int, prompt_len: int, quant_config: LynxQuantConfig | None = None,
                 spec_config: SpecConfig | None = None, dtype: torch.dtype = torch.float32, device="cpu",
                 timeout_s: float = 120.0, sliding_windows: list[int | None] | None = None):
        if num_layers < 1 or prompt_len < 1:
            raise ValueError(f"LynxCache needs num_layers >= 1 and prompt_len >= 1, got {num_layers}, {prompt_len}")
        windows = list(sliding_windows) if sliding_windows is not None else [None] * num_layers
        if len(windows) != num_layers or not all(w is None or (isinstance(w, int) and w >= 1) for w in windows):
            raise ValueError(f"sliding_windows must hold {num_layers} entries, each None or an int >= 1")
        super().__init__(layers=[LynxLayer(prompt_len, w) for w in windows])
        self.prompt_len = prompt_len
        self.quant_config = quant_config or LynxQuantConfig()
        self.spec_config = spec_config or SpecConfig()
        self.dtype, self.device, self.timeout_s = dtype, torch.device(device), timeout_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._error: BaseException | None = None
        self.prefill_logits: torch.Tensor | None = None  # [B, V]: the prefill's last-position logits
        self.loader = None
        self.used = False  # a generation has consumed this cache (one request per cache)
        self.stats: dict = {}
        self.events: list = []    # (perf_counter, "anchor" | "residual", layer, kind): arrivals
        self._res_n, self._res_first, self._res_last = 0, 0.0, 0.0  # residual segments received, first/last time
        self.residual_done_at: float | None = None  # perf_counter when the last residual segment landed
        self.timeline: list = []  # (perf_counter, "draft" | "verified" | "verify_start"): decode-side tokens
        self.reset_stats()

    @classmethod
    def for_model(cls, model, prompt_len: int, **kw) -> "LynxCache":
        windows = layer_windows(model.config)
        return cls(len(windows), prompt_len, sliding_windows=windows, **kw)

    def reset_stats(self) -> None:
        self.stats = {"drafted": 0, "accepted": 0, "rounds": 0, "tree_nodes": 0, "ttft_draft_s": None,
                      "ttft_verified_s": None, "verify_s": 0.0, "anchors_at_s": None, "residual_at_s": None}

    # -- loader side (any thread) -------------------------------------------------------------------------------------
    def put_anchor(self, layer: int, kind: str, start: int, split: SplitKV) -> None:
        with self._changed:
            self._layer(layer).put_anchor(kind, start, split)
            self.events.append((time.perf_counter(), "anchor", layer, kind))
            self._changed.notify_all()

    def put_residual(self, layer: int, kind: str, start: int, residual: torch.Tensor) -> None:
        with self._changed:
            self._layer(layer).put_residual(kind, start, residual)
            t = time.perf_counter()
            self.events.append((t, "residual", layer, kind))
            self._res_first = t if self._res_n == 0 else self._res_first
            self._res_last, self._res_n = t, self._res_n + 1
            if all(l.residual_complete() for l in self.layers):
                self.residual_done_at = t
            self._changed.notify_all()

    def put_logits(self, logits: torch.Tensor) -> None:
        """The prefill's last-position logits, [B, V] (raw, before any logits processor)."""
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(f"prefill logits must be a float tensor [B, V], got {getattr(logits, 'shape', logits)}")
        if torch.isnan(logits).any():
            raise ValueError("prefill logits contain NaN")
        with self._changed:
            if self.prefill_logits is not None:
                raise ValueError("duplicate prefill logits")
            self.prefill_logits = logits
            self._changed.notify_all()

    def fail(self, exc: BaseException) -> None:
        """The loader reports that the prompt will not be completed; waiting calls raise LoaderError."""
        with self._changed:
            self._error = exc
            self._changed.notify_all()

    def _layer(self, i: int) -> LynxLayer:
        if not 0 <= i < len(self.layers):
            raise ValueError(f"layer {i} out of range [0, {len(self.layers)})")
        return self.layers[i]

    # -- decode side --------------------------------------------------------------------------------------------------
    # What arrived whole stays usable after a later loader failure; the failure is raised to whoever still waits.
    def anchors_ready(self) -> bool:
        with self._lock:
            return self._ready_or_raise(all(l.anchors_complete() for l in self.layers))

    def residual_ready(self) -> bool:
        with self._lock:
            return self._ready_or_raise(all(l.residual_complete() for l in self.layers))

    def _ready_or_raise(self, ready: bool) -> bool:
        if not ready:
            self._raise_if_failed()
        return ready

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise LoaderError(f"KV loader failed: {self._error}") from self._error

    def _wait(self, ready, what: str, timeout: float | None) -> None:
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                if self._ready_or_raise(ready()):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LoaderError(f"timed out after {timeout:.1f} s waiting for the {what}")
                self._changed.wait(min(left, 0.5))

    def wait_anchors(self, timeout: float | None = None) -> None:
        self._wait(lambda: all(l.anchors_complete() for l in self.layers), "anchor stream", timeout)

    def wait_residual(self, timeout: float | None = None) -> None:
        if self.loader is not None:
            self.loader.on_wait()
        self._wait(lambda: all(l.residual_complete() for l in self.layers), "residual stream", timeout)

    def wait_logits(self, timeout: float | None = None) -> torch.Tensor:
        self._wait(lambda: self.prefill_logits is not None, "prefill's logits", timeout)
        return self.prefill_logits

    def set_tier(self, tier: str) -> None:
        """Materialise every layer's prompt at `tier` (after wait_anchors / wait_residual)."""
        with self._lock:
            for l in self.layers:
                l.set_tier(tier, self.dtype, self.device)

    def set_full_tier_per_layer(self) -> None:
        """Switch to the full tier layer by layer: each layer's next `update` (its turn in the next forward pass)
        first waits for that layer's residual, then materialises it. A forward pass started before the residual is
        complete thus runs each layer as soon as its residual has landed (verification overlaps the transfer)."""
        for l in self.layers:
            l.pending_full = True

    def _materialise_pending(self, i: int) -> None:
        layer = self.layers[i]
        self._wait(layer.residual_complete, f"residual stream of layer {i}", None)
        with self._lock:
            layer.set_tier("full", self.dtype, self.device)
        layer.pending_full = False

    def keep_tail(self, start: int, index: torch.Tensor) -> None:
        """Every layer keeps its positions before `start` and, per row, start + index[b] ([B, k]) after them."""
        for l in self.layers:
            l.keep_tail(start, index)

    def residual_eta(self) -> float | None:
        """Seconds until the residual is complete, extrapolated from the residual segments received so far at their
        mean interval (None before two have arrived, e.g. a residual released all at once)."""
        with self._lock:
            if self._res_n < 2:
                return None
            missing = sum(l._missing for l in self.layers)
            step = (self._res_last - self._res_first) / (self._res_n - 1)
            return max(0.0, missing * step - (time.perf_counter() - self._res_last))

    def notify_drafted(self, n: int) -> None:
        if self.loader is not None:
            self.loader.on_draft(n)

    def close(self) -> None:
        """Release the loader (stops a simulated link; a network receiver reads on to its request's end) and drop
        the reference to it, so that no cache ↔ loader cycle outlives the request (caches are then freed by
        reference counting, not by the cyclic collector, which lets garbage KV pile up). The contents stay readable."""
        loader, self.loader = self.loader, None
        if loader is not None:
            loader.close()

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.layers[layer_idx].pending_full:
            self._materialise_pending(layer_idx)
        if self.layers[layer_idx].tier is None:
            self._start_plain_generate()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _start_plain_generate(self) -> None:
        """A forward pass without speculative_generate: the full tier, once it has landed; the first forward re-runs
        the prompt's last position (get_seq_length said P - 1), whose streamed KV each layer keeps."""
        warnings.warn(PLAIN_GENERATE_HINT, stacklevel=3)
        self.pin_tier("full")

    def pin_tier(self, tier: str = "full") -> "LynxCache":
        """Serve plain decoding (`generate` without custom_generate, or forward passes) from one tier, never
        drafting: wait for it, materialise it; the first forward re-runs the prompt's last position. "anchor"
        decodes on the 4-bit anchor alone, unverified (the anchor-only ablation of the evaluation)."""
        if tier not in ("anchor", "full"):
            raise ValueError(f"tier must be 'anchor' or 'full', got {tier!r}")
        if self.used:
            raise ValueError("this LynxCache was already used for a generation; build a new one per request")
        self.used = True
        self.wait_residual() if tier == "full" else self.wait_anchors()
        self.set_tier(tier)
        for l in self.layers:
            l.rerun = 1
        self.close()  # everything this tier needs has landed (a pinned anchor never takes the residual)
        return self

    @property
    def is_compileable(self) -> bool:
        return False

    @classmethod
    def from_prefill(cls, model, input_ids: torch.Tensor, quant_config: LynxQuantConfig | None = None,
                     residual_after_tokens: int | None = None, attention_mask: torch.Tensor | None = None,
                     spec_config: SpecConfig | None = None, bandwidth_bps: float | None = None):
        """Prefill locally in full precision, encode each layer's KV, and return (cache, first_token [B, 1]) with the
        prefill's logits in the cache (first_token is their argmax, for callers that append it themselves).
        The anchor lands at once; the residual after `residual_after_tokens` draft steps (None: at once), or, with
        bandwidth_bps (bits/s), both stream over a simulated link in a background thread."""
        from .loader import prefill

        kv, logits = prefill(model, input_ids, attention_mask)
        cache = cls.from_kv(model, input_ids.shape[1], kv, logits, quant_config, residual_after_tokens, spec_config,
                            bandwidth_bps)
        return cache, logits.argmax(-1, keepdim=True)

    @classmethod
    def from_kv(cls, model, prompt_len: int, kv, logits: torch.Tensor, quant_config: LynxQuantConfig | None = None,
                residual_after_tokens: int | None = None, spec_config: SpecConfig | None = None,
                bandwidth_bps: float | None = None) -> "LynxCache":
        """A cache of a `prompt_len`-token prompt fed by an InProcessLoader from `loader.prefill`'s output (the KV
        each layer needs, the last position's logits), e.g. to decode one prefill several times."""
        from .loader import InProcessLoader

        cache = cls.for_model(model, prompt_len, quant_config=quant_config,
                              spec_config=spec_config, dtype=kv[0][0].dtype, device=kv[0][0].device)
        cache.put_logits(logits)
        InProcessLoader(kv, cache.quant_config, residual_after_tokens, bandwidth_bps).attach(cache)
        return cache
