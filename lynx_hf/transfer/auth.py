"""The handshake (authentication) shared by both sides of a connection: shared-secret mutual authentication before
anything is revealed, then a MAC on every frame, the model fingerprint, per-direction sequence numbering (`Channel`).
(A conversation over many requests is another thing: the decode side's `Session`.)

Handshake (docs/wire-format.md): prefill → HELLO{nonce Ns}; decode → HELLO{nonce Nc, mac = HMAC(secret,
"client|Ns|Nc")}; the prefill side checks the MAC (one generic refusal otherwise), and from here on every frame in
each direction carries HMAC-SHA256 (truncated to 16 bytes) under a per-connection, per-direction key derived from
the secret and both nonces; prefill → OK{mac = HMAC(secret, "server|Nc|Ns"), fingerprint}; decode checks the MAC and
the fingerprint, → OK{fingerprint}. Every handshake frame is at most MAX_HANDSHAKE bytes, and the whole handshake
has one deadline. Before the handshake ends, whatever goes wrong gets one answer, the generic refusal; the peer's
own text is quoted (`quote_peer`) wherever this side shows it."""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import time

from ..errors import ConfigError
from .transport import PRIO_ANCHOR, Transport
from .wire import (FLAG_MAC, MAX_HANDSHAKE, MAX_PAYLOAD, FrameType, PeerClosed, SequenceChecker, Stream, WireError,
                   encode_frame, header_bytes, json_payload)

SECRET_ENV = "LYNX_SECRET"
INSECURE_SECRET = b"lynx-hf-insecure: no authentication"  # --insecure (loopback only): a known key, no security
TAG = 16  # bytes of HMAC-SHA256 kept per frame
REFUSED = "refused"  # the prefill side's one answer to a client that fails the handshake, whatever failed...
LATE = "refused: the handshake's deadline passed"  # ...but a deadline it missed: that says nothing of the secret
PEER_TEXT = 200  # characters of a peer's text this side logs or shows


def quote_peer(text, limit: int = PEER_TEXT) -> str:
    """A peer's text made safe to log or show: a quoted string literal (newlines and control characters escaped,
    so it cannot forge log lines), at most `limit` characters of it."""
    s = text if isinstance(text, str) else repr(text)
    cut = len(s) > limit
    return ascii(s[:limit]) + ("…" if cut else "")


class PeerError(WireError):
    """The peer sent an ERROR frame; `reason` is what it said (raw; the message quotes it), `request_id` the frame's,
    `refused` whether it refuses that one request only (wire.RequestRefused) rather than ending the connection."""

    def __init__(self, reason, request_id: int = 0, refused: bool = False):
        super().__init__(f"peer reported an error: {quote_peer(reason)}")
        self.reason, self.request_id, self.refused = reason, request_id, refused


class HandshakeRefused(WireError):
    """This side refused the peer's handshake and has told it so (one generic ERROR frame): nothing more to send."""


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def read_secret_file(path: str) -> str:
    """A secret from a file (its first line): unlike --secret, not visible to every local user in the process list."""
    try:
        with open(path, encoding="utf-8") as f:
            s = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the secret file {path}: {e}") from None
    if not s:
        raise ConfigError(f"the secret file {path} is empty")
    return s


def resolve_secret(secret: str | None, insecure: bool = False, host: str | None = None) -> bytes:
    """`secret`, else $LYNX_SECRET, else (only with insecure=True, and only on a loopback `host` when one is given)
    a publicly known key. No built-in default; a secret and insecure together are a contradiction."""
    s = secret or os.environ.get(SECRET_ENV)
    if insecure:
        if secret:
            raise ConfigError("a secret and insecure=True together: drop --insecure to authenticate with the secret")
        if host is not None and not is_loopback(host):
            raise ConfigError(f"insecure=True (no authentication) is allowed on loopback only, not {host}")
        return INSECURE_SECRET
    if s:
        return s.encode()
    raise ConfigError(f"no shared secret: pass --secret-file, set {SECRET_ENV} or pass --secret "
                      f"(or --insecure, on loopback only)")


def mac_matches(got, want: str) -> bool:
    """Constant-time comparison of a peer's MAC field (any JSON value) with ours; never raises."""
    if not isinstance(got, str):
        return False
    return hmac.compare_digest(got.encode("utf-8", "surrogatepass"), want.encode())


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
        self.established = False  # both sides proved the secret: from here on every frame carries a MAC

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
                    tag=None, bulk=None):
        """Queue a frame; `tag` lets `Transport.drop` take it back while it is still queued; `bulk`: a data plane's
        bytes the frame refers to (posted just before it)."""
        return self.t.start_send(self._frame(ftype, stream, request_id, payload), priority, tag, bulk)

    def recv(self, timeout: float | None = 30.0, expect: FrameType | None = None, limit: int = MAX_PAYLOAD):
        f = self.t.recv(timeout, limit)
        if self._recv_key is not None:
            if not f.flags & FLAG_MAC or len(f.payload) < TAG:
                if f.type == FrameType.ERROR and not self.established:  # a refusal before the peer switched MACs on
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
            j = f.json()
            raise PeerError(j.get("error", "?"), f.request_id, j.get("refused") is True)
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


