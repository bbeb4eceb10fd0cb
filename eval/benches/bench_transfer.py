"""`lynx-hf bench transfer`: the disaggregated path swept over link bandwidth × context length × prompt text.

Per link speed a `lynx-hf serve-prefill` child process runs behind the link emulator and this process decodes, as in
the demo, for BF16, INT8, INT4 (KIVI-4), Lynx and Lynx without drafts (the full-tier reference: what drafting adds).
Per request: TTFT (first token, from the prefill's logits), TTFT verified, TT32T (32 verified tokens), drafted /
accepted tokens, bytes on the wire, and the decode process's peak resident memory above its level at the request
(sampled every 5 ms) next to the cache's documented bound (lynx_hf/cache/lynx_cache.py: encoded streams + one
dequantized prompt + tail; the forward pass's activations come on top). Every result is appended to a JSONL file as
it completes (`--out`), so an interrupted sweep resumes where it stopped; a progress bar counts requests.

Crossovers, interpolated in log link speed between measured points (per prompt and context): the link speed up to
which Lynx's TT32T stays at least 5 % below INT8's from the slowest link up, and up to which drafting pays (Lynx at
least 5 % below Lynx without drafts), and the same for TTFT (Lynx against INT8). Prints tables, writes a PNG (TT32T
and TTFT against link speed, one panel per context) and ends with one JSON line."""
from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path

from tqdm import tqdm

import lynx_hf
from lynx_hf.errors import ConfigError

from lynx_hf.eval.lib.harness import (METHODS, default_prompt_text, final_line, prefill_child, printer, pyplot,
                                      save_figure, save_plot)

OUT = "runs/bench_transfer"  # with --data-plane nixl: runs/bench_transfer_nixl
LINKS_MBPS = (50, 200, 1000, 10000)
CONTEXTS = (512, 2048, 8192)
NO_DRAFTS = "Lynx (no drafts)"
PLAN = [(name, cfg, True) for name, cfg in METHODS.items()] + [(NO_DRAFTS, METHODS["Lynx"], False)]
GAIN = 0.05  # "beats" = at least 5 % faster


def prompt_texts(names) -> dict[str, str]:
    """"code": the standard library's source (every Python has it); "shakespeare": the shared text."""
    out = {}
    for n in names:
        if n == "code":
            out[n] = default_prompt_text()
        elif n == "shakespeare":
            from lynx_hf.eval.lib.data import shakespeare

            out[n] = shakespeare().read_text()
        else:
            out[n] = Path(n).read_text(encoding="utf-8", errors="replace")
    return out


class PeakRSS:
    """Peak resident set size of this process above its level at start, sampled every `period` seconds."""

    def __init__(self, period: float = 0.005):
        self.period, self.peak, self._stop = period, 0, threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        self.base = self.peak = self.rss()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, self.rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.rss())

    @property
    def delta(self) -> int:
        return self.peak - self.base


def _key(r: dict) -> tuple:
    return r["link_mbps"], r["prompt"], r["context"], r["method"]


def _load(path: Path) -> dict:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[_key(r)] = r
    return done


def _crossover(points: list[tuple[float, float]]) -> float | None:
    """points: (link Mbit/s, ratio) sorted by link. The link speed up to which the method keeps a lead of at least
    GAIN from the slowest link up: where the ratio first rises to 1 − GAIN or above, interpolated in log link speed.
    None when it does not lead at the slowest link (a lead that appears only further up is noise here: faster links
    only shorten every method's transfer); inf when it leads across the whole sweep."""
    if not points or points[0][1] >= 1 - GAIN:
        return None
    for (b0, r0), (b1, r1) in zip(points, points[1:]):
        if r1 >= 1 - GAIN:
            f = (1 - GAIN - r0) / (r1 - r0)
            return math.exp(math.log(b0) + f * (math.log(b1) - math.log(b0)))
    return math.inf


