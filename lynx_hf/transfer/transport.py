"""A narrow transport interface with async start/wait pairs (like vLLM's KV connectors), and its backends.

    start_send(frame, priority, tag, bulk) -> Future
                                             enqueue; frames leave in priority order (lowest first), FIFO within
                                             one; after a failed send every queued and later frame fails too;
                                             `bulk` (a data plane's bytes, e.g. NIXL's) is posted just before
                                             its frame, paced with it
    drop(tag) -> int                         cancel the frames of `tag` still queued (not yet on the wire)
    bound_inflight(nbytes); has_room();      the bytes queued and not yet written (`inflight`) stay under a bound
    wait_room(timeout)                       its senders keep to: a peer that does not read stalls its own
                                             sender, never grows the queue
    readable(timeout) -> bool                a frame (or the end of the stream) is waiting to be received
    wait_send(future, timeout)               until that frame is on the wire
    recv(timeout, limit) -> Frame            next frame within `timeout` seconds in all (checked: header, length
                                             bound `limit`, CRC); WireError / PeerClosed / TimeoutError
    close()

Strict priority is applied at frame granularity by a feeder thread per connection, which hands frames to the
connection's port of an emulated NIC (lynx_hf.link: shared by every stream of the connection and, on a server, by
every connection) as the NIC takes them; a sender thread writes each when the link delivers it — so on loopback the
anchor really gets the link first."""
from __future__ import annotations

import heapq
import itertools
import queue
import select
import socket
import ssl
import threading
import time
from concurrent.futures import Future

import torch

from ..link import LinkEmulator, NicPort
from .wire import HEADER, MAGIC, MAX_PAYLOAD, FrameType, PeerClosed, WireError, json_frame, parse_frame, read_frame

PRIO_FIRST, PRIO_ANCHOR, PRIO_RESIDUAL, PRIO_CORRECTION, PRIO_END = -1, 0, 1, 2, 3  # FIRST: logits sent ahead
PLAIN_TO_TLS = ("the prefill server speaks TLS: connect with tls=True or tls_ca=... (serve-decode --tls or "
                "--tls-ca)")
DSCP = {PRIO_FIRST: 46 << 2, PRIO_ANCHOR: 46 << 2, PRIO_RESIDUAL: 10 << 2, PRIO_CORRECTION: 10 << 2,
        PRIO_END: 10 << 2}  # EF for the logits and the anchor, AF11 for the rest