def server_handshake(ch: Channel, secret: bytes, fp: str, timeout: float = 10.0, on_hello=None) -> None:
    """The prefill side's handshake within `timeout` seconds in all. Any failure before the client has proven the
    secret (a malformed frame or field, a wrong MAC, silence past the deadline) gets one generic refusal and raises
    HandshakeRefused with the actual reason (for this side's log). `on_hello()` runs when the client's HELLO has
    arrived (the server's pre-authentication budget tells a peer in mid-handshake from an idle one)."""
    deadline = time.monotonic() + timeout
    left = lambda: max(0.0, deadline - time.monotonic())
    ns = secrets.token_hex(16)
    ch.send_json(FrameType.HELLO, {"role": "prefill", "nonce": ns})
    try:
        f = ch.recv(left(), None, MAX_HANDSHAKE)
        if f.type == FrameType.PROBE:  # a client's first bytes, sent before it heard our HELLO
            f = ch.recv(left(), None, MAX_HANDSHAKE)
        if f.type != FrameType.HELLO:
            raise WireError(f"expected HELLO, got {f.type.name}")
        hello = f.json()
        if on_hello is not None:
            on_hello()
        nc = _nonce(hello)
        if not mac_matches(hello.get("mac"), _mac(secret, "client", ns, nc)):
            raise WireError("authentication failed: the client does not know the shared secret")
    except (WireError, TimeoutError) as e:
        if not isinstance(e, PeerClosed):
            try:
                ch.send_json(FrameType.ERROR, {"error": LATE if isinstance(e, TimeoutError) else REFUSED},
                             wait=False).result(1)
            except Exception:  # noqa: BLE001 — the peer may be gone already
                pass
        raise HandshakeRefused(str(e)) from None
    ch.authenticate(secret, ns, nc, "prefill")
    ch.send_json(FrameType.OK, {"mac": _mac(secret, "server", nc, ns), "fingerprint": fp})
    ok = ch.recv(left(), FrameType.OK, MAX_HANDSHAKE).json()
    if ok.get("fingerprint") != fp:
        ch.send_json(FrameType.ERROR, {"error": "model mismatch: fingerprints differ"})
        raise HandshakeRefused("model mismatch: the decode side runs a different model")
    ch.established = True


def client_handshake(ch: Channel, secret: bytes, fp: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    left = lambda: max(0.0, deadline - time.monotonic())
    ch.send_json(FrameType.PROBE, {}, wait=False)  # first: a TLS port fails on these bytes at once (we hear it close)
    try:
        first = ch.recv(left(), FrameType.HELLO, MAX_HANDSHAKE).json()
    except PeerClosed:
        raise WireError("the prefill server closed the connection before its HELLO: if it speaks TLS, connect with "
                        "tls=True or tls_ca=... (serve-decode --tls or --tls-ca)") from None
    ns = _nonce(first)
    nc = secrets.token_hex(16)
    ch.send_json(FrameType.HELLO, {"role": "decode", "nonce": nc, "mac": _mac(secret, "client", ns, nc)},
                 wait=False)  # a failed send shows in the answer (or its absence): the server's verdict comes first
    ch.authenticate(secret, ns, nc, "decode")
    try:
        ok = ch.recv(left(), FrameType.OK, MAX_HANDSHAKE).json()
    except PeerError as e:  # the server's generic refusal is its verdict on our MAC; a missed deadline says so
        if e.reason == REFUSED:
            raise WireError("authentication failed: the prefill server refused our HELLO (a different shared "
                            "secret)") from None
        if e.reason == LATE:
            raise WireError("the prefill server's handshake deadline passed before our HELLO arrived (a slow network "
                            "or a busy machine; its --handshake-timeout)") from None
        raise WireError(f"handshake failed: {e}") from None
    if not mac_matches(ok.get("mac"), _mac(secret, "server", nc, ns)):
        raise WireError("authentication failed: the prefill server does not know the shared secret")
    if ok.get("fingerprint") != fp:
        ch.send_json(FrameType.ERROR, {"error": "model mismatch: fingerprints differ"})
        raise WireError("model mismatch: the prefill side runs a different model")
    ch.send_json(FrameType.OK, {"fingerprint": fp})
    ch.established = True