def crossovers(rows: list[dict]) -> dict:
    by = {}
    for r in rows:
        by.setdefault((r["prompt"], r["context"]), {}).setdefault(r["link_mbps"], {})[r["method"]] = r
    out = {}
    for (prompt, ctx), links in sorted(by.items()):
        pts = sorted(links.items())
        ratio = lambda a, b, k="tt32t_s": [(l, m[a][k] / m[b][k]) for l, m in pts  # noqa: E731
                                           if a in m and b in m and m[a].get(k) is not None and m[b].get(k)]
        out[f"{prompt}@{ctx}"] = {"lynx_beats_int8_below_mbps": _crossover(ratio("Lynx", "INT8")),
                                  "drafting_pays_below_mbps": _crossover(ratio("Lynx", NO_DRAFTS)),
                                  "lynx_decode_start_beats_int8_below_mbps":
                                      _crossover(ratio("Lynx", "INT8", "decode_start_s"))}
    return out


def plot(rows: list[dict], path: Path) -> None:
    ctxs, prompts = sorted({r["context"] for r in rows}), sorted({r["prompt"] for r in rows})
    fig, axes = pyplot().subplots(2, len(ctxs), figsize=(4.6 * len(ctxs), 7), squeeze=False)
    for j, ctx in enumerate(ctxs):
        for i, metric in enumerate(("tt32t_s", "decode_start_s")):
            ax = axes[i][j]
            for name, _, _ in PLAN:
                for prompt, style in zip(prompts, ("-", "--", ":")):
                    pts = sorted((r["link_mbps"], r[metric]) for r in rows if r.get(metric) is not None
                                 and r["context"] == ctx and r["method"] == name and r["prompt"] == prompt)
                    if pts:
                        ax.plot(*zip(*pts), style, marker="o", ms=3, label=f"{name} ({prompt})")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{ctx} tokens: {'time to 32 verified tokens' if i == 0 else 'decode start'}")
            ax.set_xlabel("link Mbit/s")
            ax.set_ylabel("seconds")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=6)
    save_figure(fig, path)


def cache_bound_bytes(model, prompt_tokens: int, tail_tokens: int, wire_bytes: int) -> int:
    """The bound lynx_hf/cache/lynx_cache.py documents for the cache during decoding: the encoded streams (codes +
    metadata, = the bytes on the wire), one dequantized prompt in the model dtype (K and V), and the decode-side
    tail."""
    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * hd * next(model.parameters()).element_size()
    return wire_bytes + (prompt_tokens + tail_tokens) * per_token


def _request(cli, ids: list[int], cfg, spec: bool, new_tokens: int) -> tuple[dict, PeakRSS]:
    with PeakRSS() as mem:
        r = cli.generate(ids, cfg, max_new_tokens=new_tokens, speculative=spec)
    return r, mem


