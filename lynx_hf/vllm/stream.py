"""The KV stream between two vLLM instances: a prefill instance publishes each finished prompt's KV, encoded by
lynx-hf's codec, under a transfer id; a decode instance subscribes to it and gets the anchor tier first, the full
tier when the residual lands. No vLLM here: the connector (connector.py) calls these from its hooks, and the tests
drive them alone.

Wire (docs/vllm.md): lynx-hf's frames, handshake and MACs (transfer/wire.py, transfer/auth.py), TCP, paced by
the link emulator's NIC (one per publisher, shared by its connections). After the handshake the decode side sends
REQUEST {xfer, quant_config, spec, digest, start}; the prefill side answers PROMPT {xfer, quant_config, spec, start,
segments, bundled} — or ERROR (unknown transfer, codec or geometry mismatch) — then every anchor segment (priority
0), every residual segment (priority 1) and END. A segment is one layer's K or V over `segment_tokens(config)`
positions of an absolute grid (0, u, 2u, ...), packed as `serde` packs it: whole chunks (and KIVI groups), so a
segment's code is a function of its own positions' KV and a full segment encodes alike in every prompt that holds
it (the decode instance's cached blocks stand for what a later transfer would ship). Segments travel bundled: one
SEGMENT frame carries a run of one stream's segments (`serde.pack_bundle`: up to MAX_BUNDLE of them, BUNDLE_BYTES
together, a larger one alone), a layer's anchors or its residuals, so the per-frame work (MAC, wake-up, send) is
paid once per layer and stream, not per segment: Lynx sends two frames a layer where INT8 sends one (a subscriber
refuses a PROMPT without `bundled`, from a lynx-hf before, naming it). `start` is the first position the decode
instance lacks (its local prefix hit); the publisher streams the segments from the one holding it.

Bounds: a publisher holds at most `max_bytes` of encoded transfers (oldest unclaimed evicted first, and any left
unclaimed `ttl_s` seconds) and `MAX_REFUSALS` refusals. A subscriber holds one transfer's codes (its spec bounds
them) and refuses any frame larger than a bundle's bound, a malformed bundle, any segment larger than the codec's
bound for its shape, off the grid, duplicated or beyond the declared counts — before it allocates. The receiving
thread parses bytes only; checking and dequantization run on the caller's thread (`Subscription.drain` / `piece`),
so no second OpenMP pool competes with the model."""
from __future__ import annotations

import collections
import logging
import math
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass

import torch

from ..config import LynxQuantConfig
from ..errors import ConfigError
from ..link import Nic
from ..quant import codec, dequantize, encode, encode_rows
from ..transfer.serde import (BUNDLE, LEN, check_residual, pack_bundle, pack_segment, segment_bound, to_split,
                              unpack_bundle, unpack_segment, warm)
from ..transfer.auth import Channel, HandshakeRefused, PeerError, client_handshake, quote_peer, server_handshake
from ..transfer.transport import PRIO_ANCHOR, PRIO_END, PRIO_RESIDUAL, TcpTransport
from ..transfer.wire import MAX_JSON, SEGMENT_TOKENS, FrameType, PeerClosed, Stream, WireError, segment_counts

log = logging.getLogger("lynx_hf.vllm")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_XFER_ID = 128
MAX_PROMPT = 1 << 20
MAX_REFUSALS = 1024
MAX_BUNDLE, BUNDLE_BYTES = 64, 256 << 10  # a SEGMENT frame's segments at most, and their bytes (one larger: alone)


