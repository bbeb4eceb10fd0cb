"""Tensors on the wire as a self-describing binary table: KV segments (a SplitKV segment — anchor stream: codes +
metadata —, a residual segment, codes only, or in exact mode a correction segment, its bytes) and the prefill's
logits (FIRST).

Contract: every received tensor's shape and dtype is checked against what the negotiated codec declares for the
segment's geometry (`quant.stream_shapes`: no encode, no torch op) or the KV handshake declares for the logits,
before it is stored, so a peer cannot make the decoder read out of bounds; a coded stream is bounded by its codec's
`max_nbytes`. `segment_bound` / `stream_bound` size a data plane's receive memory by the same shapes."""
from __future__ import annotations

import functools
import struct

import torch

from ..arch import window_positions
from ..config import LynxQuantConfig
from ..errors import ConfigError
from ..quant import SplitKV, StreamShapes, codec, stream_shapes
from ..quant.exact import check_correction as framing
from ..quant.shapes import SENT_AXES
from .wire import WireError, segment_counts

SUB = struct.Struct("<HBBII")  # layer, kind (0 key, 1 value), axis (0 channel, 1 token, 2 none), start, count
TENS = struct.Struct("<BB")    # dtype code, ndim
DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32]
AXES = ["channel", "token", ""]
KINDS = ["key", "value"]
MAX_TENSORS, MAX_NDIM, MAX_NAME = 8, 6, 32
BUNDLE, LEN = struct.Struct("<H"), struct.Struct("<I")  # a bundle's segment count; each segment's length


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
        raw = (torch.frombuffer(bytearray(mv[pos:pos + nbytes]), dtype=torch.uint8) if nbytes
               else torch.empty(0, dtype=torch.uint8))
        tensors[name] = raw.view(dt).reshape(shape)
        pos += nbytes
    if pos != len(mv):
        raise WireError(f"{len(mv) - pos} trailing bytes after the tensor table")
    return tensors


PARTS = ("anchor", "residual", "correction")  # a segment's part each stream carries


def pack_segment(layer: int, kind: str, start: int, split: SplitKV, part: str) -> bytes:
    """One part of a segment as a SEGMENT payload: "anchor" (codes + metadata), "residual" (codes) or
    "correction" (exact mode's bytes)."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    tensors = {"codes": split.anchor, **split.meta} if part == "anchor" else {"codes": getattr(split, part)}
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


def pack_bundle(payloads: list) -> bytes:
    """Several SEGMENT payloads as one frame's: their count, then each one's length and bytes."""
    parts = [BUNDLE.pack(len(payloads))]
    for p in payloads:
        parts += [LEN.pack(len(p)), p]
    return b"".join(parts)


def unpack_bundle(payload, max_count: int, max_each: int) -> list[memoryview]:
    """A bundle → its segment payloads (views into it), after checking the count (1..max_count), each length
    (1..max_each) and that they fill the payload exactly; WireError on anything else."""
    mv = memoryview(payload)
    if len(mv) < BUNDLE.size:
        raise WireError("bundle payload too short")
    (n,), pos, out = BUNDLE.unpack_from(mv, 0), BUNDLE.size, []
    if not 1 <= n <= max_count:
        raise WireError(f"a bundle of {n} segments (1 to {max_count})")
    for _ in range(n):
        if pos + LEN.size > len(mv):
            raise WireError(f"bundle truncated after {len(out)} of its {n} segments")
        (ln,) = LEN.unpack_from(mv, pos)
        pos += LEN.size
        if not 1 <= ln <= max_each or pos + ln > len(mv):
            raise WireError(f"a bundled segment of {ln} bytes ({len(mv) - pos} left, at most {max_each})")
        out.append(mv[pos:pos + ln])
        pos += ln
    if pos != len(mv):
        raise WireError(f"{len(mv) - pos} trailing bytes after a bundle of {n} segments")
    return out


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
def _expected(config: LynxQuantConfig, kind: str, axis: str, shape: tuple, dtype: torch.dtype) -> StreamShapes:
    """What the codec produces for this segment (`quant.stream_shapes`): a split codec's on the declared `axis`
    (ValueError for an axis it never sends), the others' on their own."""
    return stream_shapes(config, kind, shape, dtype, axis=axis if codec(config).split else None)


def layer_counts(geometry: dict, prompt_len: int, start: int = 0) -> list[list[int]]:
    """Per layer, the token counts of the SEGMENT frames that carry its K (and as many its V): of the positions the
    layer's window keeps (`kv_geometry`'s windows), those from `start` on (what the decode side holds is not
    shipped), cut as the prefill side cuts them."""
    return [segment_counts(min(window_positions(prompt_len, w), prompt_len - start)) for w in geometry["windows"]]


