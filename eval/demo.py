"""`lynx-hf demo`: a prefill process and a decode process on loopback, KV over TCP behind the link emulator.

This process is the decode side; it starts `lynx-hf serve-prefill` as a child process, then sends the same prompt
with BF16, INT8, INT4 (KIVI-4), CacheGen and Lynx, and a Lynx run with drafting off (the full-tier reference).
CacheGen's encoding runs on the prefill side and its decoding on the decode side, both inside its TTFT. TTFT is
measured from sending the request (its arrival at the prefill process, on loopback) to the first token the decode process
emits: the prefill's logits (sent right after the last anchor frame) picked through the decode side's options, so it
is verified at once; TT32T to 32 verified tokens. Prints a table, writes JSON + a PNG timeline, and ends with one
JSON line."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

import lynx_hf
from lynx_hf import LynxQuantConfig
from lynx_hf.transfer.decode import DecodeClient

METHODS = {"BF16": LynxQuantConfig(method="bf16"), "INT8": LynxQuantConfig(method="int8"),
           "INT4 (KIVI-4)": LynxQuantConfig(method="kivi4"), "CacheGen": LynxQuantConfig(method="cachegen"),
           "Lynx": LynxQuantConfig()}


def default_prompt_text() -> str:
    """Text every Python installation has: the standard library's own source."""
    import inspect
    import json as _json
    import textwrap

    return "".join(inspect.getsource(m) for m in (textwrap, _json.decoder, _json.encoder, inspect))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(port: int, bandwidth_bps: float | None, secret: str, model: str | None, extra: tuple = ()):
    cmd = [sys.executable, "-m", "lynx_hf.cli", "serve-prefill", "--listen", f"127.0.0.1:{port}"] + \
        (["--bandwidth-mbps", str(bandwidth_bps / 1e6)] if bandwidth_bps else []) + \
        (["--model", model] if model else []) + list(extra)
    env = dict(os.environ, LYNX_SECRET=secret)
    # the child's log goes to a file, not a pipe: a pipe nobody drains blocks the server once ~64 KiB accumulate
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log = log
    t = time.time()
    while time.time() - t < 300:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"prefill server exited: {log.read()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("prefill server did not start within 300 s")


@contextlib.contextmanager
def prefill_child(model, bandwidth_bps: float | None, warmup_ids: list[int], model_name: str | None = None,
                  timeout_s: float = 120, server_args: tuple = (), data_plane: str = "tcp"):
    """A `serve-prefill` child process behind the link emulator (`bandwidth_bps` None or 0: no emulation;
    `server_args`: more of its flags), and a DecodeClient connected to it and warmed up (one short request through
    both processes); the child is stopped on exit. data_plane "nixl": the segments move by NIXL, which this loopback
    pair pins to loopback TCP unless $UCX_TLS / $UCX_NET_DEVICES say otherwise."""
    if data_plane == "nixl":
        os.environ.setdefault("UCX_TLS", "tcp")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        server_args = (*server_args, "--data-plane", "nixl")
    secret, port = secrets.token_hex(16), _free_port()
    proc = _start_server(port, bandwidth_bps, secret, model_name, server_args)
    try:
        cli = DecodeClient(model, "127.0.0.1", port, secret=secret, timeout_s=timeout_s, data_plane=data_plane)
        cli.generate(warmup_ids, LynxQuantConfig(), max_new_tokens=2)
        yield cli
        cli.close()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        proc.log.close()


def _row(r: dict) -> dict:
    st = r["stats"]
    # verification overlapping the transfer: seconds between the verify pass's start and the last residual arrival
    last_res = max((t for t, what, *_ in r["events"] if what == "residual"), default=None)
    vstart = [t for t, k in r["timeline"] if k == "verify_start"]
    overlap = last_res - vstart[0] if vstart and last_res is not None else None
    return {**{k: r[k] for k in ("ttft_s", "ttft_verified_s", "tt32t_s", "bytes")},
            **{k: st.get(k) for k in ("drafted", "accepted", "tree_nodes", "anchors_at_s", "residual_at_s", "verify_s")},
            "verify_overlap_s": overlap}


