"""encode_codes_triton: x → packed anchor / residual codes, one program per (b·h, block of tokens). A 4-bit anchor
packs nibbles (`_encode_kernel`); a 2- or 3-bit one packs groups of 8 channels into little-endian words
(`_encode_groups_kernel`, quant/pack.py's layout)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _code(u, thr_ptr, NSTEPS: tl.constexpr):
    # number of sorted thresholds ≤ u, by binary search over a table padded with +inf to 2**NSTEPS entries
    code = tl.zeros(u.shape, dtype=tl.int32)
    step = 1 << (NSTEPS - 1)
    for _ in tl.static_range(NSTEPS):
        cand = code + step
        t = tl.load(thr_ptr + cand - 1)
        code = tl.where(t <= u, cand, code)
        step = step // 2
    return code


@triton.jit
def _code_at(x_ptr, gmin_ptr, gscale_ptr, mu_ptr, rho_ptr, thr_ptr, bh, s, d, mask, S, D, NP, NC,
             PAGE: tl.constexpr, CHUNK: tl.constexpr, HAS_PAGE: tl.constexpr, TOKEN_AXIS: tl.constexpr,
             SIGN_MAG: tl.constexpr, STAT_UNIT: tl.constexpr):
    # the 8-bit code of x[bh, s, d] (s, d: broadcastable index blocks): u = ((x − γ_min)/γ_scale − μ)/σ, counted
    xn = tl.load(x_ptr + (bh * S + s) * D + d, mask=mask, other=0.0).to(tl.float32)
    if HAS_PAGE:
        pidx = (bh * NP + s // PAGE) * D + d
        xn = (xn - tl.load(gmin_ptr + pidx, mask=mask, other=0.0).to(tl.float32)) / \
            tl.load(gscale_ptr + pidx, mask=mask, other=1.0).to(tl.float32)
    if TOKEN_AXIS:
        cidx = bh * S + s + 0 * d
    else:
        cidx = (bh * NC + s // CHUNK) * D + d
    mu = tl.load(mu_ptr + cidx, mask=mask, other=0).to(tl.float32) * STAT_UNIT
    rho = tl.load(rho_ptr + cidx, mask=mask, other=1).to(tl.float32) * STAT_UNIT
    u = (xn - mu) / rho
    if SIGN_MAG:
        return _code(tl.abs(u), thr_ptr, 7) + tl.where(u < 0, 128, 0)
    return _code(u, thr_ptr, 8)


@triton.jit
def _encode_kernel(x_ptr, gmin_ptr, gscale_ptr, mu_ptr, rho_ptr, thr_ptr, a_ptr, r_ptr,
                   S, D, NP, NC,
                   PAGE: tl.constexpr, CHUNK: tl.constexpr, HAS_PAGE: tl.constexpr, TOKEN_AXIS: tl.constexpr,
                   SIGN_MAG: tl.constexpr, STAT_UNIT: tl.constexpr,
                   BLOCK_S: tl.constexpr, HALF_D: tl.constexpr):
    bh = tl.program_id(0)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)[:, None]  # [BLOCK_S, 1]
    j = tl.arange(0, HALF_D)[None, :]                                  # [1, HALF_D]
    mask = (s < S) & (j < D // 2)
    for half in tl.static_range(2):
        d = 2 * j + half
        code = _code_at(x_ptr, gmin_ptr, gscale_ptr, mu_ptr, rho_ptr, thr_ptr, bh, s, d, mask, S, D, NP, NC,
                        PAGE, CHUNK, HAS_PAGE, TOKEN_AXIS, SIGN_MAG, STAT_UNIT)
        if half == 0:
            a_lo, r_lo = code >> 4, code & 15
        else:
            a_hi, r_hi = code >> 4, code & 15
    out = (bh * S + s) * (D // 2) + j
    tl.store(a_ptr + out, (a_lo | (a_hi << 4)).to(tl.uint8), mask=mask)
    tl.store(r_ptr + out, (r_lo | (r_hi << 4)).to(tl.uint8), mask=mask)


@triton.jit
def _store_packed(ptr, row, ok, g, v, BITS: tl.constexpr, NBYTES):
    # v: [BLOCK_S, NG, 8] codes of BITS bits (channel 8·g + i) → BITS bytes per group of 8, little-endian;
    # row, ok: [BLOCK_S, 1] the rows and which exist; g: [1, NG]
    i = tl.arange(0, 8)[None, None, :]
    word = tl.sum(v.to(tl.int64) << (BITS * i).to(tl.int64), axis=2)  # [BLOCK_S, NG]
    for k in tl.static_range(BITS):
        byte = g * BITS + k
        tl.store(ptr + row * NBYTES + byte, ((word >> (8 * k)) & 255).to(tl.uint8), mask=ok & (byte < NBYTES))


@triton.jit
def _encode_groups_kernel(x_ptr, gmin_ptr, gscale_ptr, mu_ptr, rho_ptr, thr_ptr, a_ptr, r_ptr,
                          S, D, NP, NC,
                          PAGE: tl.constexpr, CHUNK: tl.constexpr, HAS_PAGE: tl.constexpr, TOKEN_AXIS: tl.constexpr,
                          SIGN_MAG: tl.constexpr, STAT_UNIT: tl.constexpr, ABITS: tl.constexpr,
                          BLOCK_S: tl.constexpr, NG: tl.constexpr):
    bh = tl.program_id(0)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)[:, None, None]  # [BLOCK_S, 1, 1]
    g = tl.arange(0, NG)[None, :, None]                                      # [1, NG, 1]: groups of 8 channels
    d = 8 * g + tl.arange(0, 8)[None, None, :]                               # [1, NG, 8]
    mask = (s < S) & (d < D)
    code = _code_at(x_ptr, gmin_ptr, gscale_ptr, mu_ptr, rho_ptr, thr_ptr, bh, s, d, mask, S, D, NP, NC,
                    PAGE, CHUNK, HAS_PAGE, TOKEN_AXIS, SIGN_MAG, STAT_UNIT)
    code = tl.where(mask, code, 0)
    s2 = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)[:, None]  # [BLOCK_S, 1]
    gs = tl.arange(0, NG)[None, :]
    _store_packed(a_ptr, bh * S + s2, s2 < S, gs, code >> (8 - ABITS), ABITS, D * ABITS // 8)
    _store_packed(r_ptr, bh * S + s2, s2 < S, gs, code & ((1 << (8 - ABITS)) - 1), 8 - ABITS, D * (8 - ABITS) // 8)


def encode_codes_triton(x, gmin, gscale, mu, rho, thr, *, axis: str, page: int, chunk: int, sign_magnitude: bool,
                        alpha: float | None = None, anchor_bits: int = 4):
    """Same contract as lynx_hf.quant.lynx.encode_codes (alpha is accepted and unused: the kernel's 8-step
    threshold search is cheap on a GPU). x: [B, H, S, D] → (anchor [B, H, S, D·b/8], residual [B, H, S,
    D·(8−b)/8]), b = anchor_bits."""
    from .contract import check_width

    B, H, S, D = x.shape
    check_width(D, anchor_bits)
    x = x.contiguous()
    n = 128 if sign_magnitude else 256
    table = torch.full((n,), float("inf"), dtype=torch.float32, device=x.device)
    table[: thr.numel()] = thr.to(x.device)
    anchor = torch.empty(B, H, S, D * anchor_bits // 8, dtype=torch.uint8, device=x.device)
    residual = torch.empty(B, H, S, D * (8 - anchor_bits) // 8, dtype=torch.uint8, device=x.device)
    has_page = gmin is not None
    dummy = mu  # any tensor: never read when HAS_PAGE is false
    NP = gmin.shape[2] if has_page else 1
    NC = 1 if axis == "token" else mu.shape[2]
    BLOCK_S = 32 if anchor_bits == 4 else 16  # the group kernels' int64 words: fewer rows, no spills
    grid = (B * H, triton.cdiv(S, BLOCK_S))
    common = dict(PAGE=page, CHUNK=chunk, HAS_PAGE=has_page, TOKEN_AXIS=axis == "token", SIGN_MAG=sign_magnitude,
                  STAT_UNIT=1.0 / 255 if mu.dtype == torch.uint8 else 1.0, BLOCK_S=BLOCK_S)
    args = (x, gmin.contiguous() if has_page else dummy, gscale.contiguous() if has_page else dummy,
            mu.contiguous(), rho.contiguous(), table, anchor, residual, S, D, NP, NC)
    if anchor_bits == 4:
        _encode_kernel[grid](*args, **common, HALF_D=triton.next_power_of_2(D // 2))
    else:
        _encode_groups_kernel[grid](*args, **common, ABITS=anchor_bits, NG=triton.next_power_of_2(-(-D // 8)))
    return anchor, residual
