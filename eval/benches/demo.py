"""`lynx-hf demo`: a prefill process and a decode process on loopback, KV over TCP behind the link emulator.

This process is the decode side; it starts `lynx-hf serve-prefill` as a child process, then sends the same prompt
with BF16, INT8, INT4 (KIVI-4), CacheGen, Lynx and Lynx in exact mode, and a Lynx run with drafting off (the full-tier
reference). "Identical" says what each Lynx row equals: the default Lynx its 8-bit full tier decoded without drafts,
Lynx (exact) plain `generate` on the model in its dtype (`--dtype`; the prefill process runs the same one).
CacheGen's encoding runs on the prefill side and its decoding on the decode side, both inside its TTFT. TTFT is
measured from sending the request (its arrival at the prefill process, on loopback) to the first token the decode
process emits: the prefill's logits (sent ahead of every KV frame still queued) picked through the decode side's
options, so it is verified at once and is the prefill's plus one frame for every method; decode start to the second
token, the first that needs the KV (a draft on the anchor, or a verified one): the figure the codec moves; TT32T to 32
verified tokens. `--repeat N`: N rounds on the same model and prefill process,
every method once per round in an order rotated per round; each figure the median with [min, max], each ratio the
median of the per-round paired ratios, each beside its floor from the same round's events (lynx_hf/floors.py). Prints
a table, writes JSON (every round) + a PNG timeline (+ a PNG of the rounds), and ends with one JSON line."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import lynx_hf

# prefill_child and default_prompt_text are the harness's (tests take them from here too)
from lynx_hf import LynxQuantConfig
from lynx_hf.config import AUTO

from lynx_hf.floors import floors, paired, rotated, spread, step_s
from lynx_hf.eval.lib.harness import (METHODS, default_prompt_text, final_line, prefill_child, printer, pyplot,
                                      save_figure, save_plot)


EXACT = "Lynx (exact)"
FIGURES = ("ttft_s", "ttft_verified_s", "decode_start_s", "verified_2_s", "tt32t_s")  # medians over the rounds


def _row(r: dict) -> dict:
    st = r["stats"]
    # verification overlapping the transfer: seconds between the verify pass's start and the last residual arrival
    last_res = max((t for t, what, *_ in r["events"] if what == "residual"), default=None)
    vstart = [t for t, k in r["timeline"] if k == "verify_start"]
    overlap = last_res - vstart[0] if vstart and last_res is not None else None
    return {**{k: r[k] for k in ("ttft_s", "ttft_verified_s", "decode_start_s", "verified_2_s", "tt32t_s", "bytes")},
            **{k: st.get(k) for k in ("drafted", "accepted", "tree_nodes", "anchors_at_s", "residual_at_s", "verify_s",
                                         "draft_stop")},
            "verify_overlap_s": overlap}


def _auto_note(width: dict | None) -> str:
    """What anchor_bits "auto" chose and why, with each width's forecast TT32T ("" for a fixed width)."""
    if width is None:
        return ""
    fc = ", ".join(f"{b} bits {f['tt32t_s']:.2f} s" for b, f in width["forecast"].items())
    return f" (auto: {width['why']}" + (f"; forecast TT32T {fc})" if fc else ")")


def plot_timeline(runs: dict, path: Path, bandwidth_bps: float, prompt_tokens: int, new_tokens: int = 32) -> None:
    """One row per method: each KV segment's arrival by layer (Lynx: anchor and residual; the others send their
    whole KV in one stream), and the decode side's tokens on top (draft, verify pass, verified)."""
    plt = pyplot()
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.9 * len(runs) + 1.2), sharex=True)
    for ax, (name, r) in zip(axes, runs.items()):
        t0, split = r["t0"], name.startswith("Lynx")
        for t, what, layer, kind in r["events"]:
            color = ("tab:blue" if what == "anchor" else "tab:orange") if split else "tab:purple"
            ax.plot([t - t0], [layer], "|", color=color, ms=6)
        ymax = max((e[2] for e in r["events"]), default=0) + 1
        for t, k in r["timeline"]:
            c = {"draft": "tab:gray", "verified": "tab:green", "verify_start": "tab:red"}[k]
            ax.axvline(t - t0, ymin=0.88, ymax=1.0, color=c, lw=1)
        ax.set_ylabel(f"{name}\nlayer", fontsize=8)
        ax.set_ylim(-1, ymax + 3)
    legend = [Line2D([], [], color=c, marker="|", ls="", ms=9, label=l) for c, l in (
        ("tab:purple", "KV segment (one stream)"), ("tab:blue", "Lynx anchor segment"),
        ("tab:orange", "Lynx residual segment"))] + \
        [Line2D([], [], color=c, lw=1.5, label=l) for c, l in (
            ("tab:gray", "draft token"), ("tab:red", "verify pass"), ("tab:green", "verified token"))]
    fig.legend(handles=legend, loc="lower center", ncol=6, fontsize=8, frameon=False)
    axes[-1].set_xlabel("seconds since the request was sent")
    fig.suptitle(f"lynx-hf demo: a {prompt_tokens}-token prompt's KV over a {bandwidth_bps / 1e6:g} Mbit/s link, "
                 f"then {new_tokens} tokens", fontsize=11)
    save_figure(fig, path, rect=(0, 0.05, 1, 1))


