"""The `lynx-hf` command: argument parsing only; each subcommand calls into lynx_hf or lynx_hf.eval (imported by the
subcommand that needs it, so `lynx-hf --help` starts without torch)."""
from __future__ import annotations

import argparse
import json
import os
import sys


def _codec_quality(a):
    from lynx_hf.eval import data

    data.require("codec-quality", a.text, needs_text=True)
    from lynx_hf.eval import codec_quality

    lines = []
    emit = (lambda s: None) if a.json else print
    res = codec_quality.run(a.text or data.shakespeare(), contexts=tuple(a.contexts), gen=a.gen,
                            ablation=not a.no_ablation, model_name=a.model, out=lambda s: (lines.append(s), emit(s)))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    print(json.dumps(res))


BENCH_OUT = "runs/bench_transfer"
NIXL_EXTRA = "pip install 'lynx-hf[nixl]'"


def _bench(a):
    if a.what == "transfer" and "shakespeare" in a.prompts:
        from lynx_hf.eval import data

        data.require("bench transfer --prompts shakespeare", needs_text=True,
                     text_flag="--prompts code (or a text file's path)")
    if a.what == "server-memory":
        from lynx_hf.eval import bench_server_memory

        bench_server_memory.run(model_name=a.model, as_json=a.json)
        return None
    if a.what == "startup":
        from lynx_hf.eval import bench_startup

        return bench_startup.run(a.json) and None
    if a.what == "kernels":
        if not a.gpu_compile:
            raise SystemExit("lynx-hf bench kernels: pass --gpu-compile (compile every Triton launch for sm_80 and "
                             "sm_90; the only kernel benchmark that runs without a GPU)")
        from lynx_hf.eval import bench_kernels

        try:
            bench_kernels.run(a.json)
        except RuntimeError as e:
            raise SystemExit(str(e))
        return None
    if a.what == "session":
        from lynx_hf.eval import bench_session

        out = "runs/bench_session" if a.out == BENCH_OUT else a.out
        bench_session.run(turns=a.turns, bandwidth_mbps=a.bandwidth_mbps, new_tokens=a.new_tokens,
                          prefix_cache=not a.no_prefix_cache, bf16_whole=a.bf16_whole, model_name=a.model,
                          out_dir=out, as_json=a.json, results=a.results)
        return None
    from lynx_hf.eval import bench_codec

    if a.what == "codec":
        bench_codec.run(tokens=a.tokens, as_json=a.json, device=a.device, max_mb=a.max_mb, reps=a.reps)
    else:
        from lynx_hf.eval import bench_transfer

        from lynx_hf.transfer.commands import plane_or_exit

        plane_or_exit(a)
        out = f"{BENCH_OUT}_nixl" if a.out == BENCH_OUT and a.data_plane == "nixl" else a.out
        bench_transfer.run(links_mbps=a.links, contexts=a.contexts, prompts=a.prompts, new_tokens=a.new_tokens,
                           out=out, as_json=a.json, model_name=a.model, data_plane=a.data_plane)


def _demo(a):
    from lynx_hf.eval import demo

    from lynx_hf.transfer.commands import plane_or_exit

    plane_or_exit(a)
    demo.run(a.prompt_file, a.tokens, a.bandwidth_mbps * 1e6, a.new_tokens, a.json, a.out, a.model, a.do_sample,
             data_plane=a.data_plane)


def _acceptance(a):
    from lynx_hf.eval import data

    data.require("acceptance", needs_text=True, needs_mmlu=True, text_flag=None)
    from lynx_hf.eval import acceptance

    acceptance.run(a.drafts, a.json, a.model)


def _results(a):
    from lynx_hf.eval import data

    data.require("results", needs_mmlu=True)
    from lynx_hf.eval import results

    results.run(a.questions, tuple(a.contexts), a.model, a.out, a.residual_after, lynx_config=a.lynx_config,
                as_json=a.json, ruler_samples=a.ruler_samples, demo=not a.no_demo, bandwidth_mbps=a.bandwidth_mbps,
                ruler_cells=[_cell(c) for c in a.ruler_cells] if a.ruler_cells else None)