def run(links_mbps=LINKS_MBPS, contexts=CONTEXTS, prompts=("code", "shakespeare"), new_tokens=32,
        out=OUT, as_json=False, model_name=None, data_plane="tcp") -> dict:
    """links_mbps: emulated link speeds (0: none, loopback as it is); data_plane: "tcp" or "nixl" (the segments'
    bytes by NIXL)."""
    say = printer(as_json)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "bench_transfer.jsonl"
    done = _load(results)
    model, tok = lynx_hf.load_default_model(model_name)
    max_ctx = getattr(model.config, "max_position_embeddings", 1 << 30) - new_tokens
    texts = prompt_texts(prompts)
    ids = {p: tok(t[: 8 * max(contexts)]).input_ids for p, t in texts.items()}
    for p, v in ids.items():
        if len(v) < min(max(contexts), max_ctx):
            raise ConfigError(f"prompt {p!r} has only {len(v)} tokens, fewer than the longest context")
    todo = [(l, p, c, m) for l in links_mbps for p in texts for c in contexts for m, _, _ in PLAN
            if (l, p, c, m) not in done]
    say(f"{len(done)} results in {results}; {len(todo)} requests to go")
    bar = tqdm(total=len(todo), desc="requests", disable=as_json)
    for link in links_mbps:
        if not any(k[0] == link for k in todo):
            continue
        with prefill_child(model, link * 1e6, ids[next(iter(ids))][:64], model_name, timeout_s=600,
                           data_plane=data_plane) as cli:
            for prompt in texts:
                for ctx in contexts:
                    n = min(ctx, max_ctx)
                    for name, cfg, spec in PLAN:
                        if (link, prompt, ctx, name) in done:
                            continue
                        row = _row(model, cli, ids[prompt][:n], (link, prompt, ctx, name), cfg, spec, new_tokens,
                                   data_plane)
                        done[_key(row)] = row
                        with results.open("a") as f:
                            f.write(json.dumps(row) + "\n")
                        bar.update(1)
    bar.close()
    rows = [r for k, r in done.items() if k[0] in links_mbps and k[1] in texts and k[2] in contexts]
    for r in rows:  # Lynx's output must be the full tier's, token for token
        ref = done.get((r["link_mbps"], r["prompt"], r["context"], NO_DRAFTS))
        r["identical_to_full"] = None if ref is None else r["tokens"] == ref["tokens"]
    _tables(done, links_mbps, texts, contexts, say)
    summary = _summary(done, rows, results, say)
    if save_plot(lambda path: plot(rows, path), out / "bench_transfer.png", say):
        summary["plot"] = str(out / "bench_transfer.png")
    return final_line(summary)


def _row(model, cli, ids: list[int], key: tuple, cfg, spec: bool, new_tokens: int, data_plane: str) -> dict:
    """One request's JSONL record; key: (link Mbit/s, prompt, context, method)."""
    link, prompt, ctx, name = key
    r, mem = _request(cli, ids, cfg, spec, new_tokens)
    st = r["stats"]
    return {"link_mbps": link, "prompt": prompt, "context": ctx, "prompt_tokens": len(ids),
            "method": name, **{k: r[k] for k in ("ttft_s", "ttft_verified_s", "decode_start_s", "tt32t_s", "bytes",
                                                  "prefill_s", "placed_segments")},
            "data_plane": data_plane,
            # the KV's bytes over the time from the request to the last segment's arrival
            "mb_per_s": r["bytes"] / 1e6 / (st.get("residual_at_s") or st.get("anchors_at_s")),
            "drafted": st.get("drafted", 0), "accepted": st.get("accepted", 0),
            "peak_rss_mb": mem.delta / 1e6, "tokens": r["tokens"],
            # tail: the generated tokens and at most one verify pass's tree nodes
            "cache_bound_mb": cache_bound_bytes(model, len(ids), new_tokens + 128, r["bytes"]) / 1e6}


def _tables(done: dict, links_mbps, texts, contexts, say) -> None:
    """Per prompt and context: a row per link speed, a cell per method."""
    for prompt in texts:
        for ctx in contexts:
            say(f"\n{prompt}, {ctx} tokens: TTFT / TTFT verified / TT32T (s), MB on the wire, accepted/drafted")
            say(f"{'link Mbit/s':>11s}  " + "  ".join(f"{n[:16]:>26s}" for n, _, _ in PLAN))
            for link in links_mbps:
                cells = []
                for name, _, _ in PLAN:
                    r = done.get((link, prompt, ctx, name))
                    cells.append("-" if r is None else f"{r['ttft_s']:.2f}/{r['ttft_verified_s']:.2f}/"
                                 f"{r['tt32t_s']:.2f} {r['bytes'] / 1e6:.1f}MB")
                say(f"{link:11.0f}  " + "  ".join(f"{c:>26s}" for c in cells))


