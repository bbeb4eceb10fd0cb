"""`SplitKV`: what one encoded K or V tensor is made of, and what each tier costs on the wire.

The anchor stream is the packed 4-bit MSB codes plus *all* metadata (γ, μ/σ): it alone dequantizes to the anchor
tier. The residual stream is the packed 4-bit LSB codes and nothing else. Exact mode adds a third stream, the
correction (quant/exact.py: packed bytes, lowest priority) that turns the 8-bit reconstruction into the input's
bits; the full tier is then the input itself. Baselines keep everything in `anchor` and have no residual, so both
tiers are the same for them."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import LynxQuantConfig

TIERS = ("anchor", "full")


@dataclass
class SplitKV:
    config: LynxQuantConfig
    kind: str                      # "key" | "value"
    shape: tuple                   # (B, H, S, D) of the input
    dtype: torch.dtype             # dtype of the input, restored by dequantize
    anchor: torch.Tensor           # uint8 payload of the anchor stream (codes only; meta is below)
    residual: torch.Tensor | None  # uint8 packed 4-bit LSBs, or None when the method has no residual
    meta: dict = field(default_factory=dict)  # name -> tensor; travels with the anchor
    axis: str = ""                 # grouping axis the encoder used ("channel" | "token"; "" for passthrough)
    correction: torch.Tensor | None = None  # exact mode: uint8 [N] (quant/exact.py), None until it arrives

    def row(self, i: int) -> "SplitKV":
        """Batch row i as a SplitKV of its own (views), for codes indexed by batch row (not a coded stream, no
        correction)."""
        pick = lambda t: None if t is None else t[i:i + 1]  # noqa: E731
        return SplitKV(self.config, self.kind, (1, *self.shape[1:]), self.dtype, pick(self.anchor),
                       pick(self.residual), {k: m[i:i + 1] for k, m in self.meta.items()}, self.axis)

    def meta_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.meta.values())

    def nbytes(self, tier: str = "full") -> int:
        """Bytes that must cross the wire for `tier`, metadata included (the full tier: every stream held)."""
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        n = self.anchor.numel() * self.anchor.element_size() + self.meta_nbytes()
        if tier == "full" and self.residual is not None:
            n += self.residual.numel()
        if tier == "full" and self.correction is not None:
            n += self.correction.numel()
        return n

    def bits_per_value(self, tier: str = "full") -> float:
        numel = 1
        for s in self.shape:
            numel *= s
        return 8.0 * self.nbytes(tier) / numel

    def to(self, device) -> "SplitKV":
        mv = lambda t: None if t is None else t.to(device)
        return SplitKV(self.config, self.kind, self.shape, self.dtype, mv(self.anchor), mv(self.residual),
                       {k: v.to(device) for k, v in self.meta.items()}, self.axis, mv(self.correction))
