"""Shadows only where they pay (pricing.py): the step model, the ledger, the rule, and the scheduler side asking it."""
import logging

import pytest

from lynx_hf.vllm.scheduler import PRICED, SchedulerSide
from lynx_hf.vllm.pricing import EXPLORE, EXPLORE_OTHERS, HISTORY, MIN_STEPS, PRIOR, Ledger, Pricing


def _busy(p: Pricing, a=0.05, b=0.01, steps=64, t0=0.0):
    """`steps` steps of 1..8 tokens taking exactly a + b * tokens each; → the time after them."""
    t = t0
    for i in range(steps):
        n = 1 + i % 8
        p.step(t, n)
        t += a + b * n
    p.step(t, 0)
    return t


def test_the_step_model_is_the_line_through_busy_steps_and_idle_gaps_are_not_steps():
    p = Pricing()
    assert p.model() is None  # nothing measured: not identified
    t = _busy(p)
    assert p.model() == pytest.approx((0.05, 0.01))
    p.step(t + 20.0, 3)  # the engine idled 20 s after a step of 0 tokens: no step
    p.step(t + 20.3, 0)  # a 3-token step of 0.3 s (above the line): counted
    a, b = p.model()
    assert a + 3 * b < 0.3 and b > 0.008
    flat = Pricing()
    for i in range(MIN_STEPS * 2):
        flat.step(i * 0.1, 4)  # no spread in tokens: a and b cannot be told apart
    assert flat.model() is None and flat.admit(10, 40, True)  # not priced: admitted


def test_a_shadow_is_admitted_alone_and_yields_as_the_engine_fills():
    p = Pricing()
    _busy(p)  # a = 50 ms, b = 10 ms a token
    assert p.expected(True) == PRIOR == p.expected(False)  # saving 27 (a + b (N + 1)), cost N b (62 + 4) + b (16 + 4)
    admitted = [p.admit(n, n + 1, True) for n in range(8)]
    assert admitted == [True] * 4 + [False] * 4  # N = 3: 2.43 > 2.18; N = 4: 2.70 < 2.84
    saving, cost = p.price(3, 4, True)
    assert saving == pytest.approx(27 * 0.09) and cost == pytest.approx(3 * 0.01 * 66 + 0.01 * 20)
    assert p.price(3, 40, True)[0] == pytest.approx(27 * 0.45)  # R's steps are the batch's: 40 tokens (drafts) in it
    for _ in range(40):  # drafts rarely kept lately: not even alone, where they cost R's own steps
        p.ended(Ledger(shadow_tokens=62, drafted=60, accepted=4, overlap=16), True)
    assert p.price(0, 1, True) == pytest.approx((4 * 0.06, 0.01 * (16 + 56)))
    assert [p.admit(n, n + 1, True) for n in range(3)] == [False, False, False]
    assert p.state()["refused"] == 4 + 3 and p.state()["expected"]["greedy"]["accepted"] == 4
    assert p.admit(3, 4, False)  # sampled transfers: their own ledger (the prior still)
    for _ in range(40):  # kept well again: back beside a few others
        p.ended(Ledger(shadow_tokens=40, drafted=31, accepted=30, overlap=5), True)
    # N = 6: 3.60 > 2.52; N = 20: 7.80 < 8.26
    assert p.admit(2, 3, True) and p.admit(6, 7, True) and not p.admit(20, 21, True)


def test_one_transfer_in_explore_refused_in_a_row_is_admitted_where_a_wrong_guess_is_cheap():
    p = Pricing()
    _busy(p)
    for _ in range(HISTORY):  # sampled shadows (a seed of their own) kept nothing: never worth it, alone too ...
        p.ended(Ledger(shadow_tokens=62, drafted=60, accepted=0, overlap=16), False)
    assert [p.admit(5, 6, False) for _ in range(3 * EXPLORE)] == [False] * 3 * EXPLORE  # ... not explored under load
    verdicts = [p.admit(n % (EXPLORE_OTHERS + 1), 2, False) for n in range(3 * EXPLORE)]
    assert verdicts == ([True] + [False] * (EXPLORE - 1)) * 3  # ... but measured again every EXPLORE-th where cheap
    saving, cost = p.price(0, 1, False)
    assert p.state()["explored"] == 3 and saving == 0 < cost  # alone, not worth it: refused but for exploring
    assert p.admit(2, 3, True) and p.admit(0, 1, True)  # greedy transfers priced by their own ledger (the prior)


def _live(s, ids, xfer):
    R = {"lynx": {"role": "consume", "xfer": xfer, "method": "lynx", "tier": "full", "shadow": True,
                  "host": "127.0.0.1", "port": 1, "prompt_len": len(ids) - 1}}
    assert s.matched(f"r-{xfer}", ids, R, 0) == (len(ids) - 1, True)
    s.allocated(f"r-{xfer}", ids, R, [0, 1], len(ids) - 1)
    return R


def _shadow(xfer, P):
    return {"lynx": {"role": "consume", "xfer": xfer, "method": "lynx", "tier": "anchor", "shadow": True,
                     "host": "127.0.0.1", "port": 1, "prompt_len": P}}


