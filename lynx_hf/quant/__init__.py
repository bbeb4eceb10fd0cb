"""Pure quantization: `encode(x, config) -> SplitKV`, `dequantize(split, tier) -> Tensor` and, without encoding,
`stream_shapes(config, kind, shape, dtype)`: the shapes, dtypes and byte sizes an encode of that geometry produces
(quant/shapes.py), for every method. `decode` is `dequantize` under its older name, kept for one release with a
DeprecationWarning ("decode" is the decode node).

x is one layer's keys or values, [B, H_kv, S, D], in bf16 / fp16 / fp32. This package knows nothing about caches,
models or transport. `CODECS` maps each method name of `LynxQuantConfig` to its `Codec` (encode, dequantize, shapes,
whether it has a residual stream); `encode`/`dequantize`/`stream_shapes` validate and dispatch through it. CacheGen's
bins depend on the layer's depth: its encode needs `layer=(index, num_layers)`; the other methods ignore it. The
Lynx codec picks the fastest exact implementation for the tensor's device (Triton on CUDA; on CPU the C kernels,
else torch.compile for large tensors, else eager torch; see quant/dispatch.py); `reference=True` forces the
reference (eager, threshold-search codes)."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import METHODS, LynxQuantConfig
from ..errors import ConfigError
from . import baselines, exact, lynx
from .shapes import SENT_AXES, StreamShapes, TensorSpec, coded_shapes, lynx_shapes, passthrough_shapes, uniform_shapes
from .splitkv import TIERS, SplitKV

__all__ = ["encode", "encode_rows", "dequantize", "decode", "correction", "stream_shapes", "StreamShapes", "TensorSpec",
           "SplitKV", "TIERS", "Codec", "CODECS", "codec", "validate_input"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Codec:
    """One KV method. encode(x, config, kind, reference, layer) → SplitKV;
    dequantize(split, tier, reference, out) → Tensor; shapes(config, kind, shape, dtype, axis) → StreamShapes (what
    encode produces for that geometry, without encoding; None for a codec that cannot say).
    split: True when the code has a separate residual stream (anchor first, residual later); baselines ship whole.
    coded: True when the anchor is an entropy-coded byte stream (uint8 [N], N data-dependent, at most
    `max_nbytes(shape)`) rather than codes indexed by batch row; `select(split, fn)` then maps its batch rows."""

    encode: Callable[..., SplitKV]
    dequantize: Callable[..., torch.Tensor]
    split: bool
    coded: bool = False
    max_nbytes: Callable[[tuple], int] | None = None
    select: Callable[[SplitKV, Callable], SplitKV] | None = None
    shapes: Callable[..., StreamShapes] | None = None

    @property
    def decode(self) -> Callable[..., torch.Tensor]:
        """The older name of `dequantize` (one release)."""
        warnings.warn("Codec.decode is now Codec.dequantize", DeprecationWarning, stacklevel=2)
        return self.dequantize


def _finite(x: torch.Tensor) -> None:
    if not torch.isfinite(x).all():
        raise ValueError("encode: input contains NaN or Inf")


def _lynx_encode(x, config, kind, reference, layer=None):
    from .dispatch import kernels

    if reference:
        split = lynx.encode(x, config, kind, fast=False)
    else:
        split = lynx.encode(x, config, kind, kernels(x.device, x.numel()))
    if config.exact:
        split.correction = correction(x, split)
    return split


def correction(x: torch.Tensor, split: SplitKV) -> torch.Tensor:
    """Exact mode's correction of `split` (a Lynx / paper encode of x): against the reference reconstruction, the
    one the decode side reproduces bit for bit."""
    return exact.encode_correction(x, lynx.dequantize(split, "full", lynx.REFERENCE))


def _lynx_dequantize(split, tier, reference, out=None):
    from .dispatch import kernels

    if tier == "full" and split.residual is None:
        raise ValueError("dequantize: the full tier needs the residual stream, which this SplitKV lacks")
    if tier == "full" and split.config.exact:
        if split.correction is None:
            raise ValueError("dequantize: an exact config's full tier needs the correction stream, which this "
                             "SplitKV lacks")
        x = exact.correct(lynx.dequantize(split, "full", lynx.REFERENCE), split.correction)
        return x if out is None else out.copy_(x)
    return lynx.dequantize(split, tier, lynx.REFERENCE if reference else kernels(split.anchor.device,
                                                                                 split.anchor.numel() * 2), out)


def _baseline(enc, deq, shapes) -> Codec:
    def encode_(x, config, kind, reference, layer=None):
        _finite(x)
        return enc(x, config, kind)

    def dequantize_(split, tier, reference, out=None):
        x = deq(split)
        return x if out is None else out.copy_(x)

    return Codec(encode_, dequantize_, split=False, shapes=shapes)


_LYNX = Codec(_lynx_encode, _lynx_dequantize, split=True, shapes=lynx_shapes)
_PASSTHROUGH = _baseline(baselines.encode_passthrough, baselines.dequantize_passthrough, passthrough_shapes)
_UNIFORM = _baseline(baselines.encode_uniform, baselines.dequantize_uniform, uniform_shapes)


# CacheGen is imported where it is used: it needs numpy and constriction, which the Hub folder's runtime
# (torch and transformers only) leaves behind, together with this baseline.
def _cachegen_encode(x, config, kind, reference, layer=None):
    from .cachegen import encode as cachegen_encode

    _finite(x)
    if layer is None:
        raise ValueError("encode: method 'cachegen' needs layer=(index, num_layers) (its bins depend on the depth)")
    return cachegen_encode(x, config, kind, *layer)


def _cachegen_dequantize(split, tier, reference, out=None):
    from .cachegen import dequantize as cachegen_dequantize

    x = cachegen_dequantize(split)
    return x if out is None else out.copy_(x)


def _cachegen_bound(shape: tuple) -> int:
    from .cachegen import max_nbytes

    return max_nbytes(shape)


def _cachegen_select(split, fn):
    from .cachegen import select

    return select(split, fn)


_CACHEGEN = Codec(_cachegen_encode, _cachegen_dequantize, split=False, coded=True, max_nbytes=_cachegen_bound,
                  select=_cachegen_select, shapes=coded_shapes(_cachegen_bound))
CODECS: dict[str, Codec] = {"lynx": _LYNX, "paper": _LYNX, "identity": _PASSTHROUGH, "bf16": _PASSTHROUGH,
                            "cachegen": _CACHEGEN, **{m: _UNIFORM for m in baselines.BITS}}
assert set(CODECS) == set(METHODS), "every method of LynxQuantConfig needs a codec"


def codec(config: LynxQuantConfig) -> Codec:
    return CODECS[config.method]


def validate_input(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"encode: expected a torch.Tensor, got {type(x).__name__}")
    _check_geometry(tuple(x.shape), x.dtype)


def _check_geometry(shape: tuple, dtype) -> None:
    if len(shape) != 4:
        raise ValueError(f"encode: expected x of rank 4 [B, H_kv, S, D], got shape {shape}")
    if dtype not in DTYPES:
        raise ValueError(f"encode: unsupported dtype {dtype}; expected one of {DTYPES}")
    if math.prod(shape) == 0:
        raise ValueError(f"encode: empty tensor of shape {shape}")


def _check_call(config, kind: str):
    config = config or LynxQuantConfig()
    if not isinstance(config, LynxQuantConfig):
        raise ValueError(f"encode: config must be a LynxQuantConfig, got {type(config).__name__}")
    if kind not in ("key", "value"):
        raise ValueError(f"encode: kind must be 'key' or 'value', got {kind!r}")
    if config.anchor_bits == "auto":
        raise ConfigError("encode: anchor_bits='auto' is chosen per request before encoding (lynx_hf.width."
                          "WidthPolicy, which DecodeClient and from_prefill(bandwidth_bps=...) use); give the "
                          "codec a width: 2, 3 or 4")
    return config


def encode(x: torch.Tensor, config: LynxQuantConfig | None = None, kind: str = "key", *,
           reference: bool = False, layer: tuple[int, int] | None = None) -> SplitKV:
    """Encode one K or V tensor. kind ("key" | "value") selects the grouping axis the config gives that kind;
    layer = (index, num_layers) places it in the model (CacheGen needs it)."""
    config = _check_call(config, kind)
    validate_input(x)
    if layer is not None and not (isinstance(layer, tuple) and len(layer) == 2 and 0 <= layer[0] < layer[1]):
        raise ValueError(f"encode: layer must be (index, num_layers) with 0 <= index < num_layers, got {layer!r}")
    return codec(config).encode(x, config, kind, reference, layer)


def encode_rows(x: torch.Tensor, config: LynxQuantConfig | None = None, kind: str = "key", *,
                layer: tuple[int, int] | None = None) -> list[SplitKV]:
    """`[encode(x[i:i + 1], config, kind, layer=layer) for each row i]` of x [N, H, S, D], every row's code exactly
    as encoded alone, in few passes where the codec's rows are independent (Lynx: one per axis its rows choose; the
    uniform and passthrough baselines: one); CacheGen and exact mode row by row."""
    config = _check_call(config, kind)
    validate_input(x)
    N = x.shape[0]
    if N == 1 or config.exact or config.method not in ("lynx", *baselines.BITS, "bf16", "identity"):
        return [encode(x[i:i + 1], config, kind, layer=layer) for i in range(N)]
    if config.method == "lynx":
        from .dispatch import kernels

        return lynx.encode_rows(x, config, kind, kernels(x.device, x.numel()))
    whole = encode(x, config, kind, layer=layer)
    return [whole.row(i) for i in range(N)]


def dequantize(split: SplitKV, tier: str = "full", *, reference: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Reconstruct [B, H, S, D] in the input's dtype from the anchor alone ("anchor") or both streams ("full"),
    into `out` when given (that shape and dtype, on the codes' device; any strides, e.g. a slice of a cache)."""
    if not isinstance(split, SplitKV):
        raise ValueError(f"dequantize: expected a SplitKV, got {type(split).__name__}")
    if tier not in TIERS:
        raise ValueError(f"dequantize: tier must be one of {TIERS}, got {tier!r}")
    if out is not None and (tuple(out.shape) != tuple(split.shape) or out.dtype != split.dtype
                            or out.device != split.anchor.device):
        raise ValueError(f"dequantize: out must be {tuple(split.shape)} {split.dtype} on {split.anchor.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return codec(split.config).dequantize(split, tier, reference, out)


def decode(split: SplitKV, tier: str = "full", *, reference: bool = False,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The older name of `dequantize` (kept for one release: "decode" is the decode node)."""
    warnings.warn("lynx_hf.quant.decode is now lynx_hf.quant.dequantize", DeprecationWarning, stacklevel=2)
    return dequantize(split, tier, reference=reference, out=out)


def stream_shapes(config: LynxQuantConfig | None, kind: str, shape: tuple, dtype: torch.dtype, *,
                  axis: str | None = None) -> StreamShapes:
    """What `encode` of a [B, H, S, D] tensor of `dtype` produces, without encoding: each stream's tensor shapes,
    dtypes and byte sizes (a coded anchor: its bound) and the axis. `axis`: for a split codec, the grouping axis
    the segment uses ("channel" | "token"; default the config's for `kind`, which must not be "auto"); the other
    methods fix their own. Raises ValueError for what `encode` refuses (rank, dtype, an empty or odd geometry)."""
    config = _check_call(config, kind)
    shape = tuple(int(s) for s in shape)
    _check_geometry(shape, dtype)
    c = codec(config)
    if c.shapes is None:
        raise ValueError(f"the {config.method!r} codec gives no shapes without encoding")
    if axis is not None and c.split and axis not in SENT_AXES:
        raise ValueError(f"the {config.method!r} codec sends axis 'channel' or 'token', not {axis!r}")
    return c.shapes(config, kind, shape, dtype, axis if c.split else None)
