"""CacheGen (Liu et al., SIGCOMM 2024) as LMCache's `cachegen` serde builds it: a baseline KV codec for transfer.

One layer's K or V, x: [B, H, S, D], is seen as [B, S, C] with C = H·D channels (LMCache merges the heads).
  1. Quantization, per token: symmetric absmax over the token's C channels with `bins` bins,
     q = round(x·M/m) + M ∈ [0, 2M], M = bins/2 − 1, m = max|x| (float32, travels as metadata "scale": [B, S]).
     Early layers get more bins than deep ones (`bins`): LMCache's 7B/8B setting (32 layers) gives keys 32 bins in
     layers 0–9 and 16 after, values 32 bins in layers 0–1 and 16 after; we keep the same fractions of the depth
     (on SmolLM2's 30 layers: keys 32 bins in layers 0–8, values in layers 0–1).
  2. Lossless arithmetic coding of the symbols in chunks of CHUNK tokens (LMCache: 256) that decode independently:
     each chunk carries a probability table per channel (the symbol histogram over the chunk's tokens, as uint8
     frequencies) and codes each channel's symbols with it (a range coder, `constriction`'s queue coder).
     LMCache's implementation does not delta-encode tokens against an anchor token (the paper's §5.2 variant); neither
     does this baseline.

The coded stream is `SplitKV.anchor`, uint8 [N] (no residual; both tiers dequantize alike):
    header  "CG", version, levels L = 2M + 1, chunk size, CRC-32 of everything after the header   (HEAD)
    words   uint32 [n_chunks]: coded words per chunk, chunks ordered (row, chunk)
    tables  uint8 [n_chunks, C, L]: per-channel symbol frequencies (0 = absent)
    codes   uint32 words of every chunk, channel-major within a chunk
Every byte of it (and of "scale") counts in bits/value. A stream that fails any check raises ValueError naming it."""
from __future__ import annotations

import struct
import zlib

import numpy as np
import torch

from .splitkv import SplitKV

CHUNK = 256
HEAD = struct.Struct("<2sBBHI")  # magic, version, levels, chunk, crc32
MAGIC, VERSION = b"CG", 1
DEPTH_7B, KEY_FIRST_7B, VALUE_FIRST_7B = 32, 10, 2  # LMCache's CacheGenConfig for its 7B/8B family
BINS_FIRST, BINS_REST = 32, 16


def bins(kind: str, layer: int, num_layers: int) -> int:
    """Bins of layer `layer` of `num_layers`: LMCache's 7B schedule scaled to the model's depth."""
    if not (0 <= layer < num_layers):
        raise ValueError(f"cachegen: layer {layer} outside a model of {num_layers} layers")
    first = KEY_FIRST_7B if kind == "key" else VALUE_FIRST_7B
    return BINS_FIRST if layer < max(1, round(first * num_layers / DEPTH_7B)) else BINS_REST


def _coder():
    try:
        import constriction
    except ImportError as e:  # a dependency of lynx-hf; absent only in a hand-made environment
        raise ImportError("the CacheGen codec needs the `constriction` package (pip install constriction)") from e
    return constriction


def _tables(q: np.ndarray, levels: int) -> np.ndarray:
    """q: [n, C] symbols → uint8 [C, L] frequencies: round(255·count/n), at least 1 for a symbol that occurs."""
    n, C = q.shape
    counts = np.zeros((C, levels), np.int64)
    np.add.at(counts, (np.broadcast_to(np.arange(C), (n, C)), q), 1)
    return np.where(counts > 0, np.maximum(1, np.rint(counts * 255.0 / n)), 0).astype(np.uint8)


def _code_chunk(cg, q: np.ndarray, table: np.ndarray) -> np.ndarray:
    """One chunk q: [n, C] → its uint32 words (channel c's n symbols with table[c], channel after channel)."""
    enc = cg.stream.queue.RangeEncoder()
    for c in range(q.shape[1]):
        enc.encode(np.ascontiguousarray(q[:, c], dtype=np.int32),
                   cg.stream.model.Categorical(table[c].astype(np.float64), perfect=False))
    return enc.get_compressed()


def symbols_to_stream(q: torch.Tensor, levels: int) -> torch.Tensor:
    """q: uint8 [B, S, C] symbols < levels → the coded stream (uint8 [N])."""
    cg = _coder()
    qn = q.cpu().numpy()
    B, S, C = qn.shape
    words, tables = [], []
    for b in range(B):
        for s0 in range(0, S, CHUNK):
            chunk = qn[b, s0:s0 + CHUNK]
            tables.append(_tables(chunk, levels))
            words.append(_code_chunk(cg, chunk, tables[-1]))
    body = b"".join([np.array([w.size for w in words], "<u4").tobytes(), np.stack(tables).tobytes(),
                     *(w.astype("<u4").tobytes() for w in words)])
    head = HEAD.pack(MAGIC, VERSION, levels, CHUNK, zlib.crc32(body))
    return torch.frombuffer(bytearray(head + body), dtype=torch.uint8)


def _bad(why: str):
    raise ValueError(f"cachegen: corrupted stream ({why})")


