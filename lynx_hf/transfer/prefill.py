"""Prefill side of a connection: its requests, each prefilled in steps through the server's compute queue with every
layer's KV encoded and queued as it is produced.

Contract. `PrefillNode` binds what is per server once — the model, its fingerprint, KV geometry and limits (context,
vocabulary), the prefill step, the compute queue, prefix cache and working-set slots — and `PrefillNode.serve(ch)`
answers an authenticated connection's REQUESTs until the peer closes or stays idle. One request is one `_Prefill`,
which binds what is per request once (channel, request id, prompt, codec config, held range, data plane) and runs the
steps of vLLM's KVConnectorBase_V1 on the producer side: `validate` (the REQUEST, before anything is allocated),
`plan` (the prefix-cache hit, PROMPT, the data plane), `prefill` (the cached prefix, then the forward pass in steps,
FIRST), `send_layer` (one layer's segments, as the capture hands them over), `finish` (every frame on the wire, END).

During prefill every attention layer hands its new prompt KV to a `PromptCapture` (local.py); the positions the
layer's window keeps (all of them, or a sliding window's last W) are encoded and queued as anchor segments (priority
0) and residual segments (priority 1), so the link carries layer i while layer i+1 computes. The last position's
logits (FIRST) go ahead of every segment frame still queued (behind only the frame on the wire): the decode side
picks the first token from them with its own generation options while the KV it does not need yet streams on. So
that the forward pass is the first token's only wait, a compute turn encodes a layer's KV only while the link needs
it (`LEAD_S`) and within a budget (`ENCODE_SHARE`); the rest is encoded after FIRST, at the link's pace.

One forward pass runs at a time (`ComputeQueue`), shortest remaining prompt first: a long prompt prefills one
*prefill step* (`step` tokens) per turn and queues again, so a short request waits for one step, not for a whole
long prefill. While a request waits its client hears PROGRESS frames, and a client that has gone (or cancelled)
stops its work.

A conversation's next turn says what the decode side holds (`held`, with a digest): only positions [held, P) are
shipped, and a `PrefixCache` shared by the server's connections lets the forward pass start at the longest cached
prefix (the decode side's generated tokens, which this side never saw, are recomputed)."""
from __future__ import annotations

import contextlib
import dataclasses
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
from ..quant import correction, encode
from .auth import Channel, quote_peer
from .prefix_cache import PrefixCache, layer_kv, token_digest
from .serde import pack_logits, pack_segment, stream_bound
from .settings import PREFILL_STEP
from .transport import PRIO_ANCHOR, PRIO_CORRECTION, PRIO_END, PRIO_FIRST, PRIO_RESIDUAL
from .wire import MAX_JSON, SEGMENT_TOKENS, FrameType, PeerClosed, RequestRefused, Stream, WireError

log = logging.getLogger("lynx_hf.prefill")
PROGRESS_S = 5.0     # a waiting request's client hears a PROGRESS frame at least this often
LEAD_S = 0.25        # before the logits leave, encode a layer only while its connection has less of the anchor's
#                      priority queued than the link sends in this long: the link stays fed, and the forward (the
#                      first token's) is not slowed by encoding that the link could not carry before it ends anyway
ENCODE_SHARE = 0.03  # ... and while that encoding has taken at most this share of the time since the prefill began
#                      (one layer at least): a codec dearer than its link's pace (CacheGen's entropy coder on a CPU)
#                      waits for FIRST rather than delay it


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


class Slots:
    """At most `n` requests hold a prompt's working set (its KV, once) at a time, and apart from them at most `n`
    short ones (prompts of at most `short` tokens: one prefill step), so that a short request never waits behind
    long transfers to slow clients. A waiter's `poll()` runs every `every` seconds (it may raise to give up)."""

    def __init__(self, n: int, short: int = PREFILL_STEP):
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


def kv_handshake(model, rid: int, prompt_len: int, cfg: LynxQuantConfig, geometry: dict | None = None) -> dict:
    """The PROMPT frame's JSON: what the decode side needs to build and check its LynxCache (`geometry`: the
    model's `kv_geometry`, when the caller has it)."""
    if geometry is None:
        try:
            geometry = kv_geometry(model)
        except ValueError as e:  # a layer kind a transferred prompt cannot serve
            raise WireError(str(e)) from None
    return {"request_id": rid, **geometry, "prompt_len": prompt_len, "quant_config": cfg.to_dict()}


