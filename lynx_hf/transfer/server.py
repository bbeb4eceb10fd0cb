"""`PrefillServer`: the prefill process's accept loop and what a connection may cost before and after it proves the
shared secret.

Contract (docs/wire-format.md, "Threat model"):
- Before authentication a connection costs one socket and two threads for at most `handshake_timeout` seconds (the
  TLS handshake included), within a budget of its own: `max_preauth` in all and `max_preauth_per_host` per source
  address. A new connection over the budget evicts the oldest one that has not yet sent its HELLO (else the oldest):
  idle peers cannot hold the door shut, and a legitimate client, which answers within a round trip, gets in.
- Authenticated connections have their own cap (`max_connections`); one over it is told "server busy" inside its
  authenticated channel. They are closed after `idle_timeout_s` without a request; a client that stops reading
  fails its sends after `send_timeout_s`, and its slot, thread and memory are freed.
- Peer input never reaches the log unquoted; nothing a peer sends is logged at traceback level.
- `accept()` failing (EMFILE, ENFILE, ENOBUFS) is logged and retried with back-off; the loop ends only on close().
- Memory (docs/wire-format.md, "Memory"): every byte held is under a named bound, logged at start
  (`memory_bounds`): the model, the prefix cache, `max_concurrent_prefills` working sets (a prompt's KV each), one
  forward pass at a time, and per connection `max_inflight_mb` of queued frames (a client that does not read
  stalls its own request there). Freed heap goes back to the system after each request (`release_memory`).
- The prefix cache (`prefix_cache_mb`, full-precision KV by chained block hash) is shared by every authenticated
  connection: one secret is one tenant; a hit costs a peer nothing it does not know, but its timing says whether a
  prefix was prefilled before (lynx_hf.transfer.prefix_cache)."""
from __future__ import annotations

import logging
import math
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field

import torch

from ..arch import fingerprint, kv_geometry, max_prompt_tokens
from ..errors import ConfigError
from ..flags import machine_mb
from ..link import Nic
from ..engine.warm import warm_up
from .prefill import ComputeQueue, PrefillNode, Slots, release_memory
from . import nixl
from .prefix_cache import PrefixCache
from .settings import ServerSettings, with_fields
from .auth import Channel, HandshakeRefused, PeerError, quote_peer, resolve_secret, server_handshake
from .transport import TcpTransport, TlsTcpTransport
from .wire import FrameType, WireError

log = logging.getLogger("lynx_hf.prefill")


def memory_bounds(model, prefix_cache_mb: float, max_inflight_mb: float, max_connections: int, slots: int,
                  prefill_step: int, nixl: bool = False) -> dict:
    """What the prefill server may hold, in bytes, by named bound (docs/wire-format.md, "Memory"): the model; the
    prefix cache; `slots` working sets, each a prompt's KV at most twice (the capture's copy, and the cache entries it
    reads if another request evicts them meanwhile), and as many of short prompts (one prefill step: their own
    slots); one forward pass's activations at a time (the compute queue),
    dominated at `prefill_step` tokens against a full context by one layer's attention scores and probabilities;
    per connection, its in-flight frames plus one layer's frames of one forward pass (queued inside a compute turn,
    which never waits) and, with the NIXL data plane, its staging buffer (the largest codec's segments of a whole
    context). Not counted: each connection's fixed cost (threads, buffers: ~1 MB)."""
    g, c = kv_geometry(model), model.config.get_text_config()
    size = torch.empty((), dtype=getattr(torch, g["dtype"])).element_size()
    per_layer = 2 * g["kv_heads"] * g["head_dim"] * size  # bytes a token, one layer (K and V)
    per_token = per_layer * g["num_layers"]
    context = max_prompt_tokens(model)
    heads, inter = getattr(c, "num_attention_heads", g["kv_heads"]), getattr(c, "intermediate_size", 0) or 0
    b = {"model": sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())),
         "prefix_cache": int(prefix_cache_mb * (1 << 20)),
         "working_sets": slots * 2 * (context + min(prefill_step, context)) * per_token,
         "compute": prefill_step * (2 * context * heads + 3 * inter) * size + prefill_step * per_token,
         "inflight": max_connections * (int(max_inflight_mb * (1 << 20)) + prefill_step * per_layer
                                        + (_nixl_stage(g, context) if nixl else 0))}
    return {**b, "total": sum(b.values()), "kv_bytes_per_token": per_token, "context": context,
            "short": min(prefill_step, context)}


def _nixl_stage(geometry: dict, context: int) -> int:
    """A NIXL connection's staging buffer at most: every segment of a whole context, by the largest codec."""
    from ..config import METHODS, LynxQuantConfig
    from .serde import stream_bound

    dtype = getattr(torch, geometry["dtype"])
    configs = [LynxQuantConfig(method=m) for m in METHODS] + [LynxQuantConfig(method=m, exact=True)
                                                              for m in ("lynx", "paper")]
    return max(stream_bound(c, geometry, context, dtype) for c in configs)