class Transport:
    """Base: a feeder thread hands frames in priority order to the connection's port of the NIC, and a sender thread
    writes each when the emulated link delivers it; subclasses provide _write(bytes, priority) and recv."""

    send_timeout_s = 60.0  # a frame that cannot be written within this fails the connection

    def __init__(self, link: NicPort | None = None):
        self.link = link or LinkEmulator()
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._n = itertools.count()
        self._lock = threading.Lock()  # orders start_send against the sender's failure
        self._error: BaseException | None = None
        self._closed = threading.Event()
        self._wire: queue.Queue = queue.Queue()  # frames on the (emulated) wire, in order, with their delivery time
        self.max_inflight: int | None = None  # bound_inflight
        self.inflight = 0  # bytes of frames (and their bulk) queued and not yet written, failed or dropped
        self.urgent = 0    # of those, the bytes at the anchor's priority or above (the prefill's lead reads it)
        self._room = threading.Condition()
        self._feeder = threading.Thread(target=self._feed_loop, name="lynx-feeder", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="lynx-sender", daemon=True)
        self._feeder.start()
        self._sender.start()

    def start_send(self, frame: bytes, priority: int = PRIO_ANCHOR, tag=None, bulk=None) -> Future:
        """bulk: None, or an object with `nbytes` and `post()` (blocking) that moves a data plane's bytes; the
        sender posts it right before writing `frame` (which refers to those bytes), and the link paces both."""
        fut: Future = Future()
        with self._lock:
            if self._error is not None:
                fut.set_exception(ConnectionError(f"an earlier send failed: {self._error}"))
            elif self._closed.is_set():
                fut.set_exception(ConnectionError("transport closed"))
            else:
                n = len(frame) + (bulk.nbytes if bulk is not None else 0)
                u = n if priority <= PRIO_ANCHOR else 0
                with self._room:
                    self.inflight += n
                    self.urgent += u
                self._q.put((priority, next(self._n), frame, fut, tag, bulk, self.link.nic.clock()))
                fut.add_done_callback(lambda _f, n=n, u=u: self._written(n, u))
        return fut

    def _written(self, n: int, urgent: int = 0) -> None:
        with self._room:
            self.inflight -= n
            self.urgent -= urgent
            self._room.notify_all()

    def bound_inflight(self, nbytes: int | None) -> None:
        """The bytes queued on this connection that `has_room` / `wait_room` keep under (None: no bound)."""
        self.max_inflight = nbytes

    def has_room(self) -> bool:
        """Whether another frame may be queued now without passing the in-flight bound (always, without one)."""
        return self.max_inflight is None or self.inflight < self.max_inflight

    def wait_room(self, timeout: float) -> None:
        """Until `has_room()`. TimeoutError if the peer has read nothing for `timeout` seconds (the wait restarts
        whenever a frame leaves); ConnectionError if the transport failed or closed meanwhile."""
        if self.max_inflight is None:
            return
        with self._room:
            deadline, last = time.monotonic() + timeout, self.inflight
            while self.inflight >= self.max_inflight:
                if self._error is not None or self._closed.is_set():
                    raise ConnectionError(f"the connection failed while its frames waited: {self._error or 'closed'}")
                if self.inflight < last:
                    deadline, last = time.monotonic() + timeout, self.inflight
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the peer read nothing for {timeout:.3g} s ({self.inflight} bytes queued for "
                                       f"it, the bound is {self.max_inflight})")
                self._room.wait(min(left, 0.5))

    def drop(self, tag) -> int:
        """Cancel every queued frame carrying `tag` (their futures end cancelled); returns how many."""
        with self._q.mutex:
            keep = [item for item in self._q.queue if item[4] != tag or item[2] is None]
            gone = [item for item in self._q.queue if item[4] == tag and item[2] is not None]
            self._q.queue[:] = keep
            heapq.heapify(self._q.queue)
        for item in gone:
            item[3].cancel()
        return len(gone)

    def readable(self, timeout: float) -> bool:
        """Whether a frame (or the end of the stream) is waiting, within `timeout` seconds; False where the
        backend cannot tell without receiving."""
        return False

    @staticmethod
    def wait_send(fut: Future, timeout: float | None = None) -> None:
        fut.result(timeout)

    def send(self, frame: bytes, priority: int = PRIO_ANCHOR, timeout: float | None = 60.0) -> None:
        self.wait_send(self.start_send(frame, priority), timeout)

    def _feed_loop(self) -> None:
        """Frames in priority order onto the connection's port of the NIC; each, once its last packet is on the
        (emulated) wire, goes to the writer with its delivery time, and the next one is handed over at once."""
        while True:
            item = self._q.get()
            prio, _, frame, fut, _, bulk, ready = item
            if frame is None:
                self._wire.put(item)  # the writer ends there
                return
            if self._error is not None:  # the writer has stopped: nobody else would complete this frame
                if not fut.done():
                    fut.set_exception(ConnectionError(f"an earlier send failed: {self._error}"))
                continue
            if not fut.set_running_or_notify_cancel():  # dropped while queued
                continue
            deliver = self.link.schedule(len(frame) + (bulk.nbytes if bulk is not None else 0), ready_at=ready)
            with self._lock:  # against the writer's failure: either it drains this item, or we fail it here
                err = self._error
                if err is None:
                    self._wire.put((prio, deliver or 0.0, frame, fut, None, bulk, ready))  # None: the port closed
            if err is not None:
                fut.set_exception(ConnectionError(f"an earlier send failed: {err}"))

    def _send_loop(self) -> None:
        try:
            self._write_frames()
        finally:
            self.link.close()  # the connection's share of the NIC goes with it

    def _write_frames(self) -> None:
        nic = self.link.nic
        while True:
            prio, deliver, frame, fut, _, bulk, _ = self._wire.get()
            if frame is None:
                return
            if self._error is not None:
                fut.set_exception(ConnectionError(f"an earlier send failed: {self._error}"))
                continue
            try:
                wait = deliver - nic.clock()
                if wait > 1e-6:
                    nic.sleep(wait)
                if bulk is not None:
                    bulk.post()
                self._write(frame, prio)
                fut.set_result(None)
            except BaseException as e:  # noqa: BLE001 — handed to whoever waits on the frame
                fut.set_exception(e)
                with self._lock:
                    self._error = e
                self._fail_pending(e)
                self._q.put((99, next(self._n), None, None, None, None, 0.0))  # the feeder ends too
                return

    def _fail_pending(self, e: BaseException) -> None:
        for q in (self._q, self._wire):
            while True:
                try:
                    _, _, frame, fut, *_ = q.get_nowait()
                except queue.Empty:
                    break
                if fut is not None and not fut.done():
                    fut.set_exception(e)

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._q.put((99, next(self._n), None, None, None, None, 0.0))

    def _write(self, frame: bytes, priority: int) -> None:
        raise NotImplementedError

    def recv(self, timeout: float | None = None, limit: int = MAX_PAYLOAD):
        raise NotImplementedError


