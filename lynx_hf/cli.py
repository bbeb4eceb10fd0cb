"""The `lynx-hf` command: argument parsing only; each subcommand calls into lynx_hf or lynx_hf.eval (imported by the
subcommand that needs it, so `lynx-hf --help` starts without torch).

Each subcommand has a registration function `_add_NAME(sub)` beside its handler; `lynx-hf bench`'s benchmarks and
`serve-prefill` / `serve-decode` register their own (`register(sub)` in lynx_hf.eval.benches.bench_* and
lynx_hf.transfer.commands). Every numeric flag goes through a lynx_hf.flags validator."""
from __future__ import annotations

import argparse
import os
import sys

from lynx_hf.flags import (ANCHOR_BITS_HELP, DTYPE_HELP, DTYPES, JSON_HELP, MODEL_HELP, NIXL_EXTRA,  # noqa: F401
                           PORT_HELP, HelpFormatter, subcommand)  # (JSON_HELP ... subcommand: re-exported)


def _add_eval(sub) -> None:
    subcommand(sub, "eval", "lm-eval's CLI with the `lynx` model and this project's MMLU-Pro tasks "
                            "(lynx-hf eval --model lynx --model_args kv=lynx --tasks mmlu_pro_local ...; "
                            "`lynx-hf eval --help` for every flag)")  # main() hands `eval ...` to lm-eval unparsed


def _codec_quality(a):
    from lynx_hf.eval.lib import data

    data.require("codec-quality", a.text, needs_text=True, needs_mmlu=a.widths)
    from lynx_hf.eval.quality import anchor_widths, codec_quality
    from lynx_hf.eval.lib.harness import final_line, printer

    lines = []
    emit = printer(a.json)
    out = lambda s: (lines.append(s), emit(s))
    if a.widths:
        res = anchor_widths.run(tokens=a.contexts[0] if a.contexts else 1024, gen=a.gen or 48, prompts=a.prompts,
                                model_name=a.model, out=out)
    else:
        res = codec_quality.run(a.text or data.shakespeare(), contexts=tuple(a.contexts or (512, 1024, 2048, 4096)),
                                gen=a.gen or 32, ablation=not a.no_ablation, model_name=a.model, out=out)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    final_line(res)


def _add_codec_quality(sub) -> None:
    from lynx_hf.flags import count, tokens

    q = subcommand(sub, "codec-quality", "KV codec quality on real KV of the default model")
    q.add_argument("--text", help="text file for the contexts (default: shared tinyshakespeare)")
    q.add_argument("--contexts", type=tokens(), nargs="+", help="context lengths in tokens (default 512 1024 2048 "
                                                                "4096; --widths: one prompt length, default 1024)")
    q.add_argument("--gen", type=tokens(hi=4096), help="teacher-forced tokens (default 32; --widths: 48)")
    q.add_argument("--model", help=MODEL_HELP)
    q.add_argument("--no-ablation", action="store_true",
                   help="skip the codec ablation (γ, μ/σ, α-law one at a time)")
    q.add_argument("--widths", action="store_true",
                   help="instead: the Lynx anchor at 4, 3 and 2 bits against a plain code of each width on prose, "
                        "Python, JSON and many-shot QA (needs the shared MMLU-Pro questions)")
    q.add_argument("--prompts", type=count(4), default=3,
                   help="--widths: prompts per kind of text (default 3)")
    q.add_argument("--markdown", help="also write the tables to this file")
    q.add_argument("--json", action="store_true", help=JSON_HELP)
    q.set_defaults(fn=_codec_quality)


def _add_bench(sub) -> None:
    """`lynx-hf bench BENCHMARK`: each benchmark module registers its own subcommand and flags."""
    from lynx_hf.eval.benches import (bench_codec, bench_exact, bench_kernels, bench_server_memory, bench_session,
                                      bench_startup, bench_stream, bench_transfer)

    b = subcommand(sub, "bench", "benchmarks that print numbers and a final JSON line "
                                 "(`lynx-hf bench BENCHMARK --help`: what one measures, its options)")
    benches = b.add_subparsers(dest="what", required=True, metavar="BENCHMARK", help="what to measure")
    for m in (bench_codec, bench_exact, bench_kernels, bench_transfer, bench_session, bench_startup,
              bench_server_memory, bench_stream):
        m.register(benches)


def _demo(a):
    from lynx_hf.eval.benches import demo

    from lynx_hf.transfer.commands import plane_or_exit

    plane_or_exit(a)
    demo.run(a.prompt_file, a.tokens, a.bandwidth_mbps * 1e6, a.new_tokens, a.json, a.out, a.model, a.do_sample,
             data_plane=a.data_plane, port=a.port, dtype=a.dtype, anchor_bits=a.anchor_bits, repeat=a.repeat)


