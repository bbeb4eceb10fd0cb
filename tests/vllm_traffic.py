"""Run inside .venv-vllm by tests/test_vllm.py: Lynx in vLLM under an operator's traffic. Two `vllm serve` instances
(prefill, its KV stream paced at 100 Mbit/s; decode with 32 blocks of 64 tokens of KV — 2,048 tokens — prefix
caching at vLLM's default, on) and two proxies (two shadows a request; none), started as the README says (plus a
small KV space). Prints one JSON line (the test asserts). Usage: python tests/vllm_traffic.py MODEL_DIR BASE_PORT.

1. streaming: 4 short greedy prompts together equal themselves alone, token for token; chat; whole = streamed.
2. traffic: 6 long (600-token) greedy prompts, two of them sent twice, alone first (logprobs=2), then all 8 at
   once with 4 sampled requests (temperature 1.0) and 6 plain requests decoding 300 tokens straight on the decode
   instance: more than the decode KV holds, in a mixed batch, outgrowing it (vLLM preempts). Every request
   completes; each greedy output equals itself alone or its first difference is a near-tie of the alone run's top-2
   logprobs (reported with the gap); vLLM's preemption counter is read.
3. bad requests: malformed Lynx parameters at either instance fail alone with a reason; the engines serve on.
4. sampling: the distribution of the first drafted-and-verified token (completion token 3) with drafts (proxy A)
   and without (proxy B), N requests each, χ² homogeneity; the same statistic between temperatures 1.0 and 0.6
   without drafts shows the test's power."""
import asyncio
import inspect
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request

import aiohttp

from lynx_hf.eval.benches.vllm_bench import first_difference, gap  # noqa: F401 — (the package's helpers, shared with the bench)
from lynx_hf.vllm.serve.proxy import upstream_connector
from lynx_hf.eval.benches.vllm_servers import serve, wait_up

NEW, PLAIN_NEW, N_PLAIN, N_SAMPLED = 32, 300, 6, 64


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


async def streaming(base, model):
    prompts = [f"Count from {i}: " + ", ".join(str(j) for j in range(i, i + 60)) for i in range(4)]
    bodies = [{"model": model, "prompt": p, "max_tokens": 24, "temperature": 0} for p in prompts]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), connector=upstream_connector()) as s:
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


async def complete(s, url, body):
    """→ (status, token ids, top-2 logprobs per token or None, finish reason, error text)."""
    async with s.post(url, json=body) as r:
        text = await r.text()
        if r.status != 200:
            return r.status, None, None, None, text[:300]
        c = json.loads(text)["choices"][0]
        lp = c.get("logprobs") or {}
        return 200, lp.get("tokens"), lp.get("top_logprobs"), c.get("finish_reason"), None


async def traffic(base, decode, model, prompts, plain):
    """prompts: Lynx requests through the proxy; plain: a prompt sent N_PLAIN times straight to the decode instance,
    each decoding PLAIN_NEW tokens (together they outgrow the KV: vLLM preempts)."""
    lynx, direct = f"{base}/v1/completions", f"{decode}/v1/completions"
    greedy = lambda ids, n=NEW: {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0,  # noqa
                                 "logprobs": 2}
    refs = [(lynx, greedy(p)) for p in prompts] + [(direct, greedy(plain, PLAIN_NEW))]
    batch = list(range(len(refs))) + [0, 1] + [len(prompts)] * (N_PLAIN - 1)  # two Lynx prompts twice, plain 6x
    sampled = [{"model": model, "prompt": p, "max_tokens": NEW, "temperature": 1.0, "seed": 100 + i}
               for i, p in enumerate(prompts[2:6])]  # (their prefixes hit the greedy runs' cached blocks)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900), connector=upstream_connector()) as s:
        t = time.time()
        alone = [await complete(s, url, body) for url, body in refs]
        t_alone = time.time() - t
        t = time.time()
        together = await asyncio.gather(*[complete(s, *refs[i]) for i in batch],
                                        *[complete(s, lynx, b) for b in sampled])
        t_together = time.time() - t
    rows = []
    for i, got in zip(batch, together):
        ref = alone[i]
        row = {"plain": i >= len(prompts), "status": got[0], "finish": got[3], "error": got[4]}
        if got[0] == 200 and ref[0] == 200:
            k = first_difference(ref[1], got[1])
            row.update(equal=k is None, first_diff=k, gap=None if k is None else round(gap(ref[2][k]), 6))
        rows.append(row)
    return {"greedy": rows, "sampled_status": [r[0] for r in together[len(batch):]],
            "sampled_finish": [r[3] for r in together[len(batch):]], "alone_status": [r[0] for r in alone],
            "alone_error": [r[4] for r in alone], "sampled_error": [r[4] for r in together[len(batch):]],
            "alone_s": round(t_alone, 1), "together_s": round(t_together, 1)}


