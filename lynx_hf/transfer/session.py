"""Connection set-up shared by both sides: shared-secret mutual authentication before anything is revealed, then a
MAC on every frame, the model fingerprint, per-direction sequence numbering.

Handshake (docs/wire-format.md): prefill → HELLO{nonce Ns}; decode → HELLO{nonce Nc, mac = HMAC(secret,
"client|Ns|Nc")}; the prefill side checks the MAC (one generic refusal otherwise), and from here on every frame in
each direction carries HMAC-SHA256 (truncated to 16 bytes) under a per-connection, per-direction key derived from
the secret and both nonces; prefill → OK{mac = HMAC(secret, "server|Nc|Ns"), fingerprint}; decode checks the MAC and
the fingerprint, → OK{fingerprint}. Every handshake frame is at most MAX_HANDSHAKE bytes, and the whole handshake
has one deadline."""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time

from ..errors import ConfigError
from .transport import PRIO_ANCHOR, Transport
from .wire import (FLAG_MAC, MAX_HANDSHAKE, MAX_PAYLOAD, FrameType, SequenceChecker, Stream, WireError, encode_frame,
                   header_bytes, json_payload)

SECRET_ENV = "LYNX_SECRET"
INSECURE_SECRET = b"lynx-hf-insecure: no authentication"  # --insecure (loopback only): a known key, no security
TAG = 16  # bytes of HMAC-SHA256 kept per frame
REFUSED = "refused"  # the prefill side's one answer to a client that fails authentication


class PeerError(WireError):
    """The peer sent an ERROR frame; `reason` is what it said."""

    def __init__(self, reason: str):
        super().__init__(f"peer reported an error: {reason}")
        self.reason = reason


def resolve_secret(secret: str | None, insecure: bool = False) -> bytes:
    """--secret, else $LYNX_SECRET, else (only with insecure=True) a publicly known key. No built-in default."""
    s = secret or os.environ.get(SECRET_ENV)
    if s:
        return s.encode()
    if insecure:
        return INSECURE_SECRET
    raise ConfigError(f"no shared secret: pass --secret or set {SECRET_ENV} (or --insecure, on loopback only)")


def _tag(key: bytes, header: bytes, body) -> bytes:
    """A frame's MAC tag: HMAC-SHA256(key, header with CRC zeroed ‖ body)[:TAG], without copying the body."""
    m = hmac.new(key, header, hashlib.sha256)
    m.update(body)
    return m.digest()[:TAG]


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "|".join(parts).encode(), hashlib.sha256).hexdigest()


class Channel:
    """A transport plus this direction's sequence counters, the peer's checker, and (once authenticated) the
    per-direction frame keys."""

    def __init__(self, transport: Transport):
        self.t = transport
        self.out_seq = {s: 0 for s in Stream}
        self.checker = SequenceChecker()
        self._send_key: bytes | None = None
        self._recv_key: bytes | None = None

    def authenticate(self, secret: bytes, ns: str, nc: str, role: str) -> None:
        """Switch on frame MACs: keys derived from the secret and both nonces, one per direction."""
        k = hmac.new(secret, f"keys|{ns}|{nc}".encode(), hashlib.sha256).digest()
        s2c, c2s = (hmac.new(k, d.encode(), hashlib.sha256).digest() for d in ("s2c", "c2s"))
        self._send_key, self._recv_key = (s2c, c2s) if role == "prefill" else (c2s, s2c)

    def _frame(self, ftype: FrameType, stream: Stream, request_id: int, payload: bytes) -> bytes:
        seq = self.out_seq[stream]
        self.out_seq[stream] = seq + 1
        if self._send_key is None:
            return encode_frame(ftype, stream, request_id, seq, payload)
        tag = _tag(self._send_key, header_bytes(ftype, stream, request_id, seq, len(payload) + TAG, FLAG_MAC), payload)
        return encode_frame(ftype, stream, request_id, seq, payload + tag, FLAG_MAC)

    def send_json(self, ftype: FrameType, obj: dict, request_id: int = 0, priority: int = PRIO_ANCHOR, wait=True):
        fut = self.t.start_send(self._frame(ftype, Stream.CONTROL, request_id, json_payload(obj)), priority)
        if wait:
            self.t.wait_send(fut, 60)
        return fut

    def send_binary(self, ftype: FrameType, stream: Stream, request_id: int, payload: bytes, priority: int,
                    tag=None):
        """Queue a frame; `tag` lets `Transport.drop` take it back while it is still queued."""
        return self.t.start_send(self._frame(ftype, stream, request_id, payload), priority, tag)

    def recv(self, timeout: float | None = 30.0, expect: FrameType | None = None, limit: int = MAX_PAYLOAD):
        f = self.t.recv(timeout, limit)
        if self._recv_key is not None:
            if not f.flags & FLAG_MAC or len(f.payload) < TAG:
                if f.type == FrameType.ERROR:  # a refusal sent before the peer switched MACs on
                    raise PeerError(f.json().get("error", "?"))
                raise WireError(f"{f.type.name} frame without a MAC after the handshake")
            body = memoryview(f.payload)[:-TAG]
            if not hmac.compare_digest(f.payload[-TAG:], _tag(self._recv_key, f.header(), body)):
                raise WireError(f"{f.type.name} frame fails its MAC: forged or corrupted")
            f.payload, f.flags = bytes(body), 0
        elif f.flags & FLAG_MAC:
            raise WireError("MAC-tagged frame before the handshake")
        self.checker.check(f)
        if f.type == FrameType.ERROR and expect != FrameType.ERROR:
            raise PeerError(f.json().get("error", "?"))
        if expect is not None and f.type != expect:
            raise WireError(f"expected {expect.name}, got {f.type.name}")
        return f

    def close(self):
        self.t.close()