def _cell(text: str) -> tuple[str, int]:
    task, _, length = text.partition("@")
    if not task or not length.isdigit():
        raise SystemExit(f"error: --ruler-cells takes TASK@LENGTH (e.g. niah_single_1@1024), got {text!r}")
    return task, int(length)


def _calibrate(a):
    from lynx_hf.eval import data

    data.require("calibrate", a.text, needs_text=True)
    from lynx_hf.eval import calibrate

    calibrate.run(a.model, a.text, a.budget, a.out, tuple(a.contexts), a.gen, a.json)


def _card(a):
    from lynx_hf.eval import card

    card.run(a.model, a.out, a.results or None, a.lynx_config, a.residual_after, a.push)


def _simulate(a):
    from lynx_hf.eval import simulate

    simulate.run(a.acceptance, a.json)


DESCRIPTION = """Lynx: progressive speculative quantization of the KV cache a prefill node ships to a decode node,
for Hugging Face Transformers. The anchor (4-bit) goes first and the decode node drafts on it; the residual (4-bit)
follows and one verification pass makes the output exactly that of full-KV decoding."""
EPILOG = """first steps:
  lynx-hf demo                        two processes over loopback TCP: BF16 / INT8 / INT4 / Lynx (no data needed)
  lynx-hf SUBCOMMAND --help           what a subcommand does, its options and their defaults
  lynx-hf eval --help                 lm-eval with `--model lynx --model_args kv=MODE` and this project's tasks
data: some subcommands read the shared evaluation data (README, 'Data'); they say so at once when it is missing."""


