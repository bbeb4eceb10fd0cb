"""Run inside .venv-vllm by tests/test_vllm.py (test_chi2_*): the tokens sampled Lynx requests draw in vLLM follow
full-tier decoding's distribution. Usage: python tests/vllm_chi2.py MODEL_DIR BASE_PORT [N_REQ]; prints one JSON line.

Two `vllm serve` instances (prefill; decode with LynxProposer, 8 speculative tokens) and the proxy with one shadow a
request, started as the README says, the KV link paced at MBPS Mbit/s and a 2-bit anchor, so the residual lands
after the shadow's first drafts. Per setting, N_REQ sampled requests of M tokens on distinct PROMPT-token prompts
(concurrent identical prompts are rivals and get no drafts: proposer.py), CONCURRENCY at a time, each with a seed of
its own, `logprobs: 20` and token ids. Tested: completion tokens 1..M-1, all drawn on the decode instance by vLLM's
rejection sampler — from the shadow's point-mass drafts where it had any (accepted drafts, the recovered token
after a rejection, the bonus token), else with no drafts — whichever way each verification went (conditioning on
acceptance would bias the sample). Measured: 173 of 2,080 tested tokens were accepted drafts (a sampled shadow's
chain is rarely far ahead of its request here); tests/test_chi2.py covers the draft path at every tested position.

The exact reference at each tested position is full-tier decoding's distribution there: the request's own target
logits over its full-tier KV, which vLLM returns as raw logprobs (logprobs_mode "raw_logprobs": the target model's
log-softmax before any processing, the same rows the rejection sampler draws from: v1/sample/rejection_sampler.py),
processed as vLLM samples (temperature, then top-k keeping logits >= the k-th largest, then top-p masking the
ascending cumulative probabilities <= 1 - p, the largest always kept: v1/sample/ops/topk_topp_sampler.py). With
top_k = 20 the 20 returned logprobs are the whole support. Statistic: the randomized probability integral transform
u = F(x-) + W p(x) (vocabulary by descending probability, ties by id, W ~ U(0, 1)); under H0 the u's are iid U(0, 1),
positions of one request too (each uniform given everything before it); χ² over BINS equal bins. Power: the same
samples against the reference at 0.9 x the temperature must be rejected. Drafts accepted: the decode instance's
spec-decode counters over the run."""
import asyncio
import json
import math
import os
import random
import secrets
import subprocess
import sys
import time

import aiohttp

from lynx_hf.vllm.serve.proxy import upstream_connector
from lynx_hf.eval.benches.vllm_servers import metrics, serve, speculative, stop, wait_up
from vllm_traffic import chi2_sf

N_REQ, M, PROMPT, CONCURRENCY, BINS = 260, 9, 96, 12, 20  # 260 x 8 = 2,080 tested tokens a setting
# 260 x 1.1 MB at 10 Mbit/s: ~4 minutes of link a setting, shared by 12 transfers at a time, so a residual takes
# seconds while its shadow drafts on the anchors (on 2 busy cores the engines' compute, not the link, can set the
# pace, and fewer drafts are accepted: tests/test_vllm.py bounds what the statistic needs, not a rate).
SETTINGS = {"t0.8_topk20_topp0.9": dict(temperature=0.8, top_k=20, top_p=0.9)}  # (the HF test runs two settings)
MBPS, QUANT = 10, {"anchor_bits": 2}  # a 2-bit anchor: the residual is 3/4 of the bytes, the shadow's head start
POWER_T = 0.9  # the power check's reference temperature, as a factor of the sampling one


def processed(top: dict, temperature: float, top_k: int, top_p: float) -> dict:
    """Raw logprobs {token id: logprob} (the top ones) → the distribution vLLM samples from, {token id: p}
    (float64)."""
    ranked = sorted(top, key=lambda t: (-top[t], t))
    kth = top[ranked[top_k - 1]]
    keep = [t for t in ranked if top[t] >= kth]  # (vLLM's top-k: logits >= the k-th largest)
    z = [top[t] / temperature for t in keep]
    m = max(z)
    w = [math.exp(x - m) for x in z]
    s = sum(w)
    probs = dict(zip(keep, (x / s for x in w)))
    if top_p < 1.0:
        cum, out = 0.0, {}
        asc = sorted(keep, key=lambda t: (probs[t], -t))  # ascending, as vLLM sorts
        for i, t in enumerate(asc):
            cum += probs[t]
            if cum > 1 - top_p or i == len(asc) - 1:
                out[t] = probs[t]
        s = sum(out.values())
        probs = {t: p / s for t, p in out.items()}
    return probs


def pit(probs: dict, x: int, w: float) -> float | None:
    """u = F(x-) + w p(x) under probs (descending probability, ties by id); None when x is outside the support."""
    if x not in probs:
        return None
    px = probs[x]
    below = sum(p for t, p in probs.items() if p > px or (p == px and t < x))
    return min(1.0, below + w * px)


def chi2_uniform(us: list) -> tuple[float, list]:
    counts = [0] * BINS
    for u in us:
        counts[min(BINS - 1, int(u * BINS))] += 1
    e = len(us) / BINS
    return chi2_sf(sum((c - e) ** 2 / e for c in counts), BINS - 1), counts


def token_id(s: str) -> int:
    assert s.startswith("token_id:"), s
    return int(s[len("token_id:"):])


