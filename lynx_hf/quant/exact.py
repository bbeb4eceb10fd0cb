"""Exact mode's third stream: what the full tier lacks to give back the model's KV bit for bit.

Terms. For a float x of the KV dtype, `order(x)` is its bit pattern read as a monotone integer (sign-magnitude
turned into two's complement, with −0 just below +0, so the map is a bijection on finite values). The full tier's
reconstruction x̂ is `dequantize(split, "full")` over the reference kernels (eager torch: the same bits on every
device, which the C and Triton twins are not asked to be). The *correction* is e = order(x) − order(x̂), an integer
per value; x = order⁻¹(order(x̂) + e) exactly.

Packing by need: e is zigzag-mapped (0, −1, 1, −2, … → 0, 1, 2, 3, …) and its values put in the order of x̂'s
exponent (a stable sort of a key both sides compute from x̂: values of one magnitude carry errors of one size),
then cut into blocks of BLOCK values (the last one padded with zeros); a block is stored at the width w (0 to
MAX_WIDTH bits a value) of its largest value. Bytes: the CRC-32 of x's bits (4, little-endian: the decode side
checks its result against it), the blocks' widths (one byte each), then the blocks' values in block order, each
block BLOCK·w/8 bytes, bits little-endian. On the embedded model's bf16 KV it takes ~4.1 bits a
value (docs/codec.md); a bf16 / fp16 correction needs at most 17 bits a value, an fp32 one 33.
The byte count is bounded before anything is unpacked (`max_nbytes`)."""
from __future__ import annotations

import zlib

import numpy as np
import torch


BLOCK = 32
CHUNK = 1 << 14  # blocks packed at a time
HEAD = 4  # the CRC-32 of the values, little-endian, ahead of the widths
MAX_WIDTH = 33  # zigzag of the difference of two 32-bit orders
_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}  # (fp16: the key holds its sign too)


def order(x: torch.Tensor) -> torch.Tensor:
    """Float bits → monotone int64 (−0 → −1, +0 → 0)."""
    if x.dtype not in _INT:
        raise ValueError(f"exact mode takes bf16, fp16 or fp32 KV, got {x.dtype}")
    b = x.contiguous().view(_INT[x.dtype]).long()
    mag = b & ((1 << (8 * x.element_size() - 1)) - 1)
    return torch.where(b < 0, -mag - 1, mag)


