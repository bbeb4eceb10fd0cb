"""A timeline per request for `vllm-bench` (issue 65 item 3): where a request's time goes, from the client's rows
and the decode instance's `transfer_log` (connector.py; one JSON line per finished Lynx request, R's and each
shadow's, with the worker's arrival times and the scheduler side's `timeline`, scheduler.py).

Terms. Every time is seconds from the request's *scheduled* arrival (vllm_bench.py's clock). Clocks: the client's
perf_counter and the scheduler side's time.monotonic are the same system-wide clock on Linux (CLOCK_MONOTONIC); the
worker's arrival times are time.time(), moved by the offset taken when the arm started. Per request: `prefill_done`
(the client's first token: the prefill engine's), `first_kv` / `anchor_landed` / `full_landed` (the first segment,
the last anchor segment, the last segment), `admitted` (R got blocks for its load), `first_step` / `last_step` (R's
first and last decode step; its `steps`, the mean batch it ran in, `step_s` between its steps), `tt2t`, `tt32t`, and
for Lynx its shadows (`shadows`: each one's first and last step, steps), the ledger (shadow tokens, drafts R
verified and kept) and the shadows the pricing rule refused (`priced_out`, beside `others` requests). `phases`
summarizes an arm: the medians of those marks and of the gaps between them. Pure: no vLLM, no aiohttp."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

MARKS = ("prefill_done", "first_kv", "anchor_landed", "full_landed", "admitted", "first_step", "tt2t", "tt32t")


def read_log(path: Path) -> dict[str, list[dict]]:
    """transfer_log lines by transfer id (an absent file: {})."""
    out: dict[str, list[dict]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            d = json.loads(line)
            out.setdefault(d.get("xfer"), []).append(d)
    return out


def clocks() -> dict:
    """{"mono", "wall"}: time.monotonic and time.time at one moment (to move them onto perf_counter)."""
    import time

    return {"perf": time.perf_counter(), "mono": time.monotonic(), "wall": time.time()}


def timeline(row: dict, lines: list[dict], t0: float, at: dict) -> dict:
    """One request's timeline: `row` (bench.one's, with arrival_s), its transfer_log `lines`, its arm's start t0
    (perf_counter) and `at` (clocks() taken then)."""
    due = t0 + row["arrival_s"]
    mono = lambda t: None if t is None else round(t - (at["mono"] - at["perf"]) - due, 4)  # noqa: E731
    wall = lambda t: None if t is None else round(t - (at["wall"] - at["perf"]) - due, 4)  # noqa: E731
    full = next((d for d in lines if d.get("tier") == "full"), {})
    tl = full.get("timeline") or {}
    out = {"prefill_done": row.get("ttft_s"), "first_kv": wall(full.get("first_at")),
           "anchor_landed": wall(full.get("anchor_at")), "full_landed": wall(full.get("full_at")),
           "admitted": mono(tl.get("admitted")), "first_step": mono(tl.get("first_step")),
           "last_step": mono(tl.get("last_step")), "steps": tl.get("steps"), "batch_mean": tl.get("batch_mean"),
           "step_s": None, "tt2t": row.get("tt2t_s"), "tt32t": row.get("tt32t_s")}
    if tl.get("steps", 0) > 1:
        out["step_s"] = round((tl["last_step"] - tl["first_step"]) / (tl["steps"] - 1), 4)
    for k in ("shadow_tokens", "drafted", "accepted", "overlap", "priced_out", "others"):
        out[k] = tl.get(k)
    out["shadows"] = [{"first_step": mono(s["timeline"].get("first_step")),
                       "last_step": mono(s["timeline"].get("last_step")), "steps": s["timeline"].get("steps")}
                      for s in lines if s.get("tier") == "anchor" and s.get("timeline")]
    return out


def phases(timelines: list[dict]) -> dict:
    """An arm's medians: each mark, R's batch and step, and the gaps KV landed → R's first step → TT32T."""
    def med(f):
        v = [x for x in map(f, timelines) if x is not None]
        return round(statistics.median(v), 4) if v else None

    gap = lambda a, b: lambda t: None if t[a] is None or t[b] is None else t[b] - t[a]  # noqa: E731
    return {**{k: med(lambda t, k=k: t[k]) for k in MARKS}, "batch_mean": med(lambda t: t["batch_mean"]),
            "step_s": med(lambda t: t["step_s"]), "landed_to_first_step": med(gap("full_landed", "first_step")),
            "first_step_to_tt32t": med(gap("first_step", "tt32t")),
            "shadows": sum(len(t["shadows"]) for t in timelines),
            "priced_out": sum(t["priced_out"] or 0 for t in timelines)}


def plot(arms: dict, path: Path, title: str) -> None:
    """One panel per arm, a line per request: arrival → TT32T (grey), the KV on the link (first segment → last,
    blue; the anchor's end marked), R's decode steps (black) and its shadows' (orange)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(arms), 1, figsize=(11, 2.2 + 1.6 * len(arms)), sharex=True, squeeze=False)
    for ax, (name, rows) in zip(axes[:, 0], arms.items()):
        for y, r in enumerate(rows):
            t, a = r.get("timeline") or {}, r["arrival_s"]
            seg = lambda u, v, **kw: ax.plot([a + u, a + v], [y, y], **kw) if None not in (u, v) else None  # noqa
            seg(0.0, r.get("tt32t_s"), color="0.8", lw=1)
            seg(t.get("first_kv"), t.get("full_landed"), color="tab:blue", lw=3, alpha=0.6)
            if t.get("anchor_landed") is not None:
                ax.plot([a + t["anchor_landed"]], [y], "|", color="tab:blue", ms=8)
            for s in t.get("shadows", ()):
                seg(s["first_step"], s["last_step"], color="tab:orange", lw=2)
            seg(t.get("first_step"), t.get("last_step"), color="k", lw=1.5)
        ax.set_ylabel(f"{name}\nrequest")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("seconds from the arm's start (grey: arrival → TT32T; blue: KV on the link, | the anchor "
                           "landed; orange: shadows' steps; black: R's steps)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