async def one(s, url, body) -> tuple:
    """→ (token ids, top logprobs per token as {id: logprob}) or raises with the server's answer."""
    async with s.post(url, json=body) as r:
        text = await r.text()
        assert r.status == 200, text[:300]
    lp = json.loads(text)["choices"][0]["logprobs"]
    return [token_id(t) for t in lp["tokens"]], [{token_id(k): v for k, v in top.items()} for top in lp["top_logprobs"]]


async def setting(base, model, prompts, gen: dict, seed0: int) -> list:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def run(i, ids):
        body = {"model": model, "prompt": ids, "max_tokens": M, "logprobs": 20, "return_tokens_as_token_ids": True,
                "seed": seed0 + i, **gen}
        async with gate:
            return await one(s, f"{base}/v1/completions", body)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800), connector=upstream_connector()) as s:
        return await asyncio.gather(*[run(i, p) for i, p in enumerate(prompts)])


async def refused_topk_only(base, decode, model, prompt) -> dict:
    """A sampled request with top-k and no top-p fails alone, saying why (fixes.py: it would kill vLLM 0.32's CPU
    engine): the proxy answers it, and the decode instance, sent it directly, fails it (its log says why) and serves
    a greedy request after it."""
    topk = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 1.0, "top_k": 20, "seed": 1}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300), connector=upstream_connector()) as s:
        async with s.post(f"{base}/v1/completions", json=topk) as r:
            status, text = r.status, await r.text()
        async with s.post(f"{decode}/v1/completions", json=topk) as r:
            direct = r.status
        async with s.post(f"{decode}/v1/completions", json={**topk, "temperature": 0}) as r:
            after = r.status
    return {"status": status, "says_why": "top_k and no top_p" in text, "direct": direct, "served_after": after == 200}


def judge(results, gen: dict, seed: int) -> dict:
    rng = random.Random(seed)
    us, power, outside, tv = [], [], 0, 0.0
    cooler = {**gen, "temperature": gen["temperature"] * POWER_T}
    for ids, tops in results:
        for j in range(1, len(ids)):  # the decode instance's tokens
            exact, wrong, w = processed(tops[j], **gen), processed(tops[j], **cooler), rng.random()
            u = pit(exact, ids[j], w)
            outside += u is None
            if u is not None:
                us.append(u)
                power.append(pit(wrong, ids[j], w) or 0.0)
            tv += 0.5 * sum(abs(exact.get(t, 0.0) - wrong.get(t, 0.0)) for t in set(exact) | set(wrong))
    p, counts = chi2_uniform(us)
    p_power, _ = chi2_uniform(power)
    return {"n": len(us), "outside": outside, "p": p, "counts": counts, "p_power": p_power,
            "power_mean_tv": round(tv / max(1, len(us) + outside), 4)}


def counters(decode) -> dict:
    m = metrics(decode)
    return {"drafted": m.get("vllm:spec_decode_num_draft_tokens_total", 0.0),
            "accepted": m.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)}


def prompts_from(tok, n: int) -> list:
    import inspect

    source = "".join(inspect.getsource(m) for m in (inspect, json.decoder, json.encoder, asyncio.tasks))
    ids = tok(source).input_ids
    starts = range(0, len(ids) - PROMPT, (len(ids) - PROMPT) // n)
    return [ids[a:a + PROMPT] for a in starts][:n]


def main():
    model, port0 = sys.argv[1], int(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else N_REQ  # (fewer: a smoke run, not the test)
    from transformers import AutoTokenizer

    prompts = prompts_from(AutoTokenizer.from_pretrained(model), n)
    assert len(prompts) == n and len({tuple(p) for p in prompts}) == n
    secret = secrets.token_hex(16)
    log = open(os.environ.get("LYNX_SERVE_LOG", os.devnull), "w")
    P, D, KV, A = (port0 + i for i in range(4))
    procs = [serve(model, P, KV, "kv_producer", secret, log, bandwidth_mbps=MBPS, quant=QUANT),
             serve(model, D, KV, "kv_consumer", secret, log, speculative(8), bandwidth_mbps=MBPS, quant=QUANT,
                   more={"price_shadows": False})]  # (every shadow drafts: the test is of drafted sampling)
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "lynx_hf.vllm.serve.proxy", "--prefill", f"http://127.0.0.1:{P}", "--decode",
         f"http://127.0.0.1:{D}", "--kv-port", str(KV), "--port", str(A), "--shadows", "1", "--draft-budget", str(M)],
        stdout=log, stderr=subprocess.STDOUT))
    out = {}
    try:
        for port in (P, D, A):
            wait_up(f"http://127.0.0.1:{port}/health", procs)
        base, decode = f"http://127.0.0.1:{A}", f"http://127.0.0.1:{D}"
        out["topk_only"] = asyncio.run(refused_topk_only(base, decode, model, prompts[0]))
        for k, (name, gen) in enumerate(SETTINGS.items()):
            t, before = time.time(), counters(decode)
            results = asyncio.run(setting(base, model, prompts, gen, seed0=10_000 * (k + 1)))
            after = counters(decode)
            out[name] = {**judge(results, gen, seed=k), "s": round(time.time() - t, 1),
                         **{key: after[key] - before[key] for key in after}}
            print(json.dumps(out), file=sys.stderr, flush=True)
        out["alive"] = all(p.poll() is None for p in procs)
    finally:
        stop(procs)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
