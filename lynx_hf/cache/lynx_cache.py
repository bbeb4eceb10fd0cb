"""`LynxCache`: a `transformers.Cache` whose prompt KV arrives as Lynx streams (anchor first, residual later).

It orchestrates: a loader on another thread fills each layer's `PromptStore` (`put_anchor` / `put_residual` /
`put_logits`, under the cache's lock); the decoding thread polls readiness without blocking and materialises a tier
(`set_tier`, or layer by layer inside a forward pass with `set_full_tier_per_layer`). The lock covers the stores
only: dequantization runs outside it, so the receiver keeps reading the socket while a tier is materialised.

Two ways to decode from it:
  * `model.generate(prompt, cache=cache, custom_generate=lynx_hf.speculative_generate, ...)`: drafts on the anchor
    tier while the residual streams in, then verifies (lynx_hf.engine). The first token comes from the prefill's
    last-position logits (`prefill_logits`), so it follows the caller's generation options.
  * `model.generate(prompt, cache=cache)`: plain Transformers decoding. Until its first forward the cache presents
    the prompt minus its last position, so `generate` re-runs that one position (as vLLM does when every prompt
    token is cached) — its KV stands as streamed and its logits are replaced by the prefill's exact ones (a forward
    hook on the model the cache was built for) — then decodes on the full tier, no drafting.

Turns. The first `generate` takes the prompt the cache was prefilled with (`expect_prompt` records its ids and
mask; `from_prefill` does) — another prompt or mask is refused. Once a generation is over the cache *holds* the
conversation: every token's KV but the last one's, and their ids (`held_ids`). A later `generate(ids, cache=...)`
continues it as Transformers continues any cache: `ids[:, :held]` must equal what it holds (a contradiction is
refused in one line naming the first differing position, or, with `on_mismatch="crop"`, the KV from there on is
dropped and recomputed), and only `ids[:, held:]` runs through the model (at least the last token: a turn with no new
token re-runs it). Over the network the new range arrives instead (`continue_turn` + `begin_range`, then a loader):
the sealed prefix stays in full precision, the range streams anchor first, and the engine drafts on prefix + anchor.
`copy.deepcopy(cache)` gives an independent branch of a held conversation.

Memory bound during decode, per layer: packed codes and metadata (≈ 8.5 bits/value of the held prompt, both
streams), one dequantized prompt in the model dtype ([B, H_kv, S_held, D] for K and for V; the full tier is decoded
into the anchor tier's buffers in place), and the tail ([B, H_kv, T, D] each). The forward pass's activations come
on top (measured against this bound in docs/performance.md). The cache knows nothing about sockets or sampling;
its telemetry is a `Trace` (`cache.trace`, `cache.stats`)."""
from __future__ import annotations

import hashlib
import threading
import time
import warnings
import weakref

import numpy as np
import torch
from transformers.cache_utils import Cache

from ..arch import layer_windows, media_inputs, media_key, refuse_encoder_decoder, refuse_media_positions
from ..config import LynxQuantConfig, SpecConfig
from ..loader import LoaderError
from ..quant import SplitKV
from ..trace import Trace
from .layer import KINDS, LynxLayer
from .turns import Turns

PROMPT_MISMATCH = ("generate got another prompt than the one this LynxCache was prefilled with (its ids or its "
                   "attention mask differ): pass generate the input_ids and attention_mask given to from_prefill "
                   "(a padded batch needs attention_mask= in both)")
UNBOUND_PLAIN = ("generate() without custom_generate needs a LynxCache that knows its model, to take the prefill's "
                 "logits for the first step: build it with LynxCache.for_model / from_prefill or call "
                 "cache.bind(model) first (or pass custom_generate=lynx_hf.speculative_generate)")
PLAIN_GENERATE_HINT = ("LynxCache: generate() without custom_generate waits for the residual stream and decodes on "
                       "the full tier. Pass custom_generate=lynx_hf.speculative_generate to draft on the anchor tier "
                       "while the residual streams in (same output).")


