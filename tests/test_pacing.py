"""Timing logic with injected clocks, in microseconds of real time: the link emulator's pacing, the residual's
expected arrival, and the draft policy that decides from both whether another draft step fits."""
import threading
from types import SimpleNamespace

import pytest

from lynx_hf import SpecConfig
from lynx_hf import trace as trace_mod
from lynx_hf.engine.policy import DraftPolicy
from lynx_hf.link import LinkEmulator, Nic
from lynx_hf.trace import Trace


INF = float("inf")  # a fake clock does not move while a thread waits: the NIC puts a whole frame on the wire at once


class FakeClock:
    def __init__(self):
        self.t, self.slept = 100.0, []

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.slept.append(s)
        self.t += s


def test_link_paces_bytes_at_its_bandwidth_and_delivers_each_frame_after_its_latency():
    c = FakeClock()
    link = LinkEmulator(8e6, latency_s=0.25, clock=c, sleep=c.sleep, horizon_s=INF)  # 1 MB/s
    link.pace(500_000, ready_at=100.0)
    link.pace(250_000, ready_at=100.0)  # queued behind the first: it leaves when the wire is free, not when asked
    assert c.slept == pytest.approx([0.75, 0.25])  # 0.5 s on the wire + 0.25 s, then 0.25 s more
    c.t += 10.0  # idle: the wire does not bank capacity
    link.pace(1_000_000)
    assert c.slept[-1] == pytest.approx(1.25)


def test_unbounded_link_only_adds_latency_and_a_stop_interrupts():
    c = FakeClock()
    link = LinkEmulator(None, latency_s=0.1, clock=c, sleep=c.sleep, horizon_s=INF)
    link.pace(10**9, ready_at=100.0)
    link.pace(10**9, ready_at=100.0)
    assert c.slept == pytest.approx([0.1])  # both delivered 0.1 s after they were ready
    stop = threading.Event()
    stop.set()
    assert LinkEmulator(1.0, clock=c).pace(10**6, stop) is True  # returns at once, reporting the stop
    with pytest.raises(ValueError):
        LinkEmulator(0.0)


def test_a_late_sender_loses_no_link_time_up_to_the_nics_queue():
    c = FakeClock()
    link = LinkEmulator(8e6, clock=c, sleep=c.sleep, queue_s=0.2, horizon_s=INF)  # 1 MB/s: 0.1 s per 100 kB frame
    link.pace(100_000, ready_at=100.0)
    c.t += 0.05  # the sending thread wakes 50 ms late: its next frame was queued, the NIC kept draining
    link.pace(100_000, ready_at=100.0)
    assert c.slept == pytest.approx([0.1, 0.05])  # delivered at 100.2, as if on time
    c.t += 1.0  # held back for a second (a reader that stopped reading): only the queue's 0.2 s is credited
    n = len(c.slept)
    for _ in range(3):
        link.pace(100_000, ready_at=100.0)
    assert c.slept[n:] == pytest.approx([0.1])  # two frames drain the credit at once, the third waits its turn
    assert link.nic.sent_bytes == 500_000


def test_connections_share_the_nic_by_deficit_round_robin():
    """Packets of the frames waiting go on the wire in deficit round-robin: one packet's worth of bytes per port and
    turn; a port that joins later is served at its next turn, not after the others' backlog; a closed port leaves
    the ring."""
    c = FakeClock()
    nic = Nic(8e6, clock=c, sleep=c.sleep, packet=10_000, horizon_s=INF)
    a, b, d = nic.port(), nic.port(), nic.port()
    with nic._cv:
        a.pending = (45_000, c.t)  # five packets, the last one 5 kB
        nic.horizon = 0.0  # one packet at a time, to watch the order
        order = []
        for _ in range(8):
            if len(order) == 2:
                b.pending = (30_000, c.t)  # b joins after a's first two packets
            before = {"a": a.pending, "b": b.pending}
            nic._drain()  # one packet: the wire is busy beyond the (zero) horizon after it
            order += [n for n, p in (("a", a), ("b", b)) if p.pending != before[n]]
            c.t = nic.free_at
    assert "".join(order) == "aababab" + "a"
    assert a.pending is None and b.pending is None
    assert a.delivery == pytest.approx(100 + 0.075)
    assert b.delivery == pytest.approx(100 + 0.070)  # b's three packets interleaved with a's: done before a
    d.close()
    assert d not in nic._ring and nic.port() in nic._ring
    assert d.pace(10**9) is False  # a closed port paces nothing


