"""Loaders fill a LynxCache from another thread. The interface is small (vLLM-connector style):

    attach(cache)   start delivering into `cache` (returns at once)
    on_draft(n)     the decoder has made n draft tokens (schedules may release the residual here)
    on_wait()       the decoder now blocks on the residual (a token schedule releases it; a link just goes on)
    close()         stop and free resources

`InProcessLoader` encodes a local prefill's KV and delivers it on a token-count or bandwidth-simulated
schedule; the network receiver in `lynx_hf.transfer` implements the same interface."""
from __future__ import annotations

import threading

import torch
from transformers import DynamicCache

from .config import LynxQuantConfig
from .quant import SplitKV, encode


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """Full-precision prefill: ([(K, V)] per layer, first_token [B, 1]) — the prefill node's own work."""
    dc = DynamicCache(config=model.config)
    kw = {}
    if attention_mask is not None:
        kw = {"attention_mask": attention_mask, "position_ids": (attention_mask.long().cumsum(-1) - 1).clamp_min(0)}
    out = model(input_ids=input_ids, cache=dc, use_cache=True, logits_to_keep=1, **kw)
    first = out.logits[:, -1].argmax(-1, keepdim=True)
    return [(l.keys, l.values) for l in dc.layers], first


def encode_layers(kv, config: LynxQuantConfig):
    """[(K, V)] → [(SplitKV_K, SplitKV_V)]."""
    return [(encode(k, config, "key"), encode(v, config, "value")) for k, v in kv]


def anchor_only(split):
    """The anchor-stream view of a SplitKV (what travels first): same codes and metadata, no residual."""
    return SplitKV(split.config, split.kind, split.shape, split.dtype, split.anchor, None, split.meta, split.axis)


class InProcessLoader:
    def __init__(self, kv, config: LynxQuantConfig, residual_after_tokens: int | None = None,
                 bandwidth_bps: float | None = None, latency_s: float = 0.0):
        if residual_after_tokens is not None and residual_after_tokens < 0:
            raise ValueError("residual_after_tokens must be >= 0 or None")
        if bandwidth_bps is not None and bandwidth_bps <= 0:
            raise ValueError("bandwidth_bps must be > 0")
        self.splits = encode_layers(kv, config)
        self.after, self.bw, self.latency = residual_after_tokens, bandwidth_bps, latency_s
        self.cache, self._released, self._thread = None, False, None
        self._stop = threading.Event()

    def attach(self, cache) -> "InProcessLoader":
        self.cache = cache
        cache.loader = self
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
            self.cache.put_anchor(i, "key", 0, anchor_only(sk))
            self.cache.put_anchor(i, "value", 0, anchor_only(sv))

    def _residual(self):
        if self._released:
            return
        self._released = True
        for i, (sk, sv) in enumerate(self.splits):
            if sk.residual is not None:
                self.cache.put_residual(i, "key", 0, sk.residual)
                self.cache.put_residual(i, "value", 0, sv.residual)

    def _link(self):
        """Anchor of every layer, then residual of every layer, over one link of `bw` bits/s (strict priority)."""
        from .transfer.transport import LinkEmulator

        link = LinkEmulator(self.bw, self.latency)
        try:
            for stream in ("anchor", "full"):
                for i, (sk, sv) in enumerate(self.splits):
                    for kind, s in (("key", sk), ("value", sv)):
                        n = s.nbytes("anchor") if stream == "anchor" else s.nbytes("full") - s.nbytes("anchor")
                        if link.pace(n, self._stop):
                            return
                        if stream == "anchor":
                            self.cache.put_anchor(i, kind, 0, anchor_only(s))
                        elif s.residual is not None:
                            self.cache.put_residual(i, kind, 0, s.residual)
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
