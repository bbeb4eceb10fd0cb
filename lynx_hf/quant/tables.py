"""Compander tables: the α-law curve turned into lookup tables, computed once in float64 per (method, α, anchor).

Encoding never evaluates a logarithm: a code is the number of thresholds at or below u (a bucketize), so every
implementation that computes the same u (torch eager, torch.compile, Triton) yields bit-identical codes.
Dequantizing is a table lookup. Notation (paper): u ∈ [-1, 1] is the chunk-normalised value,
y = sign(u)·ln(1+α|u|)/ln(1+α) is its companded form, and the 8-bit code c splits as c = 16·a + r."""
from __future__ import annotations

import functools
import math

import torch


def _expand(y: torch.Tensor, alpha: float) -> torch.Tensor:
    """Inverse compander: u = sign(y)·((1+α)^|y| − 1)/α (linear when α = 0). float64 in, float64 out."""
    if alpha == 0:
        return y
    return torch.sign(y) * torch.expm1(y.abs() * math.log1p(alpha)) / alpha


@functools.lru_cache(maxsize=64)
def tables(method: str, alpha: float, anchor: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(thresholds, full_lut, anchor_lut), float32 on CPU.

    method "lynx"  (rounded anchor + signed residual): with t = (y+1)/2 ∈ [0, 1], the anchor is a = round(15·t),
                   a 16-level grid that contains both ends (so a chunk's extremes survive the anchor tier), and the
                   residual r ∈ 0..15 is the signed offset round(16·(15t − a)) + 8 within the anchor cell, so the
                   full tier is t̂ = (16a + r − 8)/240: a 241-point grid that also contains both ends. Measured:
                   grids without the ends (mid-rise cells) match KIVI/INT8 in MSE but lose 3-5× in next-token KL.
                   thresholds: 255 values of u; code c = 16a + r = #thresholds ≤ u.
    method "paper" (sign-magnitude): c = s·128 + m with m = round(127·y(|u|)); thresholds: 127 values of |u|.
                   The anchor keeps the sign and the 3 top magnitude bits (+0 and -0 are both codes).
    full_lut[c]:   u reconstructed from the 8-bit code.
    anchor_lut[a]: u reconstructed from the 4-bit anchor alone: "paper" c = 16a + 7 (the +7 bias); "center" the
                   grid point of the coarse cell in y (lynx: a/15); "centroid" the mean of its 16 fine
                   reconstructions (for lynx, the mean over the codes that can occur).
    """
    f64 = torch.float64
    if method == "lynx":
        c = torch.arange(256, dtype=f64)
        a, r = torch.div(c, 16, rounding_mode="floor"), c.remainder(16)
        # fine-cell upper edges: inside an anchor cell halfway between offsets, at its top edge the anchor's own edge
        t_hi = torch.where(r == 15, (a + 0.5) / 15, (a + (r - 7.5) / 16) / 15)
        thr = _expand(2 * t_hi[:255] - 1, alpha)
        full = _expand(2 * (c - 8) / 240 - 1, alpha)  # t̂ = (16a + r − 8)/240: a 241-point grid with both ends
        center = _expand(2 * torch.arange(16, dtype=f64) / 15 - 1, alpha)  # the rounded grid a/15
    elif method == "paper":
        m = torch.arange(128, dtype=f64)
        thr = _expand((torch.arange(127, dtype=f64) + 0.5) / 127, alpha)  # |u| thresholds for round(127·y)
        mag = _expand(m / 127, alpha)
        full = torch.cat([mag, -mag])  # c = s·128 + m
        a = torch.arange(16, dtype=f64)
        sign = torch.where(a >= 8, -1.0, 1.0)
        center = sign * _expand(((a.remainder(8)) * 16 + 7.5) / 127, alpha)
    else:
        raise ValueError(f"no compander tables for method {method!r}")
    if anchor == "paper":
        anc = full[torch.arange(16) * 16 + 7]
    elif anchor == "center":
        anc = center
    elif anchor == "centroid":
        f = full.view(16, 16).clone()
        if method == "lynx":  # cells 0 and 15 are half used: t < 0 and t > 1 never occur
            f[0, :8] = torch.nan
            f[15, 9:] = torch.nan
        anc = f.nanmean(1)
    else:
        raise ValueError(f"unknown anchor design {anchor!r}")
    f32 = torch.float32
    return thr.to(f32).contiguous(), full.to(f32).contiguous(), anc.to(f32).contiguous()
