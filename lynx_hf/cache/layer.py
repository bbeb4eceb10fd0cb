"""`LynxLayer`: one decoder layer's materialised KV — the prompt region dequantized at a tier (None → "anchor" →
"full") from its `PromptStore`, then the decode-side tail of generated tokens — as a Transformers
`CacheLayerMixin` (update, crop, mask sizes, batch maps). A full-attention layer holds the whole prompt; a
sliding-window layer of window W only its last min(P, W) positions, and its mask sizes say so (`offset`).

Turns. Once a generation is over, `seal()` turns the layer into plain full-precision KV (the codes are dropped) of
the positions it holds, [offset, held_end). The next turn's new range [held_end, P') streams in as a new store:
`begin_range(P')` keeps the sealed prefix (a sliding layer only what its window still needs) and materialises it
in front of the range at each tier, so drafting runs on prefix + the range's anchor and verification on prefix +
the range's full tier."""
from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..arch import window_positions  # a sliding window's kept positions
from ..quant import dequantize
from .store import KINDS, PromptStore


class LynxLayer(CacheLayerMixin):
    """Prompt positions [offset, P) from the streams, then the decode-side tail."""

    is_compileable = False  # shapes grow as the prompt lands (and the Cache is compileable only if its layers are)
    is_croppable = True
    supports_early_init = False

    def __init__(self, prompt_len: int, sliding_window: int | None = None, device="cpu"):
        super().__init__()
        self.prompt_len, self.sliding_window = prompt_len, sliding_window
        self.is_sliding = sliding_window is not None
        self.window = window_positions(prompt_len, sliding_window)
        self.offset = prompt_len - self.window  # absolute position of keys[..., 0, :]
        self.store = PromptStore(prompt_len, self.offset, torch.device(device))
        self.tier = None
        self.rerun = 0  # leading positions of the next update that the layer already holds (plain generate())
        self.prefix: tuple | None = None  # sealed KV of earlier turns in front of the range: positions [offset, base)
        self.sealed = False  # plain full-precision KV (no store): crop anywhere its window allows

    # -- turns --------------------------------------------------------------------------------------------------------
    def seal(self) -> None:
        """The full tier (and tail) become plain KV: the codes are dropped, the prompt boundary with them."""
        if not self.is_initialized or self.tier != "full":
            raise RuntimeError("seal() needs the full tier materialised")
        self.store = PromptStore(self.end, self.end, self.store.device)  # empty: complete
        self.prompt_len, self.window, self.sealed = self.end, self.keys.shape[-2], True

    @property
    def end(self) -> int:
        """Absolute position after the last KV held (before materialisation: the prompt's length)."""
        return self.offset + self.keys.shape[-2] if self.is_initialized else self.prompt_len

    def begin_range(self, prompt_len: int) -> None:
        """A new turn: positions [end, prompt_len) will stream in; the sealed KV before them stays (a sliding
        layer's only from the first position its window needs at prompt_len)."""
        base = self.end
        if not self.sealed or prompt_len <= base:
            raise RuntimeError(f"begin_range({prompt_len}) needs a sealed layer ending before it (ends at {base})")
        first = max(self.offset, prompt_len - window_positions(prompt_len, self.sliding_window))
        keep = max(0, base - first)
        self.prefix = (self.keys[..., self.keys.shape[-2] - keep:, :],
                       self.values[..., self.values.shape[-2] - keep:, :])
        self.keys = self.values = None
        self.is_initialized, self.tier, self.sealed = False, None, False
        self.offset, self.prompt_len = first, prompt_len
        self.window = prompt_len - first
        self.store = PromptStore(prompt_len, max(first, base), self.store.device)

    def append_sealed(self, prompt_len: int) -> None:
        """A new turn computed here (the tail already holds its KV): the prompt now ends at `prompt_len`."""
        if not self.sealed or self.end != prompt_len:
            raise RuntimeError(f"append_sealed({prompt_len}) on a layer ending at {self.end}")
        self.seal()

    def crop_to(self, length: int) -> None:
        """Keep absolute positions [offset, length) of a sealed layer; refused where a sliding window would lack the
        positions it needs at `length` (they were dropped)."""
        if not self.sealed:
            raise RuntimeError("crop_to needs a sealed layer")
        need = length - window_positions(length, self.sliding_window)
        if need < self.offset:
            raise ValueError(f"cannot go back to {length} tokens: this sliding-window layer no longer holds positions "
                             f"[{need}, {self.offset}) (build a new LynxCache from the prefill)")
        keep = length - self.offset
        self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]
        self.prompt_len, self.window = length, keep
        self.store = PromptStore(length, length, self.store.device)

    # -- tiers (the caller holds no lock: the snapshot was taken under it) ----------------------------------------
    def materialise(self, tier: str, snapshot: dict, dtype: torch.dtype, device) -> None:
        """Dequantize the prompt region at `tier` from `snapshot` ({kind: [(start, segment)]}, codes on `device`),
        in place once the buffers exist: each segment decodes straight into its slice of keys / values."""
        if not self.is_initialized:
            like = {k: snapshot[k][0][1].shape for k in ("key", "value")} if snapshot["key"] else \
                {"key": self.prefix[0].shape, "value": self.prefix[1].shape}
            shape = lambda kind: (*like[kind][:2], self.window, like[kind][3])
            self.keys = torch.empty(shape("key"), dtype=dtype, device=device)      # keys: [B, H_kv, window, D]
            self.values = torch.empty(shape("value"), dtype=dtype, device=device)
            self.device, self.dtype = self.keys.device, dtype
            self.is_initialized = True
            if self.prefix is not None:  # earlier turns' sealed KV, in front of the range
                n = self.prefix[0].shape[-2]
                self.keys[..., :n, :].copy_(self.prefix[0])
                self.values[..., :n, :].copy_(self.prefix[1])
        for kind, buf in (("key", self.keys), ("value", self.values)):
            for s0, seg in snapshot[kind]:
                a = s0 - self.offset
                dst = buf[:, :, a: a + seg.shape[2]]
                if seg.dtype == dst.dtype and seg.anchor.device == dst.device:
                    dequantize(seg, tier, out=dst)
                else:  # a cache of another dtype than the prefill's KV
                    dst.copy_(dequantize(seg, tier))
        self.tier = tier
        if tier == "full":
            self.prefix = None

    # -- CacheLayerMixin --------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        raise RuntimeError("LynxLayer is initialised by a tier, not by a forward pass")

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
        """Absolute length. Before the first forward: the prompt minus its last position (see LynxCache)."""
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
        if keep < self.window:
            raise ValueError(f"cannot crop into the transferred prompt ({self.prompt_len} tokens) to "
                             f"{self.offset + keep}")
        self.keys = self.keys[..., :keep, :]
        self.values = self.values[..., :keep, :]

    def keep_tail(self, start: int, index: torch.Tensor) -> None:
        """Keep the absolute positions before `start`, then per row the positions start + index[b] ([B, k]), in that
        order; drop the rest (a verified tree path's KV, gathered in place)."""
        s = start - self.offset
        if s < self.window or s > self.keys.shape[-2]:
            raise ValueError(f"keep_tail start {start} outside the decode-side tail")
        i = index.to(self.keys.device)[:, None, :, None]                       # [B, 1, k, 1]

        def keep(t):  # keys and values may differ in head dim (MLA)
            return torch.cat([t[..., :s, :], t[..., s:, :].gather(2, i.expand(*t.shape[:2], i.shape[2], t.shape[3]))],
                             dim=-2)

        self.keys, self.values = keep(self.keys), keep(self.values)

    def reset(self) -> None:
        """Drop the decode-side tail; the transferred prompt stays."""
        if self.is_initialized:
            self.crop(self.window - self.keys.shape[-2])

    def select(self, fn) -> None:
        """Apply a batch-dimension map to the codes and the materialised KV (LynxCache holds its lock)."""
        self.store.select(fn)
        if self.is_initialized:
            self.keys, self.values = fn(self.keys), fn(self.values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select(lambda t: t.repeat_interleave(repeats, dim=0))


__all__ = ["LynxLayer", "KINDS"]