def test_the_scheduler_side_keeps_each_transfers_ledger_and_prices_shadows_beside_others(caplog):
    t = [0.0]
    s = SchedulerSide("kv_consumer", clock=lambda: t[0])
    ids = list(range(101))
    _live(s, ids, "x")
    s.step_meta([], [], {})
    assert s.matched("s0", ids, _shadow("x", 100), 0) == (100, True)  # alone: admitted
    s.allocated("s0", ids, _shadow("x", 100), [2, 3], 100)
    # the shadow decodes 3 steps; R runs: 1 token (+ vLLM's placeholders: not R's drafts), then 1 + 5 drafts (3
    # kept), then 1 + 4 (none kept), then 1 + 2, whose verification is booked when R finishes (1 kept)
    for sched, computed in (({"s0": 1}, []), ({"s0": 1}, []), ({"s0": 1, "r-x": 17}, [("r-x", None, 100)]),
                            ({"r-x": 6}, [("r-x", None, 101)]), ({"r-x": 5}, [("r-x", None, 105)]),
                            ({"r-x": 3}, [("r-x", None, 106)])):
        t[0] += 0.1
        s.step_meta([], computed, sched)
    assert s._xfers["x"].ledger == Ledger(shadow_tokens=3, drafted=9, accepted=3, overlap=1)
    shadow = s.finished("s0", None)["lynx"]["timeline"]
    assert shadow == {"admitted": 0.0, "first_step": pytest.approx(0.1), "last_step": pytest.approx(0.3), "steps": 3,
                      "batch_mean": 1.33}
    real = s.finished("r-x", None, num_computed=108)["lynx"]["timeline"]  # R's: its steps, batch, transfer's ledger
    assert real == {"admitted": 0.0, "first_step": pytest.approx(0.3), "last_step": pytest.approx(0.6), "steps": 4,
                    "batch_mean": 1.25, "shadow_tokens": 3, "drafted": 11, "accepted": 4, "overlap": 1,
                    "priced_out": 0, "others": 0}
    s.step_meta([], [], {})
    assert s.pricing.expected(False) == Ledger(3, 11, 4, 1)  # (matched without greedy=: a sampled transfer)
    # a busy engine (others running, steps of a + b n): a new transfer's shadow priced against them
    for i in range(64):
        n = 1 + i % 8
        s.step_meta([], [], {f"o{j}": 1 for j in range(n)})
        t[0] += 0.05 + 0.01 * n
    s.step_meta([], [], {f"o{j}": 1 for j in range(16)})  # 16 others running now
    ids2 = list(range(200, 301))
    _live(s, ids2, "y")
    with caplog.at_level(logging.INFO, logger="lynx_hf.vllm"):
        assert s.matched("s1", ids2, _shadow("y", 100), 0) == (1, True)  # refused: claims one token and fails
    s.allocated("s1", ids2, _shadow("y", 100), [9], 1)
    (load,) = [m for m in s.step_meta([], [], {}).loads if m.req_id == "s1"]
    assert load.error.startswith(PRICED) and "beside 16 real requests" in load.error
    assert all(r.levelno == logging.INFO for r in caplog.records if "s1" in r.getMessage())  # a decision, no fault
    assert "y" not in s.step_meta([], [], {}).drafts  # no shadow: R decodes without drafts
    t[0] += 1.0
    s.step_meta([], [], {})  # the engine emptied: the next transfer's shadows return
    ids3 = list(range(400, 501))
    _live(s, ids3, "z")
    assert s.matched("s2", ids3, _shadow("z", 100), 0) == (100, True)


def test_with_pricing_off_every_shadow_that_fits_is_admitted():
    t = [0.0]
    s = SchedulerSide("kv_consumer", clock=lambda: t[0], price_shadows=False)
    for _ in range(40):
        s.pricing.ended(Ledger(shadow_tokens=62, drafted=60, accepted=0), False)  # drafts never kept
    for i in range(64):
        n = 1 + i % 8
        s.step_meta([], [], {f"o{j}": 1 for j in range(n)})
        t[0] += 0.05 + 0.01 * n
    ids = list(range(101))
    _live(s, ids, "x")
    assert not s.pricing.admit(8, 8, False)  # the rule would refuse it ...
    assert s.matched("s0", ids, _shadow("x", 100), 0) == (100, True)  # ... but nobody asks it


def test_others_are_the_real_requests_beside_a_transfer_not_shadows_and_loading_ones_count():
    s = SchedulerSide("kv_consumer", clock=lambda: 0.0)
    ids_x, ids_w, ids_y = list(range(101)), list(range(200, 301)), list(range(400, 501))
    _live(s, ids_x, "x")
    s.step_meta([], [], {})
    assert s.matched("s0", ids_x, _shadow("x", 100), 0) == (100, True)
    s.allocated("s0", ids_x, _shadow("x", 100), [2, 3], 100)
    _live(s, ids_w, "w")  # loading: it runs soon
    _live(s, ids_y, "y")
    s.step_meta([], [], {"r-x": 1, "s0": 1, "plain": 1})  # R of x, its shadow, a plain request
    assert s._others(s._xfers["y"]) == 3  # r-x, plain, r-w; not s0, not y's own R
    assert s._others(s._xfers["x"]) == 3  # plain, r-w, r-y
