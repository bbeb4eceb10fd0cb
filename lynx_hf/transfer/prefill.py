"""Prefill side: layer-wise sending overlapped with the forward pass, and the server process.

During prefill every attention layer hands its prompt KV to a `PromptCapture` (local.py); the layer's needed
positions (all of them, or a sliding window's last W) are encoded at once and queued as anchor segments (priority 0)
and residual segments (priority 1), so the link carries layer i while layer i+1 computes. The last position's logits
follow the anchors (FIRST), so the decode side picks the first token with its own generation options."""
from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from concurrent import futures

import torch

from ..arch import fingerprint, kv_geometry
from ..config import LynxQuantConfig
from ..link import LinkEmulator
from ..local import PromptCapture
from ..quant import encode
from ..quant.dispatch import prepare
from .serde import pack_segment, pack_logits
from .session import Channel, resolve_secret, server_handshake
from .transport import PRIO_ANCHOR, PRIO_END, PRIO_RESIDUAL, TcpTransport, TlsTcpTransport
from .wire import MAX_JSON, SEGMENT_TOKENS, FrameType, PeerClosed, Stream, WireError, json_frame

log = logging.getLogger("lynx_hf.prefill")
MAX_PROMPT = 131072


def send_layer(ch: Channel, rid: int, cfg: LynxQuantConfig, layer: int, k: torch.Tensor, v: torch.Tensor,
               start: int, segment: int = SEGMENT_TOKENS) -> list:
    """Queue one layer's KV (k, v: [B, H_kv, S, D] for prompt positions [start, start + S)) as SEGMENT frames of
    `segment` tokens (small frames keep strict priority responsive)."""
    futs = []
    S = k.shape[2]
    for kind, x in (("key", k), ("value", v)):
        for off in range(0, S, segment):
            s = encode(x[:, :, off:off + segment].contiguous(), cfg, kind)
            futs.append(ch.send_binary(FrameType.SEGMENT, Stream.ANCHOR, rid,
                                       pack_segment(layer, kind, start + off, s, False), PRIO_ANCHOR, tag=rid))
            if s.residual is not None:
                futs.append(ch.send_binary(FrameType.SEGMENT, Stream.RESIDUAL, rid,
                                           pack_segment(layer, kind, start + off, s, True), PRIO_RESIDUAL, tag=rid))
    return futs


def kv_handshake(model, rid: int, prompt_len: int, cfg: LynxQuantConfig) -> dict:
    """The PROMPT frame's JSON: what the decode side needs to build and check its LynxCache."""
    try:
        geometry = kv_geometry(model)
    except ValueError as e:  # a layer kind a transferred prompt cannot serve
        raise WireError(str(e)) from None
    return {"request_id": rid, **geometry, "prompt_len": prompt_len, "quant_config": cfg.to_dict()}


@torch.no_grad()
def serve_request(model, ch: Channel, req: dict, rid: int, compute: threading.Lock | None = None) -> dict:
    """Validate a REQUEST, announce the KV (PROMPT), prefill while streaming, then FIRST (logits) and END. `compute`
    is held for the forward pass only: the paced transfer that follows runs on this connection's own sender."""
    ids = req.get("input_ids")
    if not (isinstance(ids, list) and 0 < len(ids) <= MAX_PROMPT and all(isinstance(i, int) for i in ids)):
        raise WireError(f"input_ids must be a list of 1..{MAX_PROMPT} ints")
    vocab = model.config.get_text_config().vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        raise WireError(f"token id out of range [0, {vocab})")
    try:
        cfg = LynxQuantConfig.from_dict(req.get("quant_config") or {})
    except (ValueError, TypeError) as e:
        raise WireError(f"bad quant_config: {e}") from None
    P = len(ids)
    ch.send_json(FrameType.PROMPT, kv_handshake(model, rid, P, cfg), rid)
    t0 = time.perf_counter()
    futs = []
    cap = PromptCapture(model.config, lambda i, k, v: futs.extend(send_layer(ch, rid, cfg, i, k, v, P - k.shape[2])), P)
    with compute or contextlib.nullcontext():
        out = model(input_ids=torch.tensor([ids], device=next(model.parameters()).device), cache=cap, use_cache=True,
                    logits_to_keep=1)
    prefill_s = time.perf_counter() - t0
    futs.append(ch.send_binary(FrameType.FIRST, Stream.CONTROL, rid, pack_logits(out.logits[:, -1]), PRIO_ANCHOR))
    dropped = _await_sent(ch, rid, futs)
    end = ch.send_json(FrameType.END, {"anchor_frames": ch.out_seq[Stream.ANCHOR],
                                       "residual_frames": ch.out_seq[Stream.RESIDUAL], "prefill_s": prefill_s,
                                       "cancelled": dropped is not None, "dropped": dropped or 0},
                       rid, PRIO_END, wait=False)
    end.result(600)
    return {"prompt_len": P, "prefill_s": prefill_s, "sent_s": time.perf_counter() - t0, "dropped_frames": dropped}