REF = "lynx-nodraft"  # the Lynx row's KV (its width), decoded without drafts once the residual is in
PAIRS = {"ttft_lynx_int4": ("Lynx", "INT4 (KIVI-4)", "ttft_s"), "ttft_lynx_int8": ("Lynx", "INT8", "ttft_s"),
         "tt32t_lynx_int8": ("Lynx", "INT8", "tt32t_s"),
         "decode_start_lynx_int4": ("Lynx", "INT4 (KIVI-4)", "decode_start_s"),
         "decode_start_lynx_int8": ("Lynx", "INT8", "decode_start_s"),
         "tt32t_lynx_nodraft": ("Lynx", REF, "tt32t_s")}  # the --json "ratios" (and their "floor")
AT_FLOOR = {"lynx_ttft": "ttft_s", "lynx_decode_start": "decode_start_s", "lynx_verified_2": "verified_2_s",
            "lynx_tt32t": "tt32t_s"}


def run(prompt_file=None, tokens=1024, bandwidth_bps=15e6, new_tokens=32, as_json=False, out_dir="runs",
        model_name=None, do_sample=False, methods=None, data_plane="tcp", port=None, dtype="float32",
        anchor_bits=4, repeat=1):
    """methods: {row name: LynxQuantConfig} (default METHODS and "Lynx (exact)"; it must hold "BF16", "INT8",
    "INT4 (KIVI-4)", "Lynx"). anchor_bits: the default rows' Lynx anchor width. repeat: rounds, each running every
    method once in an order rotated per round (the full-tier reference among them: it decodes the Lynx row's width);
    figures are medians with [min, max], ratios medians of the per-round paired ratios, beside their floors."""
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an int >= 1, got {repeat!r}")
    say = printer(as_json, stderr=True)
    model, tok = lynx_hf.load_default_model(model_name, dtype=getattr(torch, dtype))
    text = open(prompt_file, encoding="utf-8", errors="replace").read() if prompt_file else default_prompt_text()
    ids = tok(text).input_ids[:tokens]
    say(f"starting the prefill process (link emulator {bandwidth_bps / 1e6:.1f} Mbit/s, data plane {data_plane}) ...")
    rounds = []
    with prefill_child(model, bandwidth_bps, ids[:64], model_name, data_plane=data_plane, port=port,
                       server_args=("--dtype", dtype, "--prefill-step", str(max(1024, len(ids))),
                                    "--prefix-cache-mb", "0"),  # every method a fresh prompt's whole prefill
                       link_bps=bandwidth_bps) as cli:
        methods = methods or {**METHODS, "Lynx": LynxQuantConfig(anchor_bits=anchor_bits),
                              EXACT: LynxQuantConfig(exact=True, anchor_bits=anchor_bits)}
        gen = {"do_sample": True, "temperature": 0.7} if do_sample else {}
        for r in tqdm(range(repeat), desc="rounds", file=sys.stderr, disable=repeat == 1):
            rounds.append(_round(cli, methods, ids, new_tokens, gen, r))
    plain = None
    if EXACT in methods and not do_sample:  # exact mode = plain generate on the model, without Lynx
        plain = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0, len(ids):].tolist()
    judged = [_judge(runs, new_tokens, do_sample, plain) for runs in rounds]
    return _report(rounds[-1], judged, tok, say, bandwidth_bps, new_tokens, dtype, do_sample, data_plane, ids,
                   out_dir)


def _round(cli, methods: dict, ids, new_tokens: int, gen: dict, r: int) -> dict:
    """One round: every method and the full-tier reference of the Lynx row once, in round r's order (with an anchor
    width chosen per request, the reference right after the Lynx row: it decodes the width that row took)."""
    runs, auto = {}, methods["Lynx"].anchor_bits == AUTO
    order = rotated(list(methods) + ([] if auto else [REF]), r)
    if auto:
        order.insert(order.index("Lynx") + 1, REF)
    for name in order:
        cfg = runs["Lynx"]["cache"].quant_config if name == REF else methods[name]  # the width the Lynx row took
        torch.manual_seed(0)
        runs[name] = cli.generate(ids, cfg, max_new_tokens=new_tokens, speculative=name != REF, **gen)
    return runs