def describe_bounds(b: dict, slots: int, max_connections: int, max_inflight_mb: float) -> str:
    mb = lambda x: f"{x / (1 << 20):,.0f} MB"
    return (f"memory bounds: model {mb(b['model'])} + prefix cache {mb(b['prefix_cache'])} + working sets {slots} x "
            f"2 x ({b['context']} + {b['short']} short) tokens x {b['kv_bytes_per_token'] / 1024:.0f} KB = "
            f"{mb(b['working_sets'])} + one "
            f"forward pass {mb(b['compute'])} + in-flight frames {max_connections} connections x "
            f"({max_inflight_mb:g} MB + one layer's frames of a forward pass) = {mb(b['inflight'])}; total "
            f"{mb(b['total'])} (plus ~1 MB a connection)")


@dataclass(eq=False)
class _Pending:
    """A connection that has not yet proven the secret."""
    sock: socket.socket
    host: str
    since: float = field(default_factory=time.monotonic)
    spoke: bool = False  # its HELLO has arrived
    evicted: bool = False


def _victim(pool: list[_Pending]) -> _Pending | None:
    """Whom to drop first: the oldest connection that has not sent its HELLO, else the oldest."""
    return min(pool, key=lambda p: (p.spoke, p.since), default=None)


class _RateLimitedLog:
    """At most one line per `every` seconds for events a flood could repeat, with a count of those not shown."""

    def __init__(self, every: float = 1.0):
        self.every, self._last, self._quiet, self._lock = every, -math.inf, 0, threading.Lock()

    def warning(self, msg: str, *args) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every:
                self._quiet += 1
                return
            quiet, self._quiet, self._last = self._quiet, 0, now
        log.warning(msg + (f" (and {quiet} more like it)" if quiet else ""), *args)