def lower_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority by `nice` (Linux: a thread's own nice value; the threads it starts
    inherit it), so the KV stream's work — encoding, MACs, pacing, sends, which a real node's NIC and DMA would do —
    yields the prefill instance's cores to its forwards (docs/vllm.md measures when that pays). 0, or a platform
    without per-thread priorities: nothing."""
    if nice > 0 and hasattr(os, "setpriority"):
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except OSError as e:  # (raising one's own nice value is always allowed; a sandbox may still refuse)
            log.info("kv stream: thread priority left as it was: %s", e)


class StreamError(WireError):
    """A transfer failed: the peer refused it, broke the protocol, went away, or its time ran out."""


@dataclass(frozen=True)
class KVSpec:
    """What one request's prompt KV is: both sides must agree on every field (checked in PROMPT)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str       # the codec's input dtype: "float32" | "float16" | "bfloat16"
    prompt_len: int  # positions shipped: [0, prompt_len)

    def __post_init__(self):
        for name, hi in (("layers", 4096), ("kv_heads", 4096), ("head_dim", 4096), ("prompt_len", MAX_PROMPT)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
                raise WireError(f"KVSpec: {name} must be an int in [1, {hi}], got {v!r}")
        if self.dtype not in DTYPES:
            raise WireError(f"KVSpec: dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @classmethod
    def from_dict(cls, d) -> "KVSpec":
        names = ("layers", "kv_heads", "head_dim", "dtype", "prompt_len")
        if not isinstance(d, dict) or set(d) != set(names):
            raise WireError(f"spec must be an object with exactly {names}")
        return cls(**d)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def segments(self, config: LynxQuantConfig, start: int = 0) -> tuple[int, int]:
        """(anchor, residual) SEGMENT frames a transfer carries from position `start` (a multiple of the grid's)."""
        n = self.layers * 2 * len(segment_counts(self.prompt_len - start, segment_tokens(config)))
        return n, n if codec(config).split else 0

    def segment_limit(self, config: LynxQuantConfig) -> int:
        """The most bytes one segment's payload takes."""
        shape = (1, self.kv_heads, segment_tokens(config), self.head_dim)
        return max(segment_bound(config, kind, shape, self.torch_dtype) for kind in ("key", "value")) + 64

    def frame_limit(self, config: LynxQuantConfig) -> int:
        """The most bytes one SEGMENT frame's payload takes: a bundle (`bundles`)."""
        return BUNDLE.size + MAX_BUNDLE * LEN.size + max(BUNDLE_BYTES, self.segment_limit(config))

    def held_bound(self, config: LynxQuantConfig) -> int:
        """Bytes a subscriber may hold for one such transfer: every segment at its bound."""
        return sum(self.segments(config)) * self.segment_limit(config)


def token_digest(ids) -> str:
    """SHA-256 of a prompt's token ids (int64 little-endian): both instances must have prefilled the same tokens."""
    import hashlib

    import numpy as np

    a = ids if isinstance(ids, np.ndarray) else list(ids)  # (an ndarray row: no copy through a list)
    return hashlib.sha256(np.asarray(a, dtype="<i8").tobytes()).hexdigest()


def check_xfer_id(xfer) -> str:
    if not (isinstance(xfer, str) and 1 <= len(xfer) <= MAX_XFER_ID and xfer.isascii() and xfer.isprintable()):
        raise WireError(f"a transfer id is 1-{MAX_XFER_ID} printable ASCII characters, got {quote_peer(xfer, 40)}")
    return xfer


def segment_tokens(config: LynxQuantConfig) -> int:
    """Positions per SEGMENT on the vLLM stream's grid: the codec's unit (whole μ/σ chunks, KIVI groups, paper's γ
    pages), so nothing the codec computes spans two segments. A vLLM block must hold whole segments."""
    unit = math.lcm(config.chunk_size, config.group_size, config.page_size if config.method == "paper" else 1)
    if unit > SEGMENT_TOKENS:
        raise ConfigError(f"the vLLM stream's segment (lcm of chunk_size {config.chunk_size}, group_size "
                          f"{config.group_size}) is {unit} tokens, over its {SEGMENT_TOKENS}")
    return unit


def stream_tier(x: torch.Tensor, config: LynxQuantConfig, kind: str, layer: tuple, tier: str) -> torch.Tensor:
    """What a decode instance holds of x [1, H_kv, P, D] once `tier` landed: the grid's segments, each encoded
    alone (as encode_layer does), dequantized and joined — the reference the tests compare placed blocks with."""
    u = segment_tokens(config)
    return torch.cat([dequantize(encode(x[:, :, o:o + u].contiguous(), config, kind, layer=layer), tier)
                      for o in range(0, x.shape[2], u)], 2)


def encode_layer(config: LynxQuantConfig, layer: int, num_layers: int, k: torch.Tensor, v: torch.Tensor):
    """One layer's prompt KV (k, v: [1, H_kv, P, D]) → [(stream, start, payload)] SEGMENT payloads on the grid,
    anchor ones first."""
    out, u = {Stream.ANCHOR: [], Stream.RESIDUAL: []}, segment_tokens(config)
    for kind, x in (("key", k), ("value", v)):
        n, where = x.shape[2] // u, (layer, num_layers)
        rows = x[0, :, :n * u].unflatten(1, (n, u)).transpose(0, 1).contiguous()  # the whole segments: [n, H, u, D]
        splits = encode_rows(rows, config, kind, layer=where) if n else []
        if x.shape[2] % u:
            splits.append(encode(x[:, :, n * u:].contiguous(), config, kind, layer=where))
        for i, s in enumerate(splits):
            off = i * u
            out[Stream.ANCHOR].append((off, pack_segment(layer, kind, off, s, "anchor")))
            if s.residual is not None:
                out[Stream.RESIDUAL].append((off, pack_segment(layer, kind, off, s, "residual")))
    return [(st, off, p) for st in (Stream.ANCHOR, Stream.RESIDUAL) for off, p in out[st]]


def bundles(frames: list, first: int) -> list[tuple[Stream, list[bytes]]]:
    """encode_layer's (stream, start, payload) entries from position `first` on → runs of one stream's payloads,
    each at most MAX_BUNDLE of them and BUNDLE_BYTES together (a larger one alone): one SEGMENT frame each."""
    runs: list[list] = []  # [stream, payloads, bytes]
    for stream, off, p in frames:
        if off < first:
            continue  # the decode instance holds it (its prefix hit)
        if not runs or runs[-1][0] != stream or len(runs[-1][1]) == MAX_BUNDLE or \
                runs[-1][2] + len(p) > BUNDLE_BYTES:
            runs.append([stream, [], 0])
        runs[-1][1].append(p)
        runs[-1][2] += len(p)
    return [(stream, payloads) for stream, payloads, _ in runs]


class _Entry:
    def __init__(self, config: LynxQuantConfig, spec: KVSpec, digest: str):
        self.config, self.spec, self.digest = config, spec, digest
        self.frames: list[tuple[Stream, int, bytes]] = []  # (stream, first position, payload)
        self.nbytes, self.done, self.claimed, self.born = 0, False, False, time.monotonic()
        self.error: str | None = None  # a refused transfer: what its subscriber hears instead of KV


class KVPublisher:
    """The prefill instance's side: `publish(xfer, config, spec, layers)` stores a prompt's encoded KV (call it once
    per transfer, every layer at once or `add`/`finish` layer by layer); a TCP server streams it to the one decode
    instance that asks for it, then drops it. Every byte it holds is under `max_bytes`."""

    def __init__(self, host: str, port: int, secret: bytes, fingerprint: str, bandwidth_bps: float | None = None,
                 latency_s: float = 0.0, max_bytes: int = 1 << 30, ttl_s: float = 600.0, timeout_s: float = 30.0,
                 max_connections: int = 64, nice: int = 0):
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ConfigError(f"kv_nice must be an integer from 0 to 19, not {nice!r}")
        self.secret, self.fp, self.max_bytes, self.ttl_s, self.timeout_s = secret, fingerprint, max_bytes, ttl_s, \
            timeout_s
        self.nic = Nic(bandwidth_bps, latency_s)
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._cv = threading.Condition()
        self.stored_bytes = 0
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._conns: set[Channel] = set()
        self._slots = threading.BoundedSemaphore(max_connections)  # one thread per connection, at most this many
        self.nice = nice  # the KV stream's threads run this much below the engine (lower_priority)
        threading.Thread(target=self._accept_loop, name="lynx-kv-publisher", daemon=True).start()

    # -- the store ------------------------------------------------------------------------------------------------
    def begin(self, xfer: str, config: LynxQuantConfig, spec: KVSpec, digest: str) -> None:
        """digest: `token_digest` of the prompt's ids; the subscriber must name the same."""
        with self._cv:
            self._expire()
            if check_xfer_id(xfer) in self._entries:
                raise StreamError(f"transfer {xfer!r} is published already")
            self._entries[xfer] = _Entry(config, spec, digest)

    def add(self, xfer: str, frames: list) -> None:
        """frames: encode_layer's, one layer's."""
        size = sum(len(p) for _, _, p in frames)
        with self._cv:
            e = self._entries.get(xfer)
            if e is None:
                return  # evicted or failed meanwhile: its subscriber hears "unknown transfer"
            while self.stored_bytes + size > self.max_bytes and self._evict_one(keep=xfer):
                pass
            if self.stored_bytes + size > self.max_bytes:
                self._drop(xfer)
                log.warning("transfer %s dropped: %d bytes over the publisher's bound of %d", xfer, size,
                            self.max_bytes)
                return
            e.frames += frames
            e.nbytes += size
            self.stored_bytes += size
            self._cv.notify_all()

    def refuse(self, xfer: str, why: str) -> None:
        """Publish a refusal instead of KV (a prefill request whose Lynx parameters were refused): the subscriber to
        `xfer` hears `why` at once. At most MAX_REFUSALS are held (oldest dropped), each under the TTL."""
        with self._cv:
            self._expire()
            if check_xfer_id(xfer) in self._entries:
                return
            refusals = [x for x, e in self._entries.items() if e.error is not None]
            for x in refusals[:max(0, len(refusals) + 1 - MAX_REFUSALS)]:
                del self._entries[x]
            e = self._entries[xfer] = _Entry(None, None, "")
            e.error, e.done = why[:500], True
            self._cv.notify_all()

    def finish(self, xfer: str) -> None:
        with self._cv:
            if xfer in self._entries:
                self._entries[xfer].done = True
                self._cv.notify_all()

    def publish(self, xfer: str, config: LynxQuantConfig, spec: KVSpec, digest: str, kv: list) -> None:
        """kv: per layer (k, v), each [1, H_kv, P, D]."""
        self.begin(xfer, config, spec, digest)
        for i, (k, v) in enumerate(kv):
            self.add(xfer, encode_layer(config, i, len(kv), k, v))
        self.finish(xfer)

    def _drop(self, xfer: str) -> None:
        e = self._entries.pop(xfer, None)
        if e is not None:
            self.stored_bytes -= e.nbytes

    def _evict_one(self, keep: str) -> bool:
        for x, e in self._entries.items():
            if x != keep and not e.claimed:
                self._drop(x)
                log.warning("transfer %s evicted unclaimed (publisher bound %d bytes)", x, self.max_bytes)
                return True
        return False

    def _expire(self) -> None:
        now = time.monotonic()
        for x in [x for x, e in self._entries.items() if not e.claimed and now - e.born > self.ttl_s]:
            self._drop(x)
            log.warning("transfer %s dropped: unclaimed for %.0f s", x, self.ttl_s)

    # -- the server -----------------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        lower_priority(self.nice)  # (the sending threads it starts, and theirs, inherit it)
        while not self._stop.is_set():
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                log.warning("kv stream: refusing %s: %d connections already", quote_peer(addr[0]),
                            len(self._conns))
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, addr), name="lynx-kv-send", daemon=True).start()

    def _serve(self, conn: socket.socket, addr) -> None:
        link = self.nic.port()
        ch, peer, xfer = Channel(TcpTransport(conn, link, self.timeout_s)), quote_peer(f"{addr[0]}:{addr[1]}"), None
        with self._cv:
            self._conns.add(ch)
        try:
            server_handshake(ch, self.secret, self.fp, self.timeout_s)
            xfer = self._stream(ch, ch.recv(self.timeout_s, FrameType.REQUEST, MAX_JSON).json())
        except HandshakeRefused as e:
            log.warning("kv stream: refused %s: %s", peer, e)
        except (WireError, ConnectionError, TimeoutError, OSError) as e:
            log.warning("kv stream to %s failed: %s", peer, e)
            if not isinstance(e, PeerError):
                try:
                    ch.send_json(FrameType.ERROR, {"error": str(e)[:500]}, wait=False).result(1)
                except Exception:  # noqa: BLE001 — the peer may be gone already
                    pass
        finally:
            with self._cv:
                if xfer is not None:
                    self._drop(xfer)
                self._conns.discard(ch)
            ch.close()
            link.close()
            self._slots.release()

    def _claim(self, req: dict) -> tuple[str, _Entry, int]:
        """→ (xfer, its entry, the first position streamed: the grid's segment holding the REQUEST's `start`)."""
        xfer = check_xfer_id(req.get("xfer"))
        spec, start = KVSpec.from_dict(req.get("spec")), req.get("start")
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < spec.prompt_len:
            raise WireError(f"start must be an int in [0, {spec.prompt_len}), got {quote_peer(start, 40)}")
        try:
            config = LynxQuantConfig.from_dict(req.get("quant_config"))
        except (ConfigError, TypeError) as e:
            raise WireError(f"bad quant_config: {e}") from None
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            while xfer not in self._entries:  # the decode side may ask while the prefill still encodes
                if not self._cv.wait(max(0.0, deadline - time.monotonic())):
                    raise StreamError(f"unknown transfer {xfer!r} (never published, expired or evicted)")
            e = self._entries[xfer]
            if e.error is not None:
                del self._entries[xfer]
                raise StreamError(f"transfer {xfer!r} was refused by the prefill instance: {e.error}")
            if e.claimed:
                raise StreamError(f"transfer {xfer!r} is being streamed to another subscriber")
            if e.config != config:
                raise StreamError(f"codec mismatch: the prefill instance encoded {e.config.to_dict()}, the decode "
                                  f"instance expects {config.to_dict()}")
            if e.digest != req.get("digest"):
                raise StreamError(f"transfer {xfer!r}: the decode request's prompt differs from the one prefilled")
            if e.spec != spec:
                raise StreamError(f"KV geometry mismatch: the prefill instance has {asdict(e.spec)}, the decode "
                                  f"instance expects {asdict(spec)}")
            e.claimed = True
        return xfer, e, start - start % segment_tokens(config)

    def _stream(self, ch: Channel, req: dict) -> str:
        xfer, e, first = self._claim(req)
        n_anchor, n_res = e.spec.segments(e.config, first)
        ch.send_json(FrameType.PROMPT, {"xfer": xfer, "quant_config": e.config.to_dict(), "spec": asdict(e.spec),
                                        "start": first, "segments": {"anchor": n_anchor, "residual": n_res},
                                        "bundled": True})
        sent, futs = 0, []
        while True:
            with self._cv:
                while sent == len(e.frames) and not e.done:
                    if not self._cv.wait(self.timeout_s):
                        raise StreamError(f"transfer {xfer!r}: the prefill instance stopped producing it")
                batch, done = e.frames[sent:], e.done
            for stream, payloads in bundles(batch, first):
                prio = PRIO_ANCHOR if stream == Stream.ANCHOR else PRIO_RESIDUAL
                futs.append(ch.send_binary(FrameType.SEGMENT, stream, 0, pack_bundle(payloads), prio))
            sent += len(batch)
            if done and sent == len(e.frames):
                break
        ch.t.wait_send(ch.send_json(FrameType.END, {"anchor": n_anchor, "residual": n_res}, priority=PRIO_END,
                                    wait=False), self.timeout_s + 600)
        return xfer

    def close(self) -> None:
        """Stop listening and drop every connection (a subscriber mid-stream sees the prefill side gone)."""
        self._stop.set()
        self.sock.close()
        with self._cv:
            conns = list(self._conns)
        for ch in conns:
            ch.close()


