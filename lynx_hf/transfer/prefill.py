"""Prefill side of one request: the prompt's forward pass in chunks, each layer's KV encoded and queued as it is
produced, and the connection's request loop.

During prefill every attention layer hands its new prompt KV to a `PromptCapture` (local.py); the layer's needed
positions (all of them, or a sliding window's last W) are encoded and queued as anchor segments (priority 0) and
residual segments (priority 1), so the link carries layer i while layer i+1 computes. The last position's logits
follow the anchors (FIRST), so the decode side picks the first token with its own generation options.

One forward pass runs at a time (`ComputeQueue`), shortest remaining prompt first: a long prompt prefills
`chunk` tokens per turn and queues again, so a short request waits for one chunk, not for a whole long prefill.
While a request waits its client hears PROGRESS frames, and a client that has gone (or cancelled) stops its work.

A conversation's next turn says what the decode side holds (`held`, with a digest): only positions [held, P) are
shipped, and a `PrefixCache` shared by the server's connections lets the forward pass start at the longest cached
prefix (the decode side's generated tokens, which this side never saw, are recomputed)."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import heapq
import hmac
import itertools
import logging
import threading
import time
from concurrent import futures

import torch

from ..arch import fingerprint, kv_geometry, max_prompt_tokens
from ..config import LynxQuantConfig
from ..local import PromptCapture
from ..quant import encode
from .prefix_cache import PrefixCache, layer_kv, token_digest
from .serde import pack_logits, pack_segment, stream_bound
from .session import Channel, quote_peer
from .transport import PRIO_ANCHOR, PRIO_END, PRIO_RESIDUAL
from .wire import MAX_JSON, SEGMENT_TOKENS, FrameType, PeerClosed, Stream, WireError

log = logging.getLogger("lynx_hf.prefill")
PREFILL_CHUNK = 1024  # tokens of one forward pass of a long prompt (a short request waits for at most one)
PROGRESS_S = 5.0      # a waiting request's client hears a PROGRESS frame at least this often


class Cancelled(Exception):
    """The decode side cancelled the request (CANCEL) while it was still being prefilled."""


class ComputeQueue:
    """One forward pass at a time; among waiters the one with the fewest prompt tokens left goes first (FIFO among
    equals). `turn(tokens, poll)` is a context manager; while it waits, `poll()` runs every `every` seconds (it
    may raise to give up the place)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._busy = False
        self._waiting: list = []  # heap of (tokens left, arrival)
        self._n = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @contextlib.contextmanager
    def turn(self, tokens: int, poll=None, every: float = PROGRESS_S):
        entry = (tokens, next(self._n))
        with self._cv:
            heapq.heappush(self._waiting, entry)
        try:
            while True:
                with self._cv:
                    if not self._busy and self._waiting[0] == entry:
                        heapq.heappop(self._waiting)
                        self._busy = True
                        break
                    self._cv.wait(every)
                if poll is not None:  # outside the lock: it may write to the connection
                    poll()
        except BaseException:
            with self._cv:
                if entry in self._waiting:
                    self._waiting.remove(entry)
                    heapq.heapify(self._waiting)
                self._cv.notify_all()
            raise
        try:
            yield
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()


def send_segment(ch: Channel, stream: Stream, rid: int, payload: bytes, priority: int, plane=None):
    """Queue one segment: a SEGMENT frame, or with a data plane (`nixl.PrefillPlane`) a PLACED frame whose bytes the
    plane moves just before it (a segment that no longer fits in the peer's arena goes as a SEGMENT frame)."""
    placed = plane.place(payload) if plane is not None else None
    if placed is None:
        return ch.send_binary(FrameType.SEGMENT, stream, rid, payload, priority, tag=rid)
    desc, bulk = placed
    return ch.send_binary(FrameType.PLACED, stream, rid, desc, priority, tag=rid, bulk=bulk)


