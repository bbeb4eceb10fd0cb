"""`lynx-hf bench session`: an agent's conversation between two processes over an emulated link — each turn a real
tool output (Python standard-library source, 500–800 tokens) and the assistant's generated reply — with the whole
history re-shipped every turn ("whole"), only the turn's new positions ("delta": the decode side keeps the
conversation's LynxCache and the prefill side its prefix cache), or ("lynx/auto") each turn's new positions
computed where `session.Placement` expects the first token sooner, the prefill node or this one (conditional
disaggregation; the row's `prefilled_on` says where), or ("lynx-exact/delta") in exact mode: the first turn's KV
bit for bit (its correction stream behind the residual), later turns' new positions computed here over the held KV,
as exact mode does. The server runs with --prefill-step 4096, so that exact mode's first turn (one forward pass over
the prompt) is served.

The conversation: a system prompt of ~1K tokens describing tools (their standard-library docstrings), then per turn a
tool message and the assistant's reply of `--new-tokens` tokens (at least 32: TT32T). Every arm runs its own copy of
the conversation (replies are the arm's own, all of one length; its system prompt opens with the arm's name, so the
prefill server's prefix cache serves each arm its own earlier turns and never another arm's, as a real conversation
is served); the arms take their turns interleaved, so a busy moment of the machine falls on all of them. Per turn
and arm: TTFT (first token), first verified token, TT32T, bytes on the wire (anchor / residual), the positions
shipped and those the prefill side computed (past its prefix hit), and for Lynx `identical`: the turn's tokens equal
the same KV decoded without drafts (a plain generate on the turn's cache from its first token: one-token steps on
the full tier), and `prefill_bound`: the prefill node's compute outlasted the anchor's transfer. Progress bar; a
PNG of TTFT per turn by arm; one JSON line at the end,
{"arms": {"lynx/delta": [per turn], "lynx/whole": [...], ...}, ...}."""
from __future__ import annotations

import inspect
import json
import random
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

import lynx_hf
from lynx_hf import LynxQuantConfig, SpecConfig

from lynx_hf.floors import paired, rotated, second_token_data, spread, step_s
from lynx_hf.eval.lib.harness import final_line, prefill_child, printer, pyplot, save_figure, save_plot

OUT = "runs/bench_session"

CODECS = {"bf16": LynxQuantConfig(method="bf16"), "int8": LynxQuantConfig(method="int8"),
          "int4": LynxQuantConfig(method="kivi4"), "cachegen": LynxQuantConfig(method="cachegen"),
          "lynx": LynxQuantConfig(), "lynx-exact": LynxQuantConfig(exact=True)}
WHOLE = ("int8", "int4", "lynx")                        # whole history re-shipped every turn (+ bf16 with --bf16-whole)
DELTA = ("bf16", "int8", "int4", "cachegen", "lynx", "lynx-exact")  # only the new positions (exact: turns 2+ here)
TOOLS = ("shutil.copytree", "shutil.rmtree", "shutil.which", "subprocess.run", "os.walk", "os.makedirs",
         "glob.glob", "fnmatch.fnmatch", "json.loads", "re.sub", "difflib.unified_diff", "tempfile.mkstemp")
SOURCES = ("textwrap", "json.decoder", "argparse", "tokenize", "pathlib", "difflib", "configparser", "csv",
           "ftplib", "calendar", "gettext", "shlex")


def _obj(path: str):
    """A module ("json.decoder") or a module's attribute ("shutil.which")."""
    import importlib

    try:
        return importlib.import_module(path)
    except ImportError:
        mod, _, name = path.rpartition(".")
        return getattr(importlib.import_module(mod), name)