def _judge(runs: dict, new_tokens: int, do_sample: bool, plain) -> dict:
    """One round's rows, identity flags, decode step, floors and Lynx's distance to them."""
    rows = {n: _row(r) for n, r in runs.items()}
    n = min(32, new_tokens)
    steps = [step_s(r["timeline"], r["t0"]) for k, r in runs.items() if not k.startswith("Lynx")]
    steps = [s for s in steps if s is not None]
    step = statistics.median(steps) if steps else None  # (none measured: no TT32T floors this round)
    split = {k: r["cache"].quant_config.method in ("lynx", "paper") for k, r in runs.items()}
    fl = {k: {**floors(r, n, step, split[k]), "second": floors(r, 2, step, split[k])["ttnt"]} for k, r in runs.items()}
    lynx = rows["Lynx"]
    return {"rows": rows, "order": list(runs), "step_s": step,
            "floors": {k: {"ttft_s": f["ttft"], "decode_start_s": f["decode_start"], "verified_2_s": f["second"],
                           "tt32t_s": f["ttnt"]} for k, f in fl.items()},
            "identical": runs["Lynx"]["tokens"] == runs[REF]["tokens"] if not do_sample else None,
            "exact": None if plain is None or EXACT not in runs else runs[EXACT]["tokens"] == plain,
            "at_floor": {k: _over(lynx[f], fl["Lynx"][FLOOR_OF[f]]) for k, f in AT_FLOOR.items()}}


FLOOR_OF = {"ttft_s": "ttft", "decode_start_s": "decode_start", "verified_2_s": "second", "tt32t_s": "ttnt"}


def _over(measured, floor):
    return measured / floor if measured is not None and floor else None


def _summary(judged: list[dict]) -> dict:
    """Medians over the rounds: each method's figures, the paired ratios, the ratio floors, at_floor."""
    names = judged[0]["rows"]
    methods = {n: {k: spread([j["rows"][n][k] for j in judged]) for k in FIGURES} for n in names}
    ratios = {k: paired([j["rows"] for j in judged], a, b, f) for k, (a, b, f) in PAIRS.items()}
    floor = {k: paired([j["floors"] for j in judged], a, b, f) for k, (a, b, f) in PAIRS.items()
             if k != "ttft_lynx_int8"}
    at = {k: spread([j["at_floor"][k] for j in judged]) for k in AT_FLOOR}
    return {"methods": methods, "ratios": ratios, "floor": floor, "at_floor": at}


def _fmt(x: dict | None, digits=2) -> str:
    if x is None:
        return "-"
    m = f"{x['median']:.{digits}f}"
    return m if x["min"] == x["max"] else f"{m} [{x['min']:.{digits}f}, {x['max']:.{digits}f}]"