def send_layer(ch: Channel, rid: int, cfg: LynxQuantConfig, layer: int, k: torch.Tensor, v: torch.Tensor,
               start: int, segment: int = SEGMENT_TOKENS, num_layers: int | None = None, plane=None) -> list:
    """Queue one layer's KV (k, v: [B, H_kv, S, D] for prompt positions [start, start + S)) as segments of
    `segment` tokens (small frames keep strict priority responsive). num_layers: the model's depth (CacheGen);
    plane: the request's data plane (None: the channel carries the bytes)."""
    futs = []
    S = k.shape[2]
    for kind, x in (("key", k), ("value", v)):
        for off in range(0, S, segment):
            s = encode(x[:, :, off:off + segment].contiguous(), cfg, kind,
                       layer=None if num_layers is None else (layer, num_layers))
            futs.append(send_segment(ch, Stream.ANCHOR, rid, pack_segment(layer, kind, start + off, s, False),
                                     PRIO_ANCHOR, plane))
            if s.residual is not None:
                futs.append(send_segment(ch, Stream.RESIDUAL, rid, pack_segment(layer, kind, start + off, s, True),
                                         PRIO_RESIDUAL, plane))
    return futs


def kv_handshake(model, rid: int, prompt_len: int, cfg: LynxQuantConfig) -> dict:
    """The PROMPT frame's JSON: what the decode side needs to build and check its LynxCache."""
    try:
        geometry = kv_geometry(model)
    except ValueError as e:  # a layer kind a transferred prompt cannot serve
        raise WireError(str(e)) from None
    return {"request_id": rid, **geometry, "prompt_len": prompt_len, "quant_config": cfg.to_dict()}


class _Segmenter:
    """Cuts each layer's shipped KV into SEGMENT frames on one grid (from the layer's first shipped position,
    `segment` tokens each), however the forward pass was chunked: the frames are those of an unchunked prefill.

    Frames are queued as the layers produce their KV while the connection's in-flight frames have room. Inside a
    compute turn (`in_turn`) nothing waits: a layer whose frames find no room keeps its positions pending — as a
    range of the capture's own KV (a sliding-window layer: its passes, within its window) — and `flush()`, outside
    the turn, queues them as the peer reads, so a client that stops reading stalls only its own request."""

    def __init__(self, ch: Channel, rid: int, cfg: LynxQuantConfig, prompt_len: int, num_layers: int,
                 segment: int = SEGMENT_TOKENS, plane=None):
        self.ch, self.rid, self.cfg, self.P, self.segment, self.plane = ch, rid, cfg, prompt_len, segment, plane
        self.num_layers = num_layers
        self.cap: PromptCapture | None = None  # set once the capture exists (span reads its KV)
        self.pending: dict[int, list] = {}  # layer -> [first unsent position, end seen, [(k, v)] of a sliding layer]
        self.futs: list = []
        self.in_turn = False

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        p = self.pending.setdefault(layer, [start, start, []])
        p[1] = start + k.shape[2]
        if not self.cap.whole(layer):
            p[2].append((k, v))
        if not (self.in_turn and not self.ch.t.has_room()):
            self._send(layer, wait=not self.in_turn)

    def flush(self) -> None:
        """Queue every pending layer's frames, waiting for room (outside a compute turn)."""
        for layer in list(self.pending):
            self._send(layer, wait=True)

    def _send(self, layer: int, wait: bool) -> None:
        s0, end, parts = self.pending[layer]
        n = end - s0
        full = n if end == self.P else n - n % self.segment
        if not full:
            return
        if parts:  # k, v: [B, H_kv, n, D] from the kept passes
            K, V = torch.cat([k for k, _ in parts], 2), torch.cat([v for _, v in parts], 2)
            self.pending[layer] = [s0 + full, end, [(K[:, :, full:].clone(), V[:, :, full:].clone())]
                                   if full < n else []]
            K, V = K[:, :, :full], V[:, :, :full]
        else:
            K, V = self.cap.span(layer, s0, s0 + full)
            self.pending[layer] = [s0 + full, end, []]
        for off in range(0, full, self.segment):
            if wait:
                self.ch.t.wait_room(self.ch.t.send_timeout_s)
            self.futs += send_layer(self.ch, self.rid, self.cfg, layer, K[:, :, off:off + self.segment],
                                    V[:, :, off:off + self.segment], s0 + off, self.segment, self.num_layers,
                                    self.plane)


