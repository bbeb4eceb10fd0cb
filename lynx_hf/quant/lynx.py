"""The Lynx codec in pure torch: the reference every kernel is compared against.

Hierarchy (paper notation), for x: [B, H, S, D]:
  1. page γ ("paper" only): per page of P tokens and per channel, γ_min and γ_scale (fp16, rounded outward) map
               x to x_n = (x − γ_min) / γ_scale ∈ [0, 1]. ("lynx": x_n = x.)
  2. chunk μ/σ: per group (C tokens of one channel, or the D channels of one token), a centre μ and a half-width
               σ give u = (x_n − μ) / σ ∈ [−1, 1]; outliers only widen their own chunk. "paper": μ = mean,
               σ = max |x_n − μ|, both uint8 in units of 1/255 of the page range; "lynx": mid-range and half-range
               in fp16 (8-bit stats relative to a page lose the chunk whenever an attention-sink token sets the
               page range, measured in docs/codec.md).
  3. α-law:    y = sign(u)·ln(1+α|u|)/ln(1+α), coded on 8 bits (see tables.py), split into a b-bit anchor
               (MSBs; b = config.anchor_bits, 4 by default) and an (8 − b)-bit residual (LSBs), each bit-packed
               along D (quant/pack.py: 4-bit codes two a byte).
Dequantizing is x̂ = γ_min + γ_scale·(μ + σ·LUT[code]).
Codes depend only on u, computed the same way everywhere."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import LynxQuantConfig
from ..kernels.contract import check_out, check_ranges
from .pack import check_width, join_codes, pack_bits, split_codes, unpack_bits
from .splitkv import SplitKV
from .tables import tables



def _pad_tokens(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Pad S up to a multiple by repeating the last token (leaves every min/max unchanged)."""
    S = x.shape[2]
    pad = (-S) % multiple
    if pad == 0:
        return x
    return torch.cat([x, x[:, :, -1:].expand(-1, -1, pad, -1)], dim=2)