class Chat:
    """Token-level ChatML fragments (the embedded model's format; other tokenizers get plain role lines)."""

    def __init__(self, tok):
        self.tok = tok
        self.chatml = "<|im_start|>" in tok.get_vocab()

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def message(self, role: str, text: str) -> list[int]:
        return self.ids(f"<|im_start|>{role}\n{text}<|im_end|>\n" if self.chatml else f"{role}: {text}\n\n")

    def reply_start(self) -> list[int]:
        return self.ids("<|im_start|>assistant\n" if self.chatml else "assistant: ")

    def reply_end(self) -> list[int]:
        return self.ids("<|im_end|>\n" if self.chatml else "\n\n")


def conversation(tok, turns: int, seed: int = 0, system_tokens: int = 1024,
                 tag: str = "") -> tuple[list[int], list[list[int]]]:
    """(system prompt ids, the tool messages' ids per turn, reply prompt included), from standard-library text.
    `tag` opens the system prompt (an arm's own: no two arms share a prefix-cache block)."""
    chat, rng = Chat(tok), random.Random(seed)
    desc = "".join(f"- {p}{inspect.signature(_obj(p))}: {inspect.getdoc(_obj(p))}\n" for p in TOOLS)
    head = (f"{tag}You are a coding agent working in a Python repository. Call a tool by writing its name and "
            "arguments; each tool's output comes back in a message from the tool. Tools:\n")
    system = chat.ids(head + desc)[:system_tokens - 16]
    system = chat.message("system", tok.decode(system))
    first_user = chat.message("user", "Read the modules the tools show you and summarise what each one does.")
    msgs = []
    for t in range(turns):
        src = chat.ids(inspect.getsource(_obj(SOURCES[t % len(SOURCES)])))
        n = rng.randint(500, 800)
        a = rng.randint(0, max(0, len(src) - n))
        msgs.append(chat.message("tool", tok.decode(src[a:a + n])) + chat.reply_start())
    return system + first_user, msgs


def _turn_row(r: dict, turn: int, ids: list[int], identical, bandwidth_bps: float) -> dict:
    """One turn of one arm. prefill_bound: the prefill node's compute took longer than the anchor's time on the link
    (what set the turn's TTFT was the server, not the transfer)."""
    link_s = r["anchor_bytes"] * 8 / bandwidth_bps
    return {"turn": turn, "new_tokens": len(ids) - r["held_tokens"], "total_tokens": len(ids),
            "prefill_bound": r["prefill_s"] is not None and r["prefill_s"] > link_s,
            "held_tokens": r["held_tokens"], "ttft_s": r["ttft_s"], "ttft_verified_s": r["ttft_verified_s"],
            "tt32t_s": r["tt32t_s"], "wire_bytes": r["bytes"], "anchor_bytes": r["anchor_bytes"],
            "residual_bytes": r["bytes"] - r["anchor_bytes"],
            "prefill_tokens": len(ids) - r["held_tokens"] if r.get("prefilled_on") == "decode" else
            len(ids) - (r.get("prefix_hit") or 0), "prefill_s": r["prefill_s"],  # (computed where it was placed)
            "drafted": r["stats"]["drafted"], "accepted": r["stats"]["accepted"], "identical": identical,
            "prefilled_on": r.get("prefilled_on", "prefill"),
            "ttft_floor_s": r.get("logits_s"), "link_s": r["bytes"] * 8 / bandwidth_bps,
            "decode_start_s": r["decode_start_s"], "decode_start_data_s": second_token_data(r),
            "verified_2_s": r["verified_2_s"],
            "step_s": step_s(r["timeline"], r["t0"])}


def no_draft_reference(model, cache, ids: list[int], tokens: list[int]) -> list[int]:
    """The turn's tokens decoded again from the same KV without drafts: the cache goes back to the turn's prompt and
    first token (which came from the prefill's logits) and plain generate takes one-token steps on the full tier."""
    import torch

    start = torch.tensor([ids + tokens[:1]])
    out = model.generate(start, cache=cache, max_new_tokens=len(tokens) - 1, min_new_tokens=len(tokens) - 1,
                         do_sample=False)
    return tokens[:1] + out[0, start.shape[1]:].tolist()