def _report(runs, judged, tok, say, bandwidth_bps, new_tokens, dtype, do_sample, data_plane, ids, out_dir):
    """The table, the figures, the JSON (demo.json keeps every round) and the final line."""
    summ, last, N = _summary(judged), judged[-1], len(judged)
    rows = last["rows"]
    same = None if do_sample else all(j["identical"] for j in judged)
    exact = None if last["exact"] is None else all(j["exact"] for j in judged)
    bits, width = runs["Lynx"]["cache"].quant_config.anchor_bits, runs["Lynx"]["width"]
    say(f"\nprompt {len(ids)} tokens; prefill {runs['Lynx']['prefill_s']:.2f} s (overlapped with sending); "
        f"link {bandwidth_bps / 1e6:.1f} Mbit/s; Lynx anchor {bits} bits" + _auto_note(width)
        + (f"; {N} rounds: medians [min, max]" if N > 1 else ""))
    say(f"{'method':40s} {'TTFT s':>18s} {'decode start s':>18s} {'TT32T s':>18s} {'TT32T floor':>12s} {'MB':>7s} "
        f"{'drafted/accepted':>17s}")
    for n in summ["methods"]:
        r, m = rows[n], summ["methods"][n]
        fl = spread([j["floors"][n]["tt32t_s"] for j in judged])
        say(f"{n:40s} {_fmt(m['ttft_s']):>18s} {_fmt(m['decode_start_s']):>18s} {_fmt(m['tt32t_s']):>18s} "
            f"{_fmt(fl):>12s} {r['bytes'] / 1e6:7.2f} "
            f"{r['drafted']:>8d}/{r['accepted']:<8g}")
    R, F, A = summ["ratios"], summ["floor"], summ["at_floor"]
    say(f"TTFT Lynx/INT4 {_fmt(R['ttft_lynx_int4'])} (floor {_fmt(F['ttft_lynx_int4'])}), Lynx/INT8 "
        f"{_fmt(R['ttft_lynx_int8'])}; decode start Lynx/INT4 {_fmt(R['decode_start_lynx_int4'])} (floor "
        f"{_fmt(F['decode_start_lynx_int4'])}), Lynx/INT8 {_fmt(R['decode_start_lynx_int8'])}; TT32T Lynx/INT8 "
        f"{_fmt(R['tt32t_lynx_int8'])} (floor {_fmt(F['tt32t_lynx_int8'])}), Lynx/{REF} "
        f"{_fmt(R['tt32t_lynx_nodraft'])}; Lynx at its floor: TTFT "
        f"{_fmt(A['lynx_ttft'])}, decode start {_fmt(A['lynx_decode_start'])}, second verified "
        f"{_fmt(A['lynx_verified_2'])}, TT32T {_fmt(A['lynx_tt32t'])}; identical to 8-bit full-tier decoding: {same}"
        + ("" if exact is None else f"; Lynx (exact) identical to plain generate ({dtype}): {exact}"))
    say("Lynx generated:", repr(tok.decode(runs["Lynx"]["tokens"])))
    link_s = rows["BF16"]["bytes"] * 8 / bandwidth_bps  # BF16's KV on the link alone
    prefill_bound = runs["Lynx"]["prefill_s"] > 0.5 * link_s
    if prefill_bound:
        say(f"NOTE: the prefill ({runs['Lynx']['prefill_s']:.2f} s) took more than half as long as BF16's KV on the "
            f"link ({link_s:.2f} s): this machine's compute, not the link, sets these TTFTs, and the ratios say little "
            f"about KV transfer (use a slower --bandwidth-mbps or a less busy machine)")
    med = lambda k: statistics.median([j["rows"]["Lynx"][k] for j in judged])  # noqa: E731
    res = {"methods": {n: {**{k: (summ["methods"][n][k] or {}).get("median") for k in FIGURES},
                           "bytes": rows[n]["bytes"]} for n in summ["methods"]},  # (the plan's order)
           "lynx": {"drafted": med("drafted"), "accepted": med("accepted"), "identical_to_full": same,
                    "verify_overlap_s": rows["Lynx"]["verify_overlap_s"], "anchor_bits": bits, "width": width},
           "exact": None if EXACT not in rows else {"identical_to_plain_generate": exact, "dtype": dtype,
                                                    "bytes_vs_bf16": rows[EXACT]["bytes"] / rows["BF16"]["bytes"]},
           "rounds": N, "ratios": R, "floor": {k: v and v["median"] for k, v in F.items()},
           "at_floor": {k: v and v["median"] for k, v in A.items()},
           "identical": [j["identical"] for j in judged], "step_s": [j["step_s"] for j in judged],
           "do_sample": do_sample, "prefill_bound": prefill_bound, "data_plane": data_plane,
           "placed_segments": runs["Lynx"]["placed_segments"],
           "bandwidth_bps": bandwidth_bps, "prompt_tokens": len(ids), "prefill_s": runs["Lynx"]["prefill_s"]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps({**res, "rows": rows, "per_round": judged, "spread": summ}, indent=2))
    save_plot(lambda path: plot_timeline(runs, path, bandwidth_bps, len(ids), new_tokens), out / "demo_timeline.png",
              say, beside=out / "demo.json", what="the timeline PNG")
    if N > 1:
        save_plot(lambda path: plot_rounds(summ, judged, path), out / "demo_rounds.png", say,
                  beside=out / "demo.json", what="the rounds PNG")
    return final_line(res)


def plot_rounds(summ: dict, judged: list, path: Path) -> None:
    """Each method's TTFT and TT32T medians with their [min, max] over the rounds, and its TT32T floor."""
    plt = pyplot()
    names = list(summ["methods"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(names) + 1.8), sharey=True)
    for ax, key, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tt32t_s", "TT32T")):
        for y, n in enumerate(names):
            m = summ["methods"][n][key]
            if m is None:
                continue
            ax.barh(y, m["median"], color="tab:blue", alpha=0.4)
            ax.errorbar(m["median"], y, xerr=[[m["median"] - m["min"]], [m["max"] - m["median"]]], color="k",
                        capsize=3)
            fl = spread([j["floors"][n][key] for j in judged])
            if fl is not None:
                ax.plot([fl["median"]], [y], "|", color="tab:red", ms=16)
        ax.set_title(f"{title}: median, [min, max] over {len(judged)} rounds; red: its floor", fontsize=9)
        ax.set_xlabel("seconds since the request was sent")
    axes[0].set_yticks(range(len(names)), names, fontsize=8)
    save_figure(fig, path)