def held_claim(req: dict, ids: list[int], cfg: LynxQuantConfig, fp: str) -> tuple[int, str | None]:
    """(first position to ship, why a claim was refused or None) from a REQUEST's `held` / `held_digest`: what the
    decode side says it holds must be a proper prefix of the prompt whose digest this side computes alike; a digest
    that does not match ships the whole prompt (held 0) and says why."""
    held = req.get("held", 0)
    if type(held) is not int or not 0 <= held < len(ids):
        raise WireError(f"held must be an int in [0, {len(ids)}) (the prompt's length: at least one new token), "
                        f"got {quote_peer(held, 40)}")
    if held == 0:
        return 0, None
    digest = req.get("held_digest")
    if not isinstance(digest, str) or not hmac.compare_digest(digest.encode("ascii", "replace"),
                                                              token_digest(fp, cfg.to_dict(), ids[:held]).encode()):
        return 0, f"held_digest does not match the prompt's first {held} tokens (model, codec or ids differ)"
    return held, None


def _validate(model, req: dict) -> tuple[list[int], LynxQuantConfig]:
    """A REQUEST's prompt and codec, checked before anything is allocated or computed."""
    ids = req.get("input_ids")
    limit = max_prompt_tokens(model)
    if not (isinstance(ids, list) and len(ids) > 0 and all(type(i) is int for i in ids)):
        raise WireError("input_ids must be a non-empty list of ints")
    if len(ids) > limit:
        raise WireError(f"a prompt of {len(ids)} tokens exceeds this model's context of {limit} tokens")
    vocab = model.config.get_text_config().vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        raise WireError(f"token id out of range [0, {vocab})")
    try:
        return ids, LynxQuantConfig.from_dict(req.get("quant_config") or {})
    except (ValueError, TypeError) as e:
        raise WireError(f"bad quant_config: {e}") from None


class Slots:
    """At most `n` requests hold a prompt's working set (its KV, once) at a time, and apart from them at most `n`
    short ones (prompts of at most `short` tokens: one prefill chunk), so that a short request never waits behind
    long transfers to slow clients. A waiter's `poll()` runs every `every` seconds (it may raise to give up)."""

    def __init__(self, n: int, short: int = PREFILL_CHUNK):
        self.n, self.short = n, short
        self._long, self._short = threading.BoundedSemaphore(n), threading.BoundedSemaphore(n)

    @contextlib.contextmanager
    def hold(self, tokens: int, poll=None, every: float = PROGRESS_S):
        sem = self._short if tokens <= self.short else self._long
        while not sem.acquire(timeout=every):
            if poll is not None:
                poll()
        try:
            yield
        finally:
            sem.release()


@torch.no_grad()
def serve_request(model, ch: Channel, req: dict, rid: int, compute: ComputeQueue | None = None,
                  chunk: int = PREFILL_CHUNK, prefix: PrefixCache | None = None, fp: str | None = None,
                  plane=None, slots: Slots | None = None) -> dict:
    """Validate a REQUEST, announce the KV (PROMPT), prefill in chunks of `chunk` tokens while streaming, then
    FIRST (logits) and END. `compute` orders the forward passes of all connections (its turn is held for one chunk);
    the paced transfer runs on this connection's own sender. A continued turn (`held` > 0, its digest checked) ships
    only positions [held, P); `prefix` (shared by every connection) supplies the longest cached prefix's KV, so only
    the tokens past it are computed, and keeps what was computed. `slots` bounds the requests that hold a working
    set at once (they wait for a slot, hearing PROGRESS). `plane`: the connection's NIXL plane (None: this server has
    none), used when the REQUEST names an arena."""
    ids, cfg = _validate(model, req)
    held, refused = held_claim(req, ids, cfg, fp or fingerprint(model))
    if refused:
        log.warning("request %s: %s; shipping the whole prompt", rid, refused)
    r = _Prefill(model, ch, rid, ids, cfg, compute or ComputeQueue(), chunk, prefix)
    dropped = None
    try:
        with (slots or Slots(1, chunk)).hold(len(ids), r.poll, PROGRESS_S):
            seg = r.run(req, held, refused, plane)
        dropped = _await_sent(ch, rid, seg.futs)
    except Cancelled:
        dropped = ch.t.drop(rid)
    finally:
        release_memory()
    prefill_s = r.prefill_s or time.perf_counter() - r.t0
    end = ch.send_json(FrameType.END, {"anchor_frames": ch.out_seq[Stream.ANCHOR],
                                       "residual_frames": ch.out_seq[Stream.RESIDUAL], "prefill_s": prefill_s,
                                       "cancelled": dropped is not None, "dropped": dropped or 0},
                       rid, PRIO_END, wait=False)
    end.result(ch.t.send_timeout_s + 5)
    return {"prompt_len": len(ids), "held": held, "prefix_hit": r.hit, "computed": len(ids) - r.hit,
            "refused": refused, "prefill_s": prefill_s, "compute_s": r.compute_s,
            "sent_s": time.perf_counter() - r.t0, "dropped_frames": dropped}