class TcpTransport(Transport):
    """One TCP connection carrying every stream; the anchor's frames are marked DSCP EF. The socket's own timeout
    bounds each send (`send_timeout_s`, set once); a receive's deadline is enforced by polling for readability, so
    the receiving thread never changes what the sending thread runs under."""

    def __init__(self, sock: socket.socket, link: NicPort | None = None, send_timeout_s: float = 60.0):
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(send_timeout_s)
        self.send_timeout_s = send_timeout_s
        self._poll = select.poll() if hasattr(select, "poll") else None
        if self._poll is not None:
            self._poll.register(sock, select.POLLIN | select.POLLPRI)
        self._tos = None
        super().__init__(link)

    @classmethod
    def connect(cls, host: str, port: int, timeout: float = 10.0, link=None) -> "TcpTransport":
        return cls(socket.create_connection((host, port), timeout=timeout), link)

    def _mark(self, priority: int) -> None:
        tos = DSCP.get(priority, 0)
        if tos != self._tos:
            try:
                self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
            except OSError:
                pass  # marking is best effort (IPv6 or a restricted stack)
            self._tos = tos

    def _write(self, frame: bytes, priority: int) -> None:
        self._mark(priority)
        self.sock.sendall(frame)

    def _wait_readable(self, timeout: float | None) -> bool:
        if self._poll is not None:
            return bool(self._poll.poll(None if timeout is None else max(1, int(timeout * 1000))))
        return bool(select.select([self.sock], [], [], timeout)[0])

    def readable(self, timeout: float) -> bool:
        return self._wait_readable(timeout)

    def _recv_raw(self, n: int, deadline: float | None) -> bytes:
        """Up to n bytes from the socket (b"" at its end), waiting for them until `deadline` (monotonic)."""
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise socket.timeout("receive deadline passed")
            if self._wait_readable(left):
                return self.sock.recv(n)

    def _read_some(self, n: int, deadline: float | None) -> bytes:
        """Up to n bytes of the stream (b"" at its end) before `deadline`."""
        return self._recv_raw(min(n, 1 << 20), deadline)

    def recv(self, timeout: float | None = 30.0, limit: int = MAX_PAYLOAD):
        """One frame within `timeout` seconds in all: a peer trickling bytes cannot stretch it."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def read_exact(n: int) -> bytes:
            buf = bytearray()
            while len(buf) < n:
                try:
                    part = self._read_some(n - len(buf), deadline)
                except socket.timeout:
                    raise TimeoutError(f"no whole frame from the peer within {timeout:.3g} s") from None
                except OSError as e:
                    raise ConnectionError(f"connection lost: {e}") from None
                if not part:
                    break
                buf += part
            return bytes(buf)

        return read_frame(read_exact, limit)

    def close(self) -> None:
        super().close()
        self._sender.join(timeout=5)
        self._goodbye()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _goodbye(self) -> None:
        """Last words on the socket after the sender has stopped (none for plain TCP)."""


class TlsTcpTransport(TcpTransport):
    """TcpTransport inside TLS (the standard library's ssl), for links that leave the rack. The TLS state is an
    ssl.SSLObject over two memory BIOs, touched under one lock, while the socket is read and written outside it: the
    sender and the receiver threads never share an SSLSocket (OpenSSL forbids concurrent use of one) and never block
    each other. The TLS handshake runs in the constructor, within `timeout`."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool,
                 server_hostname: str | None = None, link: NicPort | None = None, timeout: float = 10.0,
                 send_timeout_s: float = 60.0):
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._in, self._out, server_side=server_side, server_hostname=server_hostname)
        self._tls_lock = threading.Lock()   # the SSLObject
        self._wire_lock = threading.Lock()  # the order of ciphertext on the socket
        self.sock = sock
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout(f"no TLS handshake within {timeout:.3g} s")
                sock.settimeout(left)  # bounds each send; the whole handshake is bounded by `deadline`
                try:
                    with self._tls_lock:
                        self._tls.do_handshake()
                    self._flush()
                    break
                except ssl.SSLWantReadError:
                    self._flush()
                    if not select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
                        raise socket.timeout(f"no TLS handshake within {timeout:.3g} s") from None
                    raw = sock.recv(1 << 16)
                    if not raw:
                        raise ConnectionError("the peer closed the connection during the TLS handshake")
                    if raw.startswith(MAGIC):  # plain Lynx frames where a TLS record should be
                        if server_side:  # told in its own language (a peer that spoke plain Lynx learns no more)
                            sock.sendall(json_frame(FrameType.ERROR, 0, 0, {"error": PLAIN_TO_TLS}))
                            raise WireError("the client speaks plain TCP, not TLS")
                        raise WireError("the prefill server speaks plain TCP, not TLS: connect without tls / tls_ca "
                                        "(serve-decode without --tls / --tls-ca), or start it with --tls-cert")
                    self._pull(raw)
        except (ssl.SSLError, OSError) as e:
            sock.close()
            raise ConnectionError(f"TLS handshake failed: {e}") from None
        except WireError:
            sock.close()
            raise
        super().__init__(sock, link, send_timeout_s)

    def _flush(self) -> None:
        with self._wire_lock:
            with self._tls_lock:
                data = self._out.read()
            if data:
                self.sock.sendall(data)

    def _pull(self, raw: bytes) -> None:
        """Feed ciphertext from the socket (b"": its end) to the TLS layer."""
        with self._tls_lock:
            self._in.write(raw) if raw else self._in.write_eof()

    def _write(self, frame: bytes, priority: int) -> None:
        self._mark(priority)
        with self._wire_lock:
            with self._tls_lock:
                self._tls.write(frame)
                data = self._out.read()
            self.sock.sendall(data)

    def _read_some(self, n: int, deadline: float | None) -> bytes:
        while True:
            with self._tls_lock:
                try:
                    return self._tls.read(min(n, 1 << 20))
                except ssl.SSLWantReadError:
                    pass
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    return b""
            self._flush()  # whatever the TLS layer has to say first (e.g. a key update)
            self._pull(self._recv_raw(1 << 16, deadline))

    def readable(self, timeout: float) -> bool:
        with self._tls_lock:
            if self._tls.pending():
                return True
        return self._wait_readable(timeout)

    def _goodbye(self) -> None:
        if self._error is not None or self._sender.is_alive():
            return  # the link failed or the sender is stuck in a send: no close_notify, close at once
        try:
            self.sock.settimeout(1.0)
            with self._tls_lock:
                self._tls.unwrap()
        except (ssl.SSLError, ValueError):
            pass  # close_notify queued; the peer's answer is not awaited
        try:
            self._flush()
        except OSError:
            pass


