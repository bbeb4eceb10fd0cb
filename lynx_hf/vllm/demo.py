"""`bash bootstrap.sh vllm-demo`: Lynx inside vLLM — a prefill engine and a decode engine (two processes, loopback,
the link emulated at 15 Mbit/s), one ~1K-token prompt shipped as BF16, INT8, INT4 (KIVI-4) and Lynx through the same
`LynxConnector`, 32 new tokens each, then Lynx again without drafts (the full-tier reference it must equal).

Times are seconds from the request's start: TTFT = the first token the decode engine produced (Lynx: the shadow's
first draft; the baselines: their first verified token); first verified = R's first token; TT32T = the 32nd verified
token (the prefill's first token counts). Prints a table, writes runs/vllm_demo.json and a PNG timeline, and with
--json ends with one JSON line."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

METHODS = {"BF16": "bf16", "INT8": "int8", "INT4 (KIVI-4)": "kivi4", "Lynx": "lynx"}


def default_prompt_text() -> str:
    """The standard library's own source (the HF demo's prompt too)."""
    import inspect
    import json as _json
    import textwrap

    return "".join(inspect.getsource(m) for m in (textwrap, _json.decoder, _json.encoder, inspect))


def _row(r, new_tokens: int) -> dict:
    return {"ttft_s": round(r.ttft_s, 4), "ttft_verified_s": round(r.ttft_verified_s, 4),
            "tt32t_s": None if r.tt(new_tokens) is None else round(r.tt(new_tokens), 4), "bytes": r.bytes,
            "anchor_at_s": r.anchor_at_s, "full_at_s": r.full_at_s, "drafted": r.drafted,
            "accepted": r.accepted, **r.extra}


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
        ax.plot([r.ttft_s], [y], "v", color="tab:gray")
    ax.set_yticks(range(len(runs)), list(runs))
    ax.set_xlabel("seconds since the request started (bars: KV on the link — anchor, residual / whole code; "
                  "ticks: verified tokens; ▼ TTFT)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    from ..flags import count, mbps, tokens

    ap = argparse.ArgumentParser(prog="lynx-hf vllm-demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF-format model folder (bootstrap passes the embedded one)")
    ap.add_argument("--tokens", type=tokens(), default=1024, help="prompt tokens (default 1024)")
    ap.add_argument("--new-tokens", type=tokens(hi=4096), default=32)
    ap.add_argument("--bandwidth-mbps", type=mbps("unpaced"), default=15.0, help="the emulated link (0: unpaced)")
    ap.add_argument("--num-speculative-tokens", type=count(64), default=16, help="vLLM's K (engine-wide)")
    ap.add_argument("--port", type=count(65535), default=7411, help="the prefill engine's KV stream port")
    ap.add_argument("--do-sample", action="store_true", help="temperature 0.7 (seeded) instead of greedy")
    ap.add_argument("--prompt-file", help="a text file for the prompt (default: the standard library's source)")
    ap.add_argument("--out-dir", default="runs")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    a = ap.parse_args(argv)
    for name, v, lo in (("--tokens", a.tokens, 64), ("--new-tokens", a.new_tokens, 2),
                        ("--num-speculative-tokens", a.num_speculative_tokens, 1)):
        if v < lo:
            ap.error(f"{name} must be >= {lo}, got {v}")
    if not 0 <= a.bandwidth_mbps < 1e6:
        ap.error(f"--bandwidth-mbps must be in [0, 1e6), got {a.bandwidth_mbps}")
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))

    from transformers import AutoTokenizer

    from .pd import LynxPD

    tok = AutoTokenizer.from_pretrained(a.model)
    text = Path(a.prompt_file).read_text() if a.prompt_file else default_prompt_text()
    ids = tok(text).input_ids[:a.tokens]
    if len(ids) < a.tokens:
        ap.error(f"the prompt has {len(ids)} tokens, fewer than --tokens {a.tokens}")
    sampling = {"temperature": 0.7, "seed": 1234} if a.do_sample else {}
    say(f"starting a prefill and a decode vLLM engine ({a.model}); link {a.bandwidth_mbps:g} Mbit/s")
    runs = {}
    with LynxPD(a.model, bandwidth_mbps=a.bandwidth_mbps or None, port=a.port,
                num_speculative_tokens=a.num_speculative_tokens, draft_budget=a.new_tokens - 1) as pd:
        pd.generate(ids[:128], 4, method="lynx", **sampling)  # warm-up: first-request costs out of the rows
        for name, method in METHODS.items():
            say(f"  {name} ...")
            runs[name] = pd.generate(ids, a.new_tokens, method=method, **sampling)
        say("  Lynx without drafts (the full-tier reference) ...")
        ref = pd.generate(ids, a.new_tokens, method="lynx", drafts=False, **sampling)
        version = pd.version
    lynx = runs["Lynx"]
    rows = {k: _row(r, a.new_tokens) for k, r in runs.items()}
    rows["Lynx"]["identical_to_full"] = lynx.tokens == ref.tokens
    say(f"\n{'method':<15}{'TTFT':>8}{'1st verified':>14}{'TT32T':>8}{'MB':>8}{'drafted':>9}{'accepted':>9}")
    for k, r in rows.items():
        say(f"{k:<15}{r['ttft_s']:>8.2f}{r['ttft_verified_s']:>14.2f}{r['tt32t_s'] or float('nan'):>8.2f}"
            f"{r['bytes'] / 1e6:>8.2f}{r['drafted']:>9}{r['accepted']:>9}")
    say(f"Lynx/INT4 TTFT {lynx.ttft_s / runs['INT4 (KIVI-4)'].ttft_s:.2f}, Lynx/INT8 TT32T "
        f"{lynx.tt(a.new_tokens) / runs['INT8'].tt(a.new_tokens):.2f}; identical to full-tier decoding without "
        f"drafts: {rows['Lynx']['identical_to_full']} (exact = equal to vLLM decoding the 8-bit full tier)")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    body = {"methods": rows, "engine": f"vllm {version}", "prompt_tokens": len(ids), "new_tokens": a.new_tokens,
            "bandwidth_mbps": a.bandwidth_mbps, "num_speculative_tokens": a.num_speculative_tokens,
            "sampling": sampling or "greedy"}
    (out / "vllm_demo.json").write_text(json.dumps(body, indent=2) + "\n")
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
