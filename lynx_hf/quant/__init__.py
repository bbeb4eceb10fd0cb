"""Pure quantization: `encode(x, config) -> SplitKV` and `dequantize(split, tier) -> Tensor`, for every method
(`decode` is the same function under its older name).

x is one layer's keys or values, [B, H_kv, S, D], in bf16 / fp16 / fp32. This package knows nothing about caches,
models or transport. `CODECS` maps each method name of `LynxQuantConfig` to its `Codec` (encode, decode, whether it
has a residual stream); `encode`/`dequantize` validate and dispatch through it. CacheGen's bins depend on the
layer's depth: its encode needs `layer=(index, num_layers)`; the other methods ignore it. The Lynx codec picks the
fastest exact implementation for the tensor's device (Triton on CUDA; on CPU the C kernels, else torch.compile for
large tensors, else eager torch; see quant/dispatch.py); `reference=True` forces the reference (eager,
threshold-search codes)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import METHODS, LynxQuantConfig
from . import baselines, lynx
from .splitkv import TIERS, SplitKV

__all__ = ["encode", "dequantize", "decode", "SplitKV", "TIERS", "Codec", "CODECS", "codec", "validate_input"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Codec:
    """One KV method. encode(x, config, kind, reference, layer) → SplitKV;
    decode(split, tier, reference, out) → Tensor.
    split: True when the code has a separate residual stream (anchor first, residual later); baselines ship whole.
    coded: True when the anchor is an entropy-coded byte stream (uint8 [N], N data-dependent, at most
    `max_nbytes(shape)`) rather than codes indexed by batch row; `select(split, fn)` then maps its batch rows."""

    encode: Callable[..., SplitKV]
    decode: Callable[..., torch.Tensor]
    split: bool
    coded: bool = False
    max_nbytes: Callable[[tuple], int] | None = None
    select: Callable[[SplitKV, Callable], SplitKV] | None = None


def _finite(x: torch.Tensor) -> None:
    if not torch.isfinite(x).all():
        raise ValueError("encode: input contains NaN or Inf")


def _lynx_encode(x, config, kind, reference, layer=None):
    from .dispatch import kernels

    if reference:
        return lynx.encode(x, config, kind, fast=False)
    return lynx.encode(x, config, kind, kernels(x.device, x.numel()))


def _lynx_decode(split, tier, reference, out=None):
    from .dispatch import kernels

    if tier == "full" and split.residual is None:
        raise ValueError("decode: the full tier needs the residual stream, which this SplitKV lacks")
    return lynx.decode(split, tier, lynx.REFERENCE if reference else kernels(split.anchor.device,
                                                                             split.anchor.numel() * 2), out)


def _baseline(enc, dec) -> Codec:
    def encode_(x, config, kind, reference, layer=None):
        _finite(x)
        return enc(x, config, kind)

    def decode_(split, tier, reference, out=None):
        x = dec(split)
        return x if out is None else out.copy_(x)

    return Codec(encode_, decode_, split=False)


_LYNX = Codec(_lynx_encode, _lynx_decode, split=True)
_PASSTHROUGH = _baseline(baselines.encode_passthrough, baselines.decode_passthrough)
_UNIFORM = _baseline(baselines.encode_uniform, baselines.decode_uniform)


# CacheGen is imported where it is used: it needs numpy and constriction, which the Hub folder's runtime
# (torch and transformers only) leaves behind, together with this baseline.
def _cachegen_encode(x, config, kind, reference, layer=None):
    from .cachegen import encode as cachegen_encode

    _finite(x)
    if layer is None:
        raise ValueError("encode: method 'cachegen' needs layer=(index, num_layers) (its bins depend on the depth)")
    return cachegen_encode(x, config, kind, *layer)


def _cachegen_decode(split, tier, reference, out=None):
    from .cachegen import decode as cachegen_decode

    x = cachegen_decode(split)
    return x if out is None else out.copy_(x)


def _cachegen_bound(shape: tuple) -> int:
    from .cachegen import max_nbytes

    return max_nbytes(shape)


def _cachegen_select(split, fn):
    from .cachegen import select

    return select(split, fn)


_CACHEGEN = Codec(_cachegen_encode, _cachegen_decode, split=False, coded=True, max_nbytes=_cachegen_bound,
                  select=_cachegen_select)
CODECS: dict[str, Codec] = {"lynx": _LYNX, "paper": _LYNX, "identity": _PASSTHROUGH, "bf16": _PASSTHROUGH,
                            "cachegen": _CACHEGEN, **{m: _UNIFORM for m in baselines.BITS}}
assert set(CODECS) == set(METHODS), "every method of LynxQuantConfig needs a codec"


def codec(config: LynxQuantConfig) -> Codec:
    return CODECS[config.method]


def validate_input(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"encode: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"encode: expected x of rank 4 [B, H_kv, S, D], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"encode: unsupported dtype {x.dtype}; expected one of {DTYPES}")
    if x.numel() == 0:
        raise ValueError(f"encode: empty tensor of shape {tuple(x.shape)}")


def encode(x: torch.Tensor, config: LynxQuantConfig | None = None, kind: str = "key", *,
           reference: bool = False, layer: tuple[int, int] | None = None) -> SplitKV:
    """Encode one K or V tensor. kind ("key" | "value") selects the grouping axis the config gives that kind;
    layer = (index, num_layers) places it in the model (CacheGen needs it)."""
    config = config or LynxQuantConfig()
    if not isinstance(config, LynxQuantConfig):
        raise ValueError(f"encode: config must be a LynxQuantConfig, got {type(config).__name__}")
    if kind not in ("key", "value"):
        raise ValueError(f"encode: kind must be 'key' or 'value', got {kind!r}")
    validate_input(x)
    if layer is not None and not (isinstance(layer, tuple) and len(layer) == 2 and 0 <= layer[0] < layer[1]):
        raise ValueError(f"encode: layer must be (index, num_layers) with 0 <= index < num_layers, got {layer!r}")
    return codec(config).encode(x, config, kind, reference, layer)


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
    return codec(split.config).decode(split, tier, reference, out)


decode = dequantize  # the older name (one word per meaning: "decode" is the decode node)
