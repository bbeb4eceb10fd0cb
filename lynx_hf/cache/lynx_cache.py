"""`LynxCache`: a `transformers.Cache` whose prompt KV arrives as Lynx streams (anchor first, residual later).

It orchestrates: a loader on another thread fills each layer's `PromptStore` (`put_anchor` / `put_residual` /
`put_logits`, under the cache's lock); the decoding thread polls readiness without blocking and materialises a tier
(`set_tier`, or layer by layer inside a forward pass with `set_tier("full", per_layer=True)`). The lock covers the
stores only: dequantization runs outside it, so the receiver keeps reading the socket while a tier is materialised.

Two ways to decode from it:
  * `model.generate(prompt, cache=cache, custom_generate=lynx_hf.speculative_generate, ...)`: drafts on the anchor
    tier while the residual streams in, then verifies (lynx_hf.engine). The first token comes from the prefill's
    last-position logits (`prefill_logits`), so it follows the caller's generation options.
  * `model.generate(prompt, cache=cache)`: plain Transformers decoding on the full tier, no drafting. Its first
    forward re-runs the prompt's last position — whose KV stands as streamed and whose logits are replaced by the
    prefill's exact ones — as vLLM does when every prompt token is cached (lynx_hf.cache.conversation says how).

What the cache has been asked to serve — the prompt, the conversation it holds after a generation, a turn that
continues it, `copy.deepcopy` / `fork` branches — is its `Conversation` (`cache.conversation`). The constructors that
prefill in this process (`from_prefill`, `from_kv`, `add_turn`) are lynx_hf.local's, reached through PREFILL_SIDE.
What it records of its data: `quant_config` (the codec its stored ranges are encoded with). The drafting settings
are the generate call's (`spec_config=`), never the cache's.

Memory bound during decode, per layer: packed codes and metadata (≈ 8.5 bits/value of the held prompt, both
streams), one dequantized prompt in the model dtype ([B, H_kv, S_held, D] for K and for V; the full tier is decoded
into the anchor tier's buffers in place), and the tail ([B, H_kv, T, D] each). The forward pass's activations come
on top (measured against this bound in docs/performance.md). The cache knows nothing about sockets or sampling;
its telemetry is a `Trace` (`cache.trace`, `cache.stats`)."""
from __future__ import annotations

import copy
import threading
import time
import warnings
import weakref

import numpy as np
import torch
from transformers.cache_utils import Cache

from ..config import LynxQuantConfig
from ..errors import ConfigError
from ..loader import LoaderError
from ..quant import SplitKV
from ..trace import Trace
from .layer import KINDS, LynxLayer
from .store import complete
from .conversation import Conversation

UNBOUND_PLAIN = ("generate() without custom_generate needs a LynxCache that knows its model, to take the prefill's "
                 "logits for the first step: build it with LynxCache.from_prefill / from_kv or call "
                 "cache.bind(model) first (or pass custom_generate=lynx_hf.speculative_generate)")
PLAIN_GENERATE_HINT = ("LynxCache: generate() without custom_generate waits for the residual stream and decodes on "
                       "the full tier. Pass custom_generate=lynx_hf.speculative_generate to draft on the anchor tier "
                       "while the residual streams in (same output).")