def segment_bound(config: LynxQuantConfig, kind: str, shape: tuple, dtype: torch.dtype) -> int:
    """The most bytes the SEGMENT payloads of one segment of this shape take together (anchor, residual and, exact
    mode, correction), on any axis the codec sends (a coded stream: its bound)."""
    table = lambda specs: 1 + sum(2 + len(n) + TENS.size + 4 * len(m.shape or (m.nbytes,)) + m.nbytes
                                  for n, m in specs.items())
    if config.anchor_bits == "auto":
        raise ConfigError("segment_bound: anchor_bits 'auto' has no shapes until it is resolved (lynx_hf.width)")
    best = 0
    for axis in AXES:
        try:
            s = _expected(config, kind, axis, shape, dtype)
        except ValueError:  # an axis this codec never sends
            continue
        n = SUB.size + table({"codes": s.anchor, **s.meta}) + sum(SUB.size + table({"codes": t})
                                                                  for t in (s.residual, s.correction) if t)
        best = max(best, n)
    return best


def stream_bound(config: LynxQuantConfig, geometry: dict, prompt_len: int, dtype: torch.dtype, start: int = 0) -> int:
    """The most bytes every SEGMENT payload of a request takes: what a data plane's receive memory must hold."""
    B, H, D = geometry["batch"], geometry["kv_heads"], geometry["head_dim"]
    return sum(segment_bound(config, kind, (B, H, c, D), dtype)
               for counts in layer_counts(geometry, prompt_len, start) for c in counts for kind in KINDS)


def warm(config: LynxQuantConfig, geometry: dict, prompt_len: int, dtype: torch.dtype, start: int = 0) -> None:
    """Work out, on the calling thread, the codec shapes every SEGMENT frame of a `prompt_len`-token prompt will be
    checked against (`kv_geometry`'s windows, kv heads, head dim), so that the receiving thread only looks them up.
    (The shapes come from `quant.stream_shapes`, which runs no torch op: the receiving thread must run none — a
    parallel op there would start a second OpenMP pool, which makes every parallel region of the decoding thread
    sleep and wake; measured: an 8-node draft step 136 → 108 ms.) Unusual segment sizes still work, computed there."""
    B, H, D = geometry["batch"], geometry["kv_heads"], geometry["head_dim"]
    counts = {c for layer in layer_counts(geometry, prompt_len, start) for c in layer}
    for kind in KINDS:
        for c in sorted(counts):
            for axis in AXES:
                try:
                    _expected(config, kind, axis, (B, H, c, D), dtype)
                except ValueError:  # an axis this codec never sends
                    pass


def _signatures(tensors) -> dict:
    return {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}


def to_split(tensors, config: LynxQuantConfig, kind: str, axis: str, shape: tuple, dtype: torch.dtype) -> SplitKV:
    """An anchor segment's tensors → SplitKV (residual None), after checking every shape and dtype."""
    if codec(config).split and axis not in SENT_AXES:
        raise WireError(f"segment axis {axis!r} is not valid for method {config.method!r}")
    want = _expected(config, kind, axis, shape, dtype)
    got, codes = _signatures(tensors), tensors.get("codes")
    anc = want.anchor.signature
    if want.coded and codes is not None and codes.dim() == 1 and codes.dtype == torch.uint8:
        if codes.numel() > want.anchor.nbytes:
            raise WireError(f"a coded segment of {codes.numel()} bytes exceeds the bound {want.anchor.nbytes} for "
                            f"{shape}")
        anc = got["codes"]
    meta = {k: m.signature for k, m in want.meta.items()}
    if got.get("codes") != anc or {k: v for k, v in got.items() if k != "codes"} != meta:
        raise WireError(f"anchor segment tensors {got} do not match the codec's {anc}, {meta}")
    return SplitKV(config, kind, shape, dtype, tensors["codes"], None,
                   {k: v for k, v in tensors.items() if k != "codes"}, axis)


def check_residual(tensors, config, kind, axis, shape, dtype) -> torch.Tensor:
    """A residual segment's codes, after checking them against the codec's (a residual's codes do not depend on the
    grouping axis: a split codec's are checked on its first axis whatever the frame declares)."""
    s = _expected(config, kind, axis if axis in SENT_AXES else SENT_AXES[0], shape, dtype)
    res = None if s.residual is None else s.residual.signature
    got = _signatures(tensors)
    if res is None or got != {"codes": res}:
        raise WireError(f"residual segment tensors {got} do not match the codec's {res}")
    return tensors["codes"]


def check_correction(tensors, config, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A correction segment's bytes (exact mode), after checking its table and framing against the bound."""
    codes = tensors.get("codes")
    if not config.exact or set(tensors) != {"codes"} or codes.dim() != 1 or codes.dtype != torch.uint8:
        raise WireError(f"correction segment tensors {_signatures(tensors)} for codec {config.to_dict()}")
    try:
        framing(codes, shape, dtype)
    except ValueError as e:
        raise WireError(str(e)) from None
    return codes