def _summary(done: dict, rows: list[dict], results: Path, say) -> dict:
    """The crossovers (said) and the final JSON line's numbers, per prompt@context@link of Lynx's rows."""
    cross = crossovers(rows)
    say("\ncrossovers: ≥ 5 % ahead from the slowest link up to (Mbit/s; inf: the whole sweep, None: not at the "
        "slowest link)")
    fmt = lambda v: "None" if v is None else f"{v:.0f}"
    for k, v in cross.items():
        say(f"  {k:18s} TT32T Lynx < INT8 up to {fmt(v['lynx_beats_int8_below_mbps'])}, drafting pays up to "
            f"{fmt(v['drafting_pays_below_mbps'])}, decode start Lynx < INT8 up to "
            f"{fmt(v['lynx_decode_start_beats_int8_below_mbps'])}")
    lynx_rows = [r for r in rows if r["method"] == "Lynx"]
    return {
        "results": str(results), "requests": len(rows),
        "lynx_identical_to_full": all(r["identical_to_full"] for r in lynx_rows if r["identical_to_full"] is not None),
        "accepted_mean": sum(r["accepted"] for r in lynx_rows) / max(1, len(lynx_rows)),
        "crossovers": cross,
        "tt32t_s": {f"{r['prompt']}@{r['context']}@{r['link_mbps']:g}": {
            n: done[(r["link_mbps"], r["prompt"], r["context"], n)]["tt32t_s"] for n, _, _ in PLAN
            if (r["link_mbps"], r["prompt"], r["context"], n) in done} for r in lynx_rows},
        "peak_rss_mb": {f"{r['prompt']}@{r['context']}@{r['link_mbps']:g}": {
            n: round(done[(r["link_mbps"], r["prompt"], r["context"], n)]["peak_rss_mb"], 1) for n, _, _ in PLAN
            if (r["link_mbps"], r["prompt"], r["context"], n) in done} for r in lynx_rows},
    }


def register(bench) -> None:
    """`lynx-hf bench transfer` and its flags (`bench`: the subcommands of `lynx-hf bench`)."""
    # internal: the command line's own parts (its subcommand helper and help texts, the numeric validators)
    from lynx_hf.flags import JSON_HELP, MODEL_HELP, NIXL_EXTRA, subcommand
    from lynx_hf.flags import mbps, tokens

    p = subcommand(bench, "transfer", "TTFT / TT32T over the two-process path per link speed, context and prompt")
    p.add_argument("--links", type=mbps("no emulation"), nargs="+", default=list(LINKS_MBPS),
                   help="Mbit/s (0: no emulation, loopback as it is)")
    p.add_argument("--contexts", type=tokens(), nargs="+", default=list(CONTEXTS), help="prompt tokens")
    p.add_argument("--prompts", nargs="+", default=["code", "shakespeare"],
                   help="'code' (stdlib source), 'shakespeare' (shared data) or text files")
    p.add_argument("--new-tokens", type=tokens(hi=4096), default=32, help="tokens generated per request")
    p.add_argument("--data-plane", choices=["tcp", "nixl"], default="tcp",
                   help=f"the segments' bytes over the channel or by NIXL ({NIXL_EXTRA})")
    p.add_argument("--out", help=f"results folder, resumable JSONL (default: {OUT}, {OUT}_nixl with --data-plane nixl)")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(fn=_command)


def _command(a) -> None:
    from lynx_hf.transfer.commands import plane_or_exit  # internal: --data-plane checked before the model loads

    from lynx_hf.eval.lib import data

    if "shakespeare" in a.prompts:
        data.require("bench transfer --prompts shakespeare", needs_text=True,
                     text_flag="--prompts code (or a text file's path)")
    plane_or_exit(a)
    out = a.out or (f"{OUT}_nixl" if a.data_plane == "nixl" else OUT)
    run(links_mbps=a.links, contexts=a.contexts, prompts=a.prompts, new_tokens=a.new_tokens, out=out, as_json=a.json,
        model_name=a.model, data_plane=a.data_plane)