@dataclass
class Arrival:
    """One received segment: its place in the prompt and its tensors (unchecked until drained)."""

    stream: Stream
    layer: int
    kind: str
    axis: str
    start: int
    count: int
    tensors: dict


class Subscription:
    """The decode instance's side of one transfer: a thread connects, authenticates, asks for `xfer` and receives
    its segments; `drain()` (the caller's thread) checks what arrived and adds it to the transfer's *held copy* —
    its codes, kept until `close()`, so a request that joins late or comes back after a preemption gets the same
    KV. A *piece* is one (layer, kind, start) segment of one tier: tier "anchor" (anchor-only KV, split codecs only)
    or "full"; `count(tier)` pieces of it are held, in arrival order, and `piece(tier, i)` dequantizes the i-th,
    [1, H_kv, count, D]. `anchor_done` / `full_done` say when a tier is held whole; `error` says why it failed."""

    def __init__(self, host: str, port: int, secret: bytes, fingerprint: str, xfer: str, config: LynxQuantConfig,
                 spec: KVSpec, digest: str, timeout_s: float = 60.0, connect_timeout_s: float = 10.0,
                 start: int = 0):
        """start: the first position this instance lacks (its local prefix hit); the stream starts at the grid's
        segment that holds it."""
        self.addr, self.secret, self.fp, self.digest = (host, port), secret, fingerprint, digest
        self.xfer, self.config, self.spec = check_xfer_id(xfer), config, spec
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.split = codec(config).split
        if not isinstance(start, int) or not 0 <= start < spec.prompt_len:
            raise ValueError(f"start must be in [0, {spec.prompt_len}), got {start!r}")
        self.unit, self.start = segment_tokens(config), start
        self.first = start - start % self.unit  # the first position streamed
        self.expected = spec.segments(config, self.first)
        self.pieces = self.expected[0]  # per tier: one piece per (layer, kind, start)
        self.error: str | None = None
        self._bytes_in = {Stream.ANCHOR: 0, Stream.RESIDUAL: 0}
        self._arrived_at: dict[str, float] = {}  # "first": the first segment; "anchor" / "full": that tier's last
        self._inbox: collections.deque[Arrival] = collections.deque()  # received, not yet checked (drain)
        self._held: dict = {}                    # (layer, kind, start) -> SplitKV (its residual once it landed)
        self._order = {"anchor": [], "full": []}  # per tier: the keys of its held pieces, in arrival order
        self._seen: set = set()
        self._lock = threading.Lock()            # the inbox, bytes and times (the receiving thread writes them)
        self._closed = threading.Event()
        self._ch: Channel | None = None
        warm(config, {"batch": 1, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim,
                      "windows": [None] * spec.layers}, spec.prompt_len, spec.torch_dtype)
        self._thread = threading.Thread(target=self._run, name="lynx-kv-recv", daemon=True)
        self._thread.start()

    @property
    def anchor_done(self) -> bool:
        return self.split and len(self._order["anchor"]) == self.pieces

    @property
    def full_done(self) -> bool:
        return len(self._order["full"]) == self.pieces

    def count(self, tier: str) -> int:
        """Pieces of `tier` held so far."""
        return len(self._order[tier])

    def piece(self, tier: str, i: int) -> tuple[int, str, int, torch.Tensor]:
        """The i-th held piece of `tier` → (layer, kind, start, x: [1, H_kv, count, D])."""
        key = self._order[tier][i]
        return (*key, dequantize(self._held[key], tier))

    def times(self) -> dict:
        """{"bytes", "anchor_bytes", "first_at", "anchor_at", "full_at"} so far (times: time.time() of the first
        segment, of a tier's last)."""
        with self._lock:
            return {"bytes": sum(self._bytes_in.values()), "anchor_bytes": self._bytes_in[Stream.ANCHOR],
                    **{f"{t}_at": v for t, v in self._arrived_at.items()}}

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(self._bytes_in.values())

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = why

    def _run(self) -> None:
        try:
            t = TcpTransport(socket.create_connection(self.addr, timeout=self.connect_timeout_s),
                             send_timeout_s=self.timeout_s)
            self._ch = ch = Channel(t)
            client_handshake(ch, self.secret, self.fp, self.connect_timeout_s)
            ch.send_json(FrameType.REQUEST, {"xfer": self.xfer, "quant_config": self.config.to_dict(),
                                             "spec": asdict(self.spec), "digest": self.digest, "start": self.start})
            self._check_prompt(ch.recv(self.timeout_s, FrameType.PROMPT, MAX_JSON).json())
            self._receive(ch)
        except (WireError, ConnectionError, TimeoutError, OSError) as e:
            where = f"prefill instance {self.addr[0]}:{self.addr[1]}"
            if isinstance(e, PeerClosed) or isinstance(e, ConnectionError):
                self._fail(f"{where} closed the KV stream of transfer {self.xfer!r} mid-way ({e})")
            elif isinstance(e, TimeoutError) or isinstance(e, socket.timeout):
                self._fail(f"{where}: no KV frame for {self.timeout_s:g} s on transfer {self.xfer!r}")
            else:
                self._fail(f"{where}: transfer {self.xfer!r} failed: {e}")
        except Exception as e:  # noqa: BLE001 — anything else a peer's frames provoke fails this transfer alone
            self._fail(f"transfer {self.xfer!r} failed on a malformed stream: {type(e).__name__}: {e}")
        finally:
            if self._ch is not None:
                self._ch.close()

    def _check_prompt(self, p) -> None:
        if not isinstance(p, dict):
            raise WireError("PROMPT must be a JSON object")
        if p.get("xfer") != self.xfer or p.get("quant_config") != self.config.to_dict() \
                or p.get("spec") != asdict(self.spec) or p.get("start") != self.first:
            raise WireError("PROMPT does not match the request (transfer, codec, geometry or start)")
        want = {"anchor": self.expected[0], "residual": self.expected[1]}
        if p.get("segments") != want:
            raise WireError(f"PROMPT declares {p.get('segments')} segments, expected {want}")
        if p.get("bundled") is not True:
            raise WireError("the prefill instance sends a segment a frame (a lynx-hf from before bundled segments): "
                            "run the same lynx-hf on both instances")

    def _receive(self, ch: Channel) -> None:
        limit, each = self.spec.frame_limit(self.config), self.spec.segment_limit(self.config)
        got = {Stream.ANCHOR: 0, Stream.RESIDUAL: 0}
        total = self.expected[0] + self.expected[1]
        while not self._closed.is_set():
            f = ch.recv(self.timeout_s, None, limit)
            if f.type == FrameType.END:
                if sum(got.values()) != total:
                    raise WireError(f"END after {sum(got.values())} of {total} segments")
                return
            if f.type != FrameType.SEGMENT or f.stream == Stream.CONTROL:
                raise WireError(f"unexpected {f.type.name} frame in a KV stream")
            arrivals = [Arrival(f.stream, *unpack_segment(p)) for p in unpack_bundle(f.payload, MAX_BUNDLE, each)]
            for a in arrivals:
                self._check_place(a)
                got[a.stream] += 1
            now = time.time()
            with self._lock:
                self._bytes_in[f.stream] += len(f.payload)
                self._inbox.extend(arrivals)
                self._arrived_at.setdefault("first", now)
                if got[Stream.ANCHOR] == self.expected[0] and "anchor" not in self._arrived_at:
                    self._arrived_at["anchor"] = now
                if got[Stream.ANCHOR] + got[Stream.RESIDUAL] == total:
                    self._arrived_at["full"] = now

    def _check_place(self, a: Arrival) -> None:
        P = self.spec.prompt_len
        key = (a.stream, a.layer, a.kind, a.start)
        if a.layer >= self.spec.layers or a.start % self.unit or not self.first <= a.start < P \
                or a.count != min(self.unit, P - a.start):
            raise WireError(f"segment layer {a.layer} [{a.start}, {a.start + a.count}) is off the transfer's grid")
        if key in self._seen:
            raise WireError(f"segment layer {a.layer} {a.kind} at {a.start} arrived twice")
        if a.stream == Stream.RESIDUAL and not self.split:
            raise WireError(f"a residual segment for method {self.config.method!r}, which has none")
        self._seen.add(key)

    def drain(self, budget: int | None = None) -> int:
        """Check what arrived (at most `budget` segments) and hold it; returns how many. A malformed segment fails
        the transfer (`error`). No dequantization here: `piece` does it for whoever places the piece."""
        n = 0
        while self.error is None and (budget is None or n < budget):
            with self._lock:
                if not self._inbox:
                    break
                a = self._inbox[0]
            try:
                self._hold(a)
            except (WireError, ValueError, RuntimeError) as e:
                self._fail(f"transfer {self.xfer!r}: a bad segment from the prefill instance: {e}")
                break
            with self._lock:
                self._inbox.popleft()
            n += 1
        return n

    def _hold(self, a: Arrival) -> None:
        shape, dt = (1, self.spec.kv_heads, a.count, self.spec.head_dim), self.spec.torch_dtype
        key = (a.layer, a.kind, a.start)
        if a.stream == Stream.ANCHOR:
            self._held[key] = to_split(a.tensors, self.config, a.kind, a.axis, shape, dt)
            self._order["anchor" if self.split else "full"].append(key)
            return
        split = self._held.get(key)
        if split is None:  # the publisher queues a segment's anchor before its residual, on one connection
            raise WireError(f"residual segment layer {a.layer} {a.kind} at {a.start} before its anchor")
        split.residual = check_residual(a.tensors, self.config, a.kind, split.axis, shape, dt)
        self._order["full"].append(key)

    def close(self) -> None:
        """Stop receiving and drop the held copy."""
        self._closed.set()
        if self._ch is not None:
            self._ch.close()
        self._held.clear()
        with self._lock:
            self._inbox.clear()