def run(turns: int = 4, bandwidth_mbps: float = 15.0, new_tokens: int = 32, prefix_cache: bool = True,
        bf16_whole: bool = False, model_name: str | None = None, out_dir: str = OUT,
        as_json: bool = False, seed: int = 0, results: str | None = None, port: int | None = None,
        repeat: int = 1) -> dict:
    """repeat: rounds, each the whole conversation in every arm (a round's own conversations: no prefix hit across
    rounds), the arms' order rotated per round; the ratios at the last turn are medians of per-round paired ratios,
    beside their floors (lynx_hf/floors.py: a turn's TTFT floor is its logits' arrival)."""
    say = printer(as_json, stderr=True)
    if new_tokens < 32:
        raise ValueError("--new-tokens must be at least 32 (TT32T)")
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an int >= 1, got {repeat!r}")
    model, tok = lynx_hf.load_default_model(model_name)
    plan = [(f"{c}/whole", c, False) for c in (("bf16",) if bf16_whole else ()) + WHOLE] + \
           [(f"{c}/delta", c, True) for c in DELTA] + [("lynx/auto", "lynx", True)]
    server_args = ("--prefix-cache-mb", "4096" if prefix_cache else "0", "--prefill-step", "4096")
    say(f"starting the prefill process (link emulator {bandwidth_mbps:g} Mbit/s, prefix cache "
        f"{'on' if prefix_cache else 'off'}) ...")
    t_start = time.perf_counter()
    system = conversation(tok, turns, seed)[0]
    with prefill_child(model, bandwidth_mbps * 1e6, system[:64], model_name, timeout_s=300,
                       server_args=server_args, port=port) as cli:
        bar = tqdm(total=repeat * turns * len(plan), desc="rounds x turns x arms", file=sys.stderr)
        rounds = [_round(cli, model, tok, rotated(plan, r), turns, seed, new_tokens, bandwidth_mbps, r, bar)
                  for r in range(repeat)]
        bar.close()
    wall = time.perf_counter() - t_start
    arms = {name: rounds[-1][name] for name, _, _ in plan}
    _table(arms, say)
    res = {"arms": arms, "turns": turns, "bandwidth_mbps": bandwidth_mbps, "new_tokens": new_tokens,
           "prefix_cache": prefix_cache, "wall_s": round(wall, 1), "ratios": _ratios(arms), **_rounds(rounds)}
    if repeat > 1:
        say(f"{repeat} rounds, at the last turn: " + ", ".join(
            f"{k} {v['median']:.2f} [{v['min']:.2f}, {v['max']:.2f}]" for k, v in res["ratios"].items()
            if isinstance(v, dict)) + f"; Lynx delta at its floor: TTFT {res['at_floor']['lynx_delta_ttft']}, "
            f"decode start {res['at_floor']['lynx_delta_decode_start']}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_session.json").write_text(json.dumps({**res, "per_round": rounds}, indent=2))
    save_plot(lambda path: plot(arms, path, bandwidth_mbps), out / "bench_session.png", say,
              beside=out / "bench_session.json")
    if results:
        cmd = (f"lynx-hf bench session --turns {turns} --bandwidth-mbps {bandwidth_mbps:g} --new-tokens {new_tokens}"
               + ("" if prefix_cache else " --no-prefix-cache") + (" --bf16-whole" if bf16_whole else "")
               + (f" --repeat {repeat}" if repeat > 1 else "")
               + (f" --model {model_name}" if model_name else "") + f" --results {results}")
        write_section(Path(results), markdown(res, cmd))
        say(f"wrote the agent-sessions section of {results}")
    return final_line(res)


