"""`lynx-hf demo`: a prefill process and a decode process on loopback, KV over TCP behind the link emulator.

This process is the decode side; it starts `lynx-hf serve-prefill` as a child process, then sends the same prompt
with BF16, INT8, INT4 (KIVI-4), CacheGen, Lynx and Lynx in exact mode, and a Lynx run with drafting off (the full-tier
reference). "Identical" says what each Lynx row equals: the default Lynx its 8-bit full tier decoded without drafts,
Lynx (exact) plain `generate` on the model in its dtype (`--dtype`; the prefill process runs the same one).
CacheGen's encoding runs on the prefill side and its decoding on the decode side, both inside its TTFT. TTFT is
measured from sending the request (its arrival at the prefill process, on loopback) to the first token the decode process
emits: the prefill's logits (sent right after the last anchor frame) picked through the decode side's options, so it
is verified at once; TT32T to 32 verified tokens. Prints a table, writes JSON + a PNG timeline, and ends with one
JSON line."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import lynx_hf

# prefill_child and default_prompt_text are the harness's (tests take them from here too)
from lynx_hf import LynxQuantConfig

from .harness import METHODS, default_prompt_text, final_line, prefill_child, printer, pyplot, save_figure, save_plot


EXACT = "Lynx (exact)"


def _row(r: dict) -> dict:
    st = r["stats"]
    # verification overlapping the transfer: seconds between the verify pass's start and the last residual arrival
    last_res = max((t for t, what, *_ in r["events"] if what == "residual"), default=None)
    vstart = [t for t, k in r["timeline"] if k == "verify_start"]
    overlap = last_res - vstart[0] if vstart and last_res is not None else None
    return {**{k: r[k] for k in ("ttft_s", "ttft_verified_s", "tt32t_s", "bytes")},
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


def run(prompt_file=None, tokens=1024, bandwidth_bps=15e6, new_tokens=32, as_json=False, out_dir="runs",
        model_name=None, do_sample=False, methods=None, data_plane="tcp", port=None, dtype="float32",
        anchor_bits=4):
    """methods: {row name: LynxQuantConfig} (default METHODS and "Lynx (exact)"; it must hold "BF16", "INT8",
    "INT4 (KIVI-4)", "Lynx"). anchor_bits: the default rows' Lynx anchor width."""
    say = printer(as_json, stderr=True)
    model, tok = lynx_hf.load_default_model(model_name, dtype=getattr(torch, dtype))
    text = open(prompt_file, encoding="utf-8", errors="replace").read() if prompt_file else default_prompt_text()
    ids = tok(text).input_ids[:tokens]
    say(f"starting the prefill process (link emulator {bandwidth_bps / 1e6:.1f} Mbit/s, data plane {data_plane}) ...")
    runs = {}
    with prefill_child(model, bandwidth_bps, ids[:64], model_name, data_plane=data_plane, port=port,
                       server_args=("--dtype", dtype, "--prefill-step", str(max(1024, len(ids)))),
                       link_bps=bandwidth_bps) as cli:
        methods = methods or {**METHODS, "Lynx": LynxQuantConfig(anchor_bits=anchor_bits),
                              EXACT: LynxQuantConfig(exact=True, anchor_bits=anchor_bits)}
        plan = [(n, c, True) for n, c in methods.items()] + [
            ("Lynx (no drafts: full-tier reference)", methods["Lynx"], False)]
        gen = {"do_sample": True, "temperature": 0.7} if do_sample else {}
        for name, cfg, spec in tqdm(plan, desc="methods", file=sys.stderr):
            if not spec:  # the reference decodes the Lynx row's KV: the width that row took
                cfg = runs["Lynx"]["cache"].quant_config
            torch.manual_seed(0)
            runs[name] = cli.generate(ids, cfg, max_new_tokens=new_tokens, speculative=spec, **gen)
    rows = {n: _row(r) for n, r in runs.items()}
    ref = "Lynx (no drafts: full-tier reference)"
    same = runs["Lynx"]["tokens"] == runs[ref]["tokens"] if not do_sample else None  # sampling: same distribution
    exact = None
    if EXACT in runs and not do_sample:  # exact mode = plain generate on the model, without Lynx
        plain = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        exact = runs[EXACT]["tokens"] == plain[0, len(ids):].tolist()
    bits, width = runs["Lynx"]["cache"].quant_config.anchor_bits, runs["Lynx"]["width"]
    say(f"\nprompt {len(ids)} tokens; prefill {runs['Lynx']['prefill_s']:.2f} s (overlapped with sending); "
        f"link {bandwidth_bps / 1e6:.1f} Mbit/s; Lynx anchor {bits} bits" + _auto_note(width))
    say(f"{'method':40s} {'TTFT s':>7s} {'verified':>9s} {'TT32T s':>8s} {'MB':>7s} {'drafted/accepted':>17s}")
    for n, r in rows.items():
        say(f"{n:40s} {r['ttft_s']:7.2f} {r['ttft_verified_s']:9.2f} {r['tt32t_s']:8.2f} {r['bytes'] / 1e6:7.2f} "
            f"{r['drafted']:>8d}/{r['accepted']:<8g}")
    say(f"TTFT Lynx/INT4 {rows['Lynx']['ttft_s'] / rows['INT4 (KIVI-4)']['ttft_s']:.2f}, "
        f"Lynx/INT8 {rows['Lynx']['ttft_s'] / rows['INT8']['ttft_s']:.2f}; Lynx identical to 8-bit full-tier decoding: {same}"
        + ("" if exact is None else f"; Lynx (exact) identical to plain generate ({dtype}): {exact}") + "; "
        f"verify pass started {rows['Lynx']['verify_overlap_s'] or 0:.2f} s before the last residual segment landed")
    say("Lynx generated:", repr(tok.decode(runs["Lynx"]["tokens"])))
    link_s = rows["BF16"]["bytes"] * 8 / bandwidth_bps  # BF16's KV on the link alone
    prefill_bound = runs["Lynx"]["prefill_s"] > 0.5 * link_s
    if prefill_bound:
        say(f"NOTE: the prefill ({runs['Lynx']['prefill_s']:.2f} s) took more than half as long as BF16's KV on the link "
            f"({link_s:.2f} s): this machine's compute, not the link, sets these TTFTs, and the ratios say little about "
            f"KV transfer (use a slower --bandwidth-mbps or a less busy machine)")
    res = {"methods": {n: {k: rows[n][k] for k in ("ttft_s", "ttft_verified_s", "tt32t_s", "bytes")}
                       for n in rows},
           "lynx": {"drafted": rows["Lynx"]["drafted"], "accepted": rows["Lynx"]["accepted"], "identical_to_full": same,
                    "verify_overlap_s": rows["Lynx"]["verify_overlap_s"], "anchor_bits": bits, "width": width},
           "exact": None if EXACT not in rows else {"identical_to_plain_generate": exact, "dtype": dtype,
                                                    "bytes_vs_bf16": rows[EXACT]["bytes"] / rows["BF16"]["bytes"]},
           "do_sample": do_sample, "prefill_bound": prefill_bound, "data_plane": data_plane,
           "placed_segments": runs["Lynx"]["placed_segments"],
           "bandwidth_bps": bandwidth_bps, "prompt_tokens": len(ids), "prefill_s": runs["Lynx"]["prefill_s"]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps({**res, "rows": rows}, indent=2))
    save_plot(lambda path: plot_timeline(runs, path, bandwidth_bps, len(ids), new_tokens), out / "demo_timeline.png",
              say, beside=out / "demo.json", what="the timeline PNG")
    return final_line(res)
