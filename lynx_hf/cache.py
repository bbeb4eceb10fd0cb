"""`LynxCache`: a `transformers.Cache` whose prompt KV arrives as Lynx streams (anchor first, residual later).

Per layer it holds the encoded prompt segments (packed codes + metadata), the tier they are materialised at
(None → "anchor" → "full"), and a full-precision tail for tokens generated on the decode side. Layers are filled
piecewise by a loader from another thread (`put_anchor` / `put_residual`); the decoding thread polls readiness
(`anchors_ready`, `residual_ready`) without blocking and switches tiers with `set_tier`, which dequantizes the
prompt once per change, never per step.

Memory bound during decode, per layer: packed codes and metadata (≈ 8.5 bits/value of the prompt, both streams),
one dequantized prompt in the model dtype ([B, H_kv, S_prompt, D] for K and for V), and the tail
([B, H_kv, T, D] each). The cache knows nothing about sockets or sampling."""
from __future__ import annotations

import threading
import time

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .config import LynxQuantConfig, SpecConfig
from .quant import SplitKV, decode

KINDS = ("key", "value")


class LoaderError(RuntimeError):
    """The loader failed (peer gone, corrupted stream, timeout): the prompt KV will not be completed."""


class LynxLayer(CacheLayerMixin):
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, prompt_len: int):
        super().__init__()
        self.prompt_len = prompt_len
        self.segments = {k: {} for k in KINDS}  # kind -> {start: SplitKV}, each covering [start, start + S_seg)
        self.tier = None

    # -- filled by the loader (under LynxCache's lock) --------------------------------------------------------------
    def put_anchor(self, kind: str, start: int, split: SplitKV) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        end = start + split.shape[2]
        if start < 0 or end > self.prompt_len:
            raise ValueError(f"segment [{start}, {end}) lies outside the prompt [0, {self.prompt_len})")
        if start in self.segments[kind]:
            raise ValueError(f"duplicate anchor segment for {kind} at token {start}")
        self.segments[kind][start] = split

    def put_residual(self, kind: str, start: int, residual: torch.Tensor) -> None:
        seg = self.segments[kind].get(start)
        if seg is None:
            raise ValueError(f"residual for {kind} at token {start} arrived before its anchor")
        if not seg.config.is_split:
            raise ValueError(f"method {seg.config.method!r} has no residual stream")
        if seg.residual is not None:
            raise ValueError(f"duplicate residual segment for {kind} at token {start}")
        want = (*seg.shape[:3], seg.shape[3] // 2)
        if tuple(residual.shape) != want or residual.dtype != torch.uint8:
            raise ValueError(f"residual shape {tuple(residual.shape)} {residual.dtype}, expected {want} uint8")
        seg.residual = residual

    def _covered(self, kind: str) -> int:
        return sum(s.shape[2] for s in self.segments[kind].values())

    def anchors_complete(self) -> bool:
        return all(self._covered(k) == self.prompt_len for k in KINDS)

    def residual_complete(self) -> bool:
        return self.anchors_complete() and all(
            s.residual is not None or not s.config.is_split for k in KINDS for s in self.segments[k].values())

    # -- tiers ------------------------------------------------------------------------------------------------------
    def _dequant(self, kind: str, tier: str) -> torch.Tensor:
        parts = [decode(self.segments[kind][s], tier) for s in sorted(self.segments[kind])]
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    def set_tier(self, tier: str, dtype: torch.dtype, device) -> None:
        """(Re)materialise the prompt region at `tier`, in place when the buffers exist."""
        k = self._dequant("key", tier).to(device=device, dtype=dtype)
        v = self._dequant("value", tier).to(device=device, dtype=dtype)
        if not self.is_initialized:
            self.keys, self.values = k, v
            self.device, self.dtype = k.device, dtype
            self.is_initialized = True
        else:
            self.keys[:, :, : self.prompt_len] = k
            self.values[:, :, : self.prompt_len] = v
        self.tier = tier

    # -- CacheLayerMixin --------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        raise RuntimeError("LynxLayer is initialised by set_tier; call LynxCache.set_tier before the first forward")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            raise RuntimeError("LynxCache: the prompt KV is not materialised yet (no tier set): wait for the anchors")
        self.keys = torch.cat([self.keys, key_states.to(self.keys.dtype)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.values.dtype)], dim=-2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0 if not self.is_initialized else self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Remove `-tokens_to_remove` tail tokens (negative, as DynamicLayer). The prompt itself is never cropped."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = self.get_seq_length() + tokens_to_remove
        if keep < self.prompt_len:
            raise ValueError(f"cannot crop into the transferred prompt ({self.prompt_len} tokens) to {keep}")
        self.keys = self.keys[..., :keep, :]
        self.values = self.values[..., :keep, :]

    def reset(self) -> None:
        if self.is_initialized:
            self.keys = self.keys[..., : self.prompt_len, :]
            self.values = self.values[..., : self.prompt_len, :]

    def _select(self, fn) -> None:
        for kind in KINDS:
            for s, seg in self.segments[kind].items():
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
    """Cache for a transferred prompt: `num_layers` LynxLayers of `prompt_len` tokens each."""

    def __init__(self, num_layers: int, prompt_len: int, quant_config: LynxQuantConfig | None = None,
                 spec_config: SpecConfig | None = None, dtype: torch.dtype = torch.float32, device="cpu",
                 timeout_s: float = 120.0):
        if num_layers < 1 or prompt_len < 1:
            raise ValueError(f"LynxCache needs num_layers >= 1 and prompt_len >= 1, got {num_layers}, {prompt_len}")
        super().__init__(layers=[LynxLayer(prompt_len) for _ in range(num_layers)])
        self.prompt_len = prompt_len
        self.quant_config = quant_config or LynxQuantConfig()
        self.spec_config = spec_config or SpecConfig()
        self.dtype, self.device, self.timeout_s = dtype, torch.device(device), timeout_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._error: BaseException | None = None
        self.loader = None
        self.stats: dict = {}
        self.events: list = []    # (perf_counter, "anchor" | "residual", layer, kind): arrivals
        self.timeline: list = []  # (perf_counter, "draft" | "verified" | "verify_start"): decode-side tokens
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"drafted": 0, "accepted": 0, "rounds": 0, "ttft_draft_s": None, "ttft_verified_s": None,
                      "verify_s": 0.0, "anchors_at_s": None, "residual_at_s": None}

    # -- loader side (any thread) -------------------------------------------------------------------------------------
    def put_anchor(self, layer: int, kind: str, start: int, split: SplitKV) -> None:
        with self._changed:
            self._layer(layer).put_anchor(kind, start, split)
            self.events.append((time.perf_counter(), "anchor", layer, kind))
            self._changed.notify_all()

    def put_residual(self, layer: int, kind: str, start: int, residual: torch.Tensor) -> None:
        with self._changed:
            self._layer(layer).put_residual(kind, start, residual)
            self.events.append((time.perf_counter(), "residual", layer, kind))
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
    def anchors_ready(self) -> bool:
        with self._lock:
            self._raise_if_failed()
            return all(l.anchors_complete() for l in self.layers)

    def residual_ready(self) -> bool:
        with self._lock:
            self._raise_if_failed()
            return all(l.residual_complete() for l in self.layers)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise LoaderError(f"KV loader failed: {self._error}") from self._error

    def _wait(self, pred, what: str, timeout: float | None) -> None:
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        with self._changed:
            while True:
                self._raise_if_failed()
                if all(pred(l) for l in self.layers):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LoaderError(f"timed out after {self.timeout_s if timeout is None else timeout:.1f} s "
                                      f"waiting for the {what}")
                self._changed.wait(min(left, 0.5))

    def wait_anchors(self, timeout: float | None = None) -> None:
        self._wait(LynxLayer.anchors_complete, "anchor stream", timeout)

    def wait_residual(self, timeout: float | None = None) -> None:
        if self.loader is not None:
            self.loader.on_wait()
        self._wait(LynxLayer.residual_complete, "residual stream", timeout)

    @property
    def tier(self):
        return self.layers[0].tier

    def set_tier(self, tier: str) -> None:
        with self._lock:
            self._raise_if_failed()
            for l in self.layers:
                l.set_tier(tier, self.dtype, self.device)

    def crop_to(self, length: int) -> None:
        self.crop(length - self.get_seq_length())

    def notify_drafted(self, n: int) -> None:
        if self.loader is not None:
            self.loader.on_draft(n)

    @property
    def is_compileable(self) -> bool:
        return False

    @classmethod
    def from_prefill(cls, model, input_ids: torch.Tensor, quant_config: LynxQuantConfig | None = None,
                     residual_after_tokens: int | None = None, attention_mask: torch.Tensor | None = None,
                     spec_config: SpecConfig | None = None, bandwidth_bps: float | None = None):
        """Prefill locally in full precision, encode each layer's KV, and return (cache, first_token [B, 1]).
        The anchor lands at once; the residual after `residual_after_tokens` draft tokens (None: at once), or, with
        bandwidth_bps (bits/s), both stream over a simulated link in a background thread."""
        from .loader import InProcessLoader, prefill

        kv, first = prefill(model, input_ids, attention_mask)
        cache = cls(len(kv), input_ids.shape[1], quant_config, spec_config, dtype=kv[0][0].dtype,
                    device=input_ids.device)
        InProcessLoader(kv, cache.quant_config, residual_after_tokens, bandwidth_bps).attach(cache)
        return cache, first
