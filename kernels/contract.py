"""The contract every implementation of the codec's hot ops shares (the torch reference in lynx_hf.quant.lynx, the C
kernels, Triton): argument checks that must read the same wherever a kernel runs. It imports nothing of the
package, so the kernels depend on nothing of the codec and the codec reaches them only through quant.dispatch."""
from __future__ import annotations

import math

import torch

FP16_MAX = 65504.0  # the range of the fp16 page metadata


def check_out(out: torch.Tensor, anchor: torch.Tensor, out_dtype: torch.dtype, anchor_bits: int = 4) -> None:
    """`out` [B, H, S, D] for an anchor of [B, H, S, D·anchor_bits/8] packed codes."""
    want = (*anchor.shape[:3], 8 * anchor.shape[3] // anchor_bits)
    if tuple(out.shape) != want or out.dtype != out_dtype or out.device != anchor.device:
        raise ValueError(f"dequantize: out must be {want} {out_dtype} on {anchor.device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")


def check_width(D: int, bits: int) -> None:
    """An anchor of `bits` ∈ {2, 3, 4} over D channels packs into whole groups (quant/pack.py's rule)."""
    group = {2: 4, 3: 8, 4: 2}.get(bits)
    if group is None or D % group:
        raise ValueError(f"encode: anchors of 2, 3 or 4 bits pack whole groups of channels (2 bits: 4, 3 bits: 8, "
                         f"4 bits: 2); got {bits} bits for head_dim {D}")


def check_ranges(lo: torch.Tensor, hi: torch.Tensor) -> None:
    """lo / hi: group minima / maxima covering every element of an input (NaN propagated into them)."""
    top = float(torch.maximum(-lo.amin(), hi.amax()))  # NaN when any element is NaN, inf when any is ±inf
    if not math.isfinite(top):
        raise ValueError("encode: input contains NaN or Inf")
    if top > FP16_MAX:
        raise ValueError(f"encode: |x| exceeds {FP16_MAX:g}, the range of the fp16 page metadata; use method='bf16'")
