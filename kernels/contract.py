"""The contract every implementation of the codec's hot ops shares (the torch reference in lynx_hf.quant.lynx, the C
kernels, Triton): argument checks that must read the same wherever a kernel runs. It imports nothing of the
package, so the kernels depend on nothing of the codec and the codec reaches them only through quant.dispatch."""
from __future__ import annotations

import math

import torch

FP16_MAX = 65504.0  # the range of the fp16 page metadata


def check_out(out: torch.Tensor, anchor: torch.Tensor, out_dtype: torch.dtype) -> None:
    want = (*anchor.shape[:3], 2 * anchor.shape[3])
    if tuple(out.shape) != want or out.dtype != out_dtype or out.device != anchor.device:
        raise ValueError(f"dequantize: out must be {want} {out_dtype} on {anchor.device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")


def check_ranges(lo: torch.Tensor, hi: torch.Tensor) -> None:
    """lo / hi: group minima / maxima covering every element of an input (NaN propagated into them)."""
    top = float(torch.maximum(-lo.amin(), hi.amax()))  # NaN when any element is NaN, inf when any is ±inf
    if not math.isfinite(top):
        raise ValueError("encode: input contains NaN or Inf")
    if top > FP16_MAX:
        raise ValueError(f"encode: |x| exceeds {FP16_MAX:g}, the range of the fp16 page metadata; use method='bf16'")
