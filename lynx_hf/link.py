"""The link emulator, modelled on a NIC: one `Nic` per emulated host interface (bandwidth, one-way latency), shared by
every connection (`port`) of a server, and used alike by the in-process loader and the transports, so a simulated
link and a loopback socket behave the same.

Contract:
- A port hands the NIC one frame at a time (`schedule`: returns its delivery time once its last packet is on the
  wire; `pace`: returns when it has crossed), with the time it was ready (queued by the sender). The NIC puts frames
  on one virtual wire in packets of `packet` bytes: a packet starts when the wire is free or when its frame was
  ready, whichever is later — not when the sending thread next runs — and a frame is delivered `latency_s` after its
  last packet left. A thread that wakes late (on a busy host the other process's compute delays it) therefore loses
  no link time, as a NIC keeps draining its queue while the CPU is elsewhere. The credit is bounded by the NIC's
  transmit queue (`queue_s` seconds at line rate) and the bytes in flight (`latency_s`): a sender held back longer
  (a reader that stopped reading: flow control) lost that time, as it would on a real link. An idle wire banks
  nothing: bytes never start before they are ready.
- Connections share the wire by deficit round-robin, one packet's worth of bytes per turn: a short request behind
  another client's long transfer gets half the wire at once, not the time left on the other's backlog. Within a
  connection the order is the sender's (anchor before residual: its priority queue). Packets are put on the wire
  only when it is within `horizon_s` of free, so nothing granted ahead of time keeps a newcomer waiting.
- One waiting connection at a time (the *driver*) wakes to put packets on the wire; the others sleep until their
  frame's last packet is on it, so N waiting connections cost one wake-up a packet, not N (on the prefill node
  these threads share the core its forward runs on).
- Without a bandwidth and a latency, `pace` returns at once."""
from __future__ import annotations

import threading
import time

PACKET = 16 << 10  # bytes of one virtual packet: the granularity at which connections interleave on the wire


class Nic:
    """An emulated network interface: `bandwidth_bps` bits/s (None: unbounded) and one-way `latency_s`, shared by
    its ports. `clock` and `sleep` are injectable (tests drive the NIC with a fake clock)."""

    def __init__(self, bandwidth_bps: float | None = None, latency_s: float = 0.0, clock=time.perf_counter,
                 sleep=time.sleep, queue_s: float = 0.2, packet: int = PACKET, horizon_s: float = 0.002):
        if bandwidth_bps is not None and not bandwidth_bps > 0:
            raise ValueError("bandwidth_bps must be > 0")
        if not latency_s >= 0:
            raise ValueError("latency_s must be >= 0")
        self.bps, self.latency, self.queue_s, self.packet, self.horizon = (bandwidth_bps, latency_s, queue_s,
                                                                           packet, horizon_s)
        self.clock, self.sleep = clock, sleep
        self.free_at = -float("inf")  # when the wire's last granted byte leaves
        self.sent_bytes = 0
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)  # (the NIC's lock; each port waits on its own condition of it)
        self._ring: list[NicPort] = []  # ports in round-robin order
        self._driver: NicPort | None = None  # the one waiting port that wakes to put packets on the wire
        self._rr, self._fresh = 0, True  # whose turn it is; whether it has had its quantum this turn

    @property
    def idle(self) -> bool:
        """Neither bandwidth nor latency: pacing is a no-op."""
        return self.bps is None and self.latency == 0

    def port(self) -> "NicPort":
        """A new connection's share of this NIC (close it when the connection ends)."""
        p = NicPort(self)
        with self._cv:
            self._ring.append(p)
        return p

    def _remove(self, port: "NicPort") -> None:
        with self._cv:
            if port in self._ring:
                i = self._ring.index(port)
                self._ring.pop(i)
                if i < self._rr:
                    self._rr -= 1
                self._rr = self._rr % len(self._ring) if self._ring else 0
                self._fresh = True
            for p in [port, *self._ring]:
                p._wake.notify()

    def _next(self) -> "NicPort":
        """Under the lock, some port having bytes waiting: whose packet goes next (deficit round-robin)."""
        while True:
            p = self._ring[self._rr]
            if p.pending is not None:
                if self._fresh:  # the turn has just come to this port: its quantum
                    p.deficit, self._fresh = p.deficit + self.packet, False
                size = min(p.pending[0], self.packet)
                if p.deficit >= size:
                    p.deficit -= size
                    return p  # the turn stays here: the port may send more within its deficit
            self._rr, self._fresh = (self._rr + 1) % len(self._ring), True

    def _drain(self) -> None:
        """Under the lock: put packets on the wire while it is within the horizon of free; a frame whose last packet
        is on it gets its delivery time (and its thread is woken)."""
        while any(p.pending for p in self._ring):
            now = self.clock()
            if self.free_at > now + self.horizon:
                return
            p = self._next()
            left, ready = p.pending
            size = min(left, self.packet)
            start = max(self.free_at, ready, now - self.queue_s - self.latency)  # the credit: the NIC's queue and
            # the bytes in flight (a sender that waited for its last frame's delivery presents the next one late)
            self.free_at = start + (0.0 if self.bps is None else 8 * size / self.bps)
            self.sent_bytes += size
            if left > size:
                p.pending = (left - size, ready)
            else:
                p.pending, p.delivery = None, self.free_at + self.latency
                p._wake.notify()  # its own thread only: N waiting connections are not N wake-ups a frame

    def _hand_over(self) -> None:
        """Under the lock, the driver leaving: a port still waiting drives the wire next."""
        self._driver = None
        for p in self._ring:
            if p.pending is not None:
                p._wake.notify()
                return


