"""Compander tables: the α-law curve turned into lookup tables, computed once in float64 per (method, α, anchor).

Encoding never evaluates a logarithm: a code is the number of thresholds at or below u (a bucketize), so every
implementation that computes the same u (torch eager, torch.compile, Triton) yields bit-identical codes.
Dequantizing is a table lookup. Notation (paper): u ∈ [-1, 1] is the chunk-normalised value,
y = sign(u)·ln(1+α|u|)/ln(1+α) is its companded form, and the 8-bit code c splits as c = 2^(8−b)·a + r
(b the anchor's bits, 4 by default: c = 16·a + r)."""
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
def tables(method: str, alpha: float, anchor: str, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(thresholds, full_lut, anchor_lut), float32 on CPU, for an 8-bit code whose anchor is its top `bits` bits
    (b; the residual the other 8 − b). Below, A = 2^b − 1 and R = 2^(8−b) (b = 4: A = 15, R = 16).

    method "lynx"  (rounded anchor + signed residual): with t = (y+1)/2 ∈ [0, 1], the anchor is a = round(A·t),
                   a 2^b-level grid that contains both ends (so a chunk's extremes survive the anchor tier), and the
                   residual r ∈ 0..R−1 is the signed offset round(R·(A·t − a)) + R/2 within the anchor cell, so
                   the full tier is t̂ = (R·a + r − R/2)/(A·R): a grid of A·R + 1 points (241 at b = 4, 225 at 3,
                   193 at 2) that also contains both ends. So the anchor is a plain rounded b-bit code at every
                   width, not the top bits of a 4-bit one. Measured: grids without the ends (mid-rise cells) match
                   KIVI/INT8 in MSE but lose 3-5× in next-token KL. thresholds: 255 values of u; code
                   c = R·a + r = #thresholds ≤ u.
    method "paper" (sign-magnitude): c = s·128 + m with m = round(127·y(|u|)); thresholds: 127 values of |u|.
                   The anchor keeps the sign and the b − 1 top magnitude bits (+0 and -0 are both codes).
    full_lut[c]:   u reconstructed from the 8-bit code.
    anchor_lut[a]: u reconstructed from the b-bit anchor alone: "paper" c = R·a + R/2 − 1 (b = 4: 16a + 7, the
                   published +7 bias); "center" the grid point of the coarse cell in y (lynx: a/A); "centroid" the
                   mean of its R fine reconstructions (for lynx, the mean over the codes that can occur).
    """
    if bits not in (2, 3, 4):
        raise ValueError(f"anchor bits must be 2, 3 or 4, got {bits!r}")
    f64, A, R = torch.float64, (1 << bits) - 1, 1 << (8 - bits)
    if method == "lynx":
        c = torch.arange(256, dtype=f64)
        a, r = torch.div(c, R, rounding_mode="floor"), c.remainder(R)
        # fine-cell upper edges: inside an anchor cell halfway between offsets, at its top edge the anchor's own edge
        t_hi = torch.where(r == R - 1, (a + 0.5) / A, (a + (r - R / 2 + 0.5) / R) / A)
        thr = _expand(2 * t_hi[:255] - 1, alpha)
        full = _expand(2 * (c - R / 2) / (A * R) - 1, alpha)  # (the codes past both ends never occur)
        center = _expand(2 * torch.arange(A + 1, dtype=f64) / A - 1, alpha)  # the rounded grid a/A
    elif method == "paper":
        m = torch.arange(128, dtype=f64)
        thr = _expand((torch.arange(127, dtype=f64) + 0.5) / 127, alpha)  # |u| thresholds for round(127·y)
        mag = _expand(m / 127, alpha)
        full = torch.cat([mag, -mag])  # c = s·128 + m
        a = torch.arange(A + 1, dtype=f64)
        half = (A + 1) // 2
        sign = torch.where(a >= half, -1.0, 1.0)
        center = sign * _expand(((a.remainder(half)) * R + (R - 1) / 2) / 127, alpha)
    else:
        raise ValueError(f"no compander tables for method {method!r}")
    if anchor == "paper":
        anc = full[torch.arange(A + 1) * R + R // 2 - 1]
    elif anchor == "center":
        anc = center
    elif anchor == "centroid":
        f = full.view(A + 1, R).clone()
        if method == "lynx":  # the end cells are half used: t < 0 and t > 1 never occur
            f[0, :R // 2] = torch.nan
            f[A, R // 2 + 1:] = torch.nan
        anc = f.nanmean(1)
    else:
        raise ValueError(f"unknown anchor design {anchor!r}")
    f32 = torch.float32
    return thr.to(f32).contiguous(), full.to(f32).contiguous(), anc.to(f32).contiguous()
