"""Tensors on the wire as a self-describing binary table: KV segments (a SplitKV segment — anchor stream: codes +
metadata — or a residual segment, codes only) and the prefill's logits (FIRST). Shapes are checked against what
the negotiated codec (or the KV handshake) declares, so a peer cannot make the decoder read out of bounds."""
from __future__ import annotations

import functools
import math
import struct

import torch

from ..arch import held_positions
from ..config import LynxQuantConfig
from ..quant import SplitKV, codec, encode
from .wire import WireError, segment_counts

SUB = struct.Struct("<HBBII")  # layer, kind (0 key, 1 value), axis (0 channel, 1 token, 2 none), start, count
TENS = struct.Struct("<BB")    # dtype code, ndim
DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32]
AXES = ["channel", "token", ""]
KINDS = ["key", "value"]
MAX_TENSORS, MAX_NDIM, MAX_NAME = 8, 6, 32


def pack_tensors(tensors: dict) -> bytes:
    """{name: tensor} → the self-describing table: count, then per tensor name, dtype code, rank, dims, raw bytes."""
    out = [bytes([len(tensors)])]
    for name, t in tensors.items():
        nb = name.encode()
        t = t.detach().contiguous().cpu()
        out += [bytes([len(nb)]), nb, TENS.pack(DTYPES.index(t.dtype), t.dim()), struct.pack(f"<{t.dim()}I", *t.shape),
                t.view(torch.uint8).numpy().tobytes() if t.numel() else b""]
    return b"".join(out)


