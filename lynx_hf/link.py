"""The link emulator: pacing at a bandwidth and a one-way latency, shared by every stream of one connection. Used by
the in-process loader and by the transports alike, so a simulated link and a loopback socket behave the same.

It models a link with a queue, as a NIC is: bytes handed to it at `ready_at` start when the link is free or when
they are handed over, whichever is later — not when the thread that paces them next runs. On one host shared by both
"nodes" (the demo, two CPU cores), the sending thread wakes late while the other process computes; a link that lost
that time would charge the sender's scheduling to the transfer (measured: 0.27 s over a Lynx request's 480 frames
while the decode side drafts, 0.08 s over INT8's 240, which the decode side only waits for; docs/drafting.md)."""
from __future__ import annotations

import threading
import time


class LinkEmulator:
    """A link of `bandwidth_bps` bits/s and one-way `latency_s`, shared by all streams of a connection. `clock` and
    `sleep` are injectable (tests drive the link with a fake clock)."""

    def __init__(self, bandwidth_bps: float | None = None, latency_s: float = 0.0, clock=time.perf_counter,
                 sleep=time.sleep):
        if bandwidth_bps is not None and bandwidth_bps <= 0:
            raise ValueError("bandwidth_bps must be > 0")
        self.bps, self.latency, self._free_at = bandwidth_bps, latency_s, None
        self.clock, self.sleep = clock, sleep

    def pace(self, nbytes: int, stop: threading.Event | None = None, ready_at: float | None = None) -> bool:
        """Block until the link has carried `nbytes` more, handed to it at `ready_at` (this link's clock; default:
        now); returns True if `stop` was set meanwhile. An idle link banks no capacity: bytes never start before
        they are handed over."""
        now = self.clock()
        ready = now if ready_at is None else min(ready_at, now)
        if self._free_at is None:
            self._free_at = ready + self.latency
        if self.bps is not None:
            self._free_at = max(self._free_at, ready) + 8 * nbytes / self.bps
        wait = max(0.0, self._free_at - self.clock())
        if stop is not None:
            return stop.wait(wait)
        self.sleep(wait)
        return False