class LynxCache(Cache):
    """Cache for a transferred prompt of `prompt_len` tokens: one LynxLayer per decoder layer, sliding where
    `sliding_windows[i]` is a window (see `arch.layer_windows`, which reads them from a model's config)."""

    def __init__(self, num_layers: int, prompt_len: int, quant_config: LynxQuantConfig | None = None, *,
                 dtype: torch.dtype = torch.float32, device="cpu", timeout_s: float = 120.0,
                 sliding_windows: list[int | None] | None = None, spec_config=None):
        refuse_spec_config(spec_config)
        if num_layers < 1 or prompt_len < 1:
            raise ValueError(f"LynxCache needs num_layers >= 1 and prompt_len >= 1, got {num_layers}, {prompt_len}")
        windows = list(sliding_windows) if sliding_windows is not None else [None] * num_layers
        if len(windows) != num_layers or not all(w is None or (isinstance(w, int) and w >= 1) for w in windows):
            raise ValueError(f"sliding_windows must hold {num_layers} entries, each None or an int >= 1")
        device = torch.device(device)
        super().__init__(layers=[LynxLayer(prompt_len, w, device) for w in windows])
        self.prompt_len = prompt_len
        self.quant_config = quant_config or LynxQuantConfig()  # what the prefill side encodes with
        if self.quant_config.anchor_bits == "auto":
            raise ConfigError("LynxCache holds KV of one anchor width: anchor_bits='auto' is resolved before the KV "
                             "is encoded (DecodeClient, from_prefill(..., bandwidth_bps=...): lynx_hf.width)")
        self.dtype, self.device, self.timeout_s = dtype, device, timeout_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._error: BaseException | None = None
        self._pending_full = [False] * num_layers  # materialise the full tier at the layer's next update
        self.prefill_logits: torch.Tensor | None = None  # [B, V]: the prefill's last-position logits
        self.loader = None
        self.trace = Trace()
        self.on_mismatch = "error"  # or "crop": a turn contradicting the held ids drops the KV from there on
        self.conversation = Conversation(self)
        self._pinned, self._in_generate = False, False
        self._hooks: list = []
        self._model = None   # weakref to the bound model
        self._bound = False  # bind(model) was called: plain generate can take the prefill's first-step logits

    # -- the in-process prefill side's constructors (lynx_hf.local, which registers them in PREFILL_SIDE) -------------
    @classmethod
    def from_prefill(cls, model, input_ids: torch.Tensor, *args, **kw):
        """Prefill `input_ids` locally in full precision and return (cache, first_token [B, 1]): see
        lynx_hf.local.from_prefill."""
        return _prefill_side("from_prefill")(cls, model, input_ids, *args, **kw)

    @classmethod
    def from_kv(cls, model, prompt_len: int, kv, logits: torch.Tensor, *args, **kw) -> "LynxCache":
        """A cache fed from `local.prefill`'s output: see lynx_hf.local.from_kv."""
        return _prefill_side("from_kv")(cls, model, prompt_len, kv, logits, *args, **kw)

    def add_turn(self, model, input_ids: torch.Tensor, *args, **kw) -> torch.Tensor:
        """The in-process prefill node's answer to a new turn of the conversation: see lynx_hf.local.add_turn."""
        return _prefill_side("add_turn")(model, self, input_ids, *args, **kw)

    # -- plain generate -----------------------------------------------------------------------------------------------
    @property
    def _is_user_defined(self) -> bool:
        return self._in_generate

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        # Transformers' generate sets this flag on a cache passed to it, once per call, before its first forward
        if value:
            self.conversation.enter_plain()
        self._in_generate = bool(value)

    def bind(self, model) -> "LynxCache":
        """Hook `model` (torch forward hooks, acting only on forwards given this cache) so that a plain
        `generate(ids, cache=self)` is checked and sliced by the conversation (lynx_hf.cache.conversation)."""
        ref = weakref.ref(self)

        def pre(module, args, kwargs):
            c = ref()
            if c is not None and kwargs.get("cache") is c:
                new = c.conversation.pre_forward(module, kwargs)
                return None if new is None else (args, new)

        def post(module, args, kwargs, output):
            c = ref()
            if c is not None and kwargs.get("cache") is c:
                c.conversation.post_forward(output)

        _remove_hooks(self._hooks)
        self._hooks = [model.register_forward_pre_hook(pre, with_kwargs=True, prepend=True),  # before any other
                       model.register_forward_hook(post, with_kwargs=True)]
        weakref.finalize(self, _remove_hooks, list(self._hooks))
        self._bound, self._model = True, weakref.ref(model)
        return self

    @property
    def stats(self):
        """Telemetry of the last generation (lynx_hf.trace.Stats; `cache.trace` has the events and timeline)."""
        return self.trace.stats

    # -- loader side (any thread) -------------------------------------------------------------------------------------
    def put_anchor(self, layer: int, kind: str, start: int, split: SplitKV) -> None:
        with self._changed:
            _layer(self, layer).store.put_anchor(kind, start, split)
            self.trace.arrived("anchor", layer, kind)
            self._changed.notify_all()

    def put_residual(self, layer: int, kind: str, start: int, data: torch.Tensor, stream: str = "residual") -> None:
        """A segment's residual codes, or (stream "correction", exact mode) its correction: the full tier of a
        segment is in once both are."""
        with self._changed:
            _layer(self, layer).store.put_residual(kind, start, data, stream)
            self.trace.arrived(stream, layer, kind, complete=complete(self.layers, "residual"))
            self._changed.notify_all()

    def put_logits(self, logits: torch.Tensor) -> None:
        """The prefill's last-position logits, [B, V] (raw, before any logits processor)."""
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(f"prefill logits must be a float tensor [B, V], got {getattr(logits, 'shape', logits)}")
        if _has_nan(logits):
            raise ValueError("prefill logits contain NaN")
        with self._changed:
            if self.prefill_logits is not None:
                raise ValueError("duplicate prefill logits")
            self.prefill_logits = logits
            self.trace.logits_at = time.perf_counter()
            self._changed.notify_all()

    def fail(self, exc: BaseException) -> None:
        """The loader reports that the prompt will not be completed; waiting calls raise LoaderError."""
        with self._changed:
            self._error = exc
            self._changed.notify_all()

    # -- decode side: readiness ---------------------------------------------------------------------------------------
    # What arrived whole stays usable after a later loader failure; the failure is raised to whoever still waits.
    def anchors_ready(self) -> bool:
        with self._lock:
            return _ready_or_raise(self, complete(self.layers, "anchor"))

    def residual_ready(self) -> bool:
        with self._lock:
            return _ready_or_raise(self, complete(self.layers, "residual"))

    def wait_anchors(self, timeout: float | None = None) -> None:
        _wait(self, lambda: complete(self.layers, "anchor"), "anchor stream", timeout)

    def wait_residual(self, timeout: float | None = None) -> None:
        self.need_residual()
        _wait(self, lambda: complete(self.layers, "residual"), "residual stream", timeout)

    def wait_logits(self, timeout: float | None = None) -> torch.Tensor:
        _wait(self, lambda: self.prefill_logits is not None, "prefill's logits", timeout)
        return self.prefill_logits

    def need_residual(self) -> None:
        """The decoder is about to verify: a loader on a step-count schedule releases the residual now."""
        if self.loader is not None:
            self.loader.on_wait()

    def notify_drafted(self, n: int) -> None:
        if self.loader is not None:
            self.loader.on_draft(n)

    def residual_eta(self) -> float | None:
        """Seconds until the residual is complete (see Trace.residual_eta)."""
        with self._lock:
            return self.trace.residual_eta(sum(l.store.missing for l in self.layers))

    # -- decode side: tiers -------------------------------------------------------------------------------------------
    def set_tier(self, tier: str, only_missing: bool = False, per_layer: bool = False) -> None:
        """Materialise every layer's prompt at `tier` (after wait_anchors / wait_residual; only_missing: the layers
        not at that tier yet): the segments are taken under the lock, dequantized outside it. per_layer (the full
        tier only): each layer's next `update` (its turn in the next forward pass) first waits for that layer's
        residual, then materialises it — a forward pass started before the residual is complete runs each layer as
        soon as its residual has landed (verification overlaps the transfer)."""
        if per_layer:
            if tier != "full":
                raise ValueError("set_tier(per_layer=True) switches to the full tier")
            self._pending_full = [True] * len(self.layers)
            return
        with self._lock:
            if not complete(self.layers, tier if tier == "anchor" else "residual"):
                raise RuntimeError(f"set_tier({tier!r}) before that tier's streams are complete")
            todo = [l for l in self.layers if not (only_missing and l.tier == tier)]
            snaps = [_snapshot(l) for l in todo]
        for l, snap in zip(todo, snaps):
            l.materialise(tier, snap, self.dtype, self.device)

    def pin_tier(self, tier: str = "full") -> "LynxCache":
        """Serve plain decoding (`generate` without custom_generate, or forward passes) from one tier, never
        drafting: wait for it, materialise it; the first forward re-runs the prompt's last position. "anchor"
        decodes on the 4-bit anchor alone, unverified (the anchor-only ablation of the evaluation)."""
        if tier not in ("anchor", "full"):
            raise ValueError(f"tier must be 'anchor' or 'full', got {tier!r}")
        self.conversation.settle()
        if self.conversation.phase != "fresh" or self.layers[0].tier is not None:
            raise ValueError("pin_tier serves the prompt a fresh LynxCache was filled with (before any generate)")
        self._pinned = True
        return _pin(self, tier)

    def seal(self) -> None:
        """Make the KV plain full precision (waiting for a residual still streaming): what a held conversation is."""
        if all(l.sealed for l in self.layers):
            return
        if any(l.tier != "full" for l in self.layers):
            with self._lock:
                gone = self.loader is None and not complete(self.layers, "residual")
            if gone:
                raise ValueError("this LynxCache cannot be continued: its residual stream was stopped before it landed "
                                 "(a cache pinned to the anchor tier, or a cancelled request)")
            self.wait_residual()
            self.set_tier("full", only_missing=True)
        self.close()
        for l in self.layers:
            l.rerun = 0
            l.seal()
        tokens = self.conversation.tokens
        if tokens is not None and self.layers[0].end > tokens.shape[1]:  # KV of drafts past an EOS
            for l in self.layers:
                l.crop_to(tokens.shape[1])

    def crop(self, tokens_to_remove: int) -> None:
        """Transformers' crop: drop that many (-tokens_to_remove) tail positions. A held conversation may go back
        past the transferred prompt too (`conversation.rewind`); inside a generation, only the decode-side tail."""
        if tokens_to_remove < 0 and self.conversation.holds():
            self.seal()  # (drafts' KV past an EOS dropped: what is held is what the ids say)
            self.conversation.rewind(self.layers[0].end + tokens_to_remove)
        else:
            super().crop(tokens_to_remove)

    def close(self) -> None:
        """Release the loader (stops a simulated link; a network receiver reads on to its request's end or cancels
        it) and drop the reference to it, so that no cache ↔ loader cycle outlives the request (caches are then
        freed by reference counting, not by the cyclic collector, which lets garbage KV pile up)."""
        loader, self.loader = self.loader, None
        if loader is not None:
            loader.close()

    def nbytes(self, tier: str = "full") -> int:
        """Bytes of the encoded prompt (a continued turn: its new range) held, metadata included: both streams
        ("full"), the anchor stream alone ("anchor"), or what the stores moved onto the cache's device ("staged":
        codes and metadata, never dequantized KV)."""
        with self._lock:
            if tier == "staged":
                return sum(l.store.staged_bytes for l in self.layers)
            return sum(l.store.nbytes(tier) for l in self.layers)

    # -- Transformers' Cache ------------------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        # a plain generate's first forward is handed the whole input (lynx_hf.cache.conversation)
        return 0 if self.conversation.listening else super().get_seq_length(layer_idx)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if (self.conversation.phase == "plain" or self.conversation.listening) and not self._bound:
            raise ValueError(UNBOUND_PLAIN)
        if self._pending_full[layer_idx]:
            layer = self.layers[layer_idx]
            _wait(self, lambda: complete([layer], "residual"), f"residual stream of layer {layer_idx}", None)
            with self._lock:
                snap = _snapshot(layer)
            layer.materialise("full", snap, self.dtype, self.device)
            self._pending_full[layer_idx] = False
        if self.layers[layer_idx].tier is None:  # a forward without speculative_generate: the full tier, once in
            warnings.warn(PLAIN_GENERATE_HINT, stacklevel=2)
            _pin(self, "full")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reorder_cache(self, beam_idx: torch.LongTensor):
        _batch_map(self, "reorder_cache", beam_idx, lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor):
        indices = torch.as_tensor(indices, dtype=torch.long)  # (a list of rows too, as docs/generate.md shows it)
        _batch_map(self, "batch_select_indices", indices, lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int):
        _batch_map(self, "batch_repeat_interleave", repeats, lambda t: t.repeat_interleave(repeats, dim=0))

    # -- the conversation ---------------------------------------------------------------------------------------------
    @property
    def held_ids(self) -> torch.Tensor | None:
        """[B, held]: the ids whose KV this cache holds once a generation is over (None before)."""
        return self.conversation.held_ids()

    @property
    def pinned(self) -> bool:
        """`pin_tier` was called: plain generate reads one tier, and speculative_generate refuses this cache."""
        return self._pinned

    def begin_turn(self, prompt_len: int, held: int) -> None:
        """A continued turn (`Conversation.begin_range`): the prompt is `prompt_len` positions, `held` of them here
        already; the last turn's logits and failure cleared, no full tier pending, a fresh trace counting `held`."""
        self.prompt_len, self.prefill_logits, self._error = prompt_len, None, None
        self._pending_full = [False] * len(self.layers)
        self.trace = Trace()
        self.trace.stats.held_tokens = held

    def landed(self) -> bool:
        """Every layer's full tier and the logits are here (read under the cache's lock)."""
        with self._lock:
            return complete(self.layers, "residual") and self.prefill_logits is not None

    def bound_model(self):
        """The model this cache is bound to (None: none, or no longer alive)."""
        return self._model() if self._model is not None else None

    def branch_copy(self, memo: dict) -> "LynxCache":
        """A copy of this cache's state through `memo` (deepcopy's; sealed tensors the caller put in it are shared),
        with its own lock and trace and no loader, hooks, binding or conversation: `Conversation.branch` gives it
        one."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        skip = {"_lock", "_changed", "loader", "_hooks", "_model", "trace", "conversation"}
        for k, v in self.__dict__.items():
            if k not in skip:
                setattr(new, k, copy.deepcopy(v, memo))
        new._lock = threading.Lock()
        new._changed = threading.Condition(new._lock)
        new.loader, new._hooks, new._model, new._bound = None, [], None, False
        new.trace = Trace()
        return new

    def __deepcopy__(self, memo):
        """An independent branch of a held conversation (a fresh cache is sealed first: its residual awaited)."""
        return self.conversation.branch(memo, "copy.deepcopy(LynxCache)", share=False)

    def fork(self) -> "LynxCache":
        """A branch of a held conversation that shares its sealed KV instead of copying it: sealed KV is never
        written in place (a turn crops by slicing, appends by concatenating, materialises into new buffers), so a
        turn on the branch — successful or failed half-way — leaves this cache as it was. What a network
        conversation's turn runs on."""
        return self.conversation.branch({}, "LynxCache.fork()", share=True)