class NicPort:
    """One connection's access to a NIC: `pace` blocks until the frame has crossed the link."""

    def __init__(self, nic: Nic):
        self.nic = nic
        self.pending: tuple[int, float] | None = None  # (bytes not yet on the wire, ready time) of the frame
        self.delivery: float | None = None
        self.deficit = 0
        self.closed = False
        self._wake = threading.Condition(nic._lock)

    def schedule(self, nbytes: int, ready_at: float | None = None, stop: threading.Event | None = None):
        """Block until the last packet of `nbytes`, ready at `ready_at` (the NIC's clock; default now), is on the
        wire; returns when the frame will have crossed the link (its delivery time, the NIC's clock), or None if
        `stop` was set or the port closed meanwhile (the rest of the frame then never went). The caller delivers the
        frame then and may hand the NIC its next frame at once, as a NIC's queue holds several."""
        nic = self.nic
        now = nic.clock()
        if nic.idle or self.closed or nbytes <= 0:
            return None if stop is not None and stop.is_set() else now
        with nic._cv:
            self.pending, self.delivery = (nbytes, now if ready_at is None else min(ready_at, now)), None
            try:
                while True:
                    nic._drain()
                    if self.delivery is not None:
                        return self.delivery
                    if stop is not None and stop.is_set() or self.closed:
                        self.pending = None
                        return None
                    if nic._driver is None or nic._driver is self:  # wake when the wire is within the horizon
                        nic._driver = self
                        self._wake.wait(min(max(nic.free_at - nic.horizon - nic.clock(), 0.0005), 0.05))
                    else:  # woken by the driver's _drain when this frame is on the wire (or to drive it)
                        self._wake.wait(0.05)
            finally:
                if nic._driver is self:
                    nic._hand_over()

    def pace(self, nbytes: int, stop: threading.Event | None = None, ready_at: float | None = None) -> bool:
        """`schedule`, then wait for the delivery; returns True if `stop` was set meanwhile."""
        deliver = self.schedule(nbytes, ready_at, stop)
        if deliver is None:
            return True
        wait = deliver - self.nic.clock()
        if stop is not None:
            return stop.wait(max(0.0, wait))
        if wait > 1e-6:
            self.nic.sleep(wait)
        return False

    def close(self) -> None:
        self.closed = True
        self.nic._remove(self)


class LinkEmulator(NicPort):
    """A link of its own: one port on a private NIC (the in-process loader, a client's sending side, tests)."""

    def __init__(self, bandwidth_bps: float | None = None, latency_s: float = 0.0, clock=time.perf_counter,
                 sleep=time.sleep, **nic_kw):
        super().__init__(Nic(bandwidth_bps, latency_s, clock, sleep, **nic_kw))
        self.nic._ring.append(self)

    @property
    def bps(self):
        return self.nic.bps
