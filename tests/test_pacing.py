"""Timing logic with injected clocks, in microseconds of real time: the link emulator's pacing, the residual's
expected arrival, and the draft policy that decides from both whether another draft step fits."""
import threading
from types import SimpleNamespace

import pytest

from lynx_hf import SpecConfig
from lynx_hf import trace as trace_mod
from lynx_hf.engine.policy import DraftPolicy
from lynx_hf.link import LinkEmulator
from lynx_hf.trace import Trace


class FakeClock:
    def __init__(self):
        self.t, self.slept = 100.0, []

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.slept.append(s)
        self.t += s


def test_link_paces_bytes_at_its_bandwidth_after_its_latency():
    c = FakeClock()
    link = LinkEmulator(8e6, latency_s=0.25, clock=c, sleep=c.sleep)  # 1 MB/s
    link.pace(500_000)
    link.pace(250_000)
    assert c.slept == pytest.approx([0.75, 0.25])  # latency + 0.5 s, then 0.25 s
    c.t += 10.0  # idle: the link does not bank capacity
    link.pace(1_000_000)
    assert c.slept[-1] == pytest.approx(1.0)


def test_unbounded_link_only_adds_latency_and_a_stop_interrupts():
    c = FakeClock()
    link = LinkEmulator(None, latency_s=0.1, clock=c, sleep=c.sleep)
    link.pace(10**9)
    link.pace(10**9)
    assert c.slept == pytest.approx([0.1, 0.0])
    stop = threading.Event()
    stop.set()
    assert LinkEmulator(1.0, clock=c).pace(10**6, stop) is True  # returns at once, reporting the stop
    with pytest.raises(ValueError):
        LinkEmulator(0.0)


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
    cache = SimpleNamespace(residual_ready=lambda: state["ready"], residual_eta=lambda: state["eta"],
                            spec_config=SpecConfig(verify_lead=2.0))
    p = DraftPolicy(cache)
    assert p.another_step()  # nothing known yet
    p.stepped(0.1)
    p.stepped(0.3)
    assert p.step_s(1) == pytest.approx(0.2)  # one size seen: the mean of its step times
    state["eta"] = 0.5
    assert p.another_step()  # 0.5 s left > 2 steps of 0.2 s
    state["eta"] = 0.35
    assert not p.another_step()  # due within the lead: verify now, overlapping the rest of the transfer
    state["eta"], state["ready"] = 10.0, True
    assert not p.another_step()  # never once the residual is in


def test_draft_policy_prices_a_step_by_its_frontier():
    """Step cost = a + b·nodes, fitted to the steps timed: a wide frontier that would end past the residual's due
    time is not started while a one-node step still is."""
    cache = SimpleNamespace(residual_ready=lambda: False, residual_eta=lambda: 0.09,
                            spec_config=SpecConfig(verify_lead=1.0))
    p = DraftPolicy(cache)
    for nodes, t in ((1, 0.060), (8, 0.102), (2, 0.066), (8, 0.098)):
        p.stepped(t, nodes)
    assert p.step_s(1) == pytest.approx(0.06, abs=0.004) and p.step_s(8) == pytest.approx(0.10, abs=0.004)
    assert p.another_step(1) and not p.another_step(8)
