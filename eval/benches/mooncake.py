"""Agents' conversations from a Mooncake-format trace, for `vllm-bench --trace` (pure: no vLLM, no aiohttp).

Contract. A trace is JSON lines `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids":
[ids of the prompt's 512-token blocks]}` (Mooncake's FAST'25 release). Terms:
- a request's *parent* is the earlier request sharing the longest prefix of hash ids with it (at least one block);
  a request with a parent is a *continued* turn, one without a *fresh* one; a *conversation* is a fresh request and
  every request descended from it, in trace order, sent one after another (an agent's loop: a turn leaves once its
  predecessor's answer is in);
- `scale`: text tokens per trace block (lengths scale likewise: ceil(length × scale / 512));
- a prompt is the concatenation of its hash ids' blocks, each a fixed window of `scale` tokens of the arm's text
  region (one region per arm, so no arm's prompt can hit another arm's cached blocks), cut to its scaled length;
- a turn's *shared* positions: those it has in common with its parent (its shared blocks × scale); its *new*
  positions: the rest, what the link must carry at least.
Bounds: a trace of more than MAX_LINES lines, a line over MAX_LINE bytes or a field of the wrong type is refused
with its line number."""
from __future__ import annotations

import json
import math
import random

MAX_LINES, MAX_LINE, TRACE_BLOCK = 100_000, 1 << 20, 512
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def read_trace(path: str) -> list[dict]:
    """The trace's requests in file order; ValueError naming the line and the field at the first bad one."""
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if n > MAX_LINES:
                raise ValueError(f"{path}: more than {MAX_LINES} lines")
            if len(raw) > MAX_LINE:
                raise ValueError(f"{path}:{n}: a line over {MAX_LINE} bytes")
            if not raw.strip():
                continue
            try:
                r = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            bad = [k for k in FIELDS if k not in r] if isinstance(r, dict) else list(FIELDS)
            if not bad:
                ints = (r["timestamp"], r["input_length"], r["output_length"])
                bad = [k for k, v in zip(FIELDS, ints) if isinstance(v, bool) or not isinstance(v, int) or v < 0]
                h = r["hash_ids"]
                if not (isinstance(h, list) and h and all(isinstance(x, int) and not isinstance(x, bool) for x in h)):
                    bad.append("hash_ids")
            if bad:
                raise ValueError(f"{path}:{n}: field {bad[0]!r} missing or not a non-negative int (hash_ids: a "
                                 f"non-empty list of ints)")
            rows.append({k: r[k] for k in FIELDS})
    return rows


def parents(rows: list[dict]) -> list[tuple[int | None, int]]:
    """Per request: (its parent's index or None, the number of hash ids it shares with that parent)."""
    owner, out = {}, []
    for j, r in enumerate(rows):
        h = tuple(r["hash_ids"])
        k = next((k for k in range(len(h), 0, -1) if h[:k] in owner), 0)
        out.append((owner[h[:k]] if k else None, k))
        for i in range(1, len(h) + 1):
            owner[h[:i]] = j
    return out


def scaled(n: int, scale: int) -> int:
    return math.ceil(n * scale / TRACE_BLOCK)


def conversations(rows: list[dict], k: int, scale: int, max_len: int, max_new: int) -> list[list[int]]:
    """The first k conversations (by their fresh turn's place in the trace) of at least two turns whose every turn
    fits `max_len` (scaled prompt + its new tokens, at least 2 and at most `max_new`) → their requests' indices."""
    par, root, convs = parents(rows), {}, {}
    for j, (p, _) in enumerate(par):
        root[j] = j if p is None else root[p]
        convs.setdefault(root[j], []).append(j)
    out = []
    for r0 in sorted(convs):
        turns = convs[r0]
        if len(turns) >= 2 and all(scaled(rows[j]["input_length"], scale) + new_tokens(rows[j], scale, max_new)
                                   <= max_len for j in turns):
            out.append(turns)
            if len(out) == k:
                break
    return out


def new_tokens(row: dict, scale: int, max_new: int) -> int:
    """The turn's output, scaled, in [2, max_new] (two: TT2T needs a decode-side token)."""
    return max(2, min(max_new, scaled(row["output_length"], scale)))


def prompt(row: dict, scale: int, text: list, region: int, regions: int, seed: int) -> list:
    """The turn's prompt: each hash id's block (a fixed window of `scale` tokens of the arm's text region, chosen by
    a seeded draw from the id), concatenated and cut to the scaled input length."""
    span = len(text) // regions
    if span < 2 * scale:
        raise ValueError(f"the text has {len(text)} tokens: too few for {regions} regions of blocks of {scale}")
    lo, out = region * span, []
    for h in row["hash_ids"]:
        at = lo + random.Random(f"{seed}:{h}").randrange(span - scale)
        out += text[at:at + scale]
    return out[:max(1, scaled(row["input_length"], scale))]


def turn_stats(rows: list[dict], pct) -> dict:
    """Fresh or continued turns' summary (the --json names): turns, p50 TTFT/TT2T/TT32T, p90 TT32T, mean KV bytes
    shipped and mean bytes of their new positions (`new_kv_bytes`, set by the caller). `pct(xs, q)`: a percentile."""
    ok = [r for r in rows if r["error"] is None]

    def p(key, q):
        x = pct([r[key] for r in ok], q)
        return None if x is None else round(x, 4)

    def mean(key):
        v = [r[key] for r in ok if r.get(key) is not None]
        return round(sum(v) / len(v)) if v else None

    return {"turns": len(ok), "ttft_p50_s": p("ttft_s", 50), "tt2t_p50_s": p("tt2t_s", 50),
            "tt32t_p50_s": p("tt32t_s", 50), "tt32t_p90_s": p("tt32t_s", 90), "kv_bytes_mean": mean("kv_bytes"),
            "new_kv_bytes_mean": mean("new_kv_bytes")}


def bytes_per_position(rows: list[dict]) -> float | None:
    """What one prompt position takes on the wire: the median over fresh turns that shipped from position 0 of
    bytes / positions shipped."""
    v = sorted(r["kv_bytes"] / (r["kv_prompt_len"] - r["kv_start"]) for r in rows
               if r.get("kv_bytes") and r.get("kv_start") == 0 and r["kv_prompt_len"] > 0)
    return v[len(v) // 2] if v else None