async def bad_requests(prefill, decode, base, model, kv_port):
    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300), connector=upstream_connector()) as s:
        consume = {"role": "consume", "xfer": "bad-1", "method": "no-such-codec", "tier": "full", "shadow": False,
                   "host": "127.0.0.1", "port": kv_port, "prompt_len": 3}
        async with s.post(f"{decode}/v1/completions", json={"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 4,
                                                            "kv_transfer_params": {"lynx": consume}}) as r:
            out["decode_bad"] = [r.status, (await r.text())[:300]]
        async with s.post(f"{prefill}/v1/completions", json={"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 1,
                          "kv_transfer_params": {"lynx": {"role": "produce", "xfer": "bad-2", "method": "nope"}}}) as r:
            out["prefill_bad"] = r.status
        consume = {**consume, "xfer": "bad-2", "method": "lynx"}
        t = time.time()
        async with s.post(f"{decode}/v1/completions", json={"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 4,
                                                            "kv_transfer_params": {"lynx": consume}}) as r:
            out["refused_transfer"] = [r.status, (await r.text())[:300], round(time.time() - t, 1)]
        after = await complete(s, f"{base}/v1/completions", {"model": model, "prompt": "Then it works: 1, 2, 3,",
                                                             "max_tokens": 8, "temperature": 0})
        out["served_on"] = after[0] == 200 and after[3] == "length"
    return out


async def sampling(base_a, base_b, model, ids):
    async def arm(s, base, temperature):
        body = {"model": model, "prompt": ids, "max_tokens": 4, "temperature": temperature, "logprobs": 0}
        got = await asyncio.gather(*[complete(s, f"{base}/v1/completions", body) for _ in range(N_SAMPLED)])
        return [g[1][2] for g in got if g[0] == 200 and g[1] and len(g[1]) > 2]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900), connector=upstream_connector()) as s:
        drafted = await arm(s, base_a, 1.0)
        plain = await arm(s, base_b, 1.0)
        cooler = await arm(s, base_b, 0.6)
    return {"drafted": drafted, "plain": plain, "cooler": cooler}


def chi2_sf(x, k):
    """P(χ²_k > x): the regularized upper incomplete gamma Q(k/2, x/2) (series below a + 1, continued fraction
    above)."""
    import math

    a, x = k / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    lead = math.exp(-x + a * math.log(x) - math.lgamma(a))
    if x < a + 1:
        term = total = 1.0 / a
        for n in range(1, 1000):
            term *= x / (a + n)
            total += term
            if term < total * 1e-15:
                break
        return max(0.0, 1.0 - lead * total)
    b, c, d = x + 1 - a, 1e300, 1 / (x + 1 - a)
    h = d
    for n in range(1, 1000):
        an = -n * (n - a)
        b += 2
        d, c = 1 / (an * d + b), b + an / c
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return lead * h


