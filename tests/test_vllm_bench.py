"""`python -m lynx_hf.eval.benches.vllm_bench` (bash bootstrap.sh vllm-bench): its pure parts in the fast tier (no
vLLM, no
aiohttp: schedule, percentiles, the exactness judgment, the request plan, the summary's names, /metrics parsing,
the flags), and one slow smoke run of the whole bench in .venv-vllm (skipped, saying why, where it is not set up)."""
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from lynx_hf.eval.benches import vllm_bench as bench
from lynx_hf.eval.benches.vllm_servers import free_base

ROOT = Path(__file__).resolve().parent.parent
VPY = ROOT / ".venv-vllm" / "bin" / "python"
METHOD_KEYS = {"ttft_p50_s", "ttft_p90_s", "tt32t_p50_s", "tt32t_p90_s", "output_tokens_per_s", "greedy",
               "greedy_exact", "greedy_near_tie", "errors", "drafted", "accepted", "preemptions"}


def test_the_module_imports_without_vllm_or_aiohttp():
    code = ("import sys, lynx_hf.eval.benches.vllm_bench; "
            "print(sorted(m for m in ('vllm', 'aiohttp', 'torch') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


def test_poisson_schedule_is_seeded_and_its_mean_gap_is_one_over_the_rate():
    a = bench.schedule(4000, 0.5, seed=3)
    assert a == bench.schedule(4000, 0.5, seed=3) and a != bench.schedule(4000, 0.5, seed=4)
    assert a[0] == 0.0 and all(y > x for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.mean(gaps) == pytest.approx(2.0, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(2.0, rel=0.08)  # exponential: the sd equals the mean
    assert bench.schedule(1, 0.2, 0) == [0.0]


def test_percentile_interpolates_between_order_statistics():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert bench.percentile(xs, 50) == 2.5
    assert bench.percentile(xs, 90) == pytest.approx(3.7)
    assert bench.percentile(xs, 0) == 1.0 and bench.percentile(xs, 100) == 4.0
    assert bench.percentile([7.0], 90) == 7.0
    assert bench.percentile([None, 1.0, None, 3.0], 50) == 2.0  # a request without that time does not count
    assert bench.percentile([], 50) is None and bench.percentile([None], 50) is None


def test_judge_exact_near_tie_and_differs():
    ref = [5, 6, 7, 8]
    tops = [{"a": -0.1, "b": -3.0}, {"a": -0.5, "b": -0.5004}, {"a": -0.2, "b": -2.0}, {"a": -0.1}]
    assert bench.judge([5, 6, 7, 8], ref, tops) == ("exact", None, None)
    verdict, k, g = bench.judge([5, 9, 1, 1], ref, tops)  # parts at a near-tie of the reference's top-2
    assert (verdict, k) == ("near_tie", 1) and g == pytest.approx(4e-4)
    verdict, k, g = bench.judge([5, 6, 9, 9], ref, tops)  # parts where the reference was sure: not exact
    assert (verdict, k) == ("differs", 2) and g == pytest.approx(1.8)
    assert bench.judge([5, 6, 7, 9], ref, tops)[0] == "differs"  # a single top logprob: no tie to speak of
    assert bench.judge([5, 6], ref, tops)[:2] == ("differs", 2)  # shorter: differs where it stops
    assert bench.gap(None) == math.inf and bench.first_difference([1, 2], [1, 2]) is None


def _row(i, greedy=True, tokens=(1, 2, 3), error=None):
    return {"i": i, "greedy": greedy, "error": error, "token_ids": list(tokens), "ttft_s": 1.0 + i, "tt2t_s": 2.0,
            "tt32t_s": 3.0 + i, "tokens": len(tokens), "top_logprobs": [{"x": -0.1, "y": -0.1002}] * len(tokens)}


def test_judge_rows_and_arm_stats_count_every_request():
    rows = [_row(0), _row(1, greedy=False), _row(2, tokens=(1, 9, 9)), _row(3, error="HTTP 502: no"), _row(4)]
    alone = {0: _row(0), 2: _row(2), 3: _row(3), 4: _row(4, error="timeout")}
    bench.judge_rows(rows, alone)
    assert [r.get("verdict") for r in rows] == ["exact", None, "near_tie", "unjudged: HTTP 502: no",
                                                "unjudged: timeout"]
    deltas = {bench.DRAFTED: 40.0, bench.ACCEPTED: 12.0, bench.PREEMPTED: 2.0}
    s = bench.arm_stats(rows, 10.0, deltas)
    assert set(s) == METHOD_KEYS
    assert s["errors"] == 1 and s["greedy"] == 4 and s["greedy_exact"] == 1 and s["greedy_near_tie"] == 1
    assert s["ttft_p50_s"] == 2.5  # over the 4 requests that completed: 1, 2, 3, 5
    assert s["tt32t_p90_s"] == pytest.approx(6.4)  # 3, 4, 5, 7: 5 + 0.7 * 2
    assert s["output_tokens_per_s"] == 1.2  # 12 tokens of the completed requests over a 10 s span
    assert (s["drafted"], s["accepted"], s["preemptions"]) == (40, 12, 2)


def test_summary_names_the_json_line():
    methods = {k: bench.arm_stats([_row(0)], 5.0, {bench.PREEMPTED: n}) for n, k in enumerate(bench.MEASURED)}
    s = bench.summary(24, 0.2, methods)
    assert list(s) == ["requests", "rate_per_s", "preemptions", "methods"]
    assert set(s["methods"]) == {"lynx", "ref", "int8", "int4"} and s["preemptions"] == 0 + 1 + 2 + 3
    assert all(set(m) == METHOD_KEYS for m in s["methods"].values())
    json.dumps(s)
    assert "lynx" in bench.table(s, {"lynx": 2.0}) and len(bench.table(s, {}).splitlines()) == 5


def _stats(tt32t_p50, ttft_p50=1.0, errors=0):
    figures = {"ttft_p50_s": ttft_p50, "ttft_p90_s": 2 * ttft_p50, "tt32t_p50_s": tt32t_p50,
               "tt32t_p90_s": 2 * tt32t_p50, "output_tokens_per_s": 10.0}
    return {**figures, "greedy": 12, "greedy_exact": 12, "greedy_near_tie": 0, "errors": errors, "drafted": 5,
            "accepted": 2, "preemptions": 1}


def test_over_rounds_gives_medians_sums_and_paired_ratios():
    rounds = [{"lynx": _stats(9.0), "ref": _stats(10.0), "int8": _stats(12.0), "int4": _stats(8.0)},
              {"lynx": _stats(20.0, errors=1), "ref": _stats(16.0), "int8": _stats(20.0), "int4": _stats(9.0)},
              {"lynx": _stats(11.0, ttft_p50=3.0), "ref": _stats(10.0), "int8": _stats(11.0), "int4": _stats(7.0)}]
    methods, spread, ratios = bench.over_rounds(rounds)
    assert set(methods) == {"lynx", "ref", "int8", "int4"} and all(set(m) == METHOD_KEYS for m in methods.values())
    assert methods["lynx"]["tt32t_p50_s"] == 11.0 and methods["lynx"]["ttft_p50_s"] == 1.0  # medians of rounds
    assert methods["lynx"]["errors"] == 1 and methods["lynx"]["greedy"] == 36  # counts: sums over rounds
    assert spread["lynx"]["tt32t_p50_s"] == {"median": 11.0, "min": 9.0, "max": 20.0}
    # ratios pair each round's own figures: lynx/int8 = 0.75, 1.0, 1.0 (not 11 / 12, the ratio of medians)
    assert ratios["tt32t_p50_lynx_int8"] == {"median": 1.0, "min": 0.75, "max": 1.0}
    assert ratios["tt32t_p50_lynx_ref"] == {"median": 1.1, "min": 0.9, "max": 1.25}
    assert ratios["ttft_p90_lynx_ref"] == {"median": 1.0, "min": 1.0, "max": 3.0}
    assert set(ratios) == {f"{m}_{q}_lynx_{b}" for m in ("ttft", "tt32t") for q in ("p50", "p90")
                           for b in ("int8", "ref")}
    json.dumps([methods, spread, ratios])


def test_plan_cuts_disjoint_prompts_alternating_greedy_and_sampled():
    ids = list(range(50_000))
    reqs = bench.plan(ids, 24, 0, 128, 1024, 32, "m")
    assert reqs == bench.plan(ids, 24, 0, 128, 1024, 32, "m") and reqs != bench.plan(ids, 24, 1, 128, 1024, 32, "m")
    starts = [r["prompt"][0] for r in reqs]
    assert all(128 <= len(r["prompt"]) <= 1024 for r in reqs) and len(set(starts)) == 24
    assert all(r["prompt"][-1] + 1 == nxt for r, nxt in zip(reqs, starts[1:]))  # consecutive, disjoint windows
    assert len({len(r["prompt"]) for r in reqs}) > 12  # mixed lengths
    for i, r in enumerate(reqs):
        assert r["max_tokens"] == 32 and r["stream"] and r["ignore_eos"] and r["return_tokens_as_token_ids"]
        assert "top_k" not in r  # (top_k without top_p in a speculative batch crashes vLLM 0.32's engine)
        if i % 2 == 0:
            assert r["temperature"] == 0.0 and r["logprobs"] == 2 and "seed" not in r
        else:
            assert r["temperature"] == 1.0 and r["top_p"] == 0.95 and isinstance(r["seed"], int)
    assert len({r["seed"] for r in reqs[1::2]}) == 12
    with pytest.raises(ValueError, match="lower --requests"):
        bench.plan(list(range(1000)), 4, 0, 512, 1024, 32, "m")


def test_parse_metrics_sums_label_sets_and_skips_comments():
    text = """# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="/a b/{c}"} 3.0
vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 1.234e3
vllm:num_requests_running{engine="0"} 0.0 1700000000000
vllm:num_requests_running{engine="1"} 1.0
process_cpu_seconds_total 12.5
vllm:broken{engine="0"} not-a-number
"""
    m = bench.parse_metrics(text)
    assert m["vllm:num_preemptions_total"] == 5.0 and m[bench.DRAFTED] == 1234.0
    assert m["vllm:num_requests_running"] == 1.0 and m["process_cpu_seconds_total"] == 12.5
    assert "vllm:broken" not in m and not any(k.startswith("#") for k in m)


@pytest.mark.parametrize("argv, says", [
    (["--rate", "0"], "--rate"), (["--rate", "nan"], "--rate"), (["--requests", "0"], "--requests"),
    (["--new-tokens", "1"], "--new-tokens"), (["--prompt-min", "900", "--prompt-max", "800"], "--prompt-min"),
    (["--prompt-max", "1530"], "--max-model-len"), (["--port", "65534"], "--port"), (["--seed", "-1"], "--seed"),
])
def test_bad_flags_get_one_clear_line(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench._args(["--model", "m", *argv])
    assert e.value.code == 2 and says in capsys.readouterr().err


def _vllm_ready() -> str | None:
    if not VPY.exists():
        return "no vLLM environment (.venv-vllm): run `bash bootstrap.sh vllm-env`"
    p = subprocess.run([str(VPY), "-c", "import vllm, aiohttp, tqdm, matplotlib, lynx_hf.vllm.connector"],
                       capture_output=True, text=True)
    return None if p.returncode == 0 else f"vLLM does not import in .venv-vllm: {p.stderr.strip()[-200:]}"


@pytest.mark.slow
def test_bench_smoke_on_the_embedded_model(tmp_path):
    """The whole bench, small: 6 requests of 16 tokens, prompts of 128..512 tokens, 4 arms, then the alone runs (one
    per reference: ref, int8, int4)."""
    why = _vllm_ready()
    if why:
        pytest.skip(why)
    from lynx_hf.model import DEFAULT_GGUF, converted_gguf, default_model_dir

    model = converted_gguf(default_model_dir(), DEFAULT_GGUF)
    base = free_base(bench.PORTS, 9150, 9199) or free_base(bench.PORTS, 38200, 39000)
    p = subprocess.run([str(VPY), "-m", "lynx_hf.eval.benches.vllm_bench", "--model", model, "--requests", "6",
                        "--new-tokens", "16", "--prompt-max", "512", "--rate", "0.5", "--port", str(base),
                        "--out-dir", str(tmp_path),
                        "--json"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    log = tmp_path / "vllm_bench_servers.log"
    assert p.returncode == 0 and lines, p.stderr[-3000:] + (log.read_text()[-3000:] if log.exists() else "")
    s = json.loads(lines[-1])
    assert list(s) == ["requests", "rate_per_s", "preemptions", "methods", "rounds", "ratios", "cores",
                       "kv_nice"]
    assert s["kv_nice"] == 0  # the default: the prefill side's KV threads level with its engine
    assert s["requests"] == 6 and s["rounds"] == 1 and s["ratios"]["tt32t_p90_lynx_ref"]["median"] > 0
    assert not set(s["cores"]["prefill"]) & set(s["cores"]["decode"])  # (this machine has two cores or more)
    assert set(s["methods"]) == {"lynx", "ref", "int8", "int4"}
    for name, m in s["methods"].items():
        assert set(m) == METHOD_KEYS, name
        assert m["errors"] == 0 and m["greedy"] == 3, (name, m)
        assert m["greedy_exact"] + m["greedy_near_tie"] == 3, (name, m)  # each greedy output: exact or a near-tie
        assert m["ttft_p50_s"] > 0 and m["tt32t_p50_s"] >= m["ttft_p50_s"] and m["output_tokens_per_s"] > 0
    assert all(s["methods"][k]["accepted"] == 0 for k in ("ref", "int8", "int4"))  # no shadow, no drafts
    full = json.loads((tmp_path / "vllm_bench.json").read_text())
    assert len(full["rows"]) == 24 and len(full["alone"]) == 9 and (tmp_path / "vllm_bench.png").stat().st_size > 0
    assert p.stderr.count("TT32T p50") == 1  # the table, on stderr with --json


def test_the_engines_get_disjoint_halves_of_the_cores_and_none_below_two(monkeypatch):
    from lynx_hf.vllm.serve import engine

    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda _: {3, 0, 1, 2, 5})
    assert engine.disjoint_cores() == ([0, 1], [2, 3, 5])
    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda _: {4, 7})
    assert engine.disjoint_cores() == ([4], [7])
    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda _: {0})
    assert engine.disjoint_cores() is None


def test_the_engines_get_disjoint_halves_of_the_cores_unless_shared(monkeypatch):
    from types import SimpleNamespace

    from lynx_hf.vllm.serve import engine

    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert bench.engine_cores(SimpleNamespace(shared_cores=False)) == {"prefill": [0, 1], "decode": [2, 3]}
    assert bench.engine_cores(SimpleNamespace(shared_cores=True)) == {"prefill": None, "decode": None}
    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda _pid: {5})
    assert bench.engine_cores(SimpleNamespace(shared_cores=False)) == {"prefill": None, "decode": None}
