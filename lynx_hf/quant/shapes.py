"""What an encode produces, without encoding: for a config and one segment's geometry [B, H, S, D] (and its dtype),
the shape, dtype and byte size of every tensor of each stream — the anchor codes, the residual codes, the metadata —
and the grouping axis. A receiver checks a peer's tensors against these before it stores them, and sizes its
buffers by them; nothing here allocates or runs a torch op.

Contract: for every input `encode` accepts, `<method>_shapes` equals the encode's SplitKV exactly (shapes, dtypes,
byte counts; tests/test_quant.py compares them with tolerance 0), except a coded stream's anchor (CacheGen), whose
length follows the data: its spec has `shape=None` and the codec's upper bound as `nbytes`. Inputs `encode` refuses
for their shape (an odd head_dim for 4-bit packing, say) raise the same ValueError here."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..config import LynxQuantConfig
from .baselines import _AXIS as UNIFORM_AXIS
from .baselines import BITS
from .exact import max_nbytes as correction_bound
from .pack import check_width, packed_len

SENT_AXES = ("channel", "token")  # the grouping axes a split codec's segment may declare


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a stream: its shape (None: a coded byte stream whose length follows the data) and dtype;
    `nbytes` its exact size (a coded stream: the most it may take)."""

    shape: tuple | None
    dtype: torch.dtype
    nbytes: int

    @classmethod
    def of(cls, shape: tuple, dtype: torch.dtype) -> "TensorSpec":
        shape = tuple(int(s) for s in shape)
        return cls(shape, dtype, math.prod(shape) * dtype.itemsize)

    @property
    def signature(self) -> tuple:
        """(shape, dtype), as a received tensor's `(tuple(t.shape), t.dtype)` is compared with it."""
        return self.shape, self.dtype


@dataclass(frozen=True)
class StreamShapes:
    """The tensors one encode of a [B, H, S, D] segment produces: `anchor` (codes), `residual` (codes, or None when
    the method has no residual stream), `meta` (name → spec; travels with the anchor), the grouping `axis` and, in
    exact mode, the `correction` (a coded byte stream: `shape` None, `nbytes` its bound)."""

    anchor: TensorSpec
    residual: TensorSpec | None
    meta: dict = field(default_factory=dict)
    axis: str = ""
    correction: TensorSpec | None = None

    @property
    def coded(self) -> bool:
        """The anchor is a coded byte stream (its length follows the data; `anchor.nbytes` bounds it)."""
        return self.anchor.shape is None

    def nbytes(self, tier: str = "full") -> int:
        """Bytes that cross the wire for `tier`, metadata included (`SplitKV.nbytes`); a coded stream: at most."""
        n = self.anchor.nbytes + sum(m.nbytes for m in self.meta.values())
        if tier == "full" and self.residual is not None:
            n += self.residual.nbytes
        if tier == "full" and self.correction is not None:
            n += self.correction.nbytes
        return n


def lynx_shapes(config: LynxQuantConfig, kind: str, shape: tuple, dtype: torch.dtype,
                axis: str | None = None) -> StreamShapes:
    """"lynx" / "paper": b-bit anchor codes [B, H, S, D·b/8] and (8 − b)-bit residual codes [B, H, S, D·(8−b)/8]
    (b = anchor_bits; 4: D/2 each); μ, σ per chunk of C tokens and channel
    [B, H, ⌈S/C⌉, D] or per token [B, H, S] (fp16; "paper": uint8), and for "paper" γ_min, γ_scale per page and
    channel [B, H, ⌈NC/(page/C)⌉, D] (fp16). `axis` (default: the config's for `kind`) must be "channel" or "token":
    an "auto" axis is chosen from the data, so its shapes are known only with the axis the segment declares."""
    B, H, S, D = shape
    bits = config.anchor_bits
    check_width(D, bits)
    axis = axis or config.axis(kind)
    if axis not in SENT_AXES:
        raise ValueError(f"the {config.method!r} codec's shapes need the grouping axis ('channel' or 'token'), "
                         f"got {axis!r}")
    C, paper = config.chunk_size, config.method == "paper"
    NC = -(-S // C)
    anchor = TensorSpec.of((B, H, S, packed_len(D, bits)), torch.uint8)
    residual = TensorSpec.of((B, H, S, packed_len(D, 8 - bits)), torch.uint8)
    stat = TensorSpec.of((B, H, S) if axis == "token" else (B, H, NC, D), torch.uint8 if paper else torch.float16)
    meta = {"mu": stat, "sigma": stat}
    if paper:
        page = TensorSpec.of((B, H, -(-NC // (config.page_size // C)), D), torch.float16)
        meta.update(gamma_min=page, gamma_scale=page)
    fix = TensorSpec(None, torch.uint8, correction_bound(math.prod(shape), dtype)) if config.exact else None
    return StreamShapes(anchor, residual, meta, axis, fix)


def uniform_shapes(config: LynxQuantConfig, kind: str, shape: tuple, dtype: torch.dtype,
                   axis: str | None = None) -> StreamShapes:
    """INT8 / KIVI-4 / KIVI-3 / KIVI-2 (`axis` ignored: keys per channel, values per token): codes [B, H, S, D·bits/8],
    min and scale fp16 per group — [B, H, ⌈S/G⌉, D] (keys), [B, H, S, D/G] (values; one group of D when G does not
    divide D)."""
    B, H, S, D = shape
    bits, G = BITS[config.method], config.group_size
    check_width(D, bits)
    if UNIFORM_AXIS[kind] == "channel":
        group = (B, H, -(-S // G), D)
    else:
        group = (B, H, S, D // (G if D % G == 0 else D))
    stat = TensorSpec.of(group, torch.float16)
    return StreamShapes(TensorSpec.of((B, H, S, D * bits // 8), torch.uint8), None, {"min": stat, "scale": stat})


def passthrough_shapes(config: LynxQuantConfig, kind: str, shape: tuple, dtype: torch.dtype,
                       axis: str | None = None) -> StreamShapes:
    """identity (the input's bytes) / bf16 (bfloat16's bytes): uint8 [B, H, S, D·itemsize], no metadata."""
    B, H, S, D = shape
    width = dtype.itemsize if config.method == "identity" else torch.bfloat16.itemsize
    return StreamShapes(TensorSpec.of((B, H, S, D * width), torch.uint8), None)


def coded_shapes(max_nbytes) -> callable:
    """A coded codec's shapes (CacheGen): the anchor a uint8 byte stream of at most `max_nbytes(shape)` bytes, the
    per-token scale float32 [B, S], axis "token"."""

    def shapes(config: LynxQuantConfig, kind: str, shape: tuple, dtype: torch.dtype,
               axis: str | None = None) -> StreamShapes:
        B, H, S, D = shape
        return StreamShapes(TensorSpec(None, torch.uint8, max_nbytes(tuple(shape))), None,
                            {"scale": TensorSpec.of((B, S), torch.float32)}, "token")

    return shapes