class _Prefill:
    """One request's working set, inside its slot: PROMPT, the cached prefix's KV and the computed rest through one
    capture (every frame queued as room allows), FIRST, and what was computed into the prefix cache. Nothing of the
    prompt's KV outlives `run`."""

    def __init__(self, model, ch: Channel, rid: int, ids: list[int], cfg: LynxQuantConfig, compute: ComputeQueue,
                 chunk: int, prefix: PrefixCache | None):
        self.model, self.ch, self.rid, self.ids, self.cfg = model, ch, rid, ids, cfg
        self.compute, self.chunk, self.prefix = compute, chunk, prefix
        self.t0, self.said = time.perf_counter(), time.monotonic()
        self.hit, self.lo, self.compute_s, self.prefill_s = 0, 0, 0.0, None

    def poll(self) -> None:
        """While the request waits (a slot, the compute): is its client still there, and tell it we are."""
        _check_peer(self.ch, self.rid)
        if time.monotonic() - self.said >= PROGRESS_S:
            self.said = time.monotonic()
            self.ch.send_json(FrameType.PROGRESS, {"prefilled": self.lo, "of": len(self.ids),
                                                   "queued": self.compute.waiting}, self.rid, wait=False)

    def run(self, req: dict, held: int, refused: str | None, plane) -> _Segmenter:
        P, ch, rid, cfg = len(self.ids), self.ch, self.rid, self.cfg
        self.hit, blocks = self.prefix.lookup(self.ids, P - 1) if self.prefix is not None else (0, [])
        prompt = {**kv_handshake(self.model, rid, P, cfg), "start": held, "refused": refused, "prefix_hit": self.hit}
        dp = req.get("data_plane")
        if dp is not None:
            if plane is None:
                raise WireError("this prefill server has no NIXL data plane (start it with --data-plane nixl)")
            plane.begin(dp, rid, stream_bound(cfg, prompt, P, getattr(torch, prompt["dtype"]), held))
            prompt["data_plane"] = "nixl"
        ch.send_json(FrameType.PROMPT, prompt, rid)
        seg = _Segmenter(ch, rid, cfg, P, len(prompt["windows"]), plane=plane if dp is not None else None)
        keep = self.prefix is not None and self.prefix.budget > 0
        cap = seg.cap = PromptCapture(self.model.config, seg, P, ship_from=held, keep=keep)
        try:
            device = next(self.model.parameters()).device
            for i in range(len(blocks[0]) if blocks else 0):  # the cached prefix, a layer at a time
                cap.update(*(x.to(device) for x in layer_kv(blocks, i)), i)
            del blocks  # no reference to the cache's entries from here on
            cap.forget_kept()
            logits = self._forward(cap, seg, device)
            seg.futs.append(ch.send_binary(FrameType.FIRST, Stream.CONTROL, rid, pack_logits(logits), PRIO_ANCHOR))
            if keep:  # what was computed, for the next turn (or another client's copy): one copy, per block
                self.prefix.insert(self.ids, self.hit, [cap.kept_kv(i, self.hit) for i in range(len(cap.held))])
        finally:
            seg.cap = None  # the capture (the prompt's KV) and the segmenter refer to each other: freed now, not by gc
        return seg

    def _forward(self, cap: PromptCapture, seg: _Segmenter, device) -> torch.Tensor:
        """The positions past the prefix hit, `chunk` tokens a compute turn; the last position's logits [1, V]."""
        P, out = len(self.ids), None
        for lo in range(self.hit, P, self.chunk):
            self.lo = lo
            with self.compute.turn(P - lo, self.poll, PROGRESS_S):
                t, seg.in_turn = time.perf_counter(), True
                try:
                    out = self.model(input_ids=torch.tensor([self.ids[lo:lo + self.chunk]], device=device), cache=cap,
                                     use_cache=True, logits_to_keep=1)
                finally:
                    seg.in_turn = False
                self.compute_s += time.perf_counter() - t
            _check_peer(self.ch, self.rid)
            seg.flush()  # what found no room during the turn, as the peer reads
        self.prefill_s = time.perf_counter() - self.t0
        return out.logits[:, -1]