def from_order(o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """order's inverse: int64 → floats of `dtype` (values outside the dtype's range refused)."""
    top = 1 << (torch.finfo(dtype).bits - 1)
    if o.numel() and (int(o.min()) < -top or int(o.max()) >= top):
        raise ValueError("correction segment: a corrected value lies outside the KV dtype")
    b = torch.where(o < 0, (-o - 1) | top, o)  # sign bit set for negatives
    b = torch.where(b >= top, b - 2 * top, b)  # into the signed range of the int dtype
    return b.to(_INT[dtype]).view(dtype)


def _zigzag(e: torch.Tensor) -> torch.Tensor:
    return torch.where(e < 0, -2 * e - 1, 2 * e)


def _unzigzag(z: torch.Tensor) -> torch.Tensor:
    return torch.where(z & 1 == 1, -(z >> 1) - 1, z >> 1)


def _permutation(x_hat: torch.Tensor) -> torch.Tensor:
    """The values' order on the wire: by x̂'s exponent field, stably (the same on both sides: x̂ is the same)."""
    bits, m = x_hat.contiguous().view(_INT[x_hat.dtype]).reshape(-1), _MANTISSA[x_hat.dtype]
    exponent = ((bits >> m) & 0xFF).to(torch.uint8)  # (a uint8 key sorts ~6x faster than an int64 one)
    return torch.argsort(exponent, stable=True)


def _pack(z: torch.Tensor, w: int) -> torch.Tensor:
    """z: [n, BLOCK] int64 of at most w bits → uint8 [n · BLOCK · w / 8] (bits little-endian), CHUNK blocks at a
    time (a bit is an int64 on the way: that bounds the temporary memory)."""
    out = []
    for zc in z.split(CHUNK):
        bits = ((zc.unsqueeze(-1) >> torch.arange(w)) & 1).to(torch.uint8).view(len(zc), -1, 8)
        out.append((bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8).reshape(-1))
    return torch.cat(out)


def _unpack(b: torch.Tensor, w: int, n: int) -> torch.Tensor:
    """_pack's inverse → [n, BLOCK] int64."""
    out = []
    for bc in b.view(n, -1).split(CHUNK):
        bits = ((bc.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).view(len(bc), BLOCK, w).long()
        out.append((bits << torch.arange(w)).sum(-1))
    return torch.cat(out)


def _top(dtype: torch.dtype) -> int:
    """The widest block a correction of `dtype` can need."""
    return 17 if torch.finfo(dtype).bits <= 16 else MAX_WIDTH


def max_nbytes(numel: int, dtype: torch.dtype) -> int:
    """The most bytes a correction of `numel` values of `dtype` can take."""
    blocks = -(-numel // BLOCK)
    return HEAD + blocks + blocks * BLOCK * _top(dtype) // 8


def _crc(x: torch.Tensor) -> int:
    return zlib.crc32(x.detach().cpu().contiguous().view(torch.uint8).numpy())


def encode_correction(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """x, x̂: the same shape and float dtype, on any device → the correction's bytes (uint8, 1-D, on the CPU)."""
    if x.shape != x_hat.shape or x.dtype != x_hat.dtype:
        raise ValueError(f"correction of {tuple(x.shape)} {x.dtype} against {tuple(x_hat.shape)} {x_hat.dtype}")
    x, x_hat = x.detach().cpu(), x_hat.detach().cpu()
    z = _zigzag(order(x) - order(x_hat)).reshape(-1)[_permutation(x_hat)]
    z = torch.cat([z, z.new_zeros((-z.numel()) % BLOCK)]).view(-1, BLOCK)  # z: [blocks, BLOCK]
    width = _bit_length(z.amax(1))  # the bits of each block's largest value
    sizes = width * (BLOCK // 8)
    ends = sizes.cumsum(0)
    body = torch.empty(int(ends[-1]) if len(ends) else 0, dtype=torch.uint8)
    for w in width.unique().tolist():  # each width's blocks packed together, then put in block order
        if w:
            sel = (width == w).nonzero().squeeze(1)
            body[((ends[sel] - sizes[sel]).unsqueeze(1) + torch.arange(BLOCK * w // 8)).reshape(-1)] = \
                _pack(z[sel], w)
    head = torch.tensor(list(_crc(x).to_bytes(HEAD, "little")), dtype=torch.uint8)
    return torch.cat([head, width.to(torch.uint8), body])


def _bit_length(v: torch.Tensor) -> torch.Tensor:
    """Bits of non-negative int64 values below 2^MAX_WIDTH (0 for 0), exactly."""
    return (v.unsqueeze(-1) >= (1 << torch.arange(MAX_WIDTH + 1))).sum(-1)


def decode_correction(data: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """Bytes → e in x̂'s shape (int64, on the CPU); check_correction's framing is checked again here."""
    check_correction(data, tuple(x_hat.shape), x_hat.dtype)
    numel = x_hat.numel()
    blocks = -(-numel // BLOCK)
    data = data.cpu()
    width = data[HEAD:HEAD + blocks].long()
    sizes = width * (BLOCK // 8)
    ends = sizes.cumsum(0) + HEAD + blocks
    z = torch.zeros(blocks, BLOCK, dtype=torch.long)
    for w in width.unique().tolist():
        if w:
            sel = (width == w).nonzero().squeeze(1)
            idx = (ends[sel] - sizes[sel]).unsqueeze(1) + torch.arange(BLOCK * w // 8)
            z[sel] = _unpack(data[idx.reshape(-1)], w, len(sel))
    e = torch.empty(numel, dtype=torch.long)
    e[_permutation(x_hat.detach().cpu())] = _unzigzag(z.view(-1)[:numel])
    return e.view(x_hat.shape)


def check_correction(data: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    """A received correction's framing (its widths and its length) before it is stored, with numpy only (a
    receiving thread runs no torch op: see transfer.serde.warm)."""
    numel = 1
    for s in shape:
        numel *= int(s)
    blocks = -(-numel // BLOCK)
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1 \
            or not HEAD + blocks <= data.numel() <= max_nbytes(numel, dtype):
        raise ValueError(f"correction segment: {getattr(data, 'shape', data)} cannot hold {numel} values of {dtype}")
    width = np.asarray(data[HEAD:HEAD + blocks].cpu().numpy()).astype(np.int64)
    if blocks and int(width.max()) > _top(dtype):
        raise ValueError(f"correction segment: a block of width {int(width.max())} bits (at most {_top(dtype)} for "
                         f"{dtype})")
    if HEAD + blocks + int(width.sum()) * BLOCK // 8 != data.numel():
        raise ValueError(f"correction segment: {data.numel()} bytes do not add up to what its widths say")


def correct(x_hat: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """The exact values: x̂ with its correction applied (same shape and dtype as x̂), checked against the CRC-32 of
    the encoder's values — a reconstruction x̂ that differs from the encoder's (another torch build or device that
    rounds otherwise) is refused rather than corrected into other values."""
    e = decode_correction(data, x_hat).to(x_hat.device)
    x = from_order(order(x_hat) + e, x_hat.dtype)
    if _crc(x) != int.from_bytes(bytes(data[:HEAD].cpu().tolist()), "little"):
        raise ValueError("exact mode: the corrected KV does not match the prefill side's checksum — this side's "
                         "8-bit reconstruction differs from the prefill side's (another torch build or device "
                         "rounding otherwise); the KV cannot be made exact here")
    return x
