"""eval/benches/mooncake.py (vllm-bench --trace's pure parts): a Mooncake-format trace read and checked, turns linked
to their parents, conversations chosen, prompts built per arm, bytes accounted."""
import json

import pytest

from lynx_hf.eval.benches import mooncake as tr
from lynx_hf.eval.benches.vllm_bench import percentile

ROWS = [{"timestamp": 0, "input_length": 1500, "output_length": 512, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "input_length": 600, "output_length": 40, "hash_ids": [9, 8]},
        {"timestamp": 9, "input_length": 2000, "output_length": 10, "hash_ids": [1, 2, 4, 5]},
        {"timestamp": 12, "input_length": 2500, "output_length": 10, "hash_ids": [1, 2, 4, 6, 7]},
        {"timestamp": 15, "input_length": 100, "output_length": 1, "hash_ids": [7]}]


def _write(tmp_path, rows, extra="", name="t.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)
    return str(p)


def test_a_trace_is_read_and_a_bad_line_is_named(tmp_path):
    assert tr.read_trace(_write(tmp_path, ROWS)) == ROWS
    for bad, word in (("{not json\n", "not JSON"), (json.dumps({**ROWS[0], "hash_ids": []}) + "\n", "hash_ids"),
                      (json.dumps({**ROWS[0], "input_length": -1}) + "\n", "input_length"),
                      (json.dumps({**ROWS[0], "timestamp": True}) + "\n", "timestamp"), ("[1]\n", "timestamp")):
        with pytest.raises(ValueError, match=f":6: .*{word}|:6: {word}"):
            tr.read_trace(_write(tmp_path, ROWS, bad))


def test_a_turn_continues_the_request_it_shares_the_longest_prefix_with():
    assert tr.parents(ROWS) == [(None, 0), (None, 0), (0, 2), (2, 3), (None, 0)]
    # scale 512: lengths as in the trace; conversation {0, 2, 3} fits 2600 tokens, {1} and {4} have one turn
    assert tr.conversations(ROWS, 5, 512, 2600, 32) == [[0, 2, 3]]
    assert tr.conversations(ROWS, 5, 512, 2400, 32) == []  # turn 3 (2,500 + 10) does not fit
    assert tr.new_tokens(ROWS[0], 32, 16) == 16 and tr.new_tokens(ROWS[4], 32, 16) == 2


def test_prompts_share_exactly_their_shared_blocks_and_each_arm_has_its_own_text():
    text = list(range(10_000))
    p0, p2 = (tr.prompt(ROWS[j], 32, text, 0, 3, 7) for j in (0, 2))
    assert len(p0) == 94 and len(p2) == 125  # ceil(1500 × 32 / 512), ceil(2000 × 32 / 512)
    assert p0[:64] == p2[:64] and p0[64:94] != p2[64:94]  # blocks 1, 2 shared; 3 vs 4 not
    q0 = tr.prompt(ROWS[0], 32, text, 1, 3, 7)
    assert all(3333 <= t < 6666 for t in q0) and all(t < 3333 for t in p0)  # disjoint regions
    assert tr.prompt(ROWS[0], 32, text, 0, 3, 7) == p0  # deterministic
    with pytest.raises(ValueError, match="too few"):
        tr.prompt(ROWS[0], 32, text[:100], 0, 3, 7)


def test_turn_stats_and_bytes_per_position():
    rows = [{"error": None, "ttft_s": 1.0, "tt2t_s": 2.0, "tt32t_s": 3.0, "kv_bytes": 1000, "kv_start": 0,
             "kv_prompt_len": 100, "new_kv_bytes": 1000},
            {"error": None, "ttft_s": 2.0, "tt2t_s": 3.0, "tt32t_s": 5.0, "kv_bytes": 300, "kv_start": 64,
             "kv_prompt_len": 94, "new_kv_bytes": 200},
            {"error": "HTTP 500", "ttft_s": None, "tt2t_s": None, "tt32t_s": None}]
    assert tr.bytes_per_position(rows) == 10.0  # the fresh one only
    s = tr.turn_stats(rows, percentile)
    assert s == {"turns": 2, "ttft_p50_s": 1.5, "tt2t_p50_s": 2.5, "tt32t_p50_s": 4.0, "tt32t_p90_s": 4.8,
                 "kv_bytes_mean": 650, "new_kv_bytes_mean": 600}


def test_vllm_bench_refuses_a_bad_trace_before_any_server_starts(tmp_path, capsys, monkeypatch):
    from lynx_hf.eval.benches import vllm_bench as bench

    monkeypatch.setattr(bench, "serve", lambda *a, **k: pytest.fail("a server started"))
    model = tmp_path / "m"
    model.mkdir()
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained",
                        lambda *_a, **_k: (lambda text: type("T", (), {"input_ids": list(range(9000))})()))
    for path, word in ((str(tmp_path / "none.jsonl"), "No such file"),
                       (_write(tmp_path, ROWS[:2], name="a"), "no conversation"),
                       (_write(tmp_path, ROWS, "{bad\n", name="b"), "not JSON")):
        with pytest.raises(SystemExit):
            bench.main(["--model", str(model), "--trace", path, "--port", "19300"])
        assert word in capsys.readouterr().err
