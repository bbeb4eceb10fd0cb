"""Connection set-up shared by both sides: model fingerprint, shared-secret mutual authentication (HMAC-SHA256
over both nonces), per-direction sequence numbering."""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from .transport import PRIO_ANCHOR, Transport
from .wire import FrameType, SequenceChecker, Stream, WireError, encode_frame, json_frame

SECRET_ENV = "LYNX_SECRET"
DEFAULT_SECRET = "lynx-hf-dev"  # used when neither --secret nor $LYNX_SECRET is given (say so in logs)


def resolve_secret(secret: str | None) -> bytes:
    return (secret or os.environ.get(SECRET_ENV) or DEFAULT_SECRET).encode()


def fingerprint(model) -> str:
    """Identifies the model's architecture and weights cheaply: config + a hash of a slice of each weight shape."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    for name, p in list(model.named_parameters())[:4]:
        h.update(name.encode())
        h.update(p.detach().flatten()[:64].float().numpy().tobytes())
    return h.hexdigest()[:32]


def logits_width(model) -> int:
    """Columns of the model's logits (the output embedding's rows; the config's vocab_size without one)."""
    emb = model.get_output_embeddings()
    return int(emb.weight.shape[0]) if emb is not None else int(model.config.get_text_config().vocab_size)


def _mac(secret: bytes, *parts: str) -> str:
    return hmac.new(secret, "|".join(parts).encode(), hashlib.sha256).hexdigest()


class Channel:
    """A transport plus this direction's sequence counters and the peer's checker."""

    def __init__(self, transport: Transport):
        self.t = transport
        self.out_seq = {s: 0 for s in Stream}
        self.checker = SequenceChecker()

    def _next(self, stream: Stream) -> int:
        n = self.out_seq[stream]
        self.out_seq[stream] = n + 1
        return n

    def send_json(self, ftype: FrameType, obj: dict, request_id: int = 0, priority: int = PRIO_ANCHOR, wait=True):
        fut = self.t.start_send(json_frame(ftype, request_id, self._next(Stream.CONTROL), obj), priority)
        if wait:
            self.t.wait_send(fut, 60)
        return fut

    def send_binary(self, ftype: FrameType, stream: Stream, request_id: int, payload: bytes, priority: int):
        return self.t.start_send(encode_frame(ftype, stream, request_id, self._next(stream), payload), priority)

    def recv(self, timeout: float | None = 30.0, expect: FrameType | None = None):
        f = self.t.recv(timeout)
        self.checker.check(f)
        if f.type == FrameType.ERROR and expect != FrameType.ERROR:
            raise WireError(f"peer reported an error: {f.json().get('error', '?')}")
        if expect is not None and f.type != expect:
            raise WireError(f"expected {expect.name}, got {f.type.name}")
        return f

    def close(self):
        self.t.close()


def server_handshake(ch: Channel, secret: bytes, fp: str, timeout: float = 10.0) -> None:
    ns = secrets.token_hex(16)
    ch.send_json(FrameType.HELLO, {"role": "prefill", "fingerprint": fp, "nonce": ns})
    hello = ch.recv(timeout, FrameType.HELLO).json()
    nc = str(hello.get("nonce", ""))
    if hello.get("fingerprint") != fp:
        ch.send_json(FrameType.ERROR, {"error": "model mismatch: fingerprints differ"})
        raise WireError("model mismatch: the decode side runs a different model")
    if not hmac.compare_digest(str(hello.get("mac", "")), _mac(secret, "client", ns, nc, fp)):
        ch.send_json(FrameType.ERROR, {"error": "authentication failed"})
        raise WireError("authentication failed: wrong shared secret")
    ch.send_json(FrameType.OK, {"mac": _mac(secret, "server", nc, ns, fp)})


def client_handshake(ch: Channel, secret: bytes, fp: str, timeout: float = 10.0) -> None:
    hello = ch.recv(timeout, FrameType.HELLO).json()
    ns = str(hello.get("nonce", ""))
    if hello.get("fingerprint") != fp:
        raise WireError("model mismatch: the prefill side runs a different model")
    nc = secrets.token_hex(16)
    ch.send_json(FrameType.HELLO, {"role": "decode", "fingerprint": fp, "nonce": nc,
                                   "mac": _mac(secret, "client", ns, nc, fp)})
    ok = ch.recv(timeout, FrameType.OK).json()
    if not hmac.compare_digest(str(ok.get("mac", "")), _mac(secret, "server", nc, ns, fp)):
        raise WireError("authentication failed: the prefill server does not know the shared secret")