def release_memory(collect: bool = False) -> None:
    """Give freed heap back to the system after a request (glibc keeps large freed blocks for reuse otherwise, so
    an idle server would stay at its peak); `collect`: first free what reference cycles still hold (a failed
    request's traceback and its frames' tensors). The trim is a no-op off glibc."""
    if collect:
        gc.collect()
    if _LIBC is not None:
        with _TRIM:
            _LIBC.malloc_trim(0)


def _libc():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        lib.malloc_trim.argtypes = [ctypes.c_size_t]
        return lib
    except (OSError, AttributeError):
        return None


_LIBC, _TRIM = _libc(), threading.Lock()


def _check_peer(ch: Channel, rid: int) -> None:
    """Read what the client sent meanwhile, if anything: CANCEL for this request raises Cancelled; a client that
    closed raises PeerClosed (its work stops); anything else is a protocol error."""
    if ch.t.readable(0):
        f = ch.recv(timeout=30, limit=MAX_JSON)
        if f.type != FrameType.CANCEL or f.request_id != rid:
            raise WireError(f"unexpected {f.type.name} frame for request {f.request_id} while serving request {rid}")
        raise Cancelled()


def _await_sent(ch: Channel, rid: int, futs: list, poll_s: float = 0.05) -> int | None:
    """Wait until the request's frames are on the wire, checking the connection every `poll_s`: a CANCEL from the
    decode side (it stopped early) drops what is still queued. Returns the number of frames dropped, None if none
    was. A client that stops reading fails the send after the transport's send timeout, and with it every queued
    frame. (A transport that cannot tell whether a frame waits, DistTransport, never sees a CANCEL here.)"""
    pending = list(futs)
    while pending:
        try:
            _check_peer(ch, rid)
        except Cancelled:
            return ch.t.drop(rid)
        pending = list(futures.wait(pending, timeout=poll_s).not_done)
    for f in futs:
        f.result()  # a failed send surfaces here
    return None


def serve_channel(model, ch: Channel, compute: ComputeQueue | None = None, peer: str = "peer",
                  idle_timeout_s: float = 300.0, chunk: int = PREFILL_CHUNK, prefix: PrefixCache | None = None,
                  fp: str | None = None, plane=None, slots: Slots | None = None) -> None:
    """An authenticated connection's requests on the prefill side, over any transport, until the peer closes or
    stays silent for `idle_timeout_s` (`peer`: how the log names it, already quoted); `plane`: the connection's NIXL
    plane, if the server has one; `slots`: the server's working-set slots. Wire and connection errors propagate to
    the caller."""
    last = 0
    compute = compute or ComputeQueue()
    fp = fp or fingerprint(model)  # a continued turn's digest names the model
    while True:
        try:
            f = ch.recv(timeout=idle_timeout_s, limit=MAX_JSON)
        except PeerClosed:
            return
        if f.type == FrameType.CANCEL and f.request_id <= last:
            continue  # the request had ended before the decode side's cancel arrived
        if f.type != FrameType.REQUEST:
            raise WireError(f"expected REQUEST, got {f.type.name}")
        last = f.request_id
        info = serve_request(model, ch, f.json(), f.request_id, compute, chunk, prefix, fp, plane, slots)
        log.info("request %s from %s: %s%s", f.request_id, peer, info,
                 f"; prefix cache {prefix.stats()}" if prefix is not None and prefix.budget else "")