class PrefillNode:
    """What a prefill server binds once and every request reads: the model, its fingerprint (`fp`), KV geometry
    (None, with `unservable` saying why, for layer kinds no transfer can carry), context and vocabulary limits,
    device, the prefill `step`, and the server's shared `compute` queue, `prefix` cache and working-set `slots`."""

    def __init__(self, model, step: int = PREFILL_STEP, compute: ComputeQueue | None = None,
                 prefix: PrefixCache | None = None, slots: Slots | None = None, fp: str | None = None):
        self.model, self.step, self.prefix = model, step, prefix
        self.compute, self.slots = compute or ComputeQueue(), slots or Slots(1, step)
        self.fp = fp or fingerprint(model)  # a continued turn's digest names the model
        self.context, self.vocab = max_prompt_tokens(model), model.config.get_text_config().vocab_size
        self.device = next(model.parameters()).device
        try:
            self.geometry, self.unservable = kv_geometry(model), None
        except ValueError as e:  # refused per request, as the PROMPT it cannot state
            self.geometry, self.unservable = None, str(e)

    def serve(self, ch: Channel, peer: str = "peer", idle_timeout_s: float = 300.0, plane=None) -> None:
        """An authenticated connection's requests, over any transport, until the peer closes or stays silent for
        `idle_timeout_s` (`peer`: how the log names it, already quoted); `plane`: the connection's NIXL plane, if
        the server has one. Wire and connection errors propagate to the caller."""
        last = 0
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
            try:
                info = serve_request(self, ch, f.json(), f.request_id, plane)
            except RequestRefused as e:  # nothing of the request was sent: the connection goes on
                log.warning("request %s from %s refused: %s", f.request_id, peer, e)
                ch.send_json(FrameType.ERROR, {"error": str(e)[:500], "refused": True}, f.request_id)
                continue
            log.info("request %s from %s: %s%s", f.request_id, peer, info,
                     f"; prefix cache {self.prefix.stats()}" if self.prefix is not None and self.prefix.budget else "")


def serve_channel(model, ch: Channel, peer: str = "peer", idle_timeout_s: float = 300.0) -> None:
    """A connection's requests on a node of its own (one connection, no prefix cache): `PrefillNode(model).serve`."""
    PrefillNode(model).serve(ch, peer, idle_timeout_s)


@torch.no_grad()
def serve_request(node: PrefillNode, ch: Channel, req: dict, rid: int, plane=None) -> dict:
    """One REQUEST on `ch` (see `_Prefill`); `plane`: the connection's NIXL plane (None: this server has none),
    used when the REQUEST names an arena. Returns what the log line says of it."""
    return _Prefill(node, ch, req, rid, plane).run()


