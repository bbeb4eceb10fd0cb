"""Bit packing along the last dimension, lossless. `pack_bits(codes, b)`: groups of g = 8 / gcd(8, b) consecutive
codes become g·b/8 bytes, code i of a group in bits [b·i, b·i + b) of the group's little-endian word — so 4-bit
codes are nibbles (even index in the low nibble: `pack4`) and 2-bit codes four a byte (`pack2`).
`split_codes(c, b)`: an 8-bit code c → (anchor: its top b bits, residual: the other 8 − b),
c == (anchor << (8 − b)) | residual exactly."""
import math

import torch

WIDTHS = (2, 3, 4)  # anchor widths a split 8-bit code takes (the residual: 8 − b bits)


def group(bits: int) -> int:
    """Codes a packed group holds: the fewest whose bits fill whole bytes."""
    return 8 // math.gcd(8, bits)


def packed_len(D: int, bits: int) -> int:
    """Bytes of D packed `bits`-bit codes (D a multiple of `group(bits)`)."""
    return D * bits // 8


def check_width(D: int, bits: int, what: str = "head_dim") -> None:
    """A ValueError unless D codes of `bits` bits pack into whole groups."""
    g = group(bits)
    if D % g:
        raise ValueError(f"encode: {what} must be {'even' if g == 2 else f'a multiple of {g}'} to pack {bits}-bit "
                         f"codes, got {D}")


def split_codes(codes: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes c → (anchor a = c >> (8 − bits), residual r = c & (2^(8 − bits) − 1))."""
    low = 8 - bits
    return codes >> low, codes & ((1 << low) - 1)


def join_codes(anchor: torch.Tensor, residual: torch.Tensor, bits: int = 4) -> torch.Tensor:
    return (anchor << (8 - bits)) | residual


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [..., D] uint8 in [0, 2^bits), D a multiple of group(bits) → [..., D·bits/8] uint8."""
    check_width(codes.shape[-1], bits, "the last dimension")
    if bits in (2, 4, 8):  # the same layout, by the shorter routes
        return pack4(codes) if bits == 4 else pack2(codes) if bits == 2 else codes
    g = group(bits)
    c = codes.unflatten(-1, (-1, g)).long()                                     # [..., D/g, g]
    word = (c << (torch.arange(g, device=c.device) * bits)).sum(-1, keepdim=True)  # [..., D/g, 1] (< 2^(g·bits))
    out = (word >> (torch.arange(g * bits // 8, device=c.device) * 8)) & 255      # [..., D/g, g·bits/8]
    return out.to(torch.uint8).flatten(-2)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D·bits/8] uint8 → [..., D] uint8 in [0, 2^bits)."""
    if bits in (2, 4, 8):
        return unpack4(packed) if bits == 4 else unpack2(packed) if bits == 2 else packed
    g = group(bits)
    nb = g * bits // 8
    if packed.shape[-1] % nb:
        raise ValueError(f"unpack_bits: {packed.shape[-1]} bytes are not whole groups of {nb} ({bits}-bit codes)")
    p = packed.unflatten(-1, (-1, nb)).long()                                     # [..., D/g, nb]
    word = (p << (torch.arange(nb, device=p.device) * 8)).sum(-1, keepdim=True)
    out = (word >> (torch.arange(g, device=p.device) * bits)) & ((1 << bits) - 1)  # [..., D/g, g]
    return out.to(torch.uint8).flatten(-2)


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """codes: [..., D] uint8 in [0, 15], D even → [..., D/2] uint8."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack4 needs an even last dimension, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """[..., D/2] uint8 → [..., D] uint8 in [0, 15]."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def pack2(codes: torch.Tensor) -> torch.Tensor:
    """codes: [..., D] uint8 in [0, 3], D % 4 == 0 → [..., D/4] uint8."""
    if codes.shape[-1] % 4:
        raise ValueError(f"pack2 needs a last dimension divisible by 4, got {codes.shape[-1]}")
    c = codes.unflatten(-1, (-1, 4))
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def unpack2(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=-1).flatten(-2)
