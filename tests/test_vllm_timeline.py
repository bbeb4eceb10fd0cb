"""vllm-bench's timeline per request (vllm_timeline.py): the client's row and the decode instance's transfer_log
lines joined on one clock, and an arm's phases."""
import json

import pytest

from lynx_hf.eval.benches import vllm_timeline as bt


def test_a_requests_timeline_puts_every_clock_on_its_arrival(tmp_path):
    # the arm started at perf 100.0 = monotonic 5100.0 = wall 1e9; the request arrived 2 s later
    at = {"perf": 100.0, "mono": 5100.0, "wall": 1e9}
    row = {"arrival_s": 2.0, "ttft_s": 0.4, "tt2t_s": 3.1, "tt32t_s": 5.0, "xfer": "ab"}
    r_line = {"xfer": "ab", "tier": "full", "first_at": 1e9 + 2.5, "anchor_at": 1e9 + 3.0, "full_at": 1e9 + 4.0,
              "timeline": {"admitted": 5102.45, "first_step": 5106.0, "last_step": 5106.9, "steps": 4,
                           "batch_mean": 3.5, "shadow_tokens": 40, "drafted": 20, "accepted": 12, "overlap": 6,
                           "priced_out": 0, "others": 2}}
    s_line = {"xfer": "ab", "tier": "anchor", "timeline": {"admitted": 5102.5, "first_step": 5105.1,
                                                         "last_step": 5105.9, "steps": 9, "batch_mean": 3.0}}
    log = tmp_path / "t.jsonl"
    log.write_text("\n".join(json.dumps(x) for x in (r_line, s_line, {"xfer": "zz", "tier": "full"})) + "\n")
    lines = bt.read_log(log)
    assert set(lines) == {"ab", "zz"} and bt.read_log(tmp_path / "none.jsonl") == {}
    t = bt.timeline(row, lines["ab"], 100.0, at)
    assert t["prefill_done"] == 0.4 and t["tt2t"] == 3.1 and t["tt32t"] == 5.0
    assert (t["first_kv"], t["anchor_landed"], t["full_landed"]) == pytest.approx((0.5, 1.0, 2.0))
    assert (t["admitted"], t["first_step"], t["last_step"]) == pytest.approx((0.45, 4.0, 4.9))
    assert t["step_s"] == pytest.approx(0.3) and t["steps"] == 4 and t["batch_mean"] == 3.5
    assert (t["shadow_tokens"], t["drafted"], t["accepted"], t["overlap"], t["priced_out"], t["others"]) == \
        (40, 20, 12, 6, 0, 2)
    assert t["shadows"] == [{"first_step": pytest.approx(3.1), "last_step": pytest.approx(3.9), "steps": 9}]
    bare = bt.timeline({**row, "tt32t_s": None}, [], 100.0, at)  # a failed request, no log line: no mark invented
    assert bare["full_landed"] is None and bare["first_step"] is None and bare["shadows"] == []
    assert bare["tt32t"] is None
    ph = bt.phases([t, bare, {**t, "full_landed": 3.0, "first_step": 4.5, "tt32t": 6.0, "priced_out": 2,
                              "shadows": []}])
    assert ph["full_landed"] == 2.5 and ph["first_step"] == 4.25 and ph["tt32t"] == 5.5  # medians of what exists
    assert ph["landed_to_first_step"] == pytest.approx(1.75) and ph["first_step_to_tt32t"] == pytest.approx(1.25)
    assert ph["shadows"] == 1 and ph["priced_out"] == 2
    bt.plot({"lynx": [{**row, "timeline": t}, {**row, "arrival_s": 4.0, "timeline": bare}]}, tmp_path / "p.png", "x")
    assert (tmp_path / "p.png").stat().st_size > 0