def stream_to_symbols(stream: torch.Tensor, B: int, S: int, C: int) -> tuple[torch.Tensor, int]:
    """The coded stream of a [B, S, C] tensor → (uint8 [B, S, C] symbols, levels); ValueError if it is damaged."""
    if stream.dtype != torch.uint8 or stream.dim() != 1:
        _bad(f"expected uint8 [N] bytes, got {stream.dtype} {tuple(stream.shape)}")
    raw = stream.cpu().numpy().tobytes()
    if len(raw) < HEAD.size:
        _bad(f"{len(raw)} bytes, shorter than its header")
    magic, version, levels, chunk, crc = HEAD.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        _bad(f"magic {magic!r} version {version}, expected {MAGIC!r} {VERSION}")
    if levels < 2 or chunk < 1:
        _bad(f"levels {levels}, chunk {chunk}")
    body = memoryview(raw)[HEAD.size:]
    if zlib.crc32(body) != crc:
        _bad("CRC-32 mismatch")
    n_chunks = B * -(-S // chunk)
    fixed = 4 * n_chunks + n_chunks * C * levels
    if len(body) < fixed:
        _bad(f"{len(body)} bytes after the header, its tables alone need {fixed}")
    counts = np.frombuffer(body, "<u4", n_chunks).astype(np.int64)
    tables = np.frombuffer(body, np.uint8, n_chunks * C * levels, 4 * n_chunks).reshape(n_chunks, C, levels)
    if 4 * int(counts.sum()) != len(body) - fixed:
        _bad(f"chunks declare {4 * int(counts.sum())} code bytes, {len(body) - fixed} present")
    if (tables.sum(-1) == 0).any():
        _bad("a channel's table is empty")
    cg = _coder()
    words = np.frombuffer(body, "<u4", offset=fixed)
    out = np.empty((B, S, C), np.uint8)
    i = pos = 0
    for b in range(B):
        for s0 in range(0, S, chunk):
            n = min(chunk, S - s0)
            dec = cg.stream.queue.RangeDecoder(np.array(words[pos:pos + counts[i]], np.uint32))
            for c in range(C):
                try:
                    sym = dec.decode(cg.stream.model.Categorical(tables[i, c].astype(np.float64), perfect=False), n)
                except (AssertionError, ValueError, RuntimeError) as e:  # the coder's own word on invalid data
                    _bad(f"chunk {i} channel {c}: {e}")
                if tables[i, c][sym].min() == 0:
                    _bad(f"chunk {i} channel {c} decodes a symbol its table does not hold")
                out[b, s0:s0 + n, c] = sym
            if not dec.maybe_exhausted():
                _bad(f"chunk {i} holds more codes than {n} tokens of {C} channels (another shape's stream?)")
            pos += int(counts[i])
            i += 1
    return torch.from_numpy(out), levels


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] → [B, S, H·D] (LMCache's layout: the heads merged into channels)."""
    B, H, S, D = x.shape
    return x.permute(0, 2, 1, 3).reshape(B, S, H * D)


def encode(x: torch.Tensor, config, kind: str, layer: int, num_layers: int) -> SplitKV:
    """x: [B, H, S, D] → SplitKV whose anchor is the coded stream and meta {"scale": float32 [B, S]}."""
    M = bins(kind, layer, num_layers) // 2 - 1
    t = _tokens(x.float())                                          # [B, S, C]
    m = t.abs().amax(-1)                                            # [B, S]
    q = (t * (M / m.clamp_min(torch.finfo(torch.float32).tiny)).unsqueeze(-1)).round().clamp(-M, M) + M
    stream = symbols_to_stream(q.to(torch.uint8), 2 * M + 1).to(x.device)   # coded on the CPU
    return SplitKV(config, kind, tuple(x.shape), x.dtype, stream, None, {"scale": m.contiguous()}, "token")


def from_symbols(q: torch.Tensor, levels: int, scale: torch.Tensor, like: SplitKV) -> SplitKV:
    """A SplitKV like `like` for symbols q: [B', S, C] and scale [B', S] (a batch map's result; exact)."""
    stream = symbols_to_stream(q, levels).to(like.anchor.device)
    return SplitKV(like.config, like.kind, (q.shape[0], *like.shape[1:]), like.dtype, stream, None, {"scale": scale},
                   like.axis)


def symbols(split: SplitKV) -> tuple[torch.Tensor, int]:
    B, H, S, D = split.shape
    scale = split.meta.get("scale")
    if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != (B, S):
        raise ValueError(f"cachegen: metadata 'scale' must be float32 {(B, S)}")
    if not torch.isfinite(scale).all() or (scale < 0).any():
        raise ValueError("cachegen: metadata 'scale' holds NaN, Inf or a negative value")
    q, levels = stream_to_symbols(split.anchor, B, S, H * D)
    if levels % 2 == 0:
        _bad(f"{levels} levels (a symmetric code has an odd number)")
    return q, levels


def dequantize(split: SplitKV) -> torch.Tensor:
    """The SplitKV's values, [B, H, S, D] in its dtype: x̂ = (q − M)·m/M."""
    B, H, S, D = split.shape
    q, levels = symbols(split)                                      # decoded on the CPU
    M = (levels - 1) // 2
    scale = split.meta["scale"]
    t = (q.to(scale.device).float() - M) * (scale.float() / M).unsqueeze(-1)   # [B, S, C], where the scale lives
    return t.view(B, S, H, D).permute(0, 2, 1, 3).to(split.dtype)


def select(split: SplitKV, fn) -> SplitKV:
    """Apply a batch-dimension map (reorder, select, repeat): decode the symbols, map them, code them again."""
    q, levels = symbols(split)
    return from_symbols(fn(q.to(split.anchor.device)).cpu(), levels, fn(split.meta["scale"]), split)


def max_nbytes(shape: tuple, levels: int = BINS_FIRST - 1) -> int:
    """An upper bound on a stream's size for a [B, H, S, D] tensor (a receiver bounds a frame by it): header, tables,
    and at most 2 bytes per value plus 8 per chunk (a symbol of frequency ≥ 1/(255 + L) costs < 9 bits)."""
    B, H, S, D = shape
    n_chunks = B * -(-S // CHUNK)
    return HEAD.size + n_chunks * (12 + H * D * levels) + 2 * B * H * S * D