def _nonce(hello: dict) -> str:
    n = hello.get("nonce")
    if not (isinstance(n, str) and len(n) == 32 and all(c in "0123456789abcdef" for c in n)):
        raise WireError("HELLO without a valid nonce")
    return n


def server_handshake(ch: Channel, secret: bytes, fp: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    left = lambda: max(0.0, deadline - time.monotonic())
    ns = secrets.token_hex(16)
    ch.send_json(FrameType.HELLO, {"role": "prefill", "nonce": ns})
    hello = ch.recv(left(), FrameType.HELLO, MAX_HANDSHAKE).json()
    nc = _nonce(hello)
    if not hmac.compare_digest(str(hello.get("mac", "")), _mac(secret, "client", ns, nc)):
        ch.send_json(FrameType.ERROR, {"error": REFUSED})
        raise WireError("authentication failed: the client does not know the shared secret")
    ch.authenticate(secret, ns, nc, "prefill")
    ch.send_json(FrameType.OK, {"mac": _mac(secret, "server", nc, ns), "fingerprint": fp})
    ok = ch.recv(left(), FrameType.OK, MAX_HANDSHAKE).json()
    if ok.get("fingerprint") != fp:
        ch.send_json(FrameType.ERROR, {"error": "model mismatch: fingerprints differ"})
        raise WireError("model mismatch: the decode side runs a different model")


def client_handshake(ch: Channel, secret: bytes, fp: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    left = lambda: max(0.0, deadline - time.monotonic())
    ns = _nonce(ch.recv(left(), FrameType.HELLO, MAX_HANDSHAKE).json())
    nc = secrets.token_hex(16)
    ch.send_json(FrameType.HELLO, {"role": "decode", "nonce": nc, "mac": _mac(secret, "client", ns, nc)})
    ch.authenticate(secret, ns, nc, "decode")
    try:
        ok = ch.recv(left(), FrameType.OK, MAX_HANDSHAKE).json()
    except PeerError as e:  # the server's one generic refusal is its verdict on our MAC; other errors are not
        if e.reason == REFUSED:
            raise WireError("authentication failed: the prefill server refused our shared secret") from None
        raise WireError(f"handshake failed: {e}") from None
    if not hmac.compare_digest(str(ok.get("mac", "")), _mac(secret, "server", nc, ns)):
        raise WireError("authentication failed: the prefill server does not know the shared secret")
    if ok.get("fingerprint") != fp:
        ch.send_json(FrameType.ERROR, {"error": "model mismatch: fingerprints differ"})
        raise WireError("model mismatch: the prefill side runs a different model")
    ch.send_json(FrameType.OK, {"fingerprint": fp})