def _round(cli, model, tok, plan, turns, seed, new_tokens, bandwidth_mbps, r, bar) -> dict:
    """One round: each arm its own conversation, told apart from its first token (the prefill server's prefix cache
    serves an arm its own earlier turns, never another arm's or another round's); the arms take turns in `plan`'s
    order. → {arm: [per turn]}."""
    chat = Chat(tok)
    convs = {name: conversation(tok, turns, seed, tag=f"Session {name}{f' #{r}' if r else ''}. ")
             for name, _, _ in plan}
    conv = {name: list(convs[name][0]) for name in convs}
    msgs = convs[plan[0][0]][1]  # the tool outputs: the same in every arm
    sessions = {name: cli.session(quant_config=CODECS[c], spec_config=SpecConfig(max_draft_steps=64))
                for name, c, delta in plan if delta}
    arms = {name: [] for name, _, _ in plan}
    for t in range(turns):
        for name, c, delta in plan:
            ids = conv[name] + msgs[t]
            gen = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
            if delta:  # lynx/auto: each turn's new positions where session.Placement expects them sooner
                r_ = sessions[name].generate(ids, prefill_on="auto" if name.endswith("/auto") else "prefill", **gen)
            else:
                r_ = cli.generate(ids, CODECS[c], keep_cache=True, spec_config=SpecConfig(max_draft_steps=64), **gen)
            identical = None
            if c.startswith("lynx"):  # every Lynx turn, wherever its new positions were computed
                ref = no_draft_reference(model, r_["cache"], ids, r_["tokens"])
                identical = ref == r_["tokens"]
                r_["tokens"] = ref  # the conversation goes on with what the cache now holds
            arms[name].append(_turn_row(r_, t + 1, ids, identical, bandwidth_mbps * 1e6))
            conv[name] = ids + r_["tokens"] + chat.reply_end()
            bar.update(1)
    return arms


RATIOS = {"delta_whole_ttft": ("lynx/delta", "lynx/whole", "ttft_s"),
          "lynx_int4_delta_ttft": ("lynx/delta", "int4/delta", "ttft_s"),
          "lynx_int8_delta_tt32t": ("lynx/delta", "int8/delta", "tt32t_s"),
          "delta_whole_decode_start": ("lynx/delta", "lynx/whole", "decode_start_s"),
          "lynx_int4_delta_decode_start": ("lynx/delta", "int4/delta", "decode_start_s"),
          "lynx_int8_delta_decode_start": ("lynx/delta", "int8/delta", "decode_start_s")}
FLOORED = ("ttft_s", "decode_start_s")  # the figures with a floor here (lynx_hf/floors.py)


def _floors(row: dict) -> dict:
    """The last turn's floors by arm: TTFT = the logits' arrival; decode start = the second token's data + the
    turn's step (the median over the one-stream arms' one-token steps: Lynx's drafts leave few of their own)."""
    steps = [t["step_s"] for k, t in row.items() if not k.startswith("lynx/") and t.get("step_s") is not None]
    step = statistics.median(steps) if steps else None
    return {k: {"ttft_s": t["ttft_floor_s"],
                "decode_start_s": None if step is None or t.get("decode_start_data_s") is None
                else t["decode_start_data_s"] + step} for k, t in row.items()}


def _rounds(rounds: list[dict]) -> dict:
    """At the last turn: `ratios` (medians of per-round paired ratios, [min, max]), `floor` (the TTFT and decode
    start ratios' floors), `at_floor` (Lynx delta TTFT and decode start ÷ their floors, medians); `rounds`; every
    round's identical flag."""
    last = [{k: v[-1] for k, v in arms.items()} for arms in rounds]
    floors_ = [_floors(row) for row in last]
    ratios = {k: paired(last, a, b, f) for k, (a, b, f) in RATIOS.items()}
    fl = {k: paired(floors_, a, b, f) for k, (a, b, f) in RATIOS.items() if f in FLOORED}
    at = {f"lynx_delta_{f[:-2]}": spread([row["lynx/delta"][f] / fl_["lynx/delta"][f] for row, fl_ in zip(last, floors_)
                                          if row["lynx/delta"].get(f) is not None and fl_["lynx/delta"][f]])
          for f in FLOORED}
    return {"rounds": len(rounds), "ratios": {**_ratios(rounds[-1]), **ratios},
            "floor": {k: v and v["median"] for k, v in fl.items()},
            "at_floor": {k: v and v["median"] for k, v in at.items()},
            "identical": [all(t["identical"] is True for k, v in arms.items() if k.startswith("lynx/") for t in v)
                          for arms in rounds]}