class InProcTransport(Transport):
    """Two ends of an in-memory link (tests, single process)."""

    def __init__(self, link=None):
        self.inbox: queue.Queue = queue.Queue()
        self.peer: InProcTransport | None = None
        super().__init__(link)

    @classmethod
    def pair(cls, link=None):
        a, b = cls(link), cls()
        a.peer, b.peer = b, a
        return a, b

    def _write(self, frame: bytes, priority: int) -> None:
        self.peer.inbox.put(frame)

    def readable(self, timeout: float) -> bool:
        with self.inbox.not_empty:
            return self.inbox.not_empty.wait_for(lambda: self.inbox._qsize() > 0, timeout)

    def recv(self, timeout: float | None = 30.0, limit: int = MAX_PAYLOAD):
        try:
            buf = self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no frame for {timeout} s") from None
        if buf is None:
            raise PeerClosed("peer closed the connection")
        return parse_frame(buf, limit)

    def close(self) -> None:
        super().close()
        if self.peer is not None:
            self.peer.inbox.put(None)


class DistTransport(Transport):
    """torch.distributed point-to-point (gloo on CPU, NCCL on GPU) for users who already run a process group.
    Each frame is sent as its length (int64) and then its bytes; the length is bounded before allocating, and -1
    says the peer closed. Sends and receives use two process groups (one per direction), since NCCL forbids using one
    group from two threads; construct the transport on both ranks of the pair at the same time (torch.distributed's
    new_group is collective). A receive that times out leaves the transport unusable (the pending receive cannot be
    cancelled)."""

    CLOSED = -1

    def __init__(self, peer: int, link=None, device: str = "cpu"):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("DistTransport needs torch.distributed.init_process_group first")
        me = dist.get_rank()
        lo, hi = sorted((me, peer))
        up, down = dist.new_group([lo, hi]), dist.new_group([lo, hi])  # lo → hi, hi → lo
        self.dist, self.peer_rank, self.device = dist, peer, device
        self._send_group, self._recv_group = (up, down) if me == lo else (down, up)
        self._recv_broken: str | None = None
        super().__init__(link)

    def _post(self, n: int, payload: bytes = b"") -> None:
        self.dist.send(torch.tensor([n], dtype=torch.int64, device=self.device), self.peer_rank, group=self._send_group)
        if payload:
            self.dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device), self.peer_rank,
                           group=self._send_group)

    def _write(self, frame: bytes, priority: int) -> None:
        self._post(len(frame), frame)

    def _recv_into(self, t: torch.Tensor, deadline: float | None, timeout) -> None:
        import datetime

        work = self.dist.irecv(t, self.peer_rank, group=self._recv_group)
        if deadline is None:
            work.wait()
            return
        left = max(deadline - time.monotonic(), 0.001)
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=left))
        except RuntimeError as e:
            ok = False if "imeout" in str(e) or "imed out" in str(e) else None
            if ok is None:
                raise ConnectionError(f"torch.distributed receive failed: {e}") from None
        if not ok:
            self._recv_broken = f"a receive timed out after {timeout} s"
            raise TimeoutError(f"no frame from rank {self.peer_rank} within {timeout} s")

    def recv(self, timeout: float | None = 30.0, limit: int = MAX_PAYLOAD):
        if self._recv_broken:
            raise ConnectionError(f"DistTransport unusable: {self._recv_broken}")
        deadline = None if timeout is None else time.monotonic() + timeout
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._recv_into(n, deadline, timeout)
        size = int(n.item())
        if size == self.CLOSED:
            raise PeerClosed(f"rank {self.peer_rank} closed the transport")
        if not HEADER.size <= size <= HEADER.size + limit:
            raise WireError(f"frame length {size} out of bounds")
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._recv_into(buf, deadline, timeout)
        return parse_frame(buf.cpu().numpy().tobytes(), limit)

    def close(self) -> None:
        if not self._closed.is_set():
            super().close()
            self._sender.join(timeout=30)
            try:
                self._post(self.CLOSED)
            except Exception:  # noqa: BLE001 — the peer may be gone already
                pass