def test_a_short_request_behind_a_long_transfer_gets_its_share_of_the_wire():
    """Two threads on one NIC (real clock): the long transfer's 40 frames are all queued first; the short one's 5,
    queued later, finish long before the long one's (on a per-connection FIFO they would wait for all 40)."""
    nic = Nic(8e6 * 2)  # 2 MB/s: 5 ms per 10 kB frame
    done = []

    def send(port, name, frames):
        ready = nic.clock()
        for i in range(frames):
            port.pace(10_000, ready_at=ready)
            done.append((name, i))

    long = threading.Thread(target=send, args=(nic.port(), "long", 40))
    long.start()
    while not any(n == "long" for n, _ in done):
        pass
    short = threading.Thread(target=send, args=(nic.port(), "short", 5))
    short.start()
    short.join(30)
    long.join(30)
    assert done.index(("short", 4)) < done.index(("long", 30))
    assert nic.sent_bytes == 450_000


def test_residual_eta_extrapolates_the_arrival_interval(monkeypatch):
    t = [10.0]
    monkeypatch.setattr(trace_mod.time, "perf_counter", lambda: t[0])
    tr = Trace()
    assert tr.residual_eta(5) is None
    tr.arrived("residual", 0, "key")
    assert tr.residual_eta(5) is None  # one arrival says nothing about the interval
    t[0] = 10.2
    tr.arrived("residual", 0, "value")
    assert tr.residual_eta(3) == pytest.approx(0.6)  # 3 more at 0.2 s each
    t[0] = 10.5
    assert tr.residual_eta(3) == pytest.approx(0.3)  # 0.3 s of that has passed
    assert tr.residual_eta(1) == 0.0


def test_draft_policy_stops_when_the_residual_is_due_within_the_lead():
    state = {"ready": False, "eta": None}
    cache = SimpleNamespace(residual_ready=lambda: state["ready"], residual_eta=lambda: state["eta"])
    p = DraftPolicy(cache, SpecConfig(verify_lead=2.0).verify_lead)  # the settings are passed in
    assert p.another_step()  # nothing known yet
    p.stepped(0.1)
    p.stepped(0.3)
    assert p.step_s(1) == pytest.approx(0.2)  # one size seen: the mean of its step times
    state["eta"] = 0.5
    assert p.another_step()  # 0.5 s left > 2 steps of 0.2 s
    state["eta"] = 0.35
    assert not p.another_step() and p.stop == "lead"  # due within the lead: verify now, overlapping the transfer
    state["eta"], state["ready"] = 10.0, True
    assert not p.another_step() and p.stop == "residual"  # never once the residual is in


def test_draft_policy_prices_a_step_by_its_frontier():
    """Step cost = a + b·nodes, fitted to the steps timed: a wide frontier that would end past the residual's due
    time is not started while a one-node step still is."""
    cache = SimpleNamespace(residual_ready=lambda: False, residual_eta=lambda: 0.09)
    p = DraftPolicy(cache, SpecConfig(verify_lead=1.0).verify_lead)  # the settings are passed in
    for nodes, t in ((1, 0.060), (8, 0.102), (2, 0.066), (8, 0.098)):
        p.stepped(t, nodes)
    assert p.step_s(1) == pytest.approx(0.06, abs=0.004) and p.step_s(8) == pytest.approx(0.10, abs=0.004)
    assert p.another_step(1) and not p.another_step(8)
