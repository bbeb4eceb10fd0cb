"""`vllm-bench --trace FILE`: agents' conversations from a Mooncake-format trace (mooncake.py) replayed through the
proxies, prefix caching on, each turn's KV bytes on the wire counted.

Contract. The servers are vllm_bench.py's, with prefix caching on, `--max-model-len` TRACE_MAX_LEN, the decode instance
writing its `transfer_log` (connector.py) and vLLM's dev endpoints on (`/reset_prefix_cache`). The first
`--trace-conversations` conversations of ≥ 2 turns that fit are replayed per arm (lynx, int8, int4, in vllm_bench.py's
order), every turn greedy with `ignore_eos`: conversations start at Poisson arrivals (`--rate`, `--seed`; the same
in every arm), a turn leaves the moment its predecessor's answer is in, times are from the moment it leaves. Each
arm's prompts come from its own region of the text (mooncake.prompt), so no arm hits another's blocks. Then every turn
runs alone on its reference (bench.REFERENCE) after both engines dropped their prefix caches: the fresh send a
continued turn must equal (exact, or a near-tie as bench.judge counts it). Per arm, beside bench.arm_stats' names:
`block_kv_bytes` (one 64-token block on the wire: the fresh turns' bytes per position × 64) and `fresh` /
`continued` (mooncake.turn_stats; `kv_bytes`: what the decode instance received for the turn, `new_kv_bytes`: its new
positions × bytes per position)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from lynx_hf.eval.benches import mooncake as tr
from lynx_hf.eval.benches.vllm_arms import (REFERENCE, arm_stats, idle, judge_rows, one, percentile, plot, summary,
                                            table)

TRACE_MAX_LEN = 2048
BLOCK = 64  # servers.serve's --block-size
TRACE_ARMS = ("lynx", "int8", "int4")  # (ref is the fresh sends' reference: its alone runs judge Lynx's turns)


def plan_trace(rows: list, convs: list, text: list, a, model: str) -> dict:
    """{arm: [[turn bodies] per conversation]}: each arm's prompts from its own text region."""
    out = {}
    for region, arm in enumerate(TRACE_ARMS):
        n = len(TRACE_ARMS)
        out[arm] = [[{"model": model, "prompt": tr.prompt(rows[j], a.trace_scale, text, region, n, a.seed),
                      "max_tokens": tr.new_tokens(rows[j], a.trace_scale, a.new_tokens), "stream": True,
                      "ignore_eos": True, "return_tokens_as_token_ids": True, "temperature": 0.0, "logprobs": 2}
                     for j in conv] for conv in convs]
    return out


async def replay(url: str, convs: list, starts: list, engines: tuple, timeout_s: float, name: str) -> dict:
    """Each conversation from its start, one turn after another → {"rows", "span_s", "deltas"} as bench.run_arm."""
    import asyncio

    import aiohttp

    from lynx_hf.vllm.serve.proxy import upstream_connector  # (vLLM closes idle connections)
    from tqdm import tqdm

    from lynx_hf.eval.benches.vllm_arms import ACCEPTED, DRAFTED, PREEMPTED

    before = await idle(engines)
    bar = tqdm(total=sum(map(len, convs)), desc=name, file=sys.stderr, unit="turn")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     connector=upstream_connector(limit=0)) as s:
        t0 = time.perf_counter()

        async def conversation(c):
            await asyncio.sleep(max(0.0, t0 + starts[c] - time.perf_counter()))
            out = []
            for t, body in enumerate(convs[c]):
                sent = time.perf_counter()
                row = await one(s, url, body, sent, min(32, body["max_tokens"]))
                out.append({"conv": c, "turn": t, "sent_at_s": round(sent - t0, 4), **row})
                bar.update(1)
            return out

        rows = [r for rs in await asyncio.gather(*(conversation(c) for c in range(len(convs)))) for r in rs]
    bar.close()
    after = await idle(engines)
    return {"rows": rows, "span_s": max(r["sent_at_s"] + r["done_s"] for r in rows),
            "deltas": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (DRAFTED, ACCEPTED, PREEMPTED)}}


async def alone_fresh(url: str, convs: list, engines: tuple, timeout_s: float, bar) -> dict:
    """Every turn alone, both engines' prefix caches dropped first → {(conv, turn): row}."""
    import aiohttp

    from lynx_hf.vllm.serve.proxy import upstream_connector  # (vLLM closes idle connections)

    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     connector=upstream_connector()) as s:
        for c, conv in enumerate(convs):
            for t, body in enumerate(conv):
                for e in engines:
                    async with s.post(f"{e}/reset_prefix_cache") as r:
                        if r.status != 200:
                            raise RuntimeError(f"{e}/reset_prefix_cache answered {r.status} (VLLM_SERVER_DEV_MODE?)")
                out[c, t] = await one(s, url, body, time.perf_counter(), min(32, body["max_tokens"]))
                bar.update(1)
    return out


def account(rows: list, log_path: Path, trace_rows: list, convs: list, parents: list, scale: int) -> float | None:
    """Sets each row's kv_bytes / kv_start / kv_prompt_len (its transfer_log line) and new_kv_bytes; → bytes per
    position (None when no fresh turn shipped from 0)."""
    full = {}
    if log_path.exists():
        for line in log_path.read_text().splitlines():
            d = json.loads(line)
            if d.get("tier") == "full":
                full[d["xfer"]] = d
    for r in rows:
        d = full.get(r["xfer"]) or {}
        r.update(kv_bytes=d.get("bytes"), kv_start=d.get("start"), kv_prompt_len=d.get("prompt_len"))
        j = convs[r["conv"]][r["turn"]]
        r["continued"] = parents[j][0] is not None
        r["new_positions"] = r["prompt_len"] - min(r["prompt_len"], parents[j][1] * scale)
    bpp = tr.bytes_per_position(rows)
    for r in rows:
        r["new_kv_bytes"] = None if bpp is None else round(r["new_positions"] * bpp)
    return bpp


