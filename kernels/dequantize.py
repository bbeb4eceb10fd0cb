"""dequantize_codes_triton: packed anchor (+ residual) nibbles → x̂, one program per (b·h, block of tokens)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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


def dequantize_codes_triton(anchor, residual, gmin, gscale, mu, rho, lut, *, axis: str, page: int, chunk: int,
                            out_dtype: torch.dtype, out: torch.Tensor | None = None):
    """Same contract as lynx_hf.quant.lynx.dequantize_codes (a given `out` receives a copy of the result)."""
    if out is not None:
        return out.copy_(dequantize_codes_triton(anchor, residual, gmin, gscale, mu, rho, lut, axis=axis, page=page,
                                                 chunk=chunk, out_dtype=out_dtype))
    B, H, S, HD = anchor.shape
    D = 2 * HD
    out = torch.empty(B, H, S, D, dtype=out_dtype, device=anchor.device)
    has_page, has_res = gmin is not None, residual is not None
    NP = gmin.shape[2] if has_page else 1
    NC = 1 if axis == "token" else mu.shape[2]
    BLOCK_S = 32
    grid = (B * H, triton.cdiv(S, BLOCK_S))
    _dequantize_kernel[grid](anchor.contiguous(), residual.contiguous() if has_res else anchor,
                         gmin.contiguous() if has_page else mu, gscale.contiguous() if has_page else mu,
                         mu.contiguous(), rho.contiguous(), lut.to(anchor.device).contiguous(), out, S, D, NP, NC,
                         PAGE=page, CHUNK=chunk, HAS_PAGE=has_page, TOKEN_AXIS=axis == "token", HAS_RES=has_res,
                         STAT_UNIT=1.0 / 255 if mu.dtype == torch.uint8 else 1.0,
                         BLOCK_S=BLOCK_S, HALF_D=triton.next_power_of_2(HD))
    return out
