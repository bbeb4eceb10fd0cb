"""The analytic disaggregation model: the paper's eight figures within 15 % with only the link and one overhead
fitted, and the timeline's invariants."""
import json
import subprocess
import sys

import pytest

from lynx_hf.eval.benches import simulate as sim


@pytest.fixture(scope="module")
def bits():
    return sim.measured_bits(128)


def test_bits_are_the_codecs(bits):
    assert bits["bf16"] == 16.0
    assert 8.0 < bits["int8"] <= 8.6 and 4.0 < bits["int4"] <= 4.6
    assert bits["lynx_anchor"] <= 4.5 and bits["lynx"] <= 8.5 and bits["lynx_anchor"] < bits["lynx"]


def test_timeline_invariants(bits):
    for link in (1.0, 10.0, 100.0):
        t = sim.timeline(sim.QWEN32B, sim.A100, 16384, link, 0.2, bits, acceptance=0.8)
        assert t["int4"]["ttft_s"] < t["int8"]["ttft_s"] < t["bf16"]["ttft_s"]
        assert t["lynx"]["ttft_s"] < t["int8"]["ttft_s"]
        assert 0 <= t["lynx"]["kept"] <= t["lynx"]["drafted"] <= 31
        for m in sim.METHODS:
            assert t[m]["tt32t_s"] > t[m]["ttft_s"]
    slow = sim.timeline(sim.QWEN32B, sim.A100, 16384, 1.0, 0.2, bits, 1.0)["lynx"]
    none = sim.timeline(sim.QWEN32B, sim.A100, 16384, 1.0, 0.2, bits, 0.0)["lynx"]
    assert slow["kept"] == 31 and none["kept"] == 0 and slow["tt32t_s"] < none["tt32t_s"]


def test_paper_fit_and_json():
    p = subprocess.run([sys.executable, "-m", "lynx_hf.cli", "simulate", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(r["fitted"]) == {"link_gbps", "overhead_s"}
    for m, (ttft, tt32) in sim.PAPER.items():
        assert r["paper_fit"][m]["ttft_s"] == pytest.approx(ttft, rel=0.15)
        assert r["paper_fit"][m]["tt32t_s"] == pytest.approx(tt32, rel=0.15)
    assert {p["context"] for p in r["predictions"]} >= {32768, 65536, 131072}
    assert any("MLA" in p["model"] for p in r["predictions"])
