"""The `lynx-hf` entry points end to end, at small sizes, and model loading from a local path."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lynx_hf

pytestmark = pytest.mark.slow  # every test here runs the CLI in a subprocess

TEXT = str(Path(__file__).parent / "fixtures" / "shakespeare.txt")


def _run(*args, timeout=600):
    p = subprocess.run([sys.executable, "-m", "lynx_hf.cli", *args], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads([l for l in p.stdout.splitlines() if l.startswith("{")][-1])


def test_codec_quality_json():
    r = _run("codec-quality", "--json", "--contexts", "256", "--gen", "8", "--no-ablation", "--text", TEXT)
    m = r["methods"]
    assert r["default"] == "lynx-anchor" and set(m) >= {"bf16", "int8", "kivi4", "kivi2", "cachegen", "paper-anchor",
                                                         "lynx-full"}
    assert m["lynx-anchor"]["bits_per_value"] <= 4.5 and m["lynx-full"]["bits_per_value"] <= 8.5
    assert m["lynx-full"]["kl"] < m["lynx-anchor"]["kl"] < m["kivi2"]["kl"]
    assert m["cachegen"]["bits_per_value"] < 4.5 and m["cachegen"]["kl"] < m["kivi2"]["kl"]
    coded = r["lynx_coded"]  # CacheGen's coder on Lynx's streams: lossless (asserted inside), measured, decided
    assert 0 < coded["anchor"]["coded_bits_per_value"] and coded["anchor"]["coding_s"] > 0
    assert coded["adopt"] == (coded["anchor"]["ttft_cut_bound"] >= 0.05)


def test_demo_two_processes(tmp_path):
    r = _run("demo", "--json", "--tokens", "128", "--new-tokens", "6", "--bandwidth-mbps", "50", "--out", str(tmp_path),
             "--repeat", "2")
    assert r["lynx"]["identical_to_full"] is True and r["rounds"] == 2 and r["identical"] == [True, True]
    rounds = json.loads((tmp_path / "demo.json").read_text())["per_round"]
    assert [x["order"][0] for x in rounds] == ["BF16", "INT8"]  # rotated: each round starts one method later,
    assert [x["order"][-1] for x in rounds] == ["lynx-nodraft", "BF16"]  # the no-draft reference among them
    for k, (a, b, f) in {"ttft_lynx_int4": ("Lynx", "INT4 (KIVI-4)", "ttft_s"),
                         "tt32t_lynx_int8": ("Lynx", "INT8", "tt32t_s"),
                         "decode_start_lynx_int8": ("Lynx", "INT8", "decode_start_s"),
                         "tt32t_lynx_nodraft": ("Lynx", "lynx-nodraft", "tt32t_s")}.items():  # per-round ratios
        per = sorted(x["rows"][a][f] / x["rows"][b][f] for x in rounds)
        assert r["ratios"][k] == {"median": pytest.approx((per[0] + per[1]) / 2), "min": per[0], "max": per[1]}, k
    # the first token is picked from the logits the moment they land; TT32T at or above its floor (busy machine:
    # loosely above)
    assert 0.99 <= r["at_floor"]["lynx_ttft"] <= 1.3 and 0.9 <= r["at_floor"]["lynx_tt32t"] <= 3
    assert 0.99 <= r["at_floor"]["lynx_decode_start"] <= 3 and r["ratios"]["decode_start_lynx_int4"]["median"] > 0
    for name, m in r["methods"].items():  # the first token needs no KV: it comes before the first decode-side one
        assert m["ttft_s"] < m["decode_start_s"], name
    assert list(r["methods"])[:2] == ["BF16", "INT8"]  # the plan's order, whatever the last round's
    assert set(r["methods"]) == {"BF16", "INT8", "INT4 (KIVI-4)", "CacheGen", "Lynx", "Lynx (exact)",
                                 "lynx-nodraft"}
    assert r["exact"]["identical_to_plain_generate"] is True  # exact mode = plain generate (here fp32)
    assert isinstance(r["prefill_bound"], bool)
    assert r["methods"]["BF16"]["bytes"] > r["methods"]["INT8"]["bytes"] > r["methods"]["INT4 (KIVI-4)"]["bytes"]
    assert r["methods"]["CacheGen"]["bytes"] < r["methods"]["INT4 (KIVI-4)"]["bytes"]
    assert r["methods"]["CacheGen"]["ttft_s"] > 0 and r["methods"]["CacheGen"]["tt32t_s"] > 0
    assert (tmp_path / "demo_timeline.png").stat().st_size > 10_000 and (tmp_path / "demo_rounds.png").exists()


def test_cli_errors_are_one_line():
    for args, says in ((["serve-decode", "--prefill", "127.0.0.1:1", "--prompt", "x"], "error"),
                       (["demo", "--model", "/no/such/dir"], "no such model folder: /no/such/dir"),
                       (["serve-decode", "--prefill", "127.0.0.1:1", "--link-mbps", "10", "--prompt", "x"],
                        "--link-mbps is the rate --anchor-bits auto plans with")):
        p = subprocess.run([sys.executable, "-m", "lynx_hf.cli", *args], capture_output=True, text=True, timeout=300)
        assert p.returncode != 0 and "Traceback" not in p.stderr and says in p.stderr, p.stderr[-2000:]


def test_local_path_through_the_same_entry_point(tmp_path, model_and_tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tok = model_and_tok
    torch.manual_seed(0)
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
    tiny.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, tok2 = lynx_hf.load_default_model(str(tmp_path))
    assert model.config.num_hidden_layers == 2 and tok2("hi").input_ids == tok("hi").input_ids


def test_bench_codec_json():
    r = _run("bench", "codec", "--json", "--tokens", "32", "--max-mb", "13", "--reps", "1")
    assert r["device"] == "cpu" and r["copy_gbps"] > 0 and set(r["paths"]) == {"c", "eager", "compiled"}
    assert set(r["sizes"]) == {"32", "256"}
    keys = {"encode_gbps", "decode_anchor_gbps", "decode_full_gbps", "decode_anchor_fresh_gbps",
            "decode_full_fresh_gbps"}
    for row in r["sizes"].values():
        for v in row["paths"].values():
            assert set(v) == keys and min(v.values()) > 0


def test_bench_transfer_sweep_resumes(tmp_path):
    args = ("bench", "transfer", "--json", "--links", "50", "10000", "--contexts", "96", "--prompts", TEXT,
            "--new-tokens", "4", "--out", str(tmp_path))
    r = _run(*args)
    lines = (tmp_path / "bench_transfer.jsonl").read_text().splitlines()
    assert r["requests"] == len(lines) == 2 * 6 and r["lynx_identical_to_full"] is True
    assert (tmp_path / "bench_transfer.png").stat().st_size > 0
    (key,) = r["crossovers"]
    assert key.endswith("@96") and set(r["crossovers"][key]) == {
        "lynx_beats_int8_below_mbps", "drafting_pays_below_mbps", "lynx_decode_start_beats_int8_below_mbps"}
    by = {(x["link_mbps"], x["method"]): x for x in map(json.loads, lines)}
    assert by[(50, "BF16")]["bytes"] > by[(50, "INT8")]["bytes"] > by[(50, "INT4 (KIVI-4)")]["bytes"]
    for (mbps, method), x in by.items():  # what the emulated link guarantees, under any load: a baseline's decoding
        assert x["bytes"] == by[(50, method)]["bytes"]  # starts once all of its KV, which the link paces, is in
        if not method.startswith("Lynx"):
            assert x["decode_start_s"] >= x["bytes"] * 8 / (mbps * 1e6), (mbps, method, x)
        assert x["ttft_s"] < x["decode_start_s"]  # the first token, from the logits alone, comes before
    assert _run(*args) == r  # resumed: nothing recomputed, the same summary
    assert len((tmp_path / "bench_transfer.jsonl").read_text().splitlines()) == 12


def test_crossover_rule():
    from lynx_hf.eval.benches.bench_transfer import _crossover

    assert _crossover([(50, 0.7), (200, 0.8), (1000, 1.0)]) == pytest.approx(200 * 5 ** 0.75)
    assert _crossover([(50, 0.7), (200, 0.9)]) == float("inf")
    assert _crossover([(50, 0.96), (200, 1.2)]) is None
    assert _crossover([(50, 1.0), (200, 0.9)]) is None  # a lead only at fast links is not a crossover


def test_the_gguf_conversion_is_cached_once_when_loaders_race(tmp_path, monkeypatch):
    """Two processes and two threads of this one racing on an empty cache each finish with the same folder, one
    cache folder is left, no half-written one; a later load reads it (the cached weights equal the GGUF file's) and
    the threads' loads left Transformers' loading unpatched (a model built afterwards has its weights tied, none on
    the meta device: before the loads took turns, a race left `tie_weights` a no-op for the whole process)."""
    import threading

    from lynx_hf import model as M
    from lynx_hf.arch import fingerprint

    monkeypatch.setenv("LYNX_CACHE", str(tmp_path))
    got, errors = [], []

    def load():
        try:
            got.append(M.converted_gguf(M.default_model_dir(), M.DEFAULT_GGUF))
        except Exception as e:  # noqa: BLE001 — reported below
            errors.append(e)

    code = "from lynx_hf import model as M; print(M.converted_gguf(M.default_model_dir(), M.DEFAULT_GGUF))"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
        got.append(out.strip())
    assert not errors and len(got) == 4 and len(set(got)) == 1
    assert os.listdir(M.cache_root()) == [os.path.basename(got[0])]
    cached, _ = lynx_hf.load_default_model(warm=False)
    from transformers import AutoModelForCausalLM

    direct = AutoModelForCausalLM.from_pretrained(M.default_model_dir(), gguf_file=M.DEFAULT_GGUF)
    assert cached.config._name_or_path == got[0] and fingerprint(cached) == fingerprint(direct)
    assert not any(p.is_meta for p in cached.parameters())
    assert cached.lm_head.weight.data_ptr() == cached.model.embed_tokens.weight.data_ptr()


def test_the_example_prints_its_text_once_when_piped():
    p = subprocess.run([sys.executable, "examples/generate_with_lynx.py"], capture_output=True, text=True,
                       timeout=600, cwd=Path(__file__).parent.parent)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [l for l in p.stdout.splitlines() if l.strip()]
    text, stats = "\n".join(lines[:-1]), lines[-1]
    assert stats.startswith("{'drafted'") and len(text) > 20
    assert p.stdout.count(text[:20]) == 1  # before: the streamer's text, then the same text printed again