def _add_demo(sub) -> None:
    from lynx_hf.flags import anchor_width, count, mbps, tokens

    d = subcommand(sub, "demo", "prefill and decode processes over loopback TCP: BF16 / INT8 / INT4 / Lynx")
    d.add_argument("--prompt-file", help="any text file (default: Python standard-library source)")
    d.add_argument("--tokens", type=tokens(), default=1024, help="prompt length in tokens")
    d.add_argument("--bandwidth-mbps", type=mbps(), default=15.0, help="link emulator, Mbit/s")
    d.add_argument("--new-tokens", type=tokens(hi=4096), default=32, help="tokens to generate per method")
    d.add_argument("--out", default="runs", help="folder for demo.json and demo_timeline.png")
    d.add_argument("--model", help=MODEL_HELP)
    d.add_argument("--json", action="store_true", help=JSON_HELP)
    d.add_argument("--do-sample", action="store_true", help="sample (temperature 0.7, seeded) instead of greedy")
    d.add_argument("--data-plane", choices=["tcp", "nixl"], default="tcp",
                   help=f"the segments' bytes over the TCP channel or by NIXL ({NIXL_EXTRA}; pinned to loopback "
                        f"TCP unless $UCX_TLS / $UCX_NET_DEVICES are set)")
    d.add_argument("--port", type=count(65535), help=PORT_HELP)
    d.add_argument("--dtype", choices=DTYPES, default="float32", help=DTYPE_HELP)
    d.add_argument("--anchor-bits", type=anchor_width(), default=4, help=ANCHOR_BITS_HELP + " (the Lynx rows)")
    d.add_argument("--repeat", type=count(1000, lo=1), default=1,
                   help="rounds: every method once per round in a rotated order; medians [min, max], paired ratios")
    d.set_defaults(fn=_demo)


def _acceptance(a):
    from lynx_hf.eval.lib import data

    data.require("acceptance", needs_text=True, needs_mmlu=True, text_flag=None)
    from lynx_hf.eval.quality import acceptance

    acceptance.run(a.drafts, a.json, a.model)


def _add_acceptance(sub) -> None:
    from lynx_hf.flags import tokens

    c = subcommand(sub, "acceptance", "accepted anchor-tier drafts, chain versus tree (20 prompts)")
    c.add_argument("--drafts", type=tokens(0, 4096), default=31, help="draft steps before the residual lands")
    c.add_argument("--model", help=MODEL_HELP)
    c.add_argument("--json", action="store_true", help=JSON_HELP)
    c.set_defaults(fn=_acceptance)


def _results(a):
    from lynx_hf.eval.lib import data

    data.require("results", needs_mmlu=True)
    from lynx_hf.eval.quality import results

    results.run(a.questions, tuple(a.contexts), a.model, a.out, a.residual_after, lynx_config=a.lynx_config,
                as_json=a.json, ruler_samples=a.ruler_samples, demo=not a.no_demo, bandwidth_mbps=a.bandwidth_mbps,
                ruler_cells=[_cell(c) for c in a.ruler_cells] if a.ruler_cells else None)


def _cell(text: str) -> tuple[str, int]:
    task, _, length = text.partition("@")
    if not task or not length.isdigit():
        raise SystemExit(f"error: --ruler-cells takes TASK@LENGTH (e.g. niah_single_1@1024), got {text!r}")
    return task, int(length)


def _add_results(sub) -> None:
    from lynx_hf.flags import count, mbps, tokens

    r = subcommand(sub, "results", "the paper's table by KV mode: wire, TTFT/TT32T, RULER, MMLU-Pro (docs/results.md, "
                                   "docs/results.json); reads MMLU-Pro (docs/cli.md, Data)")
    r.add_argument("--questions", type=count(1 << 20), default=500, help="MMLU-Pro questions per context length")
    r.add_argument("--contexts", type=tokens(), nargs="+", default=[512, 1024], help="context lengths in tokens")
    r.add_argument("--model", help=MODEL_HELP)
    r.add_argument("--lynx-config", help="folder, file or Hub repo with a lynx_config.json")
    r.add_argument("--residual-after", type=tokens(0, 4096), default=2,
                   help="Lynx: residual lands after this many draft steps")
    r.add_argument("--ruler-samples", type=count(1 << 20, lo=0), default=50,
                   help="RULER samples per (task, length) cell (0: no RULER)")
    r.add_argument("--ruler-cells", nargs="+", metavar="TASK@LENGTH",
                   help="RULER cells (default: niah_single_1, niah_multikey_2, niah_multikey_3 at 1K and 2K, "
                        "niah_single_1 at 4K)")
    r.add_argument("--no-demo", action="store_true", help="skip the two-process demo (no MB/TTFT/TT32T columns)")
    r.add_argument("--bandwidth-mbps", type=mbps(), default=15.0, help="the demo's emulated link")
    r.add_argument("--out", default="docs/results.md", help="the Markdown table (the JSON beside it)")
    r.add_argument("--json", action="store_true", help=JSON_HELP)
    r.set_defaults(fn=_results)