SECTION = "# Agent sessions: each turn's new KV versus the whole history"


def markdown(res: dict, cmd: str) -> list[str]:
    """The results section: the last turn by arm, the ratios, every Lynx turn's identity."""
    arms, rat = res["arms"], res["ratios"]
    lines = [SECTION, "", f"Generated by `{cmd}` ({res['wall_s']:.0f} s on this machine); the numbers are also in "
             "`bench_session.json` in its `--out` folder, beside a PNG of decode start per turn (this run's: "
             "[bench_session.png](bench_session.png)). A conversation on the embedded model between two processes "
             f"over a {res['bandwidth_mbps']:g} Mbit/s emulated link: a ~1K-token system prompt (tool descriptions), "
             "then per turn a tool output of 500–800 tokens of Python standard-library source and a "
             f"{res['new_tokens']}-token reply. *whole*: the whole history shipped every turn; *delta*: the decode "
             f"side keeps the conversation's LynxCache and only the new positions cross the link (prefix cache "
             f"{'on' if res['prefix_cache'] else 'off'}; each arm its own conversation, so the prefill server's "
             "prefix cache serves an arm only its own earlier turns, as one real conversation is served: *computed* is "
             "what the prefill node recomputed, the assistant's replies included); *auto*: Lynx delta with each "
             "continued turn's new positions computed where `session.Placement` expects the first token sooner "
             f"(turns on the decode node here: {_placed(res['arms'])}); *lynx-exact*: exact mode, equal to plain "
             "`generate` (the first turn's KV bit for bit with its correction stream — the embedded model runs in "
             "fp32 here, whose correction takes ~20 bits a value: docs/codec.md —, later turns computed on the "
             f"decode node over the held KV, as exact mode does). Last turn ({res['turns']})"
             + (" of the last round (the medians over the rounds follow the tables)" if res.get("rounds", 1) > 1
                else "") + ":", "",
             "| arm | tokens | shipped | computed | TTFT s | decode start s | TT32T s | MB (anchor + residual) "
             "| drafts kept |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rows in arms.items():
        r = rows[-1]
        mb = (f"{r['anchor_bytes'] / 1e6:.2f} + {r['residual_bytes'] / 1e6:.2f}" if r["residual_bytes"]
              else f"{r['wire_bytes'] / 1e6:.2f}")
        lines.append(f"| {name} | {r['total_tokens']} | {r['new_tokens']} | {r['prefill_tokens']} | "
                     f"{r['ttft_s']:.2f} | {_num(r['decode_start_s'])} | {r['tt32t_s']:.2f} | {mb} | "
                     f"{r['accepted'] if r['drafted'] else '–'} |")
    if rat:
        lines += ["", f"Lynx delta TTFT {rat['lynx_delta_vs_whole_ttft']:.2f}× its whole-history TTFT and "
                  f"{rat['lynx_vs_int4_delta_ttft']:.2f}× INT4 delta's; TT32T {rat['lynx_vs_int8_delta_tt32t']:.2f}× "
                  f"INT8 delta's; bytes per shipped token {rat['bytes_per_token_delta_vs_whole']:.2f}× the whole "
                  f"history's. Every Lynx turn equal to the same KV decoded without drafts: "
                  f"**{rat['lynx_identical']}**."]
    spread = [r["prefill_s"] for rows in arms.values() for r in rows[-1:]
              if r.get("prefilled_on") == "prefill" and r["prefill_s"] and r["new_tokens"] < r["total_tokens"]]
    if len(spread) > 1:
        lines += ["", f"The prefill server's compute for the last turn (the same positions in every arm that placed it "
                  f"there) took {min(spread):.2f}–{max(spread):.2f} s across arms: where two arms' TTFTs differ by "
                  "less than that spread, this machine's load, not the codec, decided (each turn is prefill-bound)."]
    lines += _per_turn(arms, "ttft_s", "TTFT")
    lines += _per_turn(arms, "decode_start_s", "Decode start (the second token, the first that needs the turn's KV)")
    return lines + _rounds_lines(res) + [""]


def _per_turn(arms: dict, figure: str, title: str) -> list[str]:
    """A table of one figure: a row per arm, a column per turn."""
    turns = [r["turn"] for r in next(iter(arms.values()))]
    return (["", f"{title} per turn and arm:", "", "| arm | " + " | ".join(f"turn {t}" for t in turns) + " |",
             "|---|" + "---:|" * len(turns)]
            + [f"| {name} | " + " | ".join(_num(r[figure]) for r in rows) + " |" for name, rows in arms.items()])


def _num(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def _rounds_lines(res: dict) -> list[str]:
    """With --repeat: the medians of the last turn's paired ratios, [min, max], beside their floors."""
    if res.get("rounds", 1) < 2:
        return []
    fl, at = res["floor"], res["at_floor"]
    out = ["", f"Over {res['rounds']} rounds (the arms' order rotated per round), the last turn's paired ratios, "
               "medians [min, max] (floor: the same ratio of the arms' floors, lynx_hf/floors.py):", ""]
    for k in RATIOS:
        v = res["ratios"].get(k)
        if v:
            f = fl.get(k)
            out.append(f"- {k}: {v['median']:.2f} [{v['min']:.2f}, {v['max']:.2f}]"
                       + ("" if f is None else f" (floor {f:.2f})"))
    return out + [f"- Lynx delta at its floor: TTFT {_num(at.get('lynx_delta_ttft'))}, decode start "
                  f"{_num(at.get('lynx_delta_decode_start'))}"]


def _placed(arms: dict) -> str:
    rows = arms.get("lynx/auto", [])
    return ", ".join(str(r["turn"]) for r in rows if r.get("prefilled_on") == "decode") or "none"


def write_section(path: Path, lines: list[str]) -> None:
    """Replace (or append) the agent-sessions section of a results file; the rest stays."""
    text = path.read_text() if path.exists() else ""
    i = text.find(SECTION)
    head = text if i < 0 else text[:i]
    j = -1 if i < 0 else text.find("\n# ", i + len(SECTION))
    tail = "" if j < 0 else text[j + 1:]
    path.write_text(head.rstrip("\n") + ("\n\n" if head.strip() else "") + "\n".join(lines)
                    + ("\n" + tail if tail else ""))


def _ratios(arms: dict) -> dict:
    """The last turn's headline ratios (what docs/results.md and the acceptance check read)."""
    last = {k: v[-1] for k, v in arms.items()}
    ld, lw, i4, i8 = (last.get(k) for k in ("lynx/delta", "lynx/whole", "int4/delta", "int8/delta"))
    if not all((ld, lw, i4, i8)):
        return {}
    return {"lynx_delta_vs_whole_ttft": ld["ttft_s"] / lw["ttft_s"],
            "lynx_vs_int4_delta_ttft": ld["ttft_s"] / i4["ttft_s"],
            "lynx_vs_int8_delta_tt32t": ld["tt32t_s"] / i8["tt32t_s"],
            "bytes_per_token_delta_vs_whole": (ld["wire_bytes"] / ld["new_tokens"]) /
                                              (lw["wire_bytes"] / lw["total_tokens"]),
            "lynx_identical": all(t["identical"] is True for k, v in arms.items() if k.startswith("lynx/") for t in v)}


def _table(arms: dict, say) -> None:
    say(f"\n{'arm':15s} {'turn':>4s} {'tokens':>7s} {'shipped':>7s} {'computed':>8s} {'TTFT s':>7s} {'verified':>8s} "
        f"{'TT32T s':>8s} {'MB':>6s} {'drafted/acc':>11s} {'on':>7s} identical")
    for name, rows in arms.items():
        for r in rows:
            say(f"{name:15s} {r['turn']:4d} {r['total_tokens']:7d} {r['new_tokens']:7d} {r['prefill_tokens']:8d} "
                f"{r['ttft_s']:7.2f} {r['ttft_verified_s']:8.2f} {r['tt32t_s']:8.2f} {r['wire_bytes'] / 1e6:6.2f} "
                f"{r['drafted']:5d}/{r['accepted']:<5g} {r['prefilled_on']:>7s} "
                f"{'' if r['identical'] is None else r['identical']}")
    rat = _ratios(arms)
    if rat:
        say(f"last turn: Lynx delta TTFT {rat['lynx_delta_vs_whole_ttft']:.2f}x whole-history, "
            f"{rat['lynx_vs_int4_delta_ttft']:.2f}x INT4 delta; TT32T {rat['lynx_vs_int8_delta_tt32t']:.2f}x "
            f"INT8 delta; bytes/token delta vs whole {rat['bytes_per_token_delta_vs_whole']:.2f}; every Lynx turn "
            f"identical: {rat['lynx_identical']}")


def plot(arms: dict, path: Path, bandwidth_mbps: float) -> None:
    fig, ax = pyplot().subplots(figsize=(9, 5))
    colors = {c: f"C{i}" for i, c in enumerate(CODECS)}
    for name, rows in arms.items():
        codec, how = name.split("/")
        ax.plot([r["turn"] for r in rows], [r["decode_start_s"] for r in rows],
                marker={"delta": "o", "auto": "^"}.get(how, "s"),
                color="k" if how == "auto" else colors[codec], ls="--" if how == "whole" else "-", label=name)
    ax.set_xticks(sorted({r["turn"] for rows in arms.values() for r in rows}))
    ax.set_xlabel("turn")
    ax.set_ylabel("decode start (s): the first token that needs the turn's KV")
    ax.set_yscale("log")
    ax.set_title(f"Agent conversation over a {bandwidth_mbps:g} Mbit/s link: decode start per turn (TTFT is the "
                 f"prefill's in every arm)\n(whole: the history re-shipped each turn; delta: only the turn's new KV)")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3, which="both")
    save_figure(fig, path)


def register(bench) -> None:
    """`lynx-hf bench session` and its flags (`bench`: the subcommands of `lynx-hf bench`)."""
    # internal: the command line's own parts (its subcommand helper and help texts, the numeric validators)
    from lynx_hf.flags import JSON_HELP, MODEL_HELP, PORT_HELP, subcommand
    from lynx_hf.flags import count, mbps, tokens

    p = subcommand(bench, "session", "an agent conversation over the two-process path: each turn's new KV (delta) "
                                     "versus the whole history re-shipped")
    p.add_argument("--turns", type=count(1000), default=4, help="turns of the conversation (8 reach ~6K tokens)")
    p.add_argument("--bandwidth-mbps", type=mbps(), default=15.0, help="the emulated link")
    p.add_argument("--new-tokens", type=tokens(hi=4096), default=32, help="tokens generated per turn (at least 32)")
    p.add_argument("--no-prefix-cache", action="store_true", help="the prefill server keeps no prefix cache")
    p.add_argument("--bf16-whole", action="store_true", help="also re-ship the whole history in BF16")
    p.add_argument("--results", metavar="FILE",
                   help="also write its section of this results file (e.g. docs/results.md)")
    p.add_argument("--out", default=OUT, help="folder for its JSON and PNG")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("--port", type=count(65535), help=PORT_HELP)
    p.add_argument("--repeat", type=count(1000), default=1,
                   help="rounds of the whole conversation, arms rotated per round; medians of paired ratios")
    p.set_defaults(fn=_command)


def _command(a) -> None:
    run(turns=a.turns, bandwidth_mbps=a.bandwidth_mbps, new_tokens=a.new_tokens, prefix_cache=not a.no_prefix_cache,
        bf16_whole=a.bf16_whole, model_name=a.model, out_dir=a.out, as_json=a.json, results=a.results, port=a.port,
        repeat=a.repeat)