class _Prefill:
    """One REQUEST, its state bound once: the node, channel, request id, prompt, codec config, held range, data plane
    and — inside its working-set slot — the PROMPT, the capture and the segmenter. Its steps run in this order
    (`run`): validate, plan, prefill (with send_layer as each layer's KV arrives), finish. Nothing of the prompt's KV
    outlives `run`."""

    def __init__(self, node: PrefillNode, ch: Channel, req: dict, rid: int, plane=None):
        self.node, self.model, self.ch, self.req, self.rid, self.conn_plane = node, node.model, ch, req, rid, plane
        self.t0, self.said = time.perf_counter(), time.monotonic()
        self.ids: list[int] = []
        self.cfg: LynxQuantConfig | None = None
        self.held, self.refused = 0, None       # the decode side's held prefix [0, held), why a claim was refused
        self.plane = None                       # the request's data plane (None: the channel carries the bytes)
        self.num_layers, self.futs = 0, []      # the model's depth (CacheGen's bins), every queued frame's future
        self.hit, self.lo, self.compute_s, self.prefill_s = 0, 0, 0.0, None
        self.corrections: list = []  # exact mode: segments whose correction waits for the logits to leave
        self.seg: _Segmenter | None = None  # while the prompt's KV is being queued

    @property
    def prompt_len(self) -> int:
        return len(self.ids)

    def run(self) -> dict:
        self.validate()
        dropped = None
        try:
            with self.node.slots.hold(self.prompt_len, self.poll, PROGRESS_S):
                blocks = self.plan()
                self.prefill(blocks)
            dropped = _await_sent(self.ch, self.rid, self.futs)
        except Cancelled:
            dropped = self.ch.t.drop(self.rid)
        finally:
            release_memory()
        return self.finish(dropped)

    def validate(self) -> None:
        """The REQUEST's prompt, codec and held claim, checked before anything is allocated or computed."""
        ids, node = self.req.get("input_ids"), self.node
        if not (isinstance(ids, list) and len(ids) > 0 and all(type(i) is int for i in ids)):
            raise RequestRefused("input_ids must be a non-empty list of ints")
        if len(ids) > node.context:
            raise RequestRefused(f"a prompt of {len(ids)} tokens exceeds this model's context of {node.context} tokens")
        if min(ids) < 0 or max(ids) >= node.vocab:
            raise RequestRefused(f"token id out of range [0, {node.vocab})")
        try:
            self.ids, self.cfg = ids, LynxQuantConfig.from_dict(self.req.get("quant_config") or {})
        except (ValueError, TypeError) as e:
            raise RequestRefused(f"bad quant_config: {e}") from None
        if self.cfg.anchor_bits == "auto":
            raise RequestRefused("quant_config: anchor_bits 'auto' is chosen by the decode side before it sends a "
                                 "request; send the width (2, 3 or 4)")
        if self.cfg.exact and len(ids) > node.step:
            raise RequestRefused(f"exact mode prefills a prompt in one forward pass, as plain generate's prefill does "
                                 f"(chunks round differently): {len(ids)} tokens exceed this server's --prefill-step "
                                 f"of {node.step}")
        if self.cfg.exact and self.req.get("held"):
            raise RequestRefused("exact mode computes a continued turn's new positions on the decode node over the "
                                 "KV it holds, as Transformers' own turns do (DecodeClient does so): a held claim "
                                 "with an exact codec is refused")
        self.held, self.refused = held_claim(self.req, ids, self.cfg, node.fp)
        if self.refused:
            log.warning("request %s: %s; shipping the whole prompt", self.rid, self.refused)

    def plan(self) -> list:
        """Inside the slot: the prefix cache's hit, the data plane (when the REQUEST names an arena) and PROMPT.
        Returns the hit's blocks (the cached prefix's KV)."""
        node, P = self.node, self.prompt_len
        if node.unservable:
            raise RequestRefused(node.unservable)
        # (exact mode: no prefix reuse — the rest computed over cached KV rounds unlike one forward over the prompt)
        reuse = node.prefix is not None and not self.cfg.exact
        self.hit, blocks = node.prefix.lookup(self.ids, P - 1) if reuse else (0, [])
        prompt = {**kv_handshake(self.model, self.rid, P, self.cfg, node.geometry), "start": self.held,
                  "refused": self.refused, "prefix_hit": self.hit}
        dp = self.req.get("data_plane")
        if dp is not None:
            if self.conn_plane is None:
                raise RequestRefused("this prefill server has no NIXL data plane (start it with --data-plane nixl)")
            self.conn_plane.begin(dp, self.rid, stream_bound(self.cfg, prompt, P, getattr(torch, prompt["dtype"]),
                                                             self.held))
            self.plane, prompt["data_plane"] = self.conn_plane, "nixl"
        self.num_layers = len(prompt["windows"])
        self.ch.send_json(FrameType.PROMPT, prompt, self.rid)
        return blocks

    def prefill(self, blocks: list) -> None:
        """The cached prefix's KV and the computed rest through one capture (every frame queued as room allows),
        FIRST, and what was computed into the prefix cache."""
        node, P = self.node, self.prompt_len
        seg = self.seg = _Segmenter(self)
        keep = node.prefix is not None and node.prefix.budget > 0
        cap = seg.cap = PromptCapture(self.model.config, seg, P, ship_from=self.held, keep=keep)
        try:
            seg.defer = True  # the cached prefix's frames too: as the link needs them, never before the logits
            for i in range(len(blocks[0]) if blocks else 0):  # the cached prefix, a layer at a time
                cap.update(*(x.to(node.device) for x in layer_kv(blocks, i)), i)
            seg.defer = False
            del blocks  # no reference to the cache's entries from here on
            cap.forget_kept()
            logits = self._forward(cap, seg)
            self.futs.append(self.ch.send_binary(FrameType.FIRST, Stream.CONTROL, self.rid, pack_logits(logits),
                                                 PRIO_FIRST))
            seg.flush()  # what the compute turns left pending, behind the logits
            self._send_corrections()
            if keep:  # what was computed, for the next turn (or another client's copy): one copy, per block
                node.prefix.insert(self.ids, self.hit, [cap.kept_kv(i, self.hit) for i in range(self.num_layers)])
        finally:
            seg.cap = self.seg = None  # the capture (the prompt's KV), the segmenter and this request refer to one
            self.corrections.clear()   # another: freed now, not by gc

    def _forward(self, cap: PromptCapture, seg: "_Segmenter") -> torch.Tensor:
        """The positions past the prefix hit, one prefill step a compute turn; the last position's logits [1, V]."""
        P, step, out = self.prompt_len, self.node.step, None
        for lo in range(self.hit, P, step):
            self.lo = lo
            with self.node.compute.turn(P - lo, self.poll, PROGRESS_S):
                t, seg.defer = time.perf_counter(), True
                try:
                    out = self.model(input_ids=torch.tensor([self.ids[lo:lo + step]], device=self.node.device),
                                     cache=cap, use_cache=True, logits_to_keep=1)
                finally:
                    seg.defer = False
                self.compute_s += time.perf_counter() - t
            _check_peer(self.ch, self.rid)
            if lo + step < P:
                seg.feed()  # between steps: what keeps the link fed, without waiting
        self.prefill_s = time.perf_counter() - self.t0
        return out.logits[:, -1]

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Queue one layer's KV (k, v: [B, H_kv, S, D] for prompt positions [start, start + S)) as SEGMENT frames
        of at most SEGMENT_TOKENS tokens (small frames keep strict priority responsive): K then V, each segment's
        anchor (priority 0), then its residual (priority 1), then in exact mode its correction (priority 2), which
        before the logits leave is only noted (`corrections`: the segment's KV, a copy no larger than the prompt's):
        its stream goes last anyway, and computing it is the codec's dearest step."""
        S, codes = k.shape[2], dataclasses.replace(self.cfg, exact=False)  # (the correction once they are queued)
        for kind, x in (("key", k), ("value", v)):
            for off in range(0, S, SEGMENT_TOKENS):
                xs = x[:, :, off:off + SEGMENT_TOKENS].contiguous()
                s = encode(xs, codes, kind, layer=(layer, self.num_layers))
                self._queue(Stream.ANCHOR, pack_segment(layer, kind, start + off, s, "anchor"), PRIO_ANCHOR)
                if s.residual is not None:
                    self._queue(Stream.RESIDUAL, pack_segment(layer, kind, start + off, s, "residual"),
                                PRIO_RESIDUAL)
                if self.cfg.exact:
                    self.corrections.append((layer, kind, start + off, xs, s))
                    if not (self.seg is not None and self.seg.defer):
                        self._send_corrections()

    def _send_corrections(self) -> None:
        """Exact mode: compute and queue the noted segments' corrections, in order."""
        for layer, kind, pos, xs, s in self.corrections:
            s.correction = correction(xs, s)
            self._queue(Stream.CORRECTION, pack_segment(layer, kind, pos, s, "correction"), PRIO_CORRECTION)
        self.corrections.clear()

    def _queue(self, stream: Stream, payload: bytes, priority: int) -> None:
        """One segment: a SEGMENT frame, or with a data plane (`nixl.PrefillPlane`) a PLACED frame whose bytes the
        plane moves just before it (a segment that no longer fits in the peer's arena goes as a SEGMENT frame)."""
        placed = self.plane.place(payload) if self.plane is not None else None
        if placed is None:
            fut = self.ch.send_binary(FrameType.SEGMENT, stream, self.rid, payload, priority, tag=self.rid)
        else:
            desc, bulk = placed
            fut = self.ch.send_binary(FrameType.PLACED, stream, self.rid, desc, priority, tag=self.rid, bulk=bulk)
        self.futs.append(fut)

    def poll(self) -> None:
        """While the request waits (a slot, the compute): is its client still there, and tell it we are."""
        _check_peer(self.ch, self.rid)
        if time.monotonic() - self.said >= PROGRESS_S:
            self.said = time.monotonic()
            self.ch.send_json(FrameType.PROGRESS, {"prefilled": self.lo, "of": self.prompt_len,
                                                   "queued": self.node.compute.waiting}, self.rid, wait=False)

    def finish(self, dropped: int | None) -> dict:
        """END (frame counts per stream, prefill time, what a CANCEL dropped), once every frame is on the wire or
        dropped; returns what the log says of the request."""
        ch, prefill_s = self.ch, self.prefill_s or time.perf_counter() - self.t0
        end = ch.send_json(FrameType.END, {"anchor_frames": ch.out_seq[Stream.ANCHOR],
                                           "residual_frames": ch.out_seq[Stream.RESIDUAL],
                                           "correction_frames": ch.out_seq[Stream.CORRECTION], "prefill_s": prefill_s,
                                           "compute_s": self.compute_s,
                                           "cancelled": dropped is not None, "dropped": dropped or 0},
                           self.rid, PRIO_END, wait=False)
        end.result(ch.t.send_timeout_s + 5)
        return {"prompt_len": self.prompt_len, "held": self.held, "prefix_hit": self.hit,
                "computed": self.prompt_len - self.hit, "refused": self.refused, "prefill_s": prefill_s,
                "compute_s": self.compute_s, "sent_s": time.perf_counter() - self.t0, "dropped_frames": dropped}


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


