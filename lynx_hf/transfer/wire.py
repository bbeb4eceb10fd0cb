"""Framed, versioned, self-describing messages (docs/wire-format.md). Nothing is ever unpickled: control payloads
are JSON objects, KV segments a binary tensor table; every length is bounded before anything is allocated, and a
CRC32 over header and payload catches corruption. On malformed input `read_frame`/`parse_frame` raise only
`WireError` (a peer that closed at a frame boundary is `PeerClosed`); on a finite byte string they never hang."""
from __future__ import annotations

import enum
import json
import struct
import zlib
from dataclasses import dataclass

from ..errors import LynxError

MAGIC = b"LYNX"
VERSION = 8  # 2: FIRST carries the prefill's logits, PROMPT declares vocab and windows; 3: frame MACs; 4: CANCEL;
#              5: PROGRESS; 6: REQUEST says what the decode side holds (held, held_digest), PROMPT where shipping
#              starts; 7: data planes (REQUEST data_plane, PROMPT data_plane, PLACED); 8: PROBE (a client's first
#              frame), PROGRESS before PROMPT (a request waiting for a working-set slot)
HEADER = struct.Struct("<4sBBBBIII I")  # magic, version, type, stream, flags, request_id, seq, length, crc32
MAX_PAYLOAD = 64 << 20   # one frame's payload
MAX_JSON = 4 << 20       # a control payload (prompt ids included)
MAX_HANDSHAKE = 4096     # any frame before the peer has proven the shared secret
FLAG_MAC = 1             # the payload ends with a MAC tag (every frame after the handshake)
SEGMENT_TOKENS = 256     # a layer's shipped positions travel in SEGMENT frames of this many tokens (the last: the rest)


def segment_counts(positions: int, segment: int = SEGMENT_TOKENS) -> list[int]:
    """Token counts of the SEGMENT frames that carry `positions` shipped positions of one layer's K or V, in order."""
    return [min(segment, positions - off) for off in range(0, positions, segment)]


class WireError(LynxError, ValueError):
    """A frame is malformed, truncated, corrupted, out of order, or the peer broke the protocol."""


class PeerClosed(WireError):
    """The peer closed the connection at a frame boundary."""


class RequestRefused(WireError):
    """The prefill side refused one request before sending anything of it (its prompt, its codec, the server's
    context or data plane): an ERROR frame with that request's id and `"refused": true` says so, and the connection
    carries the next request. Every other ERROR ends the connection."""


class FrameType(enum.IntEnum):
    HELLO = 1     # JSON: protocol version, model fingerprint, nonce, HMAC (handshake)
    OK = 2        # JSON: handshake accepted (+ server's HMAC)
    REQUEST = 3   # JSON: request_id, input_ids, quant config, held (tokens the decode side holds) and their digest,
    #               data_plane (optional: a NIXL arena)
    PROMPT = 4    # JSON: KV handshake — layers, windows, batch, kv heads, head dim, dtype, vocab, prompt length,
    #               codec, start (first position shipped), refused (why a held claim was not taken), prefix_hit
    SEGMENT = 5   # binary: one segment of one layer's K or V, anchor, residual or correction stream
    FIRST = 6     # binary: the prefill's last-position logits [batch, vocab] (tensor table)
    END = 7       # JSON: end of the request's streams (frame counts per stream, prefill time)
    ERROR = 8     # JSON: {"error": message}
    CANCEL = 9    # JSON {}: the decode side stopped early; drop this request's frames still queued
    PROGRESS = 10  # JSON {prefilled, of, queued}: the request waits for the prefill's compute (keeps its client's
    #               clock)
    PLACED = 11   # binary (offset u64, length u64, SHA-256): a segment's bytes, placed in the decode side's arena by a
    #               data plane (NIXL); counted on its stream like the SEGMENT frame it stands for
    PROBE = 12    # JSON {}: a decode client's first frame, before the server's HELLO: a TLS port fails its handshake on
    #               it at once (the client hears the close, not a deadline); a plain server skips it


class Stream(enum.IntEnum):
    CONTROL = 0
    ANCHOR = 1
    RESIDUAL = 2
    CORRECTION = 3  # exact mode: what the full tier lacks to give the model's KV bit for bit (lowest priority)


def header_bytes(ftype: FrameType, stream: Stream, request_id: int, seq: int, length: int, flags: int = 0) -> bytes:
    """A frame's header with its CRC field zeroed."""
    return HEADER.pack(MAGIC, VERSION, int(ftype), int(stream), flags, request_id & 0xFFFFFFFF, seq, length, 0)


