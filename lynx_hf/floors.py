"""The physical floor of a request's time figures, from that request's own events, and the rounds of a `--repeat`
benchmark: medians with their ranges, and ratios as medians of per-round paired ratios (the HF benches in eval/ and
the vLLM harnesses and eval/ use them). docs/performance.md
("Floors") states each formula; tests/test_floors.py checks the arithmetic on scripted timelines.

Terms, for one request; times in seconds from its start (t0):
  logits        when the prefill's logits landed: with the prompt ids, all the first token needs
  last anchor   the arrival of the anchor stream's last segment; last KV: a one-stream codec's last segment;
  last residual the full tier's last segment
  pass          one decode-side forward's verified tokens: marks within `PASS_GAP_S` of each other
  step          the run's decode step: the median gap between consecutive one-token passes (every method's plain
                decoding after its first token; the round's median over its one-stream rows)
  verify cost   a verify pass's compute once its data was in: its end minus max(its start, last residual)
  owed          the passes still due after the verify pass to reach n verified tokens, one token each
Floors (what no implementation on this machine, link and prompt could beat):
  TTFT          = logits                                  (every method: the first token is picked from them)
  decode start  = the KV its token needs + step           (the second token, the first decode-side one: a draft
                                                            needs the last anchor, a verified token every stream)
  TTnT, Lynx    = last residual + verify cost + owed × step
  TTnT, others  = last KV + (n − 1) × step               (n − 1 decode steps after the first token)
`at_floor` = measured ÷ floor (≥ 1 up to clock noise): how far the code is from the physics."""
from __future__ import annotations

import statistics

PASS_GAP_S = 2e-3  # verified marks closer than this belong to one forward pass


def passes(timeline: list, t0: float) -> list[tuple[float, int]]:
    """[(end time from t0, tokens verified)] per decode-side pass, in order."""
    out: list[list] = []
    for t, kind in sorted(timeline):
        if kind != "verified":
            continue
        t -= t0
        if out and t - out[-1][0] < PASS_GAP_S:
            out[-1][0], out[-1][1] = t, out[-1][1] + 1
        else:
            out.append([t, 1])
    return [(t, n) for t, n in out]


def step_s(timeline: list, t0: float) -> float | None:
    """The median gap between consecutive one-token passes after the first token (None: fewer than two)."""
    return median_step(passes(timeline, t0)[1:])


def median_step(ps: list[tuple[float, int]]) -> float | None:
    """The median gap between consecutive one-token passes of `ps` (None: no such pair)."""
    gaps = [b[0] - a[0] for a, b in zip(ps, ps[1:]) if a[1] == 1 and b[1] == 1]
    return statistics.median(gaps) if gaps else None


def last_arrival(events: list, t0: float, *streams: str) -> float | None:
    ts = [t for t, what, *_ in events if what in streams]
    return max(ts) - t0 if ts else None


def floors(run: dict, n: int, step: float | None, split: bool) -> dict:
    """{"ttft", "decode_start", "ttnt"} floors of one request (None where its events, or the round's step (None:
    not measured), lack what a formula needs). run: a TurnResult (or its dict) with t0, events, timeline, logits_s;
    split: a two-tier codec (Lynx)."""
    t0, out = run["t0"], {"ttft": run.get("logits_s"), "decode_start": None, "ttnt": None}
    if step is None:
        return out
    need = second_token_data(run)
    out["decode_start"] = None if need is None else need + step
    if not split:
        kv = last_arrival(run["events"], t0, "anchor", "residual", "correction")
        out["ttnt"] = None if kv is None else kv + (n - 1) * step
        return out
    residual = last_arrival(run["events"], t0, "residual", "correction")
    vstart = [t - t0 for t, k in run["timeline"] if k == "verify_start"]
    ps = passes(run["timeline"], t0)
    if residual is None:
        return out
    if not vstart:  # no drafts: the first full-tier pass after the residual plays the verify pass's part
        out["ttnt"] = residual + max(0, n - 1) * step
        return out
    after = [t for t, _ in ps if t >= vstart[0]]
    if not after:
        return out
    end = after[0]
    done = sum(k for t, k in ps if t <= end)  # verified tokens once the verify pass is over (the first included)
    out["ttnt"] = residual + max(0.0, end - max(vstart[0], residual)) + max(0, n - done) * step
    return out


def second_token_data(run: dict) -> float | None:
    """When the data of the second token (the first decode-side one) was in, from t0: a draft's is the anchor
    stream, a verified token's every stream (None: one token only, or no segment)."""
    marks = sorted((t, k) for t, k in run["timeline"] if k in ("draft", "verified"))
    if len(marks) < 2:
        return None
    streams = ("anchor",) if marks[1][1] == "draft" else ("anchor", "residual", "correction")
    return last_arrival(run["events"], run["t0"], *streams)


# -- rounds --------------------------------------------------------------------------------------------------------
def spread(values: list) -> dict | None:
    """{"median", "min", "max"} of the values that are not None (None: none are)."""
    vs = [v for v in values if v is not None]
    return {"median": statistics.median(vs), "min": min(vs), "max": max(vs)} if vs else None


def paired(rounds: list[dict], num: str, den: str, figure: str) -> dict | None:
    """The spread of the per-round ratios rounds[i][num][figure] / rounds[i][den][figure]."""
    return spread([r[num][figure] / r[den][figure] for r in rounds
                   if r[num].get(figure) is not None and r[den].get(figure)])


def line(points, min_spread: float = 0.0) -> tuple[float, float, float] | None:
    """The least-squares line through (x, y) points as (slope, mean x, mean y): y ≈ ȳ + slope·(x − x̄); None when
    Σ(x − x̄)² < min_spread or is 0 (the x too alike to tell a slope). The step models' fit (vllm/pricing.py,
    engine/drafters.py)."""
    pts = list(points)
    if not pts:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx <= 0 or sxx < min_spread:
        return None
    return sum((x - mx) * (y - my) for x, y in pts) / sxx, mx, my


def rotated(plan: list, round_index: int) -> list:
    """The plan in round `round_index`'s order: rotated by one each round, so every method runs in every slot."""
    k = round_index % len(plan) if plan else 0
    return plan[k:] + plan[:k]
