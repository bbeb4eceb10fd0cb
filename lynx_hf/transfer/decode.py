"""Decode side: `NetworkLoader` (the LynxCache loader that a receiving thread drives) and `DecodeClient`, which
sends a request to a prefill server, builds the LynxCache from the KV handshake, and generates with plain
`model.generate(prompt, cache=..., custom_generate=speculative_generate)`.

Conversations: `DecodeClient.generate(ids, cache=previous)` (or a `Session`, which keeps the cache between turns)
says in its REQUEST how many tokens the cache holds and their digest; the prefill side ships only the new positions,
anchor first, which the cache takes as a new range behind its held, full-precision prefix. A refused claim (the
digest did not match) is answered with the whole prompt, into a new cache, and `stats.held_refused` says why."""
from __future__ import annotations

import socket
import ssl
import threading
import time

import torch

from ..arch import fingerprint, kv_geometry, max_prompt_tokens
from ..cache import LynxCache
from ..config import LynxQuantConfig, SpecConfig
from ..engine.warm import warm_up
from ..errors import ConfigError
from ..loader import Loader
from ..cache.conversation import extend_here
from ..session import PLACES, Placement, Session, TurnResult, check_turn, decode_turn
from ..width import WidthPolicy, kept_width, resolve, step_from_trace, step_times, values_per_position
from .prefix_cache import token_digest
from . import nixl
from .settings import ClientSettings, with_fields
from .serde import check_correction, check_residual, stream_bound, to_split, unpack_logits, unpack_segment, warm
from .auth import Channel, PeerError, client_handshake, quote_peer, resolve_secret
from .transport import TcpTransport, TlsTcpTransport
from .wire import FrameType, RequestRefused, Stream, WireError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class NetworkLoader(Loader):
    """Receives one request's frames after PROMPT: checks each and writes it into the cache (segments, FIRST's
    logits); END closes the request. Any failure (peer gone, bad frame, timeout) is handed to the cache, so the
    decoder raises instead of emitting unverified tokens. The thread always reads to END (or an error): the channel
    belongs to the DecodeClient, whose next request starts after it. `close` before END (the decoder stopped early:
    EOS, a stop string, max tokens) sends CANCEL, and the prefill side drops the frames it still has queued."""

    def __init__(self, ch: Channel, prompt: dict, rid: int, timeout_s: float = 30.0, arena=None):
        """arena: the request's NIXL receive memory (`nixl.Arena`), which PLACED frames refer to; closed at END."""
        self.ch, self.p, self.rid, self.timeout, self.arena = ch, prompt, rid, timeout_s, arena
        self.prefill_s: float | None = None  # END's: the request's time to its forward pass's end (waits included)
        self.compute_s: float | None = None  # END's: the forward passes' own time
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.cancelled = False
        self.dropped = 0  # frames the prefill side dropped after our CANCEL
        self.placed = 0   # segments that came by the data plane (PLACED frames)

    def attach(self, cache: LynxCache) -> "NetworkLoader":
        self.cache = cache
        cache.loader = self
        threading.Thread(target=self._run, name="lynx-receiver", daemon=True).start()
        return self

    def _run(self) -> None:
        p = self.p
        B, H, D, dtype = p["batch"], p["kv_heads"], p["head_dim"], DTYPES[p["dtype"]]
        try:
            while True:
                f = self._recv()
                if f.request_id != self.rid:
                    raise WireError(f"frame for request {f.request_id} inside request {self.rid}")
                if f.type == FrameType.SEGMENT:
                    self._segment(f.stream, f.payload, B, H, D, dtype)
                elif f.type == FrameType.PLACED:
                    if self.arena is None:
                        raise WireError("a PLACED frame, but this request named no data-plane arena")
                    self._segment(f.stream, self.arena.take(f.payload, self.timeout), B, H, D, dtype)
                    self.placed += 1
                elif f.type == FrameType.PROGRESS:
                    continue  # the request waits for the prefill's compute: the server is alive, keep waiting
                elif f.type == FrameType.FIRST:
                    self.cache.put_logits(unpack_logits(f.payload, B, p["vocab"], dtype))
                elif f.type == FrameType.END and f.json().get("cancelled"):
                    if not self.cancelled:
                        raise WireError("END says the request was cancelled, but this side did not cancel it")
                    j = f.json()  # what was dropped never comes: each stream goes on after the dropped frames
                    self.ch.checker.skip_to(Stream.ANCHOR, j.get("anchor_frames"))
                    self.ch.checker.skip_to(Stream.RESIDUAL, j.get("residual_frames"))
                    self.ch.checker.skip_to(Stream.CORRECTION, j.get("correction_frames", 0))
                    self.dropped = int(j.get("dropped") or 0)
                    self._times(j)
                    self._release()
                    self.done.set()
                    return
                elif f.type == FrameType.END:
                    j = f.json()
                    if (j.get("anchor_frames"), j.get("residual_frames"), j.get("correction_frames", 0)) != (
                            self.ch.checker.next[Stream.ANCHOR], self.ch.checker.next[Stream.RESIDUAL],
                            self.ch.checker.next[Stream.CORRECTION]):
                        raise WireError(f"END counts {j} do not match the frames received")
                    if self.cache.prefill_logits is None or not self.cache.residual_ready():
                        raise WireError("END before the whole prompt KV and the logits arrived")
                    self._times(j)
                    self._release()
                    self.done.set()
                    return
                else:
                    raise WireError(f"unexpected {f.type.name} frame during a transfer")
        except BaseException as e:  # noqa: BLE001 — delivered to the decoding thread
            self.error = e
            self.cache.fail(e)

    def close(self) -> None:
        """The decoder is done with this request: if its streams are still coming, ask the prefill side to stop."""
        if not self.done.is_set() and self.error is None and not self.cancelled:
            self.cancelled = True
            try:
                self.ch.send_json(FrameType.CANCEL, {}, self.rid, wait=False)
            except Exception:  # noqa: BLE001 — a broken connection shows up in the receiver as well
                pass

    def _recv(self):
        """The next frame; with a NIXL arena, UCX is progressed while none is waiting (it has no thread of its own)."""
        if self.arena is not None:
            deadline = time.monotonic() + self.timeout
            while not self.ch.t.readable(0.002):
                self.arena.agent.progress()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no frame from the peer within {self.timeout:.3g} s")
        return self.ch.recv(self.timeout)

    def _times(self, end: dict) -> None:
        """END's times, kept when they are finite non-negative numbers (a peer's other values are not times)."""
        ok = lambda v: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9 else None
        self.prefill_s, self.compute_s = ok(end.get("prefill_s")), ok(end.get("compute_s"))

    def _release(self) -> None:
        """The streams have ended: nothing more is written into the arena (every write completed before its PLACED
        frame was sent, and END follows them)."""
        if self.arena is not None:
            self.arena.close()

    def _segment(self, stream, payload, B, H, D, dtype) -> None:
        layer, kind, axis, start, count, tensors = unpack_segment(payload)
        P, cfg = self.p["prompt_len"], self.cache.quant_config
        if not 0 <= layer < self.p["num_layers"]:
            raise WireError(f"segment for layer {layer} of {self.p['num_layers']}")
        first = self.cache.layers[layer].store.offset  # the range's first position this layer takes (a sliding
        # layer: its window's last positions; a continued turn: nothing before what the cache holds)
        if not (0 < count and first <= start and start + count <= P):
            raise WireError(f"segment of layer {layer}: tokens [{start}, {start + count}) outside [{first}, {P})")
        shape = (B, H, count, D)
        if stream == Stream.ANCHOR:
            self.cache.put_anchor(layer, kind, start, to_split(tensors, cfg, kind, axis, shape, dtype))
        elif stream == Stream.RESIDUAL:
            self.cache.put_residual(layer, kind, start, check_residual(tensors, cfg, kind, axis, shape, dtype))
        elif stream == Stream.CORRECTION:
            self.cache.put_residual(layer, kind, start, check_correction(tensors, cfg, shape, dtype), "correction")
        else:
            raise WireError("segment on the control stream")