def chi2_p(a, b, min_count=5):
    """Two-sample χ² homogeneity p-value over the categories seen >= min_count times in all (the rest pooled)."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    keep = [t for t, n in (ca + cb).items() if n >= min_count]
    rows = [[c[t] for t in keep] + [sum(v for t, v in c.items() if t not in keep)] for c in (ca, cb)]
    cols = [j for j in range(len(keep) + 1) if rows[0][j] + rows[1][j] > 0]
    if len(cols) < 2:
        return 1.0
    n0, n1 = sum(rows[0]), sum(rows[1])
    stat = sum((rows[i][j] - (n0, n1)[i] * (rows[0][j] + rows[1][j]) / (n0 + n1)) ** 2
               / ((n0, n1)[i] * (rows[0][j] + rows[1][j]) / (n0 + n1)) for i in (0, 1) for j in cols)
    return chi2_sf(stat, len(cols) - 1)


def preemptions(decode):
    text = urllib.request.urlopen(f"{decode}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:num_preemptions") and not line.startswith("#"))


def main():
    model, port0 = sys.argv[1], int(sys.argv[2])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    source = "".join(inspect.getsource(m) for m in (inspect, json.decoder, json.encoder, asyncio.tasks))
    ids = tok(source).input_ids
    prompts = [ids[k * 700:k * 700 + 600] for k in range(6)]
    secret = secrets.token_hex(16)
    log = open(os.environ.get("LYNX_SERVE_LOG", os.devnull), "w")
    P, D, KV, A, B = (port0 + i for i in range(5))
    procs = [serve(model, P, KV, "kv_producer", secret, log),
             serve(model, D, KV, "kv_consumer", secret, log, ["--num-gpu-blocks-override", "32",
                   "--speculative-config", json.dumps({"method": "custom_class", "num_speculative_tokens": 8,
                                                       "model": "lynx_hf.vllm.proposer.LynxProposer"})],
                   more={"price_shadows": False})]  # (every shadow admitted: KV pressure and drafted sampling tested)
    proxy = lambda port, shadows: subprocess.Popen(  # noqa: E731
        [sys.executable, "-m", "lynx_hf.vllm.serve.proxy", "--prefill", f"http://127.0.0.1:{P}", "--decode",
         f"http://127.0.0.1:{D}", "--kv-port", str(KV), "--port", str(port), "--shadows", str(shadows)],
        stdout=log, stderr=subprocess.STDOUT)
    proxies = [proxy(A, 2), proxy(B, 0)]
    out = {}
    try:
        for port, ps in ((P, procs), (D, procs), (A, proxies), (B, proxies)):
            wait_up(f"http://127.0.0.1:{port}/health", ps)
        base, decode = f"http://127.0.0.1:{A}", f"http://127.0.0.1:{D}"
        t = time.time()
        out["streaming"] = asyncio.run(streaming(base, model))
        out["streaming_s"] = round(time.time() - t, 1)
        before = preemptions(decode)
        plain = ids[20000:20064]
        out["traffic"] = asyncio.run(traffic(base, decode, model, prompts, plain))
        out["preemptions"] = preemptions(decode) - before
        print(json.dumps(out), file=sys.stderr, flush=True)  # (what came so far, should a later part fail)
        t = time.time()
        out["bad"] = asyncio.run(bad_requests(f"http://127.0.0.1:{P}", decode, base, model, KV))
        out["bad_s"] = round(time.time() - t, 1)
        t = time.time()
        s = asyncio.run(sampling(base, f"http://127.0.0.1:{B}", model, ids[30000:30200]))
        out["sampling"] = {"n": [len(s[k]) for k in ("drafted", "plain", "cooler")],
                           "p_drafted_vs_plain": chi2_p(s["drafted"], s["plain"]),
                           "p_plain_vs_cooler": chi2_p(s["plain"], s["cooler"]), "s": round(time.time() - t, 1)}
        out["alive"] = all(p.poll() is None for p in procs)
    finally:
        for p in procs + proxies:
            p.terminate()
        for p in procs + proxies:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