class LynxCache(Turns, Cache):
    """Cache for a transferred prompt of `prompt_len` tokens: one LynxLayer per decoder layer, sliding where
    `sliding_windows[i]` is a window (see `arch.layer_windows`; `LynxCache.for_model` reads them from a model)."""

    def __init__(self, num_layers: int, prompt_len: int, quant_config: LynxQuantConfig | None = None,
                 spec_config: SpecConfig | None = None, dtype: torch.dtype = torch.float32, device="cpu",
                 timeout_s: float = 120.0, sliding_windows: list[int | None] | None = None):
        if num_layers < 1 or prompt_len < 1:
            raise ValueError(f"LynxCache needs num_layers >= 1 and prompt_len >= 1, got {num_layers}, {prompt_len}")
        windows = list(sliding_windows) if sliding_windows is not None else [None] * num_layers
        if len(windows) != num_layers or not all(w is None or (isinstance(w, int) and w >= 1) for w in windows):
            raise ValueError(f"sliding_windows must hold {num_layers} entries, each None or an int >= 1")
        device = torch.device(device)
        super().__init__(layers=[LynxLayer(prompt_len, w, device) for w in windows])
        self.prompt_len = prompt_len
        self.quant_config = quant_config or LynxQuantConfig()
        self.spec_config = spec_config or SpecConfig()
        self.dtype, self.device, self.timeout_s = dtype, device, timeout_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._error: BaseException | None = None
        self._pending_full = [False] * num_layers  # materialise the full tier at the layer's next update
        self.prefill_logits: torch.Tensor | None = None  # [B, V]: the prefill's last-position logits
        self.loader = None
        self.trace = Trace()
        self._prompt: tuple | None = None  # (key, last token per row, mask or None) of the prompt (expect_prompt)
        self._in_generate = False  # a generate call has this cache (Transformers flagged it as user defined)
        # fresh: serves the prompt it was filled with; busy / plain: inside a generate (custom_generate / plain);
        # held: a generation is over, the next generate continues it; broken: a generation failed part-way
        self._phase, self._before, self._ran, self._first_plain = "fresh", "fresh", False, False
        self._strip: list = []  # media inputs a plain generate passes that its forwards must not run again
        self._tokens: torch.Tensor | None = None  # [B, N] CPU long: the ids by absolute position
        self.on_mismatch = "error"  # or "crop": a turn contradicting the held ids drops the KV from there on
        self._turns = 0  # generations run on this cache
        self._pinned = False
        self._hooks: list = []
        self._model = None   # weakref to the bound model
        self._media_key: str | None = None  # digest of the images / audio the prompt was prefilled with
        self._bound = False  # bind(model) was called: plain generate can take the prefill's first-step logits

    @classmethod
    def for_model(cls, model, prompt_len: int, **kw) -> "LynxCache":
        refuse_encoder_decoder(model)
        windows = layer_windows(model.config)
        return cls(len(windows), prompt_len, sliding_windows=windows, **kw).bind(model)

    # -- which request this cache serves ------------------------------------------------------------------------------
    def expect_prompt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> "LynxCache":
        """Record the prompt [B, P] (and its mask; None: no padding) whose KV this cache holds."""
        if input_ids.dim() != 2 or input_ids.shape[1] != self.prompt_len:
            raise ValueError(f"expect_prompt: input_ids must be [B, {self.prompt_len}], got {tuple(input_ids.shape)}")
        mask = _norm_mask(attention_mask, input_ids)
        self._prompt = (_prompt_key(input_ids, mask), input_ids[:, -1].tolist(), mask)
        self._tokens = input_ids.detach().long().cpu().clone()
        return self

    def check_prompt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Raise ValueError unless [B, P] input_ids and their mask are the recorded prompt's (no record: no check)."""
        if self._prompt is None:
            return
        if _prompt_key(input_ids, _norm_mask(attention_mask, input_ids)) != self._prompt[0]:
            raise ValueError(PROMPT_MISMATCH)

    @property
    def _is_user_defined(self) -> bool:
        return self._in_generate

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        # Transformers' generate sets this flag on a cache passed to it, once per call, before its first forward:
        # here a plain (non-custom) generate call starts — on a held cache it continues the conversation
        if value:
            self._enter_plain_generate()
        self._in_generate = bool(value)

    # -- plain generate: the prefill's exact first-step logits --------------------------------------------------------
    def bind(self, model) -> "LynxCache":
        """Hook `model` so that a plain `generate(prompt, cache=self)` checks the prompt it re-runs, takes the
        prefill's logits for it and records the ids it runs (the hooks act only inside a plain generate call on this
        cache; they go with the cache)."""
        ref = weakref.ref(self)

        def pre(module, args, kwargs):
            c = ref()
            if c is not None and kwargs.get("cache") is c and c._phase == "plain":
                ids = kwargs.get("input_ids")
                if c._first_plain:
                    c._plain_first_forward(ids, kwargs.get("attention_mask"))
                if ids is not None:
                    c._record(ids)
                c._ran = True
                if c._strip:  # the prompt's images are in the KV: the re-run position is text
                    return args, {k: v for k, v in kwargs.items() if k not in c._strip}

        def post(module, args, kwargs, output):
            c = ref()
            if c is not None and kwargs.get("cache") is c and c._phase == "plain" and c._first_plain:
                c._first_plain = False
                c._plain_first_logits(output)

        self.unbind()
        self._hooks = [model.register_forward_pre_hook(pre, with_kwargs=True),
                       model.register_forward_hook(post, with_kwargs=True)]
        weakref.finalize(self, _remove_hooks, list(self._hooks))
        self._bound, self._model = True, weakref.ref(model)
        return self

    def unbind(self) -> None:
        _remove_hooks(self._hooks)
        self._hooks = []

    def _plain_first_forward(self, ids, mask) -> None:
        self._substitute = ids is not None and ids.shape[1] == 1  # the re-run last prompt position alone
        if self._prompt is None or ids is None:
            return
        _, last, want = self._prompt
        if ids.shape[0] != len(last):
            raise ValueError(f"LynxCache holds {len(last)} sequence(s) but the model ran {ids.shape[0]}: num_beams > 1 "
                             f"and num_return_sequences > 1 are not supported")
        got = _norm_mask(None if mask is None else mask[:, :self.prompt_len], ids[:, :1].expand(-1, self.prompt_len))
        if ids[:, 0].tolist() != last or not torch.equal(got.cpu(), want):
            raise ValueError(PROMPT_MISMATCH)

    def _plain_first_logits(self, output) -> None:
        if not getattr(self, "_substitute", False):
            return
        logits = self.wait_logits()
        output.logits[:, -1] = logits.to(output.logits.device, output.logits.dtype)

    # telemetry (lynx_hf.trace): the typed record, and the lists the demo and benchmarks read
    @property
    def stats(self):
        return self.trace.stats

    @property
    def events(self) -> list:
        return self.trace.events

    @property
    def timeline(self) -> list:
        return self.trace.timeline

    # -- loader side (any thread) -------------------------------------------------------------------------------------
    def put_anchor(self, layer: int, kind: str, start: int, split: SplitKV) -> None:
        with self._changed:
            self._layer(layer).store.put_anchor(kind, start, split)
            self.trace.arrived("anchor", layer, kind)
            self._changed.notify_all()

    def put_residual(self, layer: int, kind: str, start: int, residual: torch.Tensor) -> None:
        with self._changed:
            self._layer(layer).store.put_residual(kind, start, residual)
            self.trace.arrived("residual", layer, kind, complete=self._complete("residual"))
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

    def _complete(self, stream: str, layers=None) -> bool:
        """Every given layer's anchor (or residual) stream is in; the caller holds the lock."""
        done = (lambda s: s.anchors_complete()) if stream == "anchor" else (lambda s: s.residual_complete())
        return all(done(l.store) for l in (self.layers if layers is None else layers))

    # -- decode side --------------------------------------------------------------------------------------------------
    # What arrived whole stays usable after a later loader failure; the failure is raised to whoever still waits.
    def anchors_ready(self) -> bool:
        with self._lock:
            return self._ready_or_raise(self._complete("anchor"))

    def residual_ready(self) -> bool:
        with self._lock:
            return self._ready_or_raise(self._complete("residual"))

    def _ready_or_raise(self, ready: bool) -> bool:
        if not ready and self._error is not None:
            raise LoaderError(f"KV loader failed: {self._error}") from self._error
        return ready

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
        self._wait(lambda: self._complete("anchor"), "anchor stream", timeout)

    def wait_residual(self, timeout: float | None = None) -> None:
        self.need_residual()
        self._wait(lambda: self._complete("residual"), "residual stream", timeout)

    def need_residual(self) -> None:
        """The decoder is about to verify: a loader on a step-count schedule releases the residual now."""
        if self.loader is not None:
            self.loader.on_wait()

    def wait_logits(self, timeout: float | None = None) -> torch.Tensor:
        self._wait(lambda: self.prefill_logits is not None, "prefill's logits", timeout)
        return self.prefill_logits

    def residual_eta(self) -> float | None:
        """Seconds until the residual is complete (see Trace.residual_eta)."""
        with self._lock:
            return self.trace.residual_eta(sum(l.store.missing for l in self.layers))

    @staticmethod
    def _snapshot(layer: LynxLayer) -> dict:
        """The layer's segments, {kind: [(start, segment)]} (the caller holds the lock and has checked that the tier
        it materialises is complete)."""
        return {kind: layer.store.snapshot(kind) for kind in KINDS}

    def set_tier(self, tier: str) -> None:
        """Materialise every layer's prompt at `tier` (after wait_anchors / wait_residual): the segments are taken
        under the lock, dequantized outside it."""
        with self._lock:
            if not self._complete(tier if tier == "anchor" else "residual"):
                raise RuntimeError(f"set_tier({tier!r}) before that tier's streams are complete")
            snaps = [self._snapshot(l) for l in self.layers]
        for l, snap in zip(self.layers, snaps):
            l.materialise(tier, snap, self.dtype, self.device)

    def set_full_tier_per_layer(self) -> None:
        """Switch to the full tier layer by layer: each layer's next `update` (its turn in the next forward pass)
        first waits for that layer's residual, then materialises it. A forward pass started before the residual is
        complete thus runs each layer as soon as its residual has landed (verification overlaps the transfer)."""
        self._pending_full = [True] * len(self.layers)

    def _materialise_pending(self, i: int) -> None:
        layer = self.layers[i]
        self._wait(lambda: self._complete("residual", [layer]), f"residual stream of layer {i}", None)
        with self._lock:
            snap = self._snapshot(layer)
        layer.materialise("full", snap, self.dtype, self.device)
        self._pending_full[i] = False

    def keep_tail(self, start: int, index: torch.Tensor) -> None:
        """Every layer keeps its positions before `start` and, per row, start + index[b] ([B, k]) after them."""
        for l in self.layers:
            l.keep_tail(start, index)

    def notify_drafted(self, n: int) -> None:
        if self.loader is not None:
            self.loader.on_draft(n)

    def close(self) -> None:
        """Release the loader (stops a simulated link; a network receiver reads on to its request's end or cancels
        it) and drop the reference to it, so that no cache ↔ loader cycle outlives the request (caches are then
        freed by reference counting, not by the cyclic collector, which lets garbage KV pile up)."""
        loader, self.loader = self.loader, None
        if loader is not None:
            loader.close()

    def nbytes(self, tier: str = "full") -> int:
        """Bytes of the encoded prompt (a continued turn: its new range) held, metadata included: both streams
        ("full") or the anchor stream alone ("anchor")."""
        with self._lock:
            return sum(l.store.nbytes(tier) for l in self.layers)

    def staged_bytes(self) -> int:
        """Bytes the stores moved onto the cache's device (codes and metadata; never dequantized KV)."""
        with self._lock:
            return sum(l.store.staged_bytes for l in self.layers)

    # -- Transformers' Cache ------------------------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self._phase == "plain" and not self._bound:
            raise ValueError(UNBOUND_PLAIN)
        if self._pending_full[layer_idx]:
            self._materialise_pending(layer_idx)
        if self.layers[layer_idx].tier is None:
            self._start_plain_generate()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _batch_map(self, name: str, arg) -> None:
        with self._lock:
            if not self._complete("residual"):
                raise ValueError(f"LynxCache.{name} needs the whole prompt KV: the residual is still streaming")
            for l in self.layers:
                getattr(l, name)(arg)

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self._batch_map("reorder_cache", beam_idx)
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor):
        self._batch_map("batch_select_indices", indices)
        self._map_rows(lambda t: t[torch.as_tensor(indices).to(t.device)])

    def batch_repeat_interleave(self, repeats: int):
        self._batch_map("batch_repeat_interleave", repeats)
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def _map_rows(self, fn) -> None:
        """The rows' ids and first-token logits follow a batch map of the KV (their prompt record is dropped)."""
        if self._tokens is not None:
            self._tokens = fn(self._tokens)
        if self.prefill_logits is not None:
            self.prefill_logits = fn(self.prefill_logits)
        self._prompt = None

    def _start_plain_generate(self) -> None:
        """A forward pass without speculative_generate: the full tier, once it has landed; the first forward re-runs
        the prompt's last position (get_seq_length said P - 1), whose streamed KV each layer keeps."""
        warnings.warn(PLAIN_GENERATE_HINT, stacklevel=3)
        self._pin("full")

    def pin_tier(self, tier: str = "full") -> "LynxCache":
        """Serve plain decoding (`generate` without custom_generate, or forward passes) from one tier, never
        drafting: wait for it, materialise it; the first forward re-runs the prompt's last position. "anchor"
        decodes on the 4-bit anchor alone, unverified (the anchor-only ablation of the evaluation)."""
        if tier not in ("anchor", "full"):
            raise ValueError(f"tier must be 'anchor' or 'full', got {tier!r}")
        self._settle()
        if self._phase != "fresh" or self.layers[0].tier is not None:
            raise ValueError("pin_tier serves the prompt a fresh LynxCache was filled with (before any generate)")
        self._pinned = True
        return self._pin(tier)

    def _pin(self, tier: str) -> "LynxCache":
        self.wait_residual() if tier == "full" else self.wait_anchors()
        self.set_tier(tier)
        for l in self.layers:
            l.rerun = 1
        self.close()  # everything this tier needs has landed (a pinned anchor never takes the residual)
        return self

    @property
    def is_compileable(self) -> bool:
        return False

    # -- convenience constructors: the prefill node's in-process side (lynx_hf.local) ------------------------------
    @classmethod
    def from_prefill(cls, model, input_ids: torch.Tensor, quant_config: LynxQuantConfig | None = None,
                     residual_after_steps: int | None = None, attention_mask: torch.Tensor | None = None,
                     spec_config: SpecConfig | None = None, bandwidth_bps: float | None = None, *,
                     residual_after_tokens: int | None = None, **media):
        """Prefill locally in full precision, encode each layer's KV, and return (cache, first_token [B, 1]) with the
        prefill's logits in the cache (first_token is their argmax, for callers that append it themselves).
        Without attention_mask, pad tokens in the prompt are masked as `generate` masks them (pad_token_id of the
        model's generation config, when it is not an EOS id); generate must then get the same prompt and mask.
        The anchor lands at once; the residual after `residual_after_steps` draft steps (None: at once; the older
        name `residual_after_tokens` is a deprecated alias), or, with bandwidth_bps (bits/s), both stream over a
        simulated link in a background thread. `media`: the prompt's images / audio as the model takes them
        (pixel_values, image_sizes, ...): they run in the prefill, and generate must get the same ones or none."""
        from ..local import generate_mask, prefill

        refuse_encoder_decoder(model)
        other = sorted(set(media) - set(media_inputs(media)))
        if other:
            raise ValueError(f"from_prefill got unexpected arguments {other} (besides its own it takes a model's media "
                             f"inputs: pixel_values, image_sizes, image_grid_thw, input_features, ...)")
        refuse_media_positions(model, media)
        if attention_mask is None:  # as generate infers it: pad tokens (pad != eos) are masked
            attention_mask = generate_mask(model, input_ids)
        kv, logits = prefill(model, input_ids, attention_mask, **media)
        cache = cls.from_kv(model, input_ids.shape[1], kv, logits, quant_config, residual_after_steps, spec_config,
                            bandwidth_bps, residual_after_tokens=residual_after_tokens)
        cache.expect_prompt(input_ids, attention_mask)
        cache._media_key = media_key(media_inputs(media))
        return cache, logits.argmax(-1, keepdim=True)

    @classmethod
    def from_kv(cls, model, prompt_len: int, kv, logits: torch.Tensor, quant_config: LynxQuantConfig | None = None,
                residual_after_steps: int | None = None, spec_config: SpecConfig | None = None,
                bandwidth_bps: float | None = None, *, residual_after_tokens: int | None = None) -> "LynxCache":
        """A cache of a `prompt_len`-token prompt fed by an InProcessLoader from `local.prefill`'s output (the KV
        each layer needs, the last position's logits), e.g. to decode one prefill several times."""
        from ..local import InProcessLoader

        cache = cls.for_model(model, prompt_len, quant_config=quant_config,
                              spec_config=spec_config, dtype=kv[0][0].dtype, device=kv[0][0].device)
        cache.put_logits(logits)
        InProcessLoader(kv, cache.quant_config, residual_after_steps, bandwidth_bps,
                        residual_after_tokens=residual_after_tokens).attach(cache)
        return cache