def _await_sent(ch: Channel, rid: int, futs: list, poll_s: float = 0.05, deadline_s: float = 600.0) -> int | None:
    """Wait until the request's frames are on the wire, checking the connection every `poll_s`: a CANCEL from the
    decode side (it stopped early) drops what is still queued. Returns the number of frames dropped, None if none
    was. (A transport that cannot tell whether a frame waits, DistTransport, never sees a CANCEL here.)"""
    deadline = time.monotonic() + deadline_s
    pending = list(futs)
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"request {rid}: frames not sent within {deadline_s} s")
        if ch.t.readable(0):
            f = ch.recv(timeout=30, limit=MAX_JSON)
            if f.type != FrameType.CANCEL or f.request_id != rid:
                raise WireError(f"unexpected {f.type.name} frame for request {f.request_id} while sending request {rid}")
            return ch.t.drop(rid)
        pending = list(futures.wait(pending, timeout=poll_s).not_done)
    for f in futs:
        f.result()  # a failed send surfaces here
    return None


def serve_channel(model, ch: Channel, secret: bytes, fp: str, hs_timeout: float = 10.0,
                  compute: threading.Lock | None = None, peer: str = "peer") -> None:
    """One connection's life on the prefill side, over any transport: handshake, then requests until the peer
    closes. Wire and connection errors propagate to the caller (PrefillServer logs them and answers ERROR)."""
    server_handshake(ch, secret, fp, hs_timeout)
    last = 0
    while True:
        try:
            f = ch.recv(timeout=3600, limit=MAX_JSON)
        except PeerClosed:
            return
        if f.type == FrameType.CANCEL and f.request_id <= last:
            continue  # the request had ended before the decode side's cancel arrived
        if f.type != FrameType.REQUEST:
            raise WireError(f"expected REQUEST, got {f.type.name}")
        last = f.request_id
        info = serve_request(model, ch, f.json(), f.request_id, compute)
        log.info("request %s from %s: %s", f.request_id, peer, info)


class PrefillServer:
    """Accepts decode peers; each connection gets its own thread, transport and sender (so a slow or stalled client
    only ever delays itself): handshake within `handshake_timeout` in all, then requests until the peer closes.
    One forward pass at a time (the CPU/GPU is the bottleneck); at most `max_connections` connections, the next
    is refused with an ERROR frame."""

    def __init__(self, model, host: str = "127.0.0.1", port: int = 0, secret: str | None = None,
                 bandwidth_bps: float | None = None, latency_s: float = 0.0, handshake_timeout: float = 10.0,
                 max_connections: int = 32, insecure: bool = False, tls_cert: str | None = None,
                 tls_key: str | None = None):
        self.model, self.secret, self.fp = model, resolve_secret(secret, insecure), fingerprint(model)
        prepare(next(model.parameters()).device)  # build the codec's kernels now, not inside the first request
        self.tls = None
        if tls_cert:  # TLS on top of the frame MACs: confidentiality for links that leave the rack
            self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.tls.load_cert_chain(tls_cert, tls_key)
        self.bw, self.latency, self.hs_timeout, self.max_conn = bandwidth_bps, latency_s, handshake_timeout, max_connections
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.address = self.sock.getsockname()[:2]
        self._compute = threading.Lock()
        self._stop = threading.Event()
        self._conns = 0
        self._conns_lock = threading.Lock()

    @property
    def connections(self) -> int:
        return self._conns

    def serve_forever(self) -> None:
        self.sock.settimeout(0.5)
        while not self._stop.is_set():
            try:
                conn, addr = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            with self._conns_lock:
                full = self._conns >= self.max_conn
                self._conns += not full
            if full:
                self._refuse(conn, addr)
                continue
            threading.Thread(target=self._handle, args=(conn, addr), name="lynx-conn", daemon=True).start()

    def start(self) -> "PrefillServer":
        threading.Thread(target=self.serve_forever, name="lynx-prefill-server", daemon=True).start()
        return self

    @staticmethod
    def _refuse(conn: socket.socket, addr) -> None:
        log.warning("refusing %s: connection limit reached", addr)
        try:
            conn.settimeout(1.0)
            conn.sendall(json_frame(FrameType.ERROR, 0, 0, {"error": "server busy: too many connections"}))
        except OSError:
            pass
        conn.close()

    def _handle(self, conn: socket.socket, addr) -> None:
        link = LinkEmulator(self.bw, self.latency)
        try:
            t = TcpTransport(conn, link) if self.tls is None else \
                TlsTcpTransport(conn, self.tls, server_side=True, link=link, timeout=self.hs_timeout)
        except ConnectionError as e:
            log.warning("client %s dropped: %s", addr, e)
            with self._conns_lock:
                self._conns -= 1
            return
        ch = Channel(t)
        try:
            serve_channel(self.model, ch, self.secret, self.fp, self.hs_timeout, self._compute, str(addr))
        except (WireError, ConnectionError, TimeoutError, OSError) as e:
            log.warning("client %s dropped: %s", addr, e)
            try:
                ch.send_json(FrameType.ERROR, {"error": str(e)[:500]}, wait=False).result(1)
            except Exception:  # noqa: BLE001 — the peer may be gone already
                pass
        except Exception as e:  # noqa: BLE001 — never let one request take the server down
            log.exception("request from %s failed: %s", addr, e)
        finally:
            ch.close()
            with self._conns_lock:
                self._conns -= 1

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