class _Segmenter:
    """Cuts each layer's shipped KV into SEGMENT frames on one grid (from the layer's first shipped position,
    SEGMENT_TOKENS tokens each), however the forward pass was stepped: the frames are those of a prefill in one pass.

    Frames are queued (`_Prefill.send_layer`) as the layers produce their KV while the connection's in-flight frames
    have room. Before the logits leave (`defer`: the cached prefix's copy into the capture and every compute turn)
    nothing waits, and nothing is encoded that the link does not need yet (`LEAD_S`) or that would cost the forward
    more than `ENCODE_SHARE` of its time: a layer whose frames find no room, a link already fed, or a spent budget
    keeps its positions pending — as a range of the capture's own KV (a sliding-window layer: its passes, within its
    window) — and `flush()`, after FIRST, queues them as the peer reads, so a client that stops reading stalls only
    its own request."""

    def __init__(self, request: _Prefill):
        self.r, self.P, self.segment = request, request.prompt_len, SEGMENT_TOKENS
        self.cap: PromptCapture | None = None  # set once the capture exists (span reads its KV)
        self.pending: dict[int, list] = {}  # layer -> [first unsent position, end seen, [(k, v)] of a sliding layer]
        self.defer = False
        self.began, self.spent = time.perf_counter(), 0.0  # the encoding `feed` did, in seconds

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        p = self.pending.setdefault(layer, [start, start, []])
        p[1] = start + k.shape[2]
        if not self.cap.whole(layer):
            p[2].append((k, v))
        if self.defer:
            self.feed()  # the layers in order, as far as the link needs them
        else:
            self._send(layer, wait=True)

    def _fed(self) -> bool:
        """No room for more frames, more of the anchor's priority queued than a paced link sends in LEAD_S (a
        residual frame queued does not count: the anchors of the layers still to come go before it), or the encoding
        budget spent."""
        t = self.r.ch.t
        bps = getattr(t.link.nic, "bps", None)
        over = self.spent > ENCODE_SHARE * (time.perf_counter() - self.began)
        return over or not t.has_room() or (bps is not None and t.urgent * 8 > bps * LEAD_S)

    def feed(self) -> None:
        """Queue pending layers, in order, while the link needs them (never waiting: inside or between turns)."""
        for layer in list(self.pending):
            if self._fed():
                return
            t = time.perf_counter()
            self._send(layer, wait=False)
            self.spent += time.perf_counter() - t

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
        t = self.r.ch.t
        for off in range(0, full, self.segment):
            if wait:
                t.wait_room(t.send_timeout_s)
            self.r.send_layer(layer, K[:, :, off:off + self.segment], V[:, :, off:off + self.segment], s0 + off)


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