def plot_timeline(runs: dict, path: Path, bandwidth_bps: float, prompt_tokens: int, new_tokens: int = 32) -> None:
    """One row per method: each KV segment's arrival by layer (Lynx: anchor and residual; the others send their
    whole KV in one stream), and the decode side's tokens on top (draft, verify pass, verified)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(prompt_file=None, tokens=1024, bandwidth_bps=15e6, new_tokens=32, as_json=False, out_dir="runs",
        model_name=None, do_sample=False, methods=None, data_plane="tcp"):
    """methods: {row name: LynxQuantConfig} (default METHODS; it must hold "BF16", "INT8", "INT4 (KIVI-4)", "Lynx")."""
    say = (lambda *a: print(*a, file=sys.stderr)) if as_json else print  # --json: stdout holds the JSON line only
    model, tok = lynx_hf.load_default_model(model_name)
    text = open(prompt_file, encoding="utf-8", errors="replace").read() if prompt_file else default_prompt_text()
    ids = tok(text).input_ids[:tokens]
    say(f"starting the prefill process (link emulator {bandwidth_bps / 1e6:.1f} Mbit/s, data plane {data_plane}) ...")
    runs = {}
    with prefill_child(model, bandwidth_bps, ids[:64], model_name, data_plane=data_plane) as cli:
        methods = methods or METHODS
        plan = [(n, c, True) for n, c in methods.items()] + [
            ("Lynx (no drafts: full-tier reference)", methods["Lynx"], False)]
        gen = {"do_sample": True, "temperature": 0.7} if do_sample else {}
        for name, cfg, spec in tqdm(plan, desc="methods", file=sys.stderr):
            torch.manual_seed(0)
            runs[name] = cli.generate(ids, cfg, max_new_tokens=new_tokens, speculative=spec, **gen)
    rows = {n: _row(r) for n, r in runs.items()}
    ref = "Lynx (no drafts: full-tier reference)"
    same = runs["Lynx"]["tokens"] == runs[ref]["tokens"] if not do_sample else None  # sampling: same distribution
    say(f"\nprompt {len(ids)} tokens; prefill {runs['Lynx']['prefill_s']:.2f} s (overlapped with sending); "
        f"link {bandwidth_bps / 1e6:.1f} Mbit/s")
    say(f"{'method':40s} {'TTFT s':>7s} {'verified':>9s} {'TT32T s':>8s} {'MB':>7s} {'drafted/accepted':>17s}")
    for n, r in rows.items():
        say(f"{n:40s} {r['ttft_s']:7.2f} {r['ttft_verified_s']:9.2f} {r['tt32t_s']:8.2f} {r['bytes'] / 1e6:7.2f} "
            f"{r['drafted']:>8d}/{r['accepted']:<8g}")
    say(f"TTFT Lynx/INT4 {rows['Lynx']['ttft_s'] / rows['INT4 (KIVI-4)']['ttft_s']:.2f}, "
        f"Lynx/INT8 {rows['Lynx']['ttft_s'] / rows['INT8']['ttft_s']:.2f}; Lynx identical to full tier: {same}; "
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
                    "verify_overlap_s": rows["Lynx"]["verify_overlap_s"]},
           "do_sample": do_sample, "prefill_bound": prefill_bound, "data_plane": data_plane,
           "placed_segments": runs["Lynx"]["placed_segments"],
           "bandwidth_bps": bandwidth_bps, "prompt_tokens": len(ids), "prefill_s": runs["Lynx"]["prefill_s"]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps({**res, "rows": rows}, indent=2))
    try:
        plot_timeline(runs, out / "demo_timeline.png", bandwidth_bps, len(ids), new_tokens)
        say(f"wrote {out / 'demo.json'} and {out / 'demo_timeline.png'}")
    except ImportError:
        say(f"wrote {out / 'demo.json'} (install matplotlib for the timeline PNG)")
    print(json.dumps(res))
    return res
