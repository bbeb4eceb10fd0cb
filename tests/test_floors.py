"""The floors' arithmetic (lynx_hf/floors.py) on scripted timelines, and the rounds' medians and paired ratios."""
import pytest

from lynx_hf.floors import floors, paired, passes, rotated, spread, step_s

T0 = 100.0  # perf_counter at the request's start


def _timeline(*marks):
    return [(T0 + t, k) for t, k in marks]


def test_passes_group_marks_of_one_forward_and_the_step_is_the_median_one_token_gap():
    tl = _timeline((1.0, "verified"), (2.0, "draft"), (3.0, "verify_start"), (3.5, "verified"), (3.5005, "verified"),
                   (3.501, "verified"), (3.6, "verified"), (3.7, "verified"), (3.85, "verified"), (3.95, "verified"))
    assert passes(tl, T0) == [(1.0, 1), (pytest.approx(3.501), 3), (pytest.approx(3.6), 1), (pytest.approx(3.7), 1),
                              (pytest.approx(3.85), 1), (pytest.approx(3.95), 1)]
    # the gaps between one-token passes after the first token (not the verify pass's): 0.1, 0.15, 0.1
    assert step_s(tl, T0) == pytest.approx(0.1)
    assert step_s(_timeline((1.0, "verified"), (2.0, "verified")), T0) is None


def test_a_one_stream_codec_owes_n_minus_one_steps_after_its_last_segment():
    run = {"t0": T0, "logits_s": 4.2, "timeline": [],
           "events": [(T0 + 1.0, "anchor", 0, "key"), (T0 + 4.0, "anchor", 1, "value")]}
    f = floors(run, 32, 0.05, split=False)
    assert f["ttft"] == 4.2 and f["ttnt"] == pytest.approx(4.0 + 31 * 0.05)


def test_lynx_owes_the_verify_pass_after_the_residual_and_the_steps_its_drafts_did_not_cover():
    events = [(T0 + 2.0, "anchor", 1, "value"), (T0 + 5.0, "residual", 0, "key"), (T0 + 7.0, "residual", 1, "value")]
    # first token at 2.1 (logits), drafts, the verify pass starts at 6.8 (overlapping the last residual) and ends at
    # 7.3 with 24 tokens (23 drafts kept + its own), 25 with the first, then 7 one-token steps
    marks = [(2.1, "verified"), (6.8, "verify_start")] + [(7.3, "verified")] * 24 + \
        [(7.3 + 0.1 * i, "verified") for i in range(1, 8)]
    run = {"t0": T0, "logits_s": 2.05, "events": events, "timeline": _timeline(*marks)}
    f = floors(run, 32, 0.1, split=True)
    assert f["ttft"] == 2.05
    assert f["ttnt"] == pytest.approx(7.0 + 0.3 + 7 * 0.1)  # residual + (7.3 - max(6.8, 7.0)) + owed 7 steps
    # a verify pass that starts after the residual landed costs its whole length
    late = dict(run, timeline=_timeline(*[(t + 1.0 if t > 2.5 else t, k) for t, k in marks]))
    assert floors(late, 32, 0.1, split=True)["ttnt"] == pytest.approx(7.0 + 0.5 + 7 * 0.1)
    # no drafts (the full-tier reference): n - 1 steps after the residual
    ref = dict(run, timeline=_timeline((2.1, "verified"), (7.2, "verified")))
    assert floors(ref, 32, 0.1, split=True)["ttnt"] == pytest.approx(7.0 + 31 * 0.1)
    # everything kept: nothing owed
    kept = dict(run, timeline=_timeline((2.1, "verified"), (6.8, "verify_start"), *[(7.3, "verified")] * 31))
    assert floors(kept, 32, 0.1, split=True)["ttnt"] == pytest.approx(7.3)
    assert floors(dict(run, events=events[:1]), 32, 0.1, split=True)["ttnt"] is None  # no residual: no floor
    assert floors(run, 32, None, split=True) == {"ttft": 2.05, "decode_start": None, "ttnt": None}  # no step: none
    # the second verified token (verified_2_s): the verify pass's, owed nothing more; without drafts, one step
    assert floors(run, 2, 0.1, split=True)["ttnt"] == pytest.approx(7.0 + 0.3)
    assert floors(ref, 2, 0.1, split=True)["ttnt"] == pytest.approx(7.0 + 0.1)