def _has_nan(t: torch.Tensor) -> bool:
    """NaN anywhere in t, checked without a torch op for CPU tensors: `put_logits` runs on a receiving thread, where
    a parallel torch op would start a second OpenMP pool (see transfer.serde.warm)."""
    if t.device.type != "cpu":
        return bool(torch.isnan(t).any())
    if t.dtype in (torch.float16, torch.bfloat16):  # NaN: exponent all ones, mantissa not zero
        bits = t.detach().view(torch.int16).numpy() & 0x7FFF
        return bool((bits > (0x7C00 if t.dtype == torch.float16 else 0x7F80)).any())
    return bool(np.isnan(t.detach().numpy()).any())


def _norm_mask(mask: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """The prompt's mask as a CPU bool tensor [B, P] (None: all visible)."""
    if mask is None:
        return torch.ones(ids.shape, dtype=torch.bool)
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
    return mask.detach().bool().cpu()


def _prompt_key(ids: torch.Tensor, mask: torch.Tensor) -> str:
    h = hashlib.sha256(str(tuple(ids.shape)).encode())
    h.update(ids.detach().long().cpu().numpy().tobytes())
    h.update(mask.numpy().tobytes())
    return h.hexdigest()


def _remove_hooks(handles) -> None:
    for h in handles:
        h.remove()