class DecodeClient:
    """The decode process's side of one connection to a prefill server."""

    def __init__(self, model, host: str | None = None, port: int | None = None,
                 settings: ClientSettings | None = None, *, secret: str | None = None, transport=None,
                 model_fingerprint: str | None = None, **fields):
        """settings: a ClientSettings (its fields may also come as keywords, over it or the defaults: timeout_s,
        insecure, tls, tls_ca, data_plane, prefill_on, link_bps). secret: the shared secret (None: $LYNX_SECRET).
        transport: an open Transport instead of host/port (e.g. a DistTransport to the prefill rank, whose side runs
        `server_handshake` and `serve_channel`). model_fingerprint: `arch.fingerprint(model)` if the caller has it
        (a process that reconnects computes it once). Without `link_bps`, `anchor_bits="auto"` (`self.width`,
        lynx_hf.width) measures the link by Lynx requests of 256 positions or more; until then it takes 4 bits.
        Everything this side must compute happens before it connects, so that the server's handshake deadline
        measures the network and the peer only."""
        st = self.settings = with_fields(ClientSettings, settings, fields, "DecodeClient")
        timeout_s, data_plane, tls, tls_ca = st.timeout_s, st.data_plane, st.tls, st.tls_ca
        self.model, self.timeout = model, timeout_s
        self.placement = Placement(st.prefill_on)
        self.width = WidthPolicy(st.link_bps)
        self.context = max_prompt_tokens(model)
        nixl.check_plane(data_plane)
        self.data_plane = data_plane
        if data_plane == "nixl":
            nixl.agent("decode")  # UCX's set-up before the first request
        key = resolve_secret(secret, st.insecure, host if transport is None else None)
        self.fp = model_fingerprint or fingerprint(model)
        self.geometry = kv_geometry(model)  # a PROMPT frame must declare exactly this
        warm_up(model)  # the codec's kernels and every path of a request, before the first one (and the handshake)
        if transport is not None:
            if data_plane == "nixl" and not isinstance(transport, TcpTransport):
                raise ConfigError("the NIXL data plane needs a TCP or TLS control channel (host and port)")
            t = transport
        elif host is None or port is None:
            raise ValueError("DecodeClient needs host and port, or a transport")
        elif tls or tls_ca:
            ctx = ssl.create_default_context(cafile=tls_ca)
            sock = socket.create_connection((host, port), timeout=timeout_s)
            t = TlsTcpTransport(sock, ctx, server_side=False, server_hostname=host, timeout=timeout_s)
        else:
            t = TcpTransport.connect(host, port, timeout_s)
        self.ch = Channel(t)
        self._rid = 0
        self._broken: BaseException | None = None
        self._lock = threading.Lock()  # one request at a time on the connection (threads sharing a client queue)
        try:
            client_handshake(self.ch, key, self.fp)
        except BaseException:
            self.ch.close()
            raise

    def _check_handshake(self, p: dict, prompt_len: int, cfg: LynxQuantConfig) -> None:
        got = {k: p.get(k) for k in self.geometry}
        if got != self.geometry or p.get("prompt_len") != prompt_len:
            bad = {k: (got[k], v) for k, v in self.geometry.items() if got[k] != v}
            raise WireError(f"KV handshake does not match this model and request (declared, expected): "
                            f"{bad or {'prompt_len': (p.get('prompt_len'), prompt_len)}}")
        try:
            srv_cfg = LynxQuantConfig.from_dict(p.get("quant_config"))
        except (ValueError, TypeError) as e:
            raise WireError(f"bad codec config in handshake: {e}") from None
        if srv_cfg != cfg:
            raise WireError("the prefill side chose a different codec config")

    def generate(self, input_ids: list[int], quant_config: LynxQuantConfig | None = None, max_new_tokens: int = 32,
                 speculative: bool = True, spec_config: SpecConfig | None = None, cache: LynxCache | None = None,
                 keep_cache: bool = False, prefill_on: str | None = None, **gen_kwargs) -> TurnResult:
        """Send the prompt, receive its KV and logits, and generate up to `max_new_tokens` tokens (the first
        included; fewer where the model's context ends: `finish_reason` "context") with any generation options
        (`gen_kwargs`, greedy by default). `cache`: the LynxCache of this conversation's previous turn
        (result["cache"]); `input_ids` then extends what it holds and only the new positions cross the link. With a
        cache (or `keep_cache`) the request's streams always run to their end, so that the returned cache can be
        continued; without, an early stop cancels what is still queued.

        Failures. A refusal of this request — its arguments here (before anything is sent), the prefill server's
        (`RequestRefused`: its context, the codec) or generate's own (an option it rejects) — leaves the connection
        usable; only a failed transport (peer gone, a bad frame, a timeout) breaks it (`broken`). Threads may share
        a client: its requests take turns on the connection."""
        ids, max_new = check_turn(self.model, self.geometry["vocab"], self.context, input_ids, max_new_tokens, cache)
        if prefill_on is not None and prefill_on not in PLACES:
            raise ValueError(f"prefill_on must be one of {', '.join(PLACES)}, got {prefill_on!r}")
        with self._lock:
            if self._broken is not None:
                raise ConnectionError(f"this connection failed earlier ({self._broken}); open a new DecodeClient "
                                      f"and go on with Session.reconnect(client)")
            return self._turn(ids, max_new, max_new < max_new_tokens, quant_config, speculative, spec_config, cache,
                              keep_cache or cache is not None, prefill_on, gen_kwargs)

    def _turn(self, ids, max_new, clipped, quant_config, speculative, spec_config, cache, keep, prefill_on,
              gen_kwargs):
        cfg = cache.quant_config if cache is not None and quant_config is None else quant_config or LynxQuantConfig()
        if cache is not None:  # the turn runs on a branch: whatever fails, `cache` stays as it was
            cache = cache.fork()
        held = cache.conversation.continue_turn(ids) if cache is not None else 0  # waits for the last turn's residual
        cfg, width = self._width(cfg, cache, ids.shape[1] - held, max_new, spec_config,
                                 0 if not speculative or cfg.exact else None)
        spec = spec_config or SpecConfig.for_anchor(cfg.anchor_bits, max_draft_steps=64 if speculative else 0)
        if held and cfg.exact:  # exact mode: a turn goes on where Transformers' own would (the held KV, one forward)
            prefill_on = "decode"
        if self.placement.choose(ids.shape[1] - held, held, lambda: self._probe(ids), prefill_on) == "decode":
            return self._turn_here(ids, max_new, clipped, spec, cache, held, gen_kwargs, width)
        t0, p, rid, arena = self._request(ids, cfg, held)
        if p["start"] == held and cache is not None:  # the new range, behind what the cache holds
            cache.conversation.begin_range(ids, quant_config=cfg)
        else:  # a first turn, or a refused claim: the whole prompt into a new cache
            # waits are bounded by the loader's per-frame timeout (a silent peer fails the cache), not by the cache's
            cache = LynxCache(p["num_layers"], p["prompt_len"], cfg, dtype=DTYPES[p["dtype"]], device=ids.device,
                              timeout_s=self.timeout + 600, sliding_windows=p["windows"]).bind(self.model)
            cache.conversation.expect_prompt(ids)
        cache.trace.stats.width = width
        loader = NetworkLoader(self.ch, p, rid, self.timeout, arena).attach(cache)
        try:
            out = decode_turn(self.model, ids, cache, spec, max_new, gen_kwargs, t0)  # one clock: from sending it
        except BaseException as e:
            if not (isinstance(e, Exception) and self._settle(cache, loader, cancel=True)):
                self._broken = e  # interrupted, or the stream did not end cleanly: the connection's state is unknown
            raise
        self._settle(cache, loader, cancel=not keep)  # without keep, an early stop cancels the frames still queued
        marks = cache.trace.times("draft", "verified")  # the first token needs no KV: the second is the KV-bound one
        self.placement.observe("prefill", ids.shape[1] - p["start"], marks[1] if len(marks) > 1 else None)
        self._observe_width(cfg, cache, loader, ids.shape[1] - (p.get("prefix_hit") or 0))
        return TurnResult.of(out[0, ids.shape[1]:].tolist(), t0, cache, held, p.get("prefix_hit"), loader, max_new,
                             clipped, refused=p.get("refused"))

    def _width(self, cfg: LynxQuantConfig, cache, positions: int, max_new: int, spec: SpecConfig | None,
               steps: int | None):
        """(the config this request is sent with, the width choice as a dict or None): anchor_bits "auto" is chosen
        by `self.width` with this request's drafting settings (`steps` 0: it does not draft); a continued turn
        keeps its cache's width."""
        if cfg.anchor_bits != "auto":
            return cfg, None
        if cache is not None:
            choice = kept_width(cache.quant_config.anchor_bits)
        else:
            if self.width.step_s is None:
                self.width.step_s = step_times(self.model, positions)
            base = spec or SpecConfig()
            choice = self.width.choose(positions, values_per_position(self.geometry), max_new, base.verify_lead,
                                       cfg.chunk_size, base.max_draft_steps if steps is None else steps)
        return resolve(cfg, choice), choice.as_dict()

    def _observe_width(self, cfg: LynxQuantConfig, cache, loader, computed: int) -> None:
        """What a Lynx request tells the width policy: the drafts its width kept, the link's rate, the compute and
        its draft steps' time (another codec's stream is paced by its own encoder: CacheGen's coder)."""
        if cfg.method not in ("lynx", "paper"):
            return
        st = cache.stats
        self.width.observe(cfg.anchor_bits, st.drafted, st.accepted)
        self.width.observe_link(cache.nbytes(), st.residual_at_s, loader.compute_s, computed)
        step = step_from_trace(cache.trace.times("draft"))
        if step is not None and self.width.step_s is not None:
            self.width.step_s[cfg.anchor_bits] = step

    def _turn_here(self, ids, max_new, clipped, spec, cache, held, gen_kwargs, width) -> TurnResult:
        """A continued turn whose new positions [held, L) are computed here, in full precision: nothing crosses
        the link, and nothing is left to verify (the KV is the model's own)."""
        t0 = time.perf_counter()
        extend_here(self.model, cache, ids, held)
        cache.trace.stats.width = width
        self.placement.observe("decode", ids.shape[1] - held, time.perf_counter() - t0)
        out = decode_turn(self.model, ids, cache, spec, max_new, gen_kwargs, t0)
        return TurnResult.of(out[0, ids.shape[1]:].tolist(), t0, cache, held, None, None, max_new, clipped, "decode")

    @torch.no_grad()
    def _probe(self, ids: torch.Tensor) -> float:
        """This node's prefill seconds per position: one timed forward of up to 64 of the turn's ids."""
        k = min(64, ids.shape[1])
        t = time.perf_counter()
        self.model(input_ids=ids[:, :k], use_cache=False, logits_to_keep=1)
        return (time.perf_counter() - t) / k

    def _request(self, ids: torch.Tensor, cfg: LynxQuantConfig, held: int):
        """Send the REQUEST and read its PROMPT: (t0, prompt, request id, NIXL arena or None). The server's refusal
        of this request (RequestRefused) leaves the connection as it was; any other failure breaks it."""
        self._rid += 1
        rid = self._rid
        warm(cfg, self.geometry, ids.shape[1], DTYPES[self.geometry["dtype"]], held)  # the receiver: no torch op
        req = {"input_ids": ids[0].tolist(), "quant_config": cfg.to_dict(), "held": held}
        if held:
            req["held_digest"] = token_digest(self.fp, cfg.to_dict(), req["input_ids"][:held])
        arena = None
        if self.data_plane == "nixl":  # receive memory for every segment the codec can send, named in the REQUEST
            arena = nixl.Arena(stream_bound(cfg, self.geometry, ids.shape[1], DTYPES[self.geometry["dtype"]], held),
                               rid)
            req["data_plane"] = arena.request()
        t0 = time.perf_counter()
        try:
            self.ch.send_json(FrameType.REQUEST, req, rid)
            p = self._recv_prompt()
            self._check_handshake(p, ids.shape[1], cfg)
            if p.get("start") not in (held, 0) or (p.get("start") == 0 and held and not p.get("refused")):
                raise WireError(f"the prefill side ships from position {p.get('start')!r}, this side holds {held}")
            if arena is not None and p.get("data_plane") != "nixl":
                raise WireError("the prefill server did not take the NIXL data plane")
        except PeerError as e:
            if not (e.refused and e.request_id == rid):
                self._broken, self._arena = e, arena
                raise
            if arena is not None:
                arena.close()  # the server never began this request's data plane
            raise RequestRefused(f"the prefill server refused this request: {quote_peer(e.reason)}") from None
        except BaseException as e:
            # (a broken connection keeps its arena: nothing may write freed memory)
            self._broken, self._arena = e, arena
            raise
        return t0, p, rid, arena

    def _settle(self, cache: LynxCache, loader: "NetworkLoader", cancel: bool) -> bool:
        """After generate: the request's streams read to their end — `cancel`: what is still queued is dropped
        (nothing will read it) — bounded by the receiver's per-frame timeout. Returns whether the connection can
        carry another request."""
        if cancel:
            cache.close()
        while not loader.done.wait(0.2) and loader.error is None:
            pass
        if loader.error is not None:  # the connection is no longer usable (a completed generate was verified)
            self._broken = loader.error
        return loader.error is None

    def _recv_prompt(self) -> dict:
        """The PROMPT frame's JSON, after any PROGRESS (the request waits for a working-set slot: the server is
        alive)."""
        while (f := self.ch.recv(self.timeout)).type == FrameType.PROGRESS:
            pass
        if f.type != FrameType.PROMPT:
            raise WireError(f"expected PROMPT, got {f.type.name}")
        return f.json()

    def session(self, cache: LynxCache | None = None, tokenizer=None, **defaults) -> "Session":
        """A conversation on this connection: each `Session.generate(conversation)` continues the previous turn's
        cache. `cache`: a conversation to resume (another session's `cache`, e.g. after its connection failed);
        tokenizer: for chat messages."""
        return Session(self, cache=cache, tokenizer=tokenizer, **defaults)

    @property
    def broken(self) -> bool:
        """A request failed on this connection: it cannot carry another (open a new DecodeClient)."""
        return self._broken is not None

    def close(self) -> None:
        self.ch.close()
