"""`bash bootstrap.sh vllm-demo`: Lynx inside vLLM — a prefill engine and a decode engine (two processes, loopback,
the link emulated at 15 Mbit/s), one ~1K-token prompt shipped as BF16, INT8, INT4 (KIVI-4) and Lynx through the same
`LynxConnector`, 32 new tokens each, then Lynx again without drafts (the full-tier reference it must equal).

Times are seconds from the request's start: TTFT = the prefill engine's token, which the client gets before any KV
moves (every method alike: vLLM's disaggregated proxies send it at once, ours too); decode start = the first token the
decode engine produced, the first that needs the KV (Lynx: the shadow's first draft, on the anchor; the baselines:
their first verified token, on the whole KV): the figure the codec moves; first verified = R's first token; TT32T =
the 32nd verified token (the prefill's first token counts). `--repeat N`: N rounds on the same engines, every method
once per round in an order rotated per round; figures are medians, ratios medians of per-round paired ratios, each
beside its floor from the round's own events (`floors`). Prints a table, writes runs/vllm_demo.json (every round)
and a PNG timeline, and with --json ends with one JSON line."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from lynx_hf.floors import median_step, paired, passes, rotated, spread

METHODS = {"BF16": "bf16", "INT8": "int8", "INT4 (KIVI-4)": "kivi4", "Lynx": "lynx"}


def default_prompt_text() -> str:
    """The standard library's own source (the HF demo's prompt too)."""
    import inspect
    import json as _json
    import textwrap

    return "".join(inspect.getsource(m) for m in (textwrap, _json.decoder, _json.encoder, inspect))


def _row(r, new_tokens: int) -> dict:
    return {"ttft_s": round(r.first_token_s, 4), "decode_start_s": round(r.ttft_s, 4),
            "verified_2_s": None if r.tt(2) is None else round(r.tt(2), 4),
            "ttft_verified_s": round(r.ttft_verified_s, 4),
            "tt32t_s": None if r.tt(min(32, new_tokens)) is None else round(r.tt(min(32, new_tokens)), 4),
            "bytes": r.bytes,
            "anchor_at_s": r.anchor_at_s, "full_at_s": r.full_at_s, "drafted": r.drafted,
            "accepted": r.accepted, **r.extra}


def _progress(it, n: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return it
    return tqdm(it, total=n, desc="rounds", file=sys.stderr, disable=n == 1)


def plot(runs: dict, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(10, 0.8 * len(runs) + 1.6))
    for y, (name, r) in enumerate(runs.items()):
        if r.anchor_at_s and r.full_at_s and r.anchor_at_s < r.full_at_s:
            ax.barh(y, r.anchor_at_s, color="tab:blue", alpha=0.35)
            ax.barh(y, r.full_at_s - r.anchor_at_s, left=r.anchor_at_s, color="tab:orange", alpha=0.35)
        elif r.full_at_s:
            ax.barh(y, r.full_at_s, color="tab:purple", alpha=0.35)
        ax.plot(r.token_s, [y] * len(r.token_s), "|", color="tab:green", ms=14)
        ax.plot([r.first_token_s], [y], "v", color="tab:gray")
        ax.plot([r.ttft_s], [y], "D", color="tab:red", ms=5)
    ax.set_yticks(range(len(runs)), list(runs))
    ax.set_xlabel("seconds since the request started (bars: KV on the link — anchor, residual / whole code; "
                  "ticks: verified tokens; ▼ TTFT, the prefill's token; ◆ decode start)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


PAIRS = {"ttft_lynx_int4": ("Lynx", "INT4 (KIVI-4)", "ttft_s"), "ttft_lynx_int8": ("Lynx", "INT8", "ttft_s"),
         "tt32t_lynx_int8": ("Lynx", "INT8", "tt32t_s"),
         "decode_start_lynx_int4": ("Lynx", "INT4 (KIVI-4)", "decode_start_s"),
         "decode_start_lynx_int8": ("Lynx", "INT8", "decode_start_s")}
FIGURES = ("ttft_s", "decode_start_s", "verified_2_s", "tt32t_s")  # each with a floor; at_floor: lynx_ttft, ...


def _passes(r) -> list[tuple[float, int]]:
    """R's decode passes after the prefill's token: [(when, tokens)] (a pass's tokens share one time)."""
    return passes([(t, "verified") for t in r.token_s[1:]], 0.0)


def step_s(r) -> float | None:
    """The median gap between consecutive one-token passes (a baseline's plain decoding)."""
    return median_step(_passes(r))


def floors(r, n: int, step: float | None, lynx: bool) -> dict:
    """lynx_hf/floors.py's formulas on vLLM's events: TTFT = the prefill engine's token as it reached the client (the
    event is the token itself: measured and floor coincide); decode start ≥ (Lynx: the last anchor, the shadow's
    first token; a baseline: its whole KV) + one step; TTnT ≥ the last segment + R's verify passes as measured (each
    from the pass before it, or from the last segment) + one step per one-token pass still owed."""
    start = r.anchor_at_s if lynx else r.full_at_s
    out = {"ttft_s": r.first_token_s, "decode_start_s": None if start is None or step is None else start + step,
           "tt32t_s": None}
    if r.full_at_s is None or step is None:
        return out
    t, done, prev = r.full_at_s, 1, r.full_at_s
    for when, k in _passes(r):
        if done >= n:
            break
        t += (when - prev) if k > 1 else step  # (one token per pass: what any decoding owes)
        prev, done = when, done + k
    out["tt32t_s"] = t + max(0, n - done) * step
    return out


def _round(pd, ids, new_tokens: int, sampling: dict, r: int, say) -> dict:
    runs = {}
    for name in rotated(list(METHODS), r):
        say(f"  {name} ...")
        runs[name] = pd.generate(ids, new_tokens, method=METHODS[name], **sampling)
    say("  Lynx without drafts (the full-tier reference) ...")
    ref = pd.generate(ids, new_tokens, method="lynx", drafts=False, **sampling)
    rows = {k: _row(runs[k], new_tokens) for k in METHODS}
    rows["Lynx"]["identical_to_full"] = runs["Lynx"].tokens == ref.tokens
    steps = sorted(s for s in (step_s(runs[k]) for k in METHODS if k != "Lynx") if s is not None)
    step = steps[len(steps) // 2] if steps else None  # (none measured: no floors this round)
    fl = {k: {**floors(runs[k], min(32, new_tokens), step, k == "Lynx"),
              "verified_2_s": floors(runs[k], 2, step, k == "Lynx")["tt32t_s"]} for k in METHODS}
    over = lambda m, f: m / f if m is not None and f else None  # noqa: E731
    return {"runs": runs, "rows": rows, "order": list(runs), "step_s": step, "floors": fl,
            "at_floor": {f"lynx_{f[:-2]}": over(rows["Lynx"][f], fl["Lynx"][f]) for f in FIGURES}}


def _summary(rounds: list[dict]) -> dict:
    return {"rounds": len(rounds),
            "ratios": {k: paired([j["rows"] for j in rounds], a, b, f) for k, (a, b, f) in PAIRS.items()},
            "floor": {k: (paired([j["floors"] for j in rounds], a, b, f) or {}).get("median")
                      for k, (a, b, f) in PAIRS.items()},
            "at_floor": {k: (spread([j["at_floor"][k] for j in rounds]) or {}).get("median")
                         for k in (f"lynx_{f[:-2]}" for f in FIGURES)},
            "identical": [j["rows"]["Lynx"]["identical_to_full"] for j in rounds],
            "spread": {n: {k: spread([j["rows"][n][k] for j in rounds]) for k in FIGURES}
                       for n in METHODS}}


def main(argv=None) -> int:
    from lynx_hf.flags import count, mbps, tokens

    ap = argparse.ArgumentParser(prog="lynx-hf vllm-demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF-format model folder (bootstrap passes the embedded one)")
    ap.add_argument("--tokens", type=tokens(), default=1024, help="prompt tokens (default 1024)")
    ap.add_argument("--new-tokens", type=tokens(hi=4096), default=32)
    ap.add_argument("--bandwidth-mbps", type=mbps("unpaced"), default=15.0, help="the emulated link (0: unpaced)")
    ap.add_argument("--num-speculative-tokens", type=count(64), default=16, help="vLLM's K (engine-wide)")
    ap.add_argument("--port", type=count(65535), default=7411, help="the prefill engine's KV stream port")
    ap.add_argument("--do-sample", action="store_true", help="temperature 0.7 (seeded) instead of greedy")
    ap.add_argument("--prompt-file", help="a text file for the prompt (default: the standard library's source)")
    ap.add_argument("--shared-cores", action="store_true",
                    help="both engines on every core (default: disjoint halves, as two serving nodes)")
    ap.add_argument("--out-dir", default="runs")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("--repeat", type=count(1000), default=1,
                    help="rounds, every method once per round in a rotated order: medians, paired ratios, floors")
    a = ap.parse_args(argv)
    for name, v, lo in (("--tokens", a.tokens, 64), ("--new-tokens", a.new_tokens, 2),
                        ("--num-speculative-tokens", a.num_speculative_tokens, 1)):
        if v < lo:
            ap.error(f"{name} must be >= {lo}, got {v}")
    if not 0 <= a.bandwidth_mbps < 1e6:
        ap.error(f"--bandwidth-mbps must be in [0, 1e6), got {a.bandwidth_mbps}")
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))

    from transformers import AutoTokenizer

    from lynx_hf.vllm.serve.engine import disjoint_cores
    from lynx_hf.vllm.serve.pd import LynxPD

    tok = AutoTokenizer.from_pretrained(a.model)
    text = Path(a.prompt_file).read_text() if a.prompt_file else default_prompt_text()
    ids = tok(text).input_ids[:a.tokens]
    if len(ids) < a.tokens:
        ap.error(f"the prompt has {len(ids)} tokens, fewer than --tokens {a.tokens}")
    sampling = {"temperature": 0.7, "seed": 1234} if a.do_sample else {}
    cores = None if a.shared_cores else disjoint_cores()
    where = "shared cores" if cores is None else f"prefill on cores {cores[0]}, decode on {cores[1]}"
    say(f"starting a prefill and a decode vLLM engine ({a.model}; {where}); link {a.bandwidth_mbps:g} Mbit/s")
    rounds = []
    # no prefix cache: every method's prefill computes the prompt, as a fresh prompt's would (with one, only the
    # first request of the run did, and the TTFT column compared a forward with cache hits)
    with LynxPD(a.model, bandwidth_mbps=a.bandwidth_mbps or None, port=a.port,
                num_speculative_tokens=a.num_speculative_tokens, draft_budget=a.new_tokens - 1,
                engine_kwargs={"enable_prefix_caching": False}, cores=cores) as pd:
        pd.generate(ids, 2, method="kivi4", **sampling)  # warm-up at the prompt's length: first-request costs out
        for r in _progress(range(a.repeat), a.repeat):
            rounds.append(_round(pd, ids, a.new_tokens, sampling, r, say))
        version = pd.version
    summ, last = _summary(rounds), rounds[-1]
    runs, rows = last["runs"], last["rows"]
    if a.repeat > 1:  # the table's figures: medians over the rounds (their ranges in the JSON)
        for n in METHODS:
            for k in FIGURES:
                rows[n][k] = (summ["spread"][n][k] or {}).get("median")
        for k in ("accepted", "drafted"):
            rows["Lynx"][k] = statistics.median(j["rows"]["Lynx"][k] for j in rounds)
        rows["Lynx"]["identical_to_full"] = all(summ["identical"])
    say(f"\n{'method':<15}{'TTFT':>8}{'decode start':>14}{'1st verified':>14}{'TT32T':>8}{'MB':>8}{'drafted':>9}"
        f"{'accepted':>9}"
        + (f"   ({a.repeat} rounds: medians)" if a.repeat > 1 else ""))
    for k, r in rows.items():
        say(f"{k:<15}{r['ttft_s']:>8.2f}{r['decode_start_s']:>14.2f}{r['ttft_verified_s']:>14.2f}"
            f"{r['tt32t_s'] or float('nan'):>8.2f}"
            f"{r['bytes'] / 1e6:>8.2f}{r['drafted']:>9}{r['accepted']:>9}")
    R, F, A = summ["ratios"], summ["floor"], summ["at_floor"]
    fmt = lambda x: "-" if x is None else f"{x['median']:.2f} [{x['min']:.2f}, {x['max']:.2f}]"  # noqa: E731
    say(f"Lynx/INT4 TTFT {fmt(R['ttft_lynx_int4'])} (the prefill's token for every method); decode start "
        f"Lynx/INT4 {fmt(R['decode_start_lynx_int4'])} (floor {F['decode_start_lynx_int4']}), Lynx/INT8 "
        f"{fmt(R['decode_start_lynx_int8'])} (floor {F['decode_start_lynx_int8']}); Lynx/INT8 TT32T "
        f"{fmt(R['tt32t_lynx_int8'])} (floor {F['tt32t_lynx_int8']}); Lynx at its floor: decode start "
        f"{A['lynx_decode_start']}, TT32T {A['lynx_tt32t']}; identical to full-tier decoding without drafts: "
        f"{rows['Lynx']['identical_to_full']} "
        f"(exact = equal to vLLM decoding the 8-bit full tier)")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    body = {"methods": rows, "engine": f"vllm {version}", "prompt_tokens": len(ids), "new_tokens": a.new_tokens,
            "bandwidth_mbps": a.bandwidth_mbps, "num_speculative_tokens": a.num_speculative_tokens,
            "sampling": sampling or "greedy",
            "cores": "shared" if cores is None else {"prefill": cores[0], "decode": cores[1]},
            **{k: v for k, v in summ.items() if k != "spread"}}
    per_round = [{k: j[k] for k in ("rows", "order", "step_s", "floors", "at_floor")} for j in rounds]
    (out / "vllm_demo.json").write_text(json.dumps({**body, "spread": summ["spread"], "per_round": per_round},
                                                   indent=2) + "\n")
    png = out / "vllm_demo.png"
    if plot(runs, png, f"Lynx in vLLM: a {len(ids)}-token prompt's KV over {a.bandwidth_mbps:g} Mbit/s, then "
                       f"{a.new_tokens} tokens"):
        say(f"wrote {out / 'vllm_demo.json'} and {png}")
    if a.json:
        print(json.dumps(body), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
