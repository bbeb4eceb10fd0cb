"""A narrow transport interface with async start/wait pairs (like vLLM's KV connectors), and its backends.

    start_send(frame, priority) -> Future   enqueue; frames leave in priority order (0 first), FIFO within one
    wait_send(future, timeout)               until that frame is on the wire
    recv(timeout) -> Frame                   next frame (checked: header, length bound, CRC); WireError/TimeoutError
    close()

Strict priority is applied at frame granularity by one sender thread per connection, which also paces the bytes
through a `LinkEmulator` shared by every stream — so on loopback the anchor really gets the link first."""
from __future__ import annotations

import itertools
import queue
import socket
import threading
import time
from concurrent.futures import Future

import torch

from .wire import HEADER, MAX_PAYLOAD, WireError, decode_frame, read_frame

PRIO_ANCHOR, PRIO_RESIDUAL, PRIO_END = 0, 1, 2
DSCP = {PRIO_ANCHOR: 46 << 2, PRIO_RESIDUAL: 10 << 2, PRIO_END: 10 << 2}  # EF for the anchor, AF11 for the rest


class LinkEmulator:
    """A link of `bandwidth_bps` bits/s and one-way `latency_s`, shared by all streams of a connection."""

    def __init__(self, bandwidth_bps: float | None = None, latency_s: float = 0.0):
        if bandwidth_bps is not None and bandwidth_bps <= 0:
            raise ValueError("bandwidth_bps must be > 0")
        self.bps, self.latency, self._free_at = bandwidth_bps, latency_s, None

    def pace(self, nbytes: int, stop: threading.Event | None = None) -> bool:
        """Block until the link has carried `nbytes` more; returns True if `stop` was set meanwhile."""
        now = time.perf_counter()
        if self._free_at is None:
            self._free_at = now + self.latency
        if self.bps is not None:
            self._free_at = max(self._free_at, now) + 8 * nbytes / self.bps
        wait = max(0.0, self._free_at - time.perf_counter())
        if stop is not None:
            return stop.wait(wait)
        time.sleep(wait)
        return False


class Transport:
    """Base: the priority sender thread; subclasses provide _write(bytes, priority) and recv."""

    def __init__(self, link: LinkEmulator | None = None):
        self.link = link or LinkEmulator()
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._n = itertools.count()
        self._closed = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="lynx-sender", daemon=True)
        self._sender.start()

    def start_send(self, frame: bytes, priority: int = PRIO_ANCHOR) -> Future:
        fut: Future = Future()
        if self._closed.is_set():
            fut.set_exception(ConnectionError("transport closed"))
        else:
            self._q.put((priority, next(self._n), frame, fut))
        return fut

    @staticmethod
    def wait_send(fut: Future, timeout: float | None = None) -> None:
        fut.result(timeout)

    def send(self, frame: bytes, priority: int = PRIO_ANCHOR, timeout: float | None = 60.0) -> None:
        self.wait_send(self.start_send(frame, priority), timeout)

    def _send_loop(self) -> None:
        while True:
            prio, _, frame, fut = self._q.get()
            if frame is None:
                return
            try:
                self.link.pace(len(frame))
                self._write(frame, prio)
                fut.set_result(None)
            except BaseException as e:  # noqa: BLE001 — handed to whoever waits on the frame
                fut.set_exception(e)
                self._fail_pending(e)
                return

    def _fail_pending(self, e: BaseException) -> None:
        while True:
            try:
                _, _, frame, fut = self._q.get_nowait()
            except queue.Empty:
                return
            if fut is not None and not fut.done():
                fut.set_exception(e)

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._q.put((99, next(self._n), None, None))

    def _write(self, frame: bytes, priority: int) -> None:
        raise NotImplementedError

    def recv(self, timeout: float | None = None):
        raise NotImplementedError


class TcpTransport(Transport):
    """One TCP connection carrying every stream; the anchor's frames are marked DSCP EF."""

    def __init__(self, sock: socket.socket, link: LinkEmulator | None = None):
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._tos = None
        super().__init__(link)

    @classmethod
    def connect(cls, host: str, port: int, timeout: float = 10.0, link=None) -> "TcpTransport":
        return cls(socket.create_connection((host, port), timeout=timeout), link)

    def _write(self, frame: bytes, priority: int) -> None:
        tos = DSCP.get(priority, 0)
        if tos != self._tos:
            try:
                self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
            except OSError:
                pass  # marking is best effort (IPv6 or a restricted stack)
            self._tos = tos
        self.sock.sendall(frame)

    def recv(self, timeout: float | None = 30.0):
        self.sock.settimeout(timeout)

        def read_exact(n: int) -> bytes:
            buf = bytearray()
            while len(buf) < n:
                try:
                    chunk = self.sock.recv(min(n - len(buf), 1 << 20))
                except socket.timeout:
                    raise TimeoutError(f"no data from the peer for {timeout} s") from None
                except OSError as e:
                    raise ConnectionError(f"connection lost: {e}") from None
                if not chunk:
                    break
                buf += chunk
            return bytes(buf)

        return read_frame(read_exact)

    def close(self) -> None:
        super().close()
        self._sender.join(timeout=5)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


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

    def recv(self, timeout: float | None = 30.0):
        try:
            buf = self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no frame for {timeout} s") from None
        if buf is None:
            raise ConnectionError("peer closed the connection")
        return decode_frame(buf)

    def close(self) -> None:
        super().close()
        if self.peer is not None:
            self.peer.inbox.put(None)


class DistTransport(Transport):
    """torch.distributed point-to-point (gloo on CPU, NCCL on GPU) for users who already run a process group.
    Each frame is sent as its length (int64) and then its bytes; the length is bounded before allocating."""

    def __init__(self, peer: int, link=None, device: str = "cpu"):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("DistTransport needs torch.distributed.init_process_group first")
        self.dist, self.peer_rank, self.device = dist, peer, device
        super().__init__(link)

    def _write(self, frame: bytes, priority: int) -> None:
        n = torch.tensor([len(frame)], dtype=torch.int64, device=self.device)
        self.dist.send(n, self.peer_rank)
        self.dist.send(torch.frombuffer(bytearray(frame), dtype=torch.uint8).to(self.device), self.peer_rank)

    def recv(self, timeout: float | None = None):
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.dist.recv(n, self.peer_rank)
        size = int(n.item())
        if not HEADER.size <= size <= HEADER.size + MAX_PAYLOAD:
            raise WireError(f"frame length {size} out of bounds")
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.dist.recv(buf, self.peer_rank)
        return decode_frame(buf.cpu().numpy().tobytes())