def test_the_decode_start_floor_is_the_data_of_the_second_token_plus_one_step():
    events = [(T0 + 2.0, "anchor", 1, "value"), (T0 + 7.0, "residual", 1, "value")]
    run = {"t0": T0, "logits_s": 0.5, "events": events,  # the first token from the logits alone, ahead of the KV
           "timeline": _timeline((0.6, "verified"), (2.1, "draft"), (2.2, "draft"))}
    assert floors(run, 32, 0.1, split=True)["decode_start"] == pytest.approx(2.0 + 0.1)  # a draft: the anchor's
    ref = dict(run, timeline=_timeline((0.6, "verified"), (7.2, "verified")))  # no drafts: every stream's
    assert floors(ref, 32, 0.1, split=True)["decode_start"] == pytest.approx(7.0 + 0.1)
    one = {"t0": T0, "logits_s": 0.5, "events": [(T0 + 4.0, "anchor", 1, "value")],
           "timeline": _timeline((0.6, "verified"), (4.3, "verified"))}
    assert floors(one, 32, 0.1, split=False)["decode_start"] == pytest.approx(4.1)
    assert floors(dict(one, timeline=_timeline((0.6, "verified"))), 32, 0.1, split=False)["decode_start"] is None


def test_rounds_are_medians_with_ranges_and_ratios_are_medians_of_paired_ratios():
    assert spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0} and spread([None]) is None
    rounds = [{"a": {"t": 1.0}, "b": {"t": 2.0}}, {"a": {"t": 3.0}, "b": {"t": 3.0}},
              {"a": {"t": 2.0}, "b": {"t": 8.0}}]
    # the per-round ratios 0.5, 1.0, 0.25: their median, not the ratio of the medians (2 / 3)
    assert paired(rounds, "a", "b", "t") == {"median": 0.5, "min": 0.25, "max": 1.0}
    plan = ["x", "y", "z"]
    orders = [rotated(plan, r) for r in range(3)]
    assert orders == [["x", "y", "z"], ["y", "z", "x"], ["z", "x", "y"]]
    assert all(sorted(o[i] for o in orders) == plan for i in range(3))  # every method in every slot


def test_the_vllm_demos_floors_count_the_verify_passes_as_measured_and_owed_steps_at_the_step():
    from lynx_hf.eval.benches.vllm_demo import floors as pd_floors, step_s as pd_step
    from lynx_hf.vllm.serve.pd import PDResult

    # a baseline: its whole KV at 4.0, then one token a step (0.05 s) from 4.1
    base = PDResult([0] * 32, 0.5, 4.1, 4.1, [0.5] + [4.1 + 0.05 * i for i in range(31)], "length", full_at_s=4.0,
                    anchor_at_s=4.0)
    assert pd_step(base) == pytest.approx(0.05)
    f = pd_floors(base, 32, 0.05, lynx=False)
    assert f["decode_start_s"] == pytest.approx(4.05) and f["ttft_s"] == 0.5
    assert f["tt32t_s"] == pytest.approx(4.0 + 31 * 0.05)
    # Lynx: anchors at 2.0, everything at 7.0; R's first pass at 7.4 verifies 17 tokens, the next 14 more at 7.6
    lynx = PDResult([0] * 32, 0.5, 2.2, 7.4, [0.5] + [7.4] * 17 + [7.6] * 14, "length", anchor_at_s=2.0,
                    full_at_s=7.0)
    f = pd_floors(lynx, 32, 0.05, lynx=True)
    assert f["decode_start_s"] == pytest.approx(2.05) and f["tt32t_s"] == pytest.approx(7.0 + 0.4 + 0.2)
    short = PDResult([0] * 20, 0.5, 2.2, 7.4, [0.5] + [7.4] * 19, "stop", anchor_at_s=2.0, full_at_s=7.0)
    assert pd_floors(short, 32, 0.05, lynx=True)["tt32t_s"] == pytest.approx(7.4 + 12 * 0.05)  # 12 owed


