"""dequantize_codes_triton: packed anchor (+ residual) codes → x̂, one program per (b·h, block of tokens). A 4-bit
anchor reads nibbles (`_dequantize_kernel`); a 2- or 3-bit one groups of 8 channels as little-endian words
(`_dequantize_groups_kernel`, quant/pack.py's layout)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_value(code, lut_ptr, gmin_ptr, gscale_ptr, mu_ptr, rho_ptr, out_ptr, bh, s, d, mask, S, D, NP, NC,
                 PAGE: tl.constexpr, CHUNK: tl.constexpr, HAS_PAGE: tl.constexpr, TOKEN_AXIS: tl.constexpr,
                 STAT_UNIT: tl.constexpr):
    # out[bh, s, d] = γ_min + γ_scale·(μ + σ·LUT[code]) (s, d: broadcastable index blocks, code their codes)
    u = tl.load(lut_ptr + code, mask=mask, other=0.0)
    if TOKEN_AXIS:
        cidx = bh * S + s + 0 * d
    else:
        cidx = (bh * NC + s // CHUNK) * D + d
    mu = tl.load(mu_ptr + cidx, mask=mask, other=0).to(tl.float32) * STAT_UNIT
    rho = tl.load(rho_ptr + cidx, mask=mask, other=0).to(tl.float32) * STAT_UNIT
    xn = mu + rho * u
    if HAS_PAGE:
        pidx = (bh * NP + s // PAGE) * D + d
        xn = tl.load(gmin_ptr + pidx, mask=mask, other=0.0).to(tl.float32) + \
            tl.load(gscale_ptr + pidx, mask=mask, other=0.0).to(tl.float32) * xn
    tl.store(out_ptr + (bh * S + s) * D + d, xn.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(a_ptr, r_ptr, gmin_ptr, gscale_ptr, mu_ptr, rho_ptr, lut_ptr, out_ptr,
                       S, D, NP, NC,
                       PAGE: tl.constexpr, CHUNK: tl.constexpr, HAS_PAGE: tl.constexpr, TOKEN_AXIS: tl.constexpr,
                       HAS_RES: tl.constexpr, STAT_UNIT: tl.constexpr,
                       BLOCK_S: tl.constexpr, HALF_D: tl.constexpr):
    bh = tl.program_id(0)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)[:, None]
    j = tl.arange(0, HALF_D)[None, :]
    mask = (s < S) & (j < D // 2)
    packed = (bh * S + s) * (D // 2) + j
    a = tl.load(a_ptr + packed, mask=mask, other=0).to(tl.int32)
    if HAS_RES:
        r = tl.load(r_ptr + packed, mask=mask, other=0).to(tl.int32)
    for half in tl.static_range(2):
        d = 2 * j + half
        code = (a >> (4 * half)) & 15
        if HAS_RES:
            code = (code << 4) | ((r >> (4 * half)) & 15)
        _store_value(code, lut_ptr, gmin_ptr, gscale_ptr, mu_ptr, rho_ptr, out_ptr, bh, s, d, mask, S, D, NP, NC,
                     PAGE, CHUNK, HAS_PAGE, TOKEN_AXIS, STAT_UNIT)


@triton.jit
def _load_packed(ptr, row, ok, g, BITS: tl.constexpr, NBYTES):
    # BITS bytes per group of 8 channels → [BLOCK_S, NG, 8] codes (row, ok: [BLOCK_S, 1]; g: [1, NG])
    word = tl.zeros(g.shape, dtype=tl.int64) + tl.zeros(row.shape, dtype=tl.int64)
    for k in tl.static_range(BITS):
        byte = g * BITS + k
        word |= tl.load(ptr + row * NBYTES + byte, mask=ok & (byte < NBYTES), other=0).to(tl.int64) << (8 * k)
    i = tl.arange(0, 8)[None, None, :]
    return ((word[:, :, None] >> (BITS * i).to(tl.int64)) & ((1 << BITS) - 1)).to(tl.int32)


@triton.jit
def _dequantize_groups_kernel(a_ptr, r_ptr, gmin_ptr, gscale_ptr, mu_ptr, rho_ptr, lut_ptr, out_ptr,
                              S, D, NP, NC,
                              PAGE: tl.constexpr, CHUNK: tl.constexpr, HAS_PAGE: tl.constexpr,
                              TOKEN_AXIS: tl.constexpr, HAS_RES: tl.constexpr, STAT_UNIT: tl.constexpr,
                              ABITS: tl.constexpr, BLOCK_S: tl.constexpr, NG: tl.constexpr):
    bh = tl.program_id(0)
    s2 = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)[:, None]  # [BLOCK_S, 1]
    gs = tl.arange(0, NG)[None, :]
    code = _load_packed(a_ptr, bh * S + s2, s2 < S, gs, ABITS, D * ABITS // 8)
    if HAS_RES:
        code = (code << (8 - ABITS)) | _load_packed(r_ptr, bh * S + s2, s2 < S, gs, 8 - ABITS, D * (8 - ABITS) // 8)
    s = s2[:, :, None]                                                   # [BLOCK_S, 1, 1]
    d = 8 * gs[:, :, None] + tl.arange(0, 8)[None, None, :]             # [1, NG, 8]
    mask = (s < S) & (d < D)
    _store_value(code, lut_ptr, gmin_ptr, gscale_ptr, mu_ptr, rho_ptr, out_ptr, bh, s, d, mask, S, D, NP, NC,
                 PAGE, CHUNK, HAS_PAGE, TOKEN_AXIS, STAT_UNIT)


def dequantize_codes_triton(anchor, residual, gmin, gscale, mu, rho, lut, *, axis: str, page: int, chunk: int,
                            out_dtype: torch.dtype, out: torch.Tensor | None = None, anchor_bits: int = 4):
    """Same contract as lynx_hf.quant.lynx.dequantize_codes (a given `out` receives a copy of the result)."""
    if out is not None:
        return out.copy_(dequantize_codes_triton(anchor, residual, gmin, gscale, mu, rho, lut, axis=axis, page=page,
                                                 chunk=chunk, out_dtype=out_dtype, anchor_bits=anchor_bits))
    B, H, S, HD = anchor.shape
    D = 8 * HD // anchor_bits
    out = torch.empty(B, H, S, D, dtype=out_dtype, device=anchor.device)
    has_page, has_res = gmin is not None, residual is not None
    NP = gmin.shape[2] if has_page else 1
    NC = 1 if axis == "token" else mu.shape[2]
    BLOCK_S = 32 if anchor_bits == 4 else 16  # the group kernels' int64 words: fewer rows, no spills
    grid = (B * H, triton.cdiv(S, BLOCK_S))
    args = (anchor.contiguous(), residual.contiguous() if has_res else anchor,
            gmin.contiguous() if has_page else mu, gscale.contiguous() if has_page else mu,
            mu.contiguous(), rho.contiguous(), lut.to(anchor.device).contiguous(), out, S, D, NP, NC)
    common = dict(PAGE=page, CHUNK=chunk, HAS_PAGE=has_page, TOKEN_AXIS=axis == "token", HAS_RES=has_res,
                  STAT_UNIT=1.0 / 255 if mu.dtype == torch.uint8 else 1.0, BLOCK_S=BLOCK_S)
    if anchor_bits == 4:
        _dequantize_kernel[grid](*args, **common, HALF_D=triton.next_power_of_2(HD))
    else:
        _dequantize_groups_kernel[grid](*args, **common, ABITS=anchor_bits, NG=triton.next_power_of_2(-(-D // 8)))
    return out