def unpack_tensors(mv: memoryview, pos: int = 0) -> dict:
    """The table at mv[pos:] (which it must fill exactly) → {name: tensor}; WireError on anything malformed."""
    if pos >= len(mv):
        raise WireError("tensor table missing")
    n = mv[pos]
    pos += 1
    if n > MAX_TENSORS:
        raise WireError(f"{n} tensors in a table (at most {MAX_TENSORS})")
    tensors = {}
    for _ in range(n):
        if pos >= len(mv):
            raise WireError("truncated tensor table")
        ln = mv[pos]
        pos += 1
        if ln > MAX_NAME or pos + ln + TENS.size > len(mv):
            raise WireError("bad tensor name")
        name = bytes(mv[pos:pos + ln]).decode("ascii", errors="strict") if ln else ""
        pos += ln
        code, ndim = TENS.unpack_from(mv, pos)
        pos += TENS.size
        if code >= len(DTYPES) or ndim > MAX_NDIM or pos + 4 * ndim > len(mv):
            raise WireError(f"bad dtype code {code} or rank {ndim} for tensor {name!r}")
        shape = struct.unpack_from(f"<{ndim}I", mv, pos)
        pos += 4 * ndim
        dt = DTYPES[code]
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty(0, dtype=dt).element_size()
        if pos + nbytes > len(mv):  # bounded by the payload actually received, before allocating
            raise WireError(f"tensor {name!r} declares {nbytes} bytes, only {len(mv) - pos} left")
        raw = torch.frombuffer(bytearray(mv[pos:pos + nbytes]), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        tensors[name] = raw.view(dt).reshape(shape)
        pos += nbytes
    if pos != len(mv):
        raise WireError(f"{len(mv) - pos} trailing bytes after the tensor table")
    return tensors


def pack_segment(layer: int, kind: str, start: int, split: SplitKV, residual: bool) -> bytes:
    tensors = {"codes": split.residual} if residual else {"codes": split.anchor, **split.meta}
    return SUB.pack(layer, KINDS.index(kind), AXES.index(split.axis), start, split.shape[2]) + pack_tensors(tensors)


def unpack_segment(payload: bytes):
    """→ (layer, kind, axis, start, count, {name: tensor}); raises WireError on anything malformed."""
    mv = memoryview(payload)
    if len(mv) < SUB.size + 1:
        raise WireError("segment payload too short")
    layer, kind, axis, start, count = SUB.unpack_from(mv, 0)
    if kind > 1 or axis > 2:
        raise WireError(f"bad segment kind {kind} or axis {axis}")
    return layer, KINDS[kind], AXES[axis], start, count, unpack_tensors(mv, SUB.size)


def pack_logits(logits: torch.Tensor) -> bytes:
    """FIRST payload: the prefill's last-position logits [B, V], in the model's dtype (exact)."""
    return pack_tensors({"logits": logits})


def unpack_logits(payload: bytes, batch: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    got = unpack_tensors(memoryview(payload))
    t = got.get("logits")
    if set(got) != {"logits"} or tuple(t.shape) != (batch, vocab) or t.dtype != dtype:
        sig = {k: (tuple(v.shape), v.dtype) for k, v in got.items()}
        raise WireError(f"FIRST carries {sig}, expected logits {(batch, vocab)} {dtype}")
    return t


@functools.lru_cache(maxsize=256)
def _expected(config: LynxQuantConfig, kind: str, axis: str, shape: tuple, dtype: torch.dtype):
    """Shapes/dtypes the codec produces for this segment: (anchor codes, residual codes or None, {meta}, axis). A
    coded stream's anchor is (None, uint8): its length is the data's, bounded by the codec's `max_nbytes`."""
    c = codec(config)
    if c.split and axis in ("channel", "token"):
        config = LynxQuantConfig(**{**config.to_dict(), ("key_axis" if kind == "key" else "value_axis"): axis})
    s = encode(torch.zeros(shape, dtype=dtype), config, kind, reference=True, layer=(0, 1) if c.coded else None)
    sig = lambda t: (tuple(t.shape), t.dtype)
    anchor = (None, torch.uint8) if c.coded else sig(s.anchor)
    return anchor, None if s.residual is None else sig(s.residual), {k: sig(v) for k, v in s.meta.items()}, s.axis


def layer_counts(geometry: dict, prompt_len: int, start: int = 0) -> list[list[int]]:
    """Per layer, the token counts of the SEGMENT frames that carry its K (and as many its V): positions [start, P)
    of what the layer holds (`kv_geometry`'s windows), cut as the prefill side cuts them."""
    return [segment_counts(min(held_positions(prompt_len, w), prompt_len - start)) for w in geometry["windows"]]


def segment_bound(config: LynxQuantConfig, kind: str, shape: tuple, dtype: torch.dtype) -> int:
    """The most bytes an anchor and a residual SEGMENT payload of this shape take together, on any axis the codec
    sends (a coded stream: the codec's `max_nbytes`)."""
    table = lambda sigs: 1 + sum(2 + len(n) + TENS.size + 4 * len(shp) + math.prod(shp) * dt.itemsize
                                 for n, (shp, dt) in sigs.items())
    best = 0
    for axis in AXES:
        try:
            anc, res, meta, _ = _expected(config, kind, axis, shape, dtype)
        except (ValueError, RuntimeError):  # an axis this codec never sends
            continue
        if anc[0] is None:
            anc = ((codec(config).max_nbytes(shape),), torch.uint8)
        n = SUB.size + table({"codes": anc, **meta}) + (SUB.size + table({"codes": res}) if res else 0)
        best = max(best, n)
    return best


def stream_bound(config: LynxQuantConfig, geometry: dict, prompt_len: int, dtype: torch.dtype, start: int = 0) -> int:
    """The most bytes every SEGMENT payload of a request takes: what a data plane's receive memory must hold."""
    B, H, D = geometry["batch"], geometry["kv_heads"], geometry["head_dim"]
    return sum(segment_bound(config, kind, (B, H, c, D), dtype)
               for counts in layer_counts(geometry, prompt_len, start) for c in counts for kind in KINDS)


def warm(config: LynxQuantConfig, geometry: dict, prompt_len: int, dtype: torch.dtype, start: int = 0) -> None:
    """Work out, on the calling thread, the codec shapes every SEGMENT frame of a `prompt_len`-token prompt will be
    checked against (`kv_geometry`'s windows, kv heads, head dim), so that the receiving thread runs no torch op:
    a parallel op there would start a second OpenMP pool, which makes every parallel region of the decoding thread
    sleep and wake (measured: an 8-node draft step 136 → 108 ms). Unusual segment sizes still work, computed there."""
    B, H, D = geometry["batch"], geometry["kv_heads"], geometry["head_dim"]
    counts = {c for layer in layer_counts(geometry, prompt_len, start) for c in layer}
    for kind in KINDS:
        for c in sorted(counts):
            for axis in AXES:
                try:
                    _expected(config, kind, axis, (B, H, c, D), dtype)
                except (ValueError, RuntimeError):  # an axis this codec never sends
                    pass


def to_split(tensors, config: LynxQuantConfig, kind: str, axis: str, shape: tuple, dtype: torch.dtype) -> SplitKV:
    """An anchor segment's tensors → SplitKV (residual None), after checking every shape and dtype."""
    anc, _, meta, want_axis = _expected(config, kind, axis, shape, dtype)
    if codec(config).split and axis != want_axis:
        raise WireError(f"segment axis {axis!r} is not valid for method {config.method!r}")
    got = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    codes = tensors.get("codes")
    if anc[0] is None and codes is not None and codes.dim() == 1 and codes.dtype == torch.uint8:
        bound = codec(config).max_nbytes(shape)
        if codes.numel() > bound:
            raise WireError(f"a coded segment of {codes.numel()} bytes exceeds the bound {bound} for {shape}")
        anc = got["codes"]
    if got.get("codes") != anc or {k: v for k, v in got.items() if k != "codes"} != meta:
        raise WireError(f"anchor segment tensors {got} do not match the codec's {anc}, {meta}")
    return SplitKV(config, kind, shape, dtype, tensors["codes"], None,
                   {k: v for k, v in tensors.items() if k != "codes"}, axis)


def check_residual(tensors, config, kind, axis, shape, dtype) -> torch.Tensor:
    _, res, _, _ = _expected(config, kind, axis, shape, dtype)
    got = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    if res is None or got != {"codes": res}:
        raise WireError(f"residual segment tensors {got} do not match the codec's {res}")
    return tensors["codes"]
