"""Nibble packing: two 4-bit codes a byte along the last dimension (even index in the low nibble). Lossless."""
import torch


def split_codes(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes c → (anchor a = c >> 4, residual r = c & 15); c == 16·a + r exactly."""
    return codes >> 4, codes & 15


def join_codes(anchor: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return (anchor << 4) | residual


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