def refuse_spec_config(spec_config) -> None:
    """The drafting settings moved from the cache to the generate call (0.1: the cache stores, the engine is told)."""
    if spec_config is not None:
        raise TypeError("spec_config is a setting of the generate call, not of the cache: pass it to "
                        "model.generate(..., custom_generate=lynx_hf.speculative_generate, "
                        "spec_config=SpecConfig(...))")


PREFILL_SIDE: dict = {}  # "from_prefill", "from_kv", "add_turn": registered by lynx_hf.local (above this package)


def _prefill_side(name: str):
    if name not in PREFILL_SIDE:
        raise RuntimeError(f"LynxCache.{name} is lynx_hf.local's: import lynx_hf.local (or use lynx_hf.LynxCache)")
    return PREFILL_SIDE[name]


def _layer(cache: LynxCache, i: int) -> LynxLayer:
    if not 0 <= i < len(cache.layers):
        raise ValueError(f"layer {i} out of range [0, {len(cache.layers)})")
    return cache.layers[i]


def _ready_or_raise(cache: LynxCache, ready: bool) -> bool:
    if not ready and cache._error is not None:
        raise LoaderError(f"KV loader failed: {cache._error}") from cache._error
    return ready


def _wait(cache: LynxCache, ready, what: str, timeout: float | None) -> None:
    timeout = cache.timeout_s if timeout is None else timeout
    deadline = time.monotonic() + timeout
    with cache._changed:
        while True:
            if _ready_or_raise(cache, ready()):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise LoaderError(f"timed out after {timeout:.1f} s waiting for the {what}")
            cache._changed.wait(min(left, 0.5))