def _calibrate(a):
    from lynx_hf.eval.lib import data

    data.require("calibrate", a.text, needs_text=True)
    from lynx_hf.eval.tools import calibrate

    calibrate.run(a.model, a.text, a.budget, a.out, tuple(a.contexts), a.gen, a.json)


def _add_calibrate(sub) -> None:
    from lynx_hf.flags import count, tokens

    k = subcommand(sub, "calibrate", "search the codec's settings for a model; writes lynx_config.json")
    k.add_argument("--model", help=MODEL_HELP)
    k.add_argument("--text", help="calibration text file (default: shared tinyshakespeare)")
    k.add_argument("--budget", type=count(10000), default=24, help="settings to score at most")
    k.add_argument("--contexts", type=tokens(), nargs="+", default=[512, 1024], help="calibration prompt lengths")
    k.add_argument("--gen", type=tokens(hi=4096), default=32, help="teacher-forced tokens per prompt")
    k.add_argument("--out", default="lynx_config", help="folder for lynx_config.json")
    k.add_argument("--json", action="store_true", help=JSON_HELP)
    k.set_defaults(fn=_calibrate)


def _card(a):
    from lynx_hf.eval.tools import card

    card.run(a.model, a.out, a.results or None, a.lynx_config, a.residual_after, a.push)


def _add_card(sub) -> None:
    from lynx_hf.flags import tokens

    h = subcommand(sub, "card", "a Hub-ready folder: model card, lynx_config.json, custom_generate/")
    h.add_argument("--model", help="base model's Hub id (default: the embedded SmolLM2-135M-Instruct's)")
    h.add_argument("--out", required=True, help="folder to write")
    h.add_argument("--results", default="docs/results.md", help="results of `lynx-hf results` ('' for none)")
    h.add_argument("--lynx-config", help="folder, file or Hub repo with a lynx_config.json (default: the defaults)")
    h.add_argument("--residual-after", type=tokens(0, 4096), default=8,
                   help="custom_generate's local residual schedule")
    h.add_argument("--push", metavar="REPO", help="upload the folder to this Hub repo")
    h.set_defaults(fn=_card)


def _simulate(a):
    from lynx_hf.eval.benches import simulate

    simulate.run(a.acceptance, a.json)


def _add_simulate(sub) -> None:
    from lynx_hf.flags import number

    s = subcommand(sub, "simulate", "analytic TTFT / TT32T model fitted to the paper, then extrapolated")
    s.add_argument("--acceptance", type=number(0, 1), default=24.3 / 31,
                   help="fraction of draft steps kept (default: the tree's, lynx-hf acceptance)")
    s.add_argument("--json", action="store_true", help=JSON_HELP)
    s.set_defaults(fn=_simulate)


DESCRIPTION = """Lynx: progressive speculative quantization of the KV cache a prefill node ships to a decode node,
for Hugging Face Transformers. The anchor (4-bit) goes first and the decode node drafts on it; the residual (4-bit)
follows and one verification pass makes the output exactly that of full-KV decoding."""
EPILOG = """first steps:
  lynx-hf demo                        two processes over loopback TCP: BF16 / INT8 / INT4 / Lynx (no data needed)
  lynx-hf SUBCOMMAND --help           what a subcommand does, its options and their defaults
  lynx-hf eval --help                 lm-eval with `--model lynx --model_args kv=MODE` and this project's tasks
data: some subcommands read the shared evaluation data (docs/cli.md, 'Data'); they say so at once when it is missing."""
COMMANDS = (_add_eval, _add_codec_quality, _add_bench, _add_acceptance, _add_demo, _add_results, _add_calibrate,
            _add_card, _add_simulate)  # in --help's order; serve-prefill and serve-decode come last


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand, its options and their help (every numeric option through lynx_hf.flags.number)."""
    from lynx_hf.transfer import commands  # serve-prefill, serve-decode

    p = argparse.ArgumentParser(prog="lynx-hf", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="on an error, show its traceback (also: LYNX_DEBUG=1)")
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in COMMANDS:
        add(sub)
    commands.register(sub)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["eval"]:  # every lm-eval flag passes through unchanged
        from lynx_hf.eval.lmeval import lm_eval_model

        return lm_eval_model.cli(argv[1:])
    p = build_parser()
    a = p.parse_args(argv)
    from lynx_hf.errors import LynxError

    try:
        return a.fn(a)
    except (LynxError, ConnectionError, TimeoutError, FileNotFoundError) as e:  # anything else is a bug: traceback
        if a.debug or os.environ.get("LYNX_DEBUG"):
            raise
        print(f"lynx-hf {a.cmd}: error: {e} (--debug shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
