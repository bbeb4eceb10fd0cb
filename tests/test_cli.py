"""The `lynx-hf` entry points end to end, at small sizes, and model loading from a local path."""
import json
import subprocess
import sys
from pathlib import Path

import torch

import lynx_hf

TEXT = str(Path(__file__).parent / "fixtures" / "shakespeare.txt")


def _run(*args, timeout=600):
    p = subprocess.run([sys.executable, "-m", "lynx_hf.cli", *args], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads([l for l in p.stdout.splitlines() if l.startswith("{")][-1])


def test_codec_quality_json():
    r = _run("codec-quality", "--json", "--contexts", "256", "--gen", "8", "--no-ablation", "--text", TEXT)
    m = r["methods"]
    assert r["default"] == "lynx-anchor" and set(m) >= {"bf16", "int8", "kivi4", "kivi2", "paper-anchor", "lynx-full"}
    assert m["lynx-anchor"]["bits_per_value"] <= 4.5 and m["lynx-full"]["bits_per_value"] <= 8.5
    assert m["lynx-full"]["kl"] < m["lynx-anchor"]["kl"] < m["kivi2"]["kl"]


def test_demo_two_processes(tmp_path):
    r = _run("demo", "--json", "--tokens", "128", "--new-tokens", "6", "--bandwidth-mbps", "50", "--out", str(tmp_path))
    assert r["lynx"]["identical_to_full"] is True
    assert set(r["methods"]) == {"BF16", "INT8", "INT4 (KIVI-4)", "Lynx"}
    assert r["methods"]["BF16"]["bytes"] > r["methods"]["INT8"]["bytes"] > r["methods"]["INT4 (KIVI-4)"]["bytes"]
    assert (tmp_path / "demo.json").exists() and (tmp_path / "demo_timeline.png").stat().st_size > 10_000


def test_cli_errors_are_one_line():
    for args, says in ((["serve-decode", "--prefill", "127.0.0.1:1", "--prompt", "x"], "error"),
                       (["demo", "--model", "/no/such/dir"], "no such model folder: /no/such/dir")):
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
    assert r["device"] == "cpu" and r["copy_gbps"] > 0 and set(r["paths"]) == {"eager", "compiled"}
    assert set(r["sizes"]) == {"32", "256"}
    for row in r["sizes"].values():
        for v in row["paths"].values():
            assert set(v) == {"encode_gbps", "decode_anchor_gbps", "decode_full_gbps"} and min(v.values()) > 0