def _snapshot(layer: LynxLayer) -> dict:
    """The layer's segments, {kind: [(start, segment)]} (the caller holds the lock and has checked that the tier it
    materialises is complete)."""
    return {kind: layer.store.snapshot(kind) for kind in KINDS}


def _pin(cache: LynxCache, tier: str) -> LynxCache:
    cache.wait_residual() if tier == "full" else cache.wait_anchors()
    cache.set_tier(tier)
    for l in cache.layers:
        l.rerun = 1
    cache.close()  # everything this tier needs has landed (a pinned anchor never takes the residual)
    return cache


def _batch_map(cache: LynxCache, name: str, arg, rows) -> None:
    """A batch map of the KV; the rows' ids and first-token logits follow it (their prompt record is dropped)."""
    with cache._lock:
        if not complete(cache.layers, "residual"):
            raise ValueError(f"LynxCache.{name} needs the whole prompt KV: the residual is still streaming")
        for l in cache.layers:
            getattr(l, name)(arg)
    conv = cache.conversation
    if conv.tokens is not None:
        conv.tokens = rows(conv.tokens)
    if cache.prefill_logits is not None:
        cache.prefill_logits = rows(cache.prefill_logits)
    if conv.visible is not None:  # (a row's padding stays known: it cannot be continued)
        conv.visible = rows(conv.visible)
    conv.prompt = None



def _has_nan(t: torch.Tensor) -> bool:
    """NaN anywhere in t, checked without a torch op for CPU tensors: `put_logits` runs on a receiving thread, where
    a parallel torch op would start a second OpenMP pool (see transfer.serde.warm)."""
    if t.device.type != "cpu":
        return bool(torch.isnan(t).any())
    if t.dtype in (torch.float16, torch.bfloat16):  # NaN: exponent all ones, mantissa not zero
        bits = t.detach().view(torch.int16).numpy() & 0x7FFF
        return bool((bits > (0x7C00 if t.dtype == torch.float16 else 0x7F80)).any())
    return bool(np.isnan(t.detach().numpy()).any())


def _remove_hooks(handles) -> None:
    for h in handles:
        h.remove()
