"""Baselines behind the same encode/dequantize API: identity (lossless), BF16 passthrough, uniform INT8, KIVI-4/3/2.

Uniform codes are asymmetric min-max with round-to-nearest (KIVI): keys grouped per channel over `group_size`
tokens, values per token over `group_size` channels; min and scale travel as fp16. Everything is in the anchor
stream (no residual), so both tiers dequantize alike."""
from __future__ import annotations

import torch

from ..config import LynxQuantConfig
from .lynx import _pad_tokens
from .pack import pack_bits, unpack_bits
from .splitkv import SplitKV

BITS = {"int8": 8, "kivi4": 4, "kivi3": 3, "kivi2": 2}
_AXIS = {"key": "channel", "value": "token"}  # KIVI: per-channel keys, per-token values


def _grouped(x: torch.Tensor, axis: str, group: int) -> torch.Tensor:
    """x: [B, H, S, D] → a view whose last dim is one group: channel → [B, H, NG, D, G];
    token → [B, H, S, D/G, G]."""
    B, H, S, D = x.shape
    if axis == "channel":
        return _pad_tokens(x, group).view(B, H, -1, group, D).transpose(-1, -2)
    g = group if D % group == 0 else D
    return x.view(B, H, S, D // g, g)


def _ungroup(g: torch.Tensor, axis: str, shape) -> torch.Tensor:
    B, H, S, D = shape
    if axis == "channel":
        return g.transpose(-1, -2).reshape(B, H, -1, D)[:, :, :S]
    return g.reshape(B, H, S, D)


def encode_uniform(x: torch.Tensor, config: LynxQuantConfig, kind: str) -> SplitKV:
    bits = BITS[config.method]
    axis = _AXIS[kind]
    L = 2 ** bits - 1
    g = _grouped(x.float(), axis, config.group_size)
    mn = g.amin(-1, keepdim=True).half()
    scale = ((g.amax(-1, keepdim=True) - mn.float()) / L).clamp_min(2.0 ** -24).half()
    q = ((g - mn.float()) / scale.float()).round().clamp(0, L).to(torch.uint8)
    codes = _ungroup(q, axis, x.shape)
    payload = pack_bits(codes, bits)
    meta = {"min": mn.squeeze(-1), "scale": scale.squeeze(-1)}
    return SplitKV(config, kind, tuple(x.shape), x.dtype, payload, None, meta)


def dequantize_uniform(split: SplitKV) -> torch.Tensor:
    bits = BITS[split.config.method]
    axis = _AXIS[split.kind]
    codes = unpack_bits(split.anchor, bits)
    g = _grouped(codes.float(), axis, split.config.group_size)
    x = g * split.meta["scale"].float().unsqueeze(-1) + split.meta["min"].float().unsqueeze(-1)
    return _ungroup(x, axis, split.shape).to(split.dtype)


def encode_passthrough(x: torch.Tensor, config: LynxQuantConfig, kind: str) -> SplitKV:
    """identity: the raw bytes of x (lossless); bf16: x rounded to bfloat16."""
    t = x if config.method == "identity" else x.to(torch.bfloat16)
    payload = t.contiguous().view(torch.uint8)
    return SplitKV(config, kind, tuple(x.shape), x.dtype, payload, None, {})


def dequantize_passthrough(split: SplitKV) -> torch.Tensor:
    dt = split.dtype if split.config.method == "identity" else torch.bfloat16
    return split.anchor.view(dt).view(split.shape).to(split.dtype)