def page_range(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page min / max [B, H, NP, D] → γ_min, γ_scale fp16 with γ_min ≤ lo and γ_min + γ_scale ≥ hi."""
    gmin = lo.half()
    gmin = torch.where(gmin.float() > lo, torch.nextafter(gmin, torch.tensor(-torch.inf, dtype=gmin.dtype)), gmin)
    span = hi - gmin.float()
    gscale = span.clamp_min(2.0 ** -24).half()
    gscale = torch.where(gscale.float() < span,
                         torch.nextafter(gscale, torch.tensor(torch.inf, dtype=gscale.dtype)), gscale)
    return gmin, gscale


def _page_view(t: torch.Tensor, S: int, page: int) -> torch.Tensor:
    """Per-page [B, H, NP, D] → per-token [B, H, S, D] (a cheap expand + reshape)."""
    B, H, NP, D = t.shape
    return t.float().unsqueeze(3).expand(B, H, NP, page, D).reshape(B, H, NP * page, D)[:, :, :S]


def _chunk_view(t: torch.Tensor, S: int, axis: str, chunk: int) -> torch.Tensor:
    """Chunk stats → broadcastable per-token view: channel axis [B,H,NC,D] → [B,H,S,D];
    token axis [B,H,S] → [B,H,S,1]."""
    if axis == "token":
        return t.float().unsqueeze(-1)
    B, H, NC, D = t.shape
    return t.float().unsqueeze(3).expand(B, H, NC, chunk, D).reshape(B, H, NC * chunk, D)[:, :, :S]


def minmax(x: torch.Tensor, chunk: int, channel: bool = True, token: bool = True):
    """One pass of ranges over x: [B, H, S, D] (any float dtype; results fp32, NaN propagates).
    → ((lo_c, hi_c) per chunk of C tokens and channel [B, H, NC, D], (lo_t, hi_t) per token [B, H, S]); a part not
    asked for is (None, None) (an implementation may compute it anyway)."""
    B, H, S, D = x.shape
    xf = x.float()
    ch = tok = (None, None)
    if channel:
        g = _pad_tokens(xf, chunk).view(B, H, -1, chunk, D)
        ch = (g.amin(3), g.amax(3))
    if token:
        tok = (xf.amin(-1), xf.amax(-1))
    return ch, tok


def range_stats(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group min / max (fp32, finite) → μ = mid-range and σ = half-range in fp16, σ rounded outward so that
    σ ≥ max(hi − μ, μ − lo) in fp32: then |u| ≤ 1 for every member of the group."""
    mu = ((hi + lo) / 2).half()
    span = torch.maximum(hi - mu.float(), mu.float() - lo)
    sigma = span.clamp_min(2.0 ** -24).half()
    sigma = torch.where(sigma.float() < span, torch.nextafter(sigma, torch.tensor(torch.inf, dtype=sigma.dtype)), sigma)
    return mu, sigma


def chunk_stats(xn: torch.Tensor, axis: str, chunk: int, paper: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """xn: [B, H, S, D] → μ, σ: [B, H, NC, D] (channel axis) or [B, H, S] (token axis).
    paper: mean / max-deviation as uint8 in units of 1/255 (xn ∈ [0, 1]); else range_stats (fp16)."""
    B, H, S, D = xn.shape
    (lo_c, hi_c), (lo_t, hi_t) = minmax(xn, chunk, channel=axis == "channel", token=axis == "token")
    lo, hi = (lo_t, hi_t) if axis == "token" else (lo_c, hi_c)
    if not paper:
        return range_stats(lo, hi)
    if axis == "token":
        mean = xn.mean(-1)
    else:
        g = _pad_tokens(xn, chunk).view(B, H, -1, chunk, D)
        valid = torch.ones(g.shape[2] * chunk, dtype=xn.dtype, device=xn.device)
        valid[S:] = 0
        valid = valid.view(1, 1, -1, chunk, 1)
        mean = (g * valid).sum(3) / valid.sum(3)
    mu_q = (mean * 255).round().clamp(0, 255)
    muf = mu_q / 255
    dev = torch.maximum(hi - muf, muf - lo)
    rho_q = (dev * 255).ceil().clamp(1, 255)
    return mu_q.to(torch.uint8), rho_q.to(torch.uint8)


def _stat_unit(t: torch.Tensor) -> float:
    return 1.0 / 255 if t.dtype == torch.uint8 else 1.0


def normalise(x, gmin, gscale, mu, rho, *, axis: str, page: int, chunk: int) -> torch.Tensor:
    """u = ((x − γ_min)/γ_scale − μ)/σ in fp32 (no page stage when gmin is None), in this exact order of
    operations (the kernels repeat it)."""
    S = x.shape[2]
    xn = x.float()
    if gmin is not None:
        xn = (xn - _page_view(gmin, S, page)) / _page_view(gscale, S, page)
    k = _stat_unit(mu)
    return (xn - _chunk_view(mu, S, axis, chunk) * k) / (_chunk_view(rho, S, axis, chunk) * k)


def codes_from_u(u: torch.Tensor, thr: torch.Tensor, sign_magnitude: bool) -> torch.Tensor:
    """u → 8-bit codes by counting thresholds (bucketize): exact and implementation-independent."""
    thr = thr.to(u.device)
    if sign_magnitude:
        m = torch.bucketize(u.abs(), thr, right=True)
        return ((u < 0).to(torch.int64) * 128 + m).to(torch.uint8)
    return torch.bucketize(u, thr, right=True).to(torch.uint8)


def codes_from_u_fast(u: torch.Tensor, thr: torch.Tensor, sign_magnitude: bool, alpha: float,
                      anchor_bits: int = 4) -> torch.Tensor:
    """The same codes as codes_from_u, without a 255-way search: the code computed arithmetically from the
    companded value, then moved by at most one cell so that thr[c-1] <= u < thr[c] holds exactly (transcendental
    rounding can only be off by one cell: cells are >= 1/240 wide, errors ~1e-7). `anchor_bits` b: the "lynx"
    code's nesting (A = 2^b − 1 anchor cells of R = 2^(8−b) offsets; the thresholds must be that code's)."""
    thr = thr.to(u.device)
    v = u.abs() if sign_magnitude else u
    y = v if alpha == 0 else torch.sign(v) * torch.log1p(alpha * v.abs()) / math.log1p(alpha)
    n = thr.numel()
    if sign_magnitude:
        c = (y * 127).round()
    else:
        A, R = (1 << anchor_bits) - 1, 1 << (8 - anchor_bits)
        tA = (y + 1) * (A / 2)  # A·t
        a = (tA + 0.5).floor().clamp(0, A)
        c = a * R + (R * (tA - a) + (R / 2 + 0.5)).floor().clamp(0, R - 1)
    c = c.clamp(0, n).long()
    c = c + ((c < n) & (v >= thr[c.clamp(max=n - 1)])).long()
    c = c - ((c > 0) & (v < thr[(c - 1).clamp(min=0)])).long()
    if sign_magnitude:
        c = c + (u < 0).long() * 128
    return c.to(torch.uint8)


BLOCK_NUMEL = 1 << 17  # elements per block: every pass of the elementwise chain stays in cache


def _head_blocks(H: int, per_head: int):
    """Head ranges of about BLOCK_NUMEL elements, or None when one block suffices (or inside torch.compile, which
    fuses the chain itself). Every statistic is per head, so blocks are independent."""
    hb = max(1, BLOCK_NUMEL // max(1, per_head))
    if H <= hb or torch.compiler.is_compiling():
        return None
    return [slice(i, i + hb) for i in range(0, H, hb)]


def _sl(t, h):
    return None if t is None else t[:, h]


def encode_codes(x, gmin, gscale, mu, rho, thr, *, axis: str, page: int, chunk: int, sign_magnitude: bool,
                 alpha: float | None = None, anchor_bits: int = 4):
    """Normalise, compand, split and pack (the op the Triton kernel fuses).
    x: [B, H, S, D] → (anchor [B, H, S, D·b/8], residual [B, H, S, D·(8−b)/8]) uint8, b = anchor_bits (4: D/2
    each). With alpha given, codes come from the arithmetic path (identical codes, several times faster on CPU);
    else from the threshold search. Large inputs run in blocks of heads (all statistics are per head), so each
    elementwise pass stays cache-resident."""
    B, H, S, D = x.shape
    blocks = _head_blocks(H, B * S * D)
    if blocks:
        parts = [encode_codes(x[:, h], _sl(gmin, h), _sl(gscale, h), _sl(mu, h), _sl(rho, h), thr, axis=axis,
                              page=page, chunk=chunk, sign_magnitude=sign_magnitude, alpha=alpha,
                              anchor_bits=anchor_bits) for h in blocks]
        return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)
    u = normalise(x, gmin, gscale, mu, rho, axis=axis, page=page, chunk=chunk)
    c = codes_from_u(u, thr, sign_magnitude) if alpha is None else \
        codes_from_u_fast(u, thr, sign_magnitude, alpha, anchor_bits)
    a, r = split_codes(c, anchor_bits)
    return pack_bits(a, anchor_bits), pack_bits(r, 8 - anchor_bits)


def dequantize_codes(anchor, residual, gmin, gscale, mu, rho, lut, *, axis: str, page: int, chunk: int,
                     out_dtype: torch.dtype, out: torch.Tensor | None = None, anchor_bits: int = 4) -> torch.Tensor:
    """Unpack, look up and de-normalise. residual None → anchor tier (lut is the 2^b-entry anchor table, b =
    anchor_bits), else full tier (lut is the 256-entry table). Returns [B, H, S, D] in out_dtype, written into `out`
    when given (a tensor of that shape and dtype, any strides: e.g. a slice of a cache's KV buffer). Blocks of
    heads, as encode."""
    if out is not None:
        check_out(out, anchor, out_dtype, anchor_bits)
        return out.copy_(dequantize_codes(anchor, residual, gmin, gscale, mu, rho, lut, axis=axis, page=page,
                                          chunk=chunk, out_dtype=out_dtype, anchor_bits=anchor_bits))
    B, H, S, HD = anchor.shape
    blocks = _head_blocks(H, B * S * HD * 8 // anchor_bits)
    if blocks:
        return torch.cat([dequantize_codes(anchor[:, h], _sl(residual, h), _sl(gmin, h), _sl(gscale, h), _sl(mu, h),
                                           _sl(rho, h), lut, axis=axis, page=page, chunk=chunk, out_dtype=out_dtype,
                                           anchor_bits=anchor_bits)
                          for h in blocks], 1)
    a = unpack_bits(anchor, anchor_bits)
    code = a if residual is None else join_codes(a, unpack_bits(residual, 8 - anchor_bits), anchor_bits)
    S = code.shape[2]
    u = lut.to(code.device)[code.long()]
    k = _stat_unit(mu)
    xn = _chunk_view(mu, S, axis, chunk) * k + _chunk_view(rho, S, axis, chunk) * k * u
    if gmin is None:
        return xn.to(out_dtype)
    return (_page_view(gmin, S, page) + _page_view(gscale, S, page) * xn).to(out_dtype)


AUTO_CHANNEL_RATIO = 2.9


def choose_axis(x: torch.Tensor) -> str:
    """"channel" when a few channels dominate (max/median of the per-channel absmax, averaged over heads, at least
    AUTO_CHANNEL_RATIO: keys, with their rotary outlier channels), else "token" (values: per-token scale, and
    small-norm attention-sink tokens that keep their precision only in their own group). On SmolLM2 the rule
    picks "channel" for every key tensor and "token" for all but the first value tensors (docs/codec.md)."""
    return _axis_from_absmax(x.detach().float().abs().amax(2))


def _axis_from_absmax(ch: torch.Tensor) -> str:
    """ch: per-channel absmax [B, H, D]."""
    ratio = ch.amax(-1) / ch.median(-1).values.clamp_min(1e-30)
    return "channel" if float(ratio.mean()) >= AUTO_CHANNEL_RATIO else "token"


@dataclass(frozen=True)
class Kernels:
    """The codec's four hot ops. Every implementation (this module's torch, the Triton kernels, the C kernels)
    provides the same four signatures with the same results; `encode` / `dequantize` are written over them."""

    minmax: Callable = minmax
    range_stats: Callable = range_stats
    encode_codes: Callable = encode_codes
    dequantize_codes: Callable = dequantize_codes


REFERENCE = Kernels()


def encode(x: torch.Tensor, config: LynxQuantConfig, kind: str, kernels: Kernels = REFERENCE,
           fast: bool = True, axis: str | None = None) -> SplitKV:
    """Lynx / paper encode over `kernels`. One pass of ranges (minmax) gives the finiteness check, the automatic
    axis, the page stage and the chunk stats; a second pass writes the codes. fast=False codes by the threshold
    search (the definition of the code) instead of the arithmetic path. axis: the grouping axis to use instead of
    the config's (encode_rows passes the one its rows chose)."""
    axis, bits = axis or config.axis(kind), config.anchor_bits
    check_width(x.shape[-1], bits)
    S, paper, C = x.shape[2], config.method == "paper", config.chunk_size
    (lo_c, hi_c), (lo_t, hi_t) = kernels.minmax(x, C, channel=True, token=axis != "channel" and not paper)
    check_ranges(lo_c, hi_c)
    if axis == "auto":
        axis = _axis_from_absmax(torch.maximum(lo_c.abs(), hi_c.abs()).amax(2))
    gmin = gscale = None
    if paper:  # page ranges from the chunk ranges (a page is a whole number of chunks)
        B, H, NC, D = lo_c.shape
        per = config.page_size // C
        pad = lambda t: torch.cat([t, t[:, :, -1:].expand(-1, -1, (-NC) % per, -1)], 2).view(B, H, -1, per, D)
        gmin, gscale = page_range(pad(lo_c).amin(3), pad(hi_c).amax(3))
        xn = (x.float() - _page_view(gmin, S, config.page_size)) / _page_view(gscale, S, config.page_size)
        mu, rho = chunk_stats(xn, axis, C, paper)
    else:
        mu, rho = kernels.range_stats(*((lo_t, hi_t) if axis == "token" else (lo_c, hi_c)))
    thr, _, _ = tables(config.method, float(config.alpha), config.anchor, bits)
    anchor, residual = kernels.encode_codes(x, gmin, gscale, mu, rho, thr, axis=axis, page=config.page_size, chunk=C,
                                            sign_magnitude=paper, alpha=float(config.alpha) if fast else None,
                                            anchor_bits=bits)
    meta = {"mu": mu, "sigma": rho}
    if paper:
        meta.update(gamma_min=gmin, gamma_scale=gscale)
    return SplitKV(config, kind, tuple(x.shape), x.dtype, anchor, residual, meta, axis)


def encode_rows(x: torch.Tensor, config: LynxQuantConfig, kind: str, kernels: Kernels = REFERENCE) -> list[SplitKV]:
    """`encode(x[i:i + 1])` for every row of x [N, H, S, D], each row's code exactly its own alone (an "auto" axis
    chosen per row, from the same per-channel absmax `encode` reads): one `encode` per axis the rows choose."""
    axis, N = config.axis(kind), x.shape[0]
    if axis == "auto":
        ch = x.detach().float().abs().amax(2)  # [N, H, D]
        axes = [_axis_from_absmax(ch[i:i + 1]) for i in range(N)]
    else:
        axes = [axis] * N
    out: list = [None] * N
    for a in sorted(set(axes)):
        rows = [i for i in range(N) if axes[i] == a]
        part = x if len(rows) == N else x.index_select(0, torch.tensor(rows, device=x.device))
        s = encode(part, config, kind, kernels, axis=a)
        for j, i in enumerate(rows):
            out[i] = s.row(j)
    return out


def dequantize(split: SplitKV, tier: str, kernels: Kernels = REFERENCE,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Lynx / paper reconstruction of `split` at `tier` over `kernels` (`dequantize_codes`: unpack, look up,
    de-normalise), into `out` when given."""
    cfg = split.config
    _, full, anc = tables(cfg.method, float(cfg.alpha), cfg.anchor, cfg.anchor_bits)
    m = split.meta
    res, lut = (split.residual, full) if tier == "full" else (None, anc)
    return kernels.dequantize_codes(split.anchor, res, m.get("gamma_min"), m.get("gamma_scale"), m["mu"], m["sigma"],
                                    lut, axis=split.axis, page=cfg.page_size, chunk=cfg.chunk_size,
                                    out_dtype=split.dtype, out=out, anchor_bits=cfg.anchor_bits)