def _sub(sub, name: str, text: str):
    """A subcommand whose --help shows `text` and every option's default."""
    from lynx_hf.transfer.commands import HelpFormatter

    return sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                          formatter_class=HelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand, its options and their help (every numeric option through lynx_hf.flags.number)."""
    from lynx_hf.flags import count, mbps, megabytes, number, tokens

    p = argparse.ArgumentParser(prog="lynx-hf", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="on an error, show its traceback (also: LYNX_DEBUG=1)")
    sub = p.add_subparsers(dest="cmd", required=True)
    _sub(sub, "eval", "lm-eval's CLI with the `lynx` model and this project's MMLU-Pro tasks "
                      "(lynx-hf eval --model lynx --model_args kv=lynx --tasks mmlu_pro_local ...; "
                      "`lynx-hf eval --help` for every flag)")

    q = _sub(sub, "codec-quality", "KV codec quality on real KV of the default model")
    q.add_argument("--text", help="text file for the contexts (default: shared tinyshakespeare)")
    q.add_argument("--contexts", type=tokens(), nargs="+", default=[512, 1024, 2048, 4096], help="context lengths in tokens")
    q.add_argument("--gen", type=tokens(hi=4096), default=32, help="teacher-forced tokens")
    q.add_argument("--model", help="Hub id or local path (default: embedded SmolLM2-135M-Instruct)")
    q.add_argument("--no-ablation", action="store_true", help="skip the codec ablation (γ, μ/σ, α-law one at a time)")
    q.add_argument("--markdown", help="also write the tables to this file")
    q.add_argument("--json", action="store_true", help="print only the final JSON line")
    q.set_defaults(fn=_codec_quality)

    b = _sub(sub, "bench", "benchmarks that print numbers and a final JSON line")
    b.add_argument("what", choices=["codec", "kernels", "transfer", "session", "startup", "server-memory"],
                   help="codec: encode/decode throughput; kernels --gpu-compile: every Triton launch compiled for "
                        "sm_80 and sm_90 here (registers, spills, bytes moved); transfer: TTFT/TT32T over the "
                        "two-process path per link "
                        "speed; session: an agent conversation over the two-process path, each turn's new KV "
                        "(delta) versus the whole history re-shipped; startup: `lynx-hf --help` and the default "
                        "model's load, each in a fresh process; server-memory: a serve-prefill's VmRSS after a 6K-"
                        "token miss, with 4 clients that never read, and idle, against the bounds it declares")
    b.add_argument("--gpu-compile", action="store_true",
                   help="kernels: compile ahead of time for NVIDIA sm_80 / sm_90 (no GPU needed)")
    b.add_argument("--tokens", type=tokens(), default=4096, help="codec: headline size, the KV of this many tokens")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="codec")
    b.add_argument("--max-mb", type=megabytes(), default=1200, help="codec: largest tensor of the size sweep")
    b.add_argument("--reps", type=count(1000), default=5, help="codec: timed repetitions per size (the median is reported)")
    b.add_argument("--links", type=mbps("no emulation"), nargs="+", default=[50, 200, 1000, 10000],
                   help="transfer: Mbit/s (0: no emulation, loopback as it is)")
    b.add_argument("--data-plane", choices=["tcp", "nixl"], default="tcp",
                   help=f"transfer: the segments' bytes over the channel or by NIXL ({NIXL_EXTRA}; results in "
                        f"runs/bench_transfer_nixl)")
    b.add_argument("--contexts", type=tokens(), nargs="+", default=[512, 2048, 8192], help="transfer: prompt tokens")
    b.add_argument("--prompts", nargs="+", default=["code", "shakespeare"],
                   help="transfer: 'code' (stdlib source), 'shakespeare' (shared data) or text files")
    b.add_argument("--new-tokens", type=tokens(hi=4096), default=32, help="transfer, session: tokens generated per request/turn")
    b.add_argument("--turns", type=count(1000), default=4, help="session: turns of the conversation (8 reach ~6K tokens)")
    b.add_argument("--bandwidth-mbps", type=mbps(), default=15.0, help="session: the emulated link")
    b.add_argument("--no-prefix-cache", action="store_true", help="session: the prefill server keeps no prefix cache")
    b.add_argument("--bf16-whole", action="store_true", help="session: also re-ship the whole history in BF16")
    b.add_argument("--results", metavar="FILE",
                   help="session: also write its section of this results file (e.g. docs/results.md)")
    b.add_argument("--out", default=BENCH_OUT,
                   help="transfer: results folder (resumable JSONL); session: folder for its JSON and PNG "
                        "(default runs/bench_session)")
    b.add_argument("--model", help="transfer, session: Hub id or local path (default: embedded SmolLM2-135M-Instruct)")
    b.add_argument("--json", action="store_true", help="print only the final JSON line")
    b.set_defaults(fn=_bench)

    c = _sub(sub, "acceptance", "accepted anchor-tier drafts, chain versus tree (20 prompts)")
    c.add_argument("--drafts", type=tokens(0, 4096), default=31, help="draft steps before the residual lands")
    c.add_argument("--model", help="Hub id or local path (default: embedded SmolLM2-135M-Instruct)")
    c.add_argument("--json", action="store_true", help="print only the final JSON line")
    c.set_defaults(fn=_acceptance)

    d = _sub(sub, "demo", "prefill and decode processes over loopback TCP: BF16 / INT8 / INT4 / Lynx")
    d.add_argument("--prompt-file", help="any text file (default: Python standard-library source)")
    d.add_argument("--tokens", type=tokens(), default=1024, help="prompt length in tokens")
    d.add_argument("--bandwidth-mbps", type=mbps(), default=15.0, help="link emulator, Mbit/s")
    d.add_argument("--new-tokens", type=tokens(hi=4096), default=32, help="tokens to generate per method")
    d.add_argument("--out", default="runs", help="folder for demo.json and demo_timeline.png")
    d.add_argument("--model", help="Hub id or local path (default: embedded SmolLM2-135M-Instruct)")
    d.add_argument("--json", action="store_true", help="print only the final JSON line")
    d.add_argument("--do-sample", action="store_true", help="sample (temperature 0.7, seeded) instead of greedy")
    d.add_argument("--data-plane", choices=["tcp", "nixl"], default="tcp",
                   help=f"the segments' bytes over the TCP channel or by NIXL ({NIXL_EXTRA}; pinned to loopback "
                        f"TCP unless $UCX_TLS / $UCX_NET_DEVICES are set)")
    d.set_defaults(fn=_demo)

    r = _sub(sub, "results", "the paper's table by KV mode: wire, TTFT/TT32T, RULER, MMLU-Pro (docs/results.md, "
                             "docs/results.json); reads MMLU-Pro (README, Data)")
    r.add_argument("--questions", type=count(1 << 20), default=500, help="MMLU-Pro questions per context length")
    r.add_argument("--contexts", type=tokens(), nargs="+", default=[512, 1024], help="context lengths in tokens")
    r.add_argument("--model", help="Hub id or local path (default: embedded SmolLM2-135M-Instruct)")
    r.add_argument("--lynx-config", help="folder, file or Hub repo with a lynx_config.json")
    r.add_argument("--residual-after", type=tokens(0, 4096), default=2, help="Lynx: residual lands after this many draft steps")
    r.add_argument("--ruler-samples", type=count(1 << 20, lo=0), default=50, help="RULER samples per (task, length) cell (0: no RULER)")
    r.add_argument("--ruler-cells", nargs="+", metavar="TASK@LENGTH",
                   help="RULER cells (default: niah_single_1, niah_multikey_2, niah_multikey_3 at 1K and 2K, "
                        "niah_single_1 at 4K)")
    r.add_argument("--no-demo", action="store_true", help="skip the two-process demo (no MB/TTFT/TT32T columns)")
    r.add_argument("--bandwidth-mbps", type=mbps(), default=15.0, help="the demo's emulated link")
    r.add_argument("--out", default="docs/results.md", help="the Markdown table (the JSON beside it)")
    r.add_argument("--json", action="store_true", help="print only the final JSON line")
    r.set_defaults(fn=_results)

    k = _sub(sub, "calibrate", "search the codec's settings for a model; writes lynx_config.json")
    k.add_argument("--model", help="Hub id or local path (default: embedded SmolLM2-135M-Instruct)")
    k.add_argument("--text", help="calibration text file (default: shared tinyshakespeare)")
    k.add_argument("--budget", type=count(10000), default=24, help="settings to score at most")
    k.add_argument("--contexts", type=tokens(), nargs="+", default=[512, 1024], help="calibration prompt lengths")
    k.add_argument("--gen", type=tokens(hi=4096), default=32, help="teacher-forced tokens per prompt")
    k.add_argument("--out", default="lynx_config", help="folder for lynx_config.json")
    k.add_argument("--json", action="store_true", help="print only the final JSON line")
    k.set_defaults(fn=_calibrate)

    h = _sub(sub, "card", "a Hub-ready folder: model card, lynx_config.json, custom_generate/")
    h.add_argument("--model", help="base model's Hub id (default: the embedded SmolLM2-135M-Instruct's)")
    h.add_argument("--out", required=True, help="folder to write")
    h.add_argument("--results", default="docs/results.md", help="results of `lynx-hf results` ('' for none)")
    h.add_argument("--lynx-config", help="folder, file or Hub repo with a lynx_config.json (default: the defaults)")
    h.add_argument("--residual-after", type=tokens(0, 4096), default=8, help="custom_generate's local residual schedule")
    h.add_argument("--push", metavar="REPO", help="upload the folder to this Hub repo")
    h.set_defaults(fn=_card)

    s = _sub(sub, "simulate", "analytic TTFT / TT32T model fitted to the paper, then extrapolated")
    s.add_argument("--acceptance", type=number(0, 1), default=24.3 / 31,
                   help="fraction of draft steps kept (default: the tree's, lynx-hf acceptance)")
    s.add_argument("--json", action="store_true", help="print only the final JSON line")
    s.set_defaults(fn=_simulate)

    from lynx_hf.transfer import commands  # serve-prefill, serve-decode

    commands.register(sub)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["eval"]:  # every lm-eval flag passes through unchanged
        from lynx_hf.eval import lm_eval_model

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
