"""What fills a LynxCache from another thread, and the prefill that produces what it ships.

`Loader` is the seam (vLLM-connector style): `attach(cache)` starts delivering and returns at once; the cache calls
the optional hooks `on_draft(n)` / `on_wait()` (documented no-ops); the loader's owner calls `close()`. A loader
delivers through `cache.put_anchor / put_residual / put_logits`, or `cache.fail(exc)` when it cannot finish.

`prefill` runs the prefill node's full-precision forward pass and keeps, per layer, the prompt KV that layer needs
(`PromptCapture`: all P positions for full attention, the last min(P, W) for a sliding window W) and the last
position's logits. `InProcessLoader` encodes that KV and delivers it on a token-count or bandwidth-simulated
schedule; the network receiver in `lynx_hf.transfer` is the other implementation."""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import torch
from transformers import DynamicCache

from .cache import layer_windows
from .config import LynxQuantConfig
from .link import LinkEmulator
from .quant import SplitKV, encode


class Loader(ABC):
    """Fills one LynxCache. Subclasses implement `attach`; the hooks below are optional no-ops."""

    cache = None

    @abstractmethod
    def attach(self, cache) -> "Loader":
        """Set `cache.loader = self` and start delivering into `cache`; return at once."""

    def on_draft(self, n: int) -> None:
        """The decoder has made n draft steps (a token-count schedule may release the residual here)."""

    def on_wait(self) -> None:
        """The decoder now blocks on the residual (a token-count schedule releases it; a real link just goes on)."""

    def close(self) -> None:
        """Stop delivering and free resources; called by the loader's owner (the cache's `close`)."""


class PromptCapture(DynamicCache):
    """A DynamicCache for the prefill forward that hands each layer's needed prompt KV to `on_layer(i, k, v)` as
    soon as the layer has produced it (k, v: [B, H_kv, held_i, D], the last held_i positions of the prompt)."""

    def __init__(self, config, on_layer, prompt_len: int):
        super().__init__(config=config)
        self.on_layer, self.prompt_len = on_layer, prompt_len
        self.held = [prompt_len if w is None else min(prompt_len, w) for w in layer_windows(config)]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if key_states.shape[-2] == self.prompt_len:  # the prompt's own forward pass
            n = self.held[layer_idx]
            self.on_layer(layer_idx, key_states[:, :, -n:], value_states[:, :, -n:])
        return out


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """Full-precision prefill: ([(K, V)] per layer, each [B, H_kv, held_i, D]; last-position logits [B, V] in the
    model's dtype) — the prefill node's own work."""
    kv = {}
    cap = PromptCapture(model.config, lambda i, k, v: kv.__setitem__(i, (k, v)), input_ids.shape[1])
    kw = {}
    if attention_mask is not None:
        kw = {"attention_mask": attention_mask, "position_ids": (attention_mask.long().cumsum(-1) - 1).clamp_min(0)}
    out = model(input_ids=input_ids, cache=cap, use_cache=True, logits_to_keep=1, **kw)
    return [kv[i] for i in range(len(kv))], out.logits[:, -1]


def encode_layers(kv, config: LynxQuantConfig):
    """[(K, V)] → [(SplitKV_K, SplitKV_V)]."""
    return [(encode(k, config, "key"), encode(v, config, "value")) for k, v in kv]


def anchor_only(split):
    """The anchor-stream view of a SplitKV (what travels first): same codes and metadata, no residual."""
    return SplitKV(split.config, split.kind, split.shape, split.dtype, split.anchor, None, split.meta, split.axis)


class InProcessLoader(Loader):
    """Delivers a local prefill's encoded KV: the anchor at once and the residual after `residual_after_tokens`
    draft steps (None: at once), or both over a simulated link of `bandwidth_bps` bits/s (anchor first)."""

    def __init__(self, kv, config: LynxQuantConfig, residual_after_tokens: int | None = None,
                 bandwidth_bps: float | None = None, latency_s: float = 0.0):
        if residual_after_tokens is not None and residual_after_tokens < 0:
            raise ValueError("residual_after_tokens must be >= 0 or None")
        if bandwidth_bps is not None and bandwidth_bps <= 0:
            raise ValueError("bandwidth_bps must be > 0")
        self.splits = encode_layers(kv, config)
        self.after, self.bw, self.latency = residual_after_tokens, bandwidth_bps, latency_s
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
        for i, (sk, sv) in enumerate(self.splits):
            if sk.residual is not None:
                self.cache.put_residual(i, "key", self.starts[i], sk.residual)
                self.cache.put_residual(i, "value", self.starts[i], sv.residual)

    def _link(self):
        """Anchor of every layer, then residual of every layer, over one link of `bw` bits/s (strict priority)."""
        link = LinkEmulator(self.bw, self.latency)
        try:
            for stream in ("anchor", "full"):
                for i, (sk, sv) in enumerate(self.splits):
                    for kind, s in (("key", sk), ("value", sv)):
                        n = s.nbytes("anchor") if stream == "anchor" else s.nbytes("full") - s.nbytes("anchor")
                        if link.pace(n, self._stop):
                            return
                        if stream == "anchor":
                            self.cache.put_anchor(i, kind, self.starts[i], anchor_only(s))
                        elif s.residual is not None:
                            self.cache.put_residual(i, kind, self.starts[i], s.residual)
            self._released = True
        except Exception as e:  # surfaced to the decoding thread
            self.cache.fail(e)

    def on_draft(self, n: int) -> None:
        if self.bw is None and self.after is not None and n >= self.after:
            self._residual()

    def on_wait(self) -> None:
        if self.bw is None:
            self._residual()

    def close(self) -> None:
        self._stop.set()