async def run(a, engines: tuple, text: list, log_path: Path, say) -> dict:
    """Proxies, a warm-up, each arm's replay, the fresh references, the accounting → (summary, detail)."""
    from tqdm import tqdm

    from lynx_hf.eval.benches.vllm_arms import ARMS, proxies, run_alone, schedule

    rows = tr.read_trace(a.trace)
    convs = tr.conversations(rows, a.trace_conversations, a.trace_scale, TRACE_MAX_LEN, a.new_tokens)
    if not convs:
        raise ValueError(f"{a.trace}: no conversation of two turns fits {TRACE_MAX_LEN} tokens at --trace-scale "
                         f"{a.trace_scale}")
    par, model = tr.parents(rows), a.model
    bodies, starts = plan_trace(rows, convs, text, a, model), schedule(len(convs), a.rate, a.seed)
    say(f"trace {a.trace}: {len(convs)} conversations, {sum(map(len, convs))} turns per arm "
        f"(trace requests {[c for c in convs]}), {a.trace_scale} tokens per trace block")
    async with proxies(engines, a.port, a.new_tokens) as url:
        for name in ARMS:  # (a short prompt outside every arm's region's blocks: nothing a turn could hit)
            await run_alone(url[name], [{**bodies["lynx"][0][0], "prompt": text[:40], "max_tokens": 4}], [0], 1,
                            a.timeout_s)
        k = a.seed % len(TRACE_ARMS)
        order, arms = list(TRACE_ARMS[k:] + TRACE_ARMS[:k]), {}
        for name in order:
            say(f"{name}: {len(convs)} conversations ({url[name]})")
            arms[name] = await replay(url[name], bodies[name], starts, engines, a.timeout_s, name)
        bar, alone = tqdm(total=sum(map(len, convs)) * len(order), desc="fresh", file=sys.stderr, unit="turn"), {}
        for name in order:
            alone[name] = await alone_fresh(url[REFERENCE[name]], bodies[name], engines, a.timeout_s, bar)
        bar.close()
    methods = {}
    for name in order:
        rs = arms[name]["rows"]
        for r in rs:
            r["i"] = (r["conv"], r["turn"])
        judge_rows(rs, alone[name])
        bpp = account(rs, log_path, rows, convs, par, a.trace_scale)
        methods[name] = {**arm_stats(rs, arms[name]["span_s"], arms[name]["deltas"]),
                         "block_kv_bytes": None if bpp is None else round(bpp * BLOCK),
                         "fresh": tr.turn_stats([r for r in rs if not r["continued"]], percentile),
                         "continued": tr.turn_stats([r for r in rs if r["continued"]], percentile)}
    s = {**summary(sum(map(len, convs)), a.rate, {k: methods[k] for k in TRACE_ARMS}),
         "trace": {"file": a.trace, "scale": a.trace_scale, "conversations": len(convs), "requests": convs}}
    return s, {"order": order, "arms": arms, "alone": alone}


def report(s: dict, detail: dict, out: Path, say) -> None:
    """The table (with fresh / continued lines), runs/vllm_bench_trace.json and its CDF plot."""
    tt2t = {k: percentile([r["tt2t_s"] for r in detail["arms"][k]["rows"] if r["error"] is None], 50)
            for k in s["methods"]}
    lines = [table(s, tt2t), "", f"{'method':<7}{'turns':>14}{'TTFT p50':>10}{'TT2T p50':>10}{'TT32T p50':>11}"
             f"{'p90':>8}{'KV MB':>8}{'new MB':>8}"]
    for k, m in s["methods"].items():
        for kind in ("fresh", "continued"):
            t = m[kind]
            f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
            lines.append(f"{k:<7}{kind + ' ' + str(t['turns']):>14}{f(t['ttft_p50_s']):>10}{f(t['tt2t_p50_s']):>10}"
                         f"{f(t['tt32t_p50_s']):>11}{f(t['tt32t_p90_s']):>8}"
                         f"{f(t['kv_bytes_mean'] and t['kv_bytes_mean'] / 1e6):>8}"
                         f"{f(t['new_kv_bytes_mean'] and t['new_kv_bytes_mean'] / 1e6):>8}")
    say("\n".join(lines))
    (out / "vllm_bench_trace.json").write_text(json.dumps({
        "summary": s, "order": detail["order"],
        "rows": [{"arm": k, **r, "i": list(r["i"])} for k in detail["order"] for r in detail["arms"][k]["rows"]],
        "alone": [{"arm": k, "reference": REFERENCE[k], "conv": c, "turn": t, **r}
                  for k in detail["order"] for (c, t), r in detail["alone"][k].items()]}, indent=1) + "\n")
    plot(detail["arms"], out / "vllm_bench_trace.png", f"Lynx in vLLM, agents' conversations from {s['trace']['file']}")
    say(f"wrote {out / 'vllm_bench_trace.json'} and {out / 'vllm_bench_trace.png'}")