@dataclass
class Frame:
    type: FrameType
    stream: Stream
    request_id: int
    seq: int
    payload: bytes
    flags: int = 0

    def header(self) -> bytes:
        """The header as sent, CRC field zeroed: what a frame MAC covers along with the payload."""
        return header_bytes(self.type, self.stream, self.request_id, self.seq, len(self.payload), self.flags)

    def json(self) -> dict:
        if len(self.payload) > MAX_JSON:
            raise WireError(f"control payload of {len(self.payload)} bytes exceeds {MAX_JSON}")
        try:
            obj = json.loads(self.payload.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WireError(f"{self.type.name} payload is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise WireError(f"{self.type.name} payload must be a JSON object")
        return obj


def encode_frame(ftype: FrameType, stream: Stream, request_id: int, seq: int, payload: bytes, flags: int = 0) -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise WireError(f"payload of {len(payload)} bytes exceeds MAX_PAYLOAD {MAX_PAYLOAD}")
    head = header_bytes(ftype, stream, request_id, seq, len(payload), flags)
    crc = zlib.crc32(payload, zlib.crc32(head))
    return head[:-4] + struct.pack("<I", crc) + payload


def json_payload(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def json_frame(ftype: FrameType, request_id: int, seq: int, obj: dict) -> bytes:
    return encode_frame(ftype, Stream.CONTROL, request_id, seq, json_payload(obj))


def parse_header(head: bytes, limit: int = MAX_PAYLOAD) -> tuple[FrameType, Stream, int, int, int, int, int]:
    if len(head) != HEADER.size:
        raise WireError(f"truncated header: {len(head)} of {HEADER.size} bytes")
    magic, ver, ftype, stream, flags, rid, seq, length, crc = HEADER.unpack(head)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: not a Lynx peer")
    if ver != VERSION:
        raise WireError(f"protocol version {ver} is not supported (this side speaks {VERSION})")
    try:
        ftype, stream = FrameType(ftype), Stream(stream)
    except ValueError:
        raise WireError(f"unknown frame type {ftype} or stream {stream}") from None
    if flags & ~FLAG_MAC:
        raise WireError(f"unknown flags {flags:#x}")
    if length > limit:
        raise WireError(f"declared payload of {length} bytes exceeds the limit of {limit} bytes")
    return ftype, stream, rid, seq, length, crc, flags


def check_crc(head: bytes, payload: bytes, crc: int) -> None:
    zeroed = head[:-4] + b"\0\0\0\0"
    if zlib.crc32(payload, zlib.crc32(zeroed)) != crc:
        raise WireError("checksum mismatch: frame corrupted")


def read_frame(read_exact, limit: int = MAX_PAYLOAD) -> Frame:
    """Read one frame with `read_exact(n) -> bytes` (which returns fewer bytes only at end of stream); a payload
    longer than `limit` is refused from its header, before it is read."""
    head = read_exact(HEADER.size)
    if len(head) == 0:
        raise PeerClosed("peer closed the connection")
    ftype, stream, rid, seq, length, crc, flags = parse_header(head, limit)
    payload = read_exact(length) if length else b""
    if len(payload) != length:
        raise WireError(f"truncated frame: {len(payload)} of {length} payload bytes, then the peer closed")
    check_crc(head, payload, crc)
    return Frame(ftype, stream, rid, seq, payload, flags)


def parse_frame(buf: bytes, limit: int = MAX_PAYLOAD) -> Frame:
    """One whole frame from a byte string (trailing bytes are an error)."""
    pos = 0

    def read_exact(n):
        nonlocal pos
        part = buf[pos:pos + n]
        pos += len(part)
        return part

    f = read_frame(read_exact, limit)
    if pos != len(buf):
        raise WireError(f"{len(buf) - pos} trailing bytes after the frame")
    return f


class SequenceChecker:
    """Per-stream sequence numbers: each stream counts 0, 1, 2, ... — duplicates and reordering are errors. After a
    cancelled request the peer's (authenticated) END says where each stream goes on (`skip_to`)."""

    def __init__(self):
        self.next = {s: 0 for s in Stream}

    def skip_to(self, stream: Stream, seq) -> None:
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < self.next[stream]:
            raise WireError(f"END moves the {stream.name.lower()} stream to {seq!r}, behind {self.next[stream]}")
        self.next[stream] = seq

    def check(self, f: Frame) -> None:
        want = self.next[f.stream]
        if f.seq != want:
            what = "duplicated" if f.seq < want else "out-of-order (frames missing)"
            raise WireError(f"{what} frame on the {f.stream.name.lower()} stream: seq {f.seq}, expected {want}")
        self.next[f.stream] = want + 1