class PrefillServer:
    """Accepts decode peers; each connection gets its own thread, transport and sender (so a slow or stalled client
    only ever delays itself), and a port of the server's one emulated NIC (`bandwidth_bps`, `latency_s`: a link
    shared fairly by the connections, lynx_hf.link). `data_plane="nixl"`: a client may have the segments' bytes
    written into its memory by NIXL (lynx_hf.transfer.nixl); the control frames stay on the channel. Forward passes
    go through one `ComputeQueue` (shortest remaining prompt first, a prefill step of `prefill_step` tokens a turn;
    the server's model-side state is one `PrefillNode`, `node`)."""

    def __init__(self, model, settings: ServerSettings | None = None, *, secret: str | None = None,
                 listen_socket: socket.socket | None = None, **fields):
        """settings: a ServerSettings (its fields may also come as keywords, over it or the defaults); secret: the
        shared secret (None: $LYNX_SECRET); listen_socket: bound by the caller (serve-prefill binds it before the
        model loads), else one is bound at the settings' host and port."""
        st = self.settings = with_fields(ServerSettings, settings, fields, "PrefillServer")
        host, data_plane, tls_cert, tls_key = st.host, st.data_plane, st.tls_cert, st.tls_key
        nixl.check_plane(data_plane)
        self.nixl = data_plane == "nixl"
        if self.nixl:
            nixl.agent("prefill")  # started now (UCX's set-up), not inside the first request
        self.tls = None
        if tls_cert:  # TLS on top of the frame MACs: confidentiality for links that leave the rack
            self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                self.tls.load_cert_chain(tls_cert, tls_key)
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"cannot load the TLS certificate {tls_cert}"
                                  f"{'' if tls_key else ' (no --tls-key: the key must be inside it)'}: {e}") from None
        self.model, self.secret, self.fp = model, resolve_secret(secret, st.insecure, host), fingerprint(model)
        warm_up(model)  # the codec's kernels and a request's paths now, not inside the first request
        if listen_socket is not None:  # bound by the caller (serve-prefill, before loading the model): listen now
            listen_socket.listen()
        self.sock = listen_socket or socket.create_server((host, st.port), reuse_port=False)
        self.address = self.sock.getsockname()[:2]
        self.compute = ComputeQueue()
        self.nic = Nic(st.bandwidth_bps, st.latency_s)  # one link for every connection, shared by deficit round-robin
        self.prefix = PrefixCache(int(st.prefix_cache_mb * (1 << 20)),
                                  f"{self.fp}|{next(model.parameters()).dtype}")  # shared by every connection
        self.slots = Slots(st.max_concurrent_prefills, st.prefill_step)  # requests holding a working set at once
        self.node = PrefillNode(model, st.prefill_step, self.compute, self.prefix, self.slots, self.fp)
        self.max_inflight = int(st.max_inflight_mb * (1 << 20))
        try:
            self.bounds = memory_bounds(model, st.prefix_cache_mb, st.max_inflight_mb, st.max_connections,
                                        st.max_concurrent_prefills, st.prefill_step, nixl=self.nixl)
        except ValueError as e:  # a layer kind whose KV no transfer can carry
            raise ConfigError(f"this model cannot be served: {e}") from None
        log.info(describe_bounds(self.bounds, st.max_concurrent_prefills, st.max_connections, st.max_inflight_mb))
        if self.bounds["total"] > machine_mb() * (1 << 20):
            log.warning("these bounds add up to more than this machine's memory (%.0f MB): lower --max-connections, "
                        "--max-inflight-mb, --max-concurrent-prefills or --prefix-cache-mb", machine_mb())
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the two budgets below
        self._conns = 0
        self._pending: list[_Pending] = []  # oldest first
        self._preauth_log = _RateLimitedLog()

    @property
    def connections(self) -> int:
        """Authenticated connections being served."""
        return self._conns

    @property
    def preauth(self) -> int:
        """Connections that have not (yet) proven the secret (not counting those evicted, whose threads are ending)."""
        with self._lock:
            return sum(not p.evicted for p in self._pending)

    def serve_forever(self) -> None:
        self.sock.settimeout(0.5)
        backoff = 0.05
        while not self._stop.is_set():
            try:
                conn, addr = self.sock.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if self._stop.is_set() or self.sock.fileno() < 0:
                    break
                log.error("accept failed: %s; evicting the oldest unauthenticated connection, retrying in %.2f s",
                          e, backoff)
                self._evict_oldest()
                self._stop.wait(backoff)
                backoff = min(2 * backoff, 1.0)
                continue
            backoff = 0.05
            self._admit(conn, addr)

    def start(self) -> "PrefillServer":
        threading.Thread(target=self.serve_forever, name="lynx-prefill-server", daemon=True).start()
        return self

    def _evict(self, victim: _Pending) -> None:
        victim.evicted = True
        try:
            victim.sock.shutdown(socket.SHUT_RDWR)  # its thread sees the end of the stream and frees the slot
        except OSError:
            pass

    def _evict_oldest(self, host: str | None = None) -> None:
        with self._lock:
            victim = _victim([p for p in self._pending if not p.evicted and (host is None or p.host == host)])
        if victim is not None:
            self._evict(victim)

    def _admit(self, conn: socket.socket, addr) -> None:
        pend, st = _Pending(conn, str(addr[0])), self.settings
        with self._lock:
            live = [p for p in self._pending if not p.evicted]
            same = [p for p in live if p.host == pend.host]
            over = same if len(same) >= st.max_preauth_per_host else live if len(live) >= st.max_preauth else []
            victim = _victim(over)
            self._pending.append(pend)
        if victim is not None:
            self._preauth_log.warning("pre-authentication budget full: dropping %s (unauthenticated for %.1f s)",
                                      victim.host, time.monotonic() - victim.since)
            self._evict(victim)
        threading.Thread(target=self._handle, args=(pend, addr), name="lynx-conn", daemon=True).start()

    def _handle(self, pend: _Pending, addr) -> None:
        ch, link, authed, peer = None, None, False, quote_peer(f"{addr[0]}:{addr[1]}")
        try:
            link = self.nic.port()  # this connection's share of the server's one (emulated) NIC
            conn = pend.sock
            t = TcpTransport(conn, link, self.settings.send_timeout_s) if self.tls is None else \
                TlsTcpTransport(conn, self.tls, server_side=True, link=link, timeout=self.settings.handshake_timeout,
                                send_timeout_s=self.settings.send_timeout_s)
            t.bound_inflight(self.max_inflight)  # a client that does not read stalls its own request, no queue grows
            ch = Channel(t)
            left = pend.since + self.settings.handshake_timeout - time.monotonic()
            server_handshake(ch, self.secret, self.fp, max(0.01, left),
                             on_hello=lambda: setattr(pend, "spoke", True))
            with self._lock:
                self._pending.remove(pend)
                authed = self._conns < self.settings.max_connections
                self._conns += authed
            if not authed:
                log.warning("refusing %s: %d authenticated connections already", peer, self.settings.max_connections)
                ch.send_json(FrameType.ERROR, {"error": "server busy: too many connections"}, wait=False).result(1)
                return
            plane = nixl.PrefillPlane(self.settings.send_timeout_s) if self.nixl else None
            try:
                self.node.serve(ch, peer, self.settings.idle_timeout_s, plane)
            finally:
                if plane is not None:
                    plane.close()
        except HandshakeRefused as e:
            self._preauth_log.warning("refused %s%s: %s", peer, " (evicted)" if pend.evicted else "", e)
        except (WireError, ConnectionError, TimeoutError, OSError) as e:
            if not authed:
                self._preauth_log.warning("client %s dropped before authenticating: %s", peer, e)
                return
            log.warning("client %s dropped: %s", peer, e)
            if not isinstance(e, PeerError):  # an ERROR from the peer is not answered with another
                try:
                    ch.send_json(FrameType.ERROR, {"error": str(e)[:500]}, wait=False).result(1)
                except Exception:  # noqa: BLE001 — the peer may be gone already
                    pass
        except Exception as e:  # noqa: BLE001 — a bug of ours: never let one request take the server down
            log.exception("request from %s failed: %s", peer, e)
        finally:
            with self._lock:
                if pend in self._pending:
                    self._pending.remove(pend)
                self._conns -= authed
            if ch is not None:
                ch.close()
            else:
                pend.sock.close()
            if link is not None:
                link.close()  # (a TLS handshake that failed left no sender to close it)
            if authed:
                release_memory(collect=True)  # what a failed request's traceback held goes back to the system

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