def test_the_session_benchs_rounds_judge_the_last_turn_and_every_turns_identity():
    from lynx_hf.eval.benches.bench_session import _rounds

    def turn(ttft, tt32t, floor, identical=None, start=None, data=None, step=None):
        return {"ttft_s": ttft, "tt32t_s": tt32t, "ttft_floor_s": floor, "wire_bytes": 100, "new_tokens": 10,
                "total_tokens": 10, "identical": identical, "decode_start_s": start, "decode_start_data_s": data,
                "step_s": step}

    def arms(d, w, i4, i8, first_identical=True):  # decode start: Lynx delta 2d (its data in at 2d - 0.3)
        return {"lynx/delta": [turn(1, 1, 1, first_identical), turn(d, 4.0, d * 0.9, True, 2 * d, 2 * d - 0.3, 9.0)],
                "lynx/whole": [turn(1, 1, 1, True), turn(w, 5.0, w, True, 4.0, 3.0)],
                "int4/delta": [turn(1, 1, 1), turn(i4, 5.0, i4, None, 4 * i4, 3.0, 0.3)],
                "int8/delta": [turn(1, 1, 1), turn(1, i8, 1, None, 8.0, 7.0, 0.1)]}

    out = _rounds([arms(1.0, 2.0, 1.0, 8.0), arms(2.0, 2.0, 1.0, 4.0), arms(1.5, 5.0, 2.0, 5.0, False)])
    assert out["rounds"] == 3 and out["identical"] == [True, True, False]
    assert out["ratios"]["delta_whole_ttft"] == {"median": 0.5, "min": 0.3, "max": 1.0}
    assert out["ratios"]["lynx_int4_delta_ttft"]["median"] == 1.0
    assert out["ratios"]["lynx_int8_delta_tt32t"] == {"median": 0.8, "min": 0.5, "max": 1.0}
    assert (out["floor"]["delta_whole_ttft"] == pytest.approx(0.45)
            and out["at_floor"]["lynx_delta_ttft"] == pytest.approx(1 / 0.9))
    assert out["ratios"]["lynx_identical"] is False  # the last round's every turn, not its last turn alone
    # decode start: the step is the one-stream arms' median (0.2; Lynx's own 9.0 is not one), the floor data + step
    assert out["ratios"]["delta_whole_decode_start"] == {"median": 0.75, "min": 0.5, "max": 1.0}
    assert out["ratios"]["lynx_int4_delta_decode_start"]["median"] == pytest.approx(0.5)
    assert out["ratios"]["lynx_int8_delta_decode_start"]["median"] == pytest.approx(3.0 / 8.0)
    assert out["at_floor"]["lynx_delta_decode_start"] == pytest.approx(3.0 / 2.9)  # d = 1.5: 3.0 over 2.7 + 0.2
    assert out["floor"]["lynx_int8_delta_decode_start"] == pytest.approx(2.9 / 7.2)


def test_line_is_the_least_squares_fit_and_refuses_x_too_alike():
    from lynx_hf.floors import line

    slope, mx, my = line([(1, 0.084), (8, 0.112), (16, 0.144), (8, 0.112)])  # y = 0.08 + 0.004 x
    assert slope == pytest.approx(0.004) and my - slope * mx == pytest.approx(0.08)
    assert line([]) is None and line([(4, 1.0), (4, 2.0)]) is None  # one x: no slope
    assert line([(1, 1.0), (2, 2.0)], min_spread=2) is None and line([(1, 1.0), (2, 2.0)], 0.5)[0] == 1.0
