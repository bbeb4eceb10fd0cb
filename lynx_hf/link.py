"""The link emulator: pacing at a bandwidth and a one-way latency, shared by every stream of one connection. Used by
the in-process loader and by the transports alike, so a simulated link and a loopback socket behave the same."""
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

    def pace(self, nbytes: int, stop: threading.Event | None = None) -> bool:
        """Block until the link has carried `nbytes` more; returns True if `stop` was set meanwhile."""
        now = self.clock()
        if self._free_at is None:
            self._free_at = now + self.latency
        if self.bps is not None:
            self._free_at = max(self._free_at, now) + 8 * nbytes / self.bps
        wait = max(0.0, self._free_at - self.clock())
        if stop is not None:
            return stop.wait(wait)
        self.sleep(wait)
        return False
