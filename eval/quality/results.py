"""`lynx-hf results`: the paper's table and the accuracy tables of docs/results.md (and docs/results.json, which
`lynx-hf card` reads), in one invocation.

The paper's table (top of the file), one row per KV mode: bits/value and MB on the wire, TTFT and TT32T in the
two-process demo (eval/benches/demo.py) at a stated link, RULER accuracy (eval/quality/ruler.py: lm-eval's own needle
tasks), and
MMLU-Pro agreement with BF16 and KL (below). Every part resumes from its partial file.

MMLU-Pro protocol, per question of `mmlu_pro_longctx` (data read with `datasets` through the task's own loader) and
per context length: the prefill node runs the prompt but its last token in full precision; each KV mode moves that KV
into a LynxCache; the decode node feeds the last token ("(") and predicts the option letter, the argmax of the letters'
logits. "lynx" decodes with `speculative_generate` (residual after `residual_after` draft steps: drafts on the
anchor, then verification), every other mode with plain `generate` on its tier. Reported per mode: accuracy with a
95 % Wilson interval and agreement with BF16's predictions (both through the `evaluate` metric in
eval/lmeval/metrics/accuracy_ci), and the mean KL(exact KV ‖ mode) of the next-token distribution. The script checks
that
Lynx's letter and its first `new_tokens` greedy tokens equal plain greedy decoding on the full tier, for every
question, and fails otherwise."""
from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig
# internal: one prefill's (KV, logits), reused by every KV mode (LynxCache.from_prefill runs its own)
from lynx_hf.local import prefill

from lynx_hf.eval.lib.kv_modes import mode_config, transferred_cache
from lynx_hf.eval.lmeval.tasks import lynx_mmlu_pro as mp

ROWS = ("bf16", "int8", "int4", "kivi2", "cachegen", "anchor", "lynx")
LABELS = {"bf16": "BF16", "int8": "INT8", "int4": "INT4 (KIVI-4)", "kivi2": "KIVI-2", "cachegen": "CacheGen",
          "anchor": "Lynx anchor only", "lynx": "Lynx"}
DEMO = {"bf16": "BF16", "int8": "INT8", "int4": "INT4 (KIVI-4)", "kivi2": "KIVI-2", "cachegen": "CacheGen",
        "lynx": "Lynx"}  # demo row names; the anchor alone is never a decode node's answer (Lynx drafts on it)
METRIC = str(Path(__file__).resolve().parents[1] / "lmeval" / "metrics" / "accuracy_ci")
DEMO_ROUNDS = 3  # the demo's figures: medians of paired rounds (lynx_hf/floors.py), never one run


def _bits(kv, mode: str, lynx_config) -> float:
    """Bits per value on the wire for this mode (both streams for "lynx"; the anchor stream for "anchor")."""
    from lynx_hf import quant

    cfg, tier = mode_config(mode, lynx_config)
    nbytes = numel = 0
    for i, (k, v) in enumerate(kv):
        for x, kind in ((k, "key"), (v, "value")):
            nbytes += quant.encode(x, cfg, kind, layer=(i, len(kv))).nbytes(tier)
            numel += x.numel()
    return 8 * nbytes / numel


@torch.inference_mode()
def _decode(model, ids, kv, logits, mode, lynx_config, residual_after, new_tokens):
    """(first-step logits [V], generated tokens [new_tokens], cache stats) of one mode; "full" = the Lynx codec's
    full tier with plain greedy decoding (the reference Lynx must equal)."""
    P = ids.shape[1] - 1
    kw = dict(max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, output_logits=True)
    if mode == "full":
        cfg, _ = mode_config("lynx", lynx_config)
        cache = LynxCache.from_kv(model, P, kv, logits, cfg).pin_tier("full")
    else:
        cache = transferred_cache(model, kv, logits, P, mode, lynx_config, residual_after=residual_after)
        if mode == "lynx":
            kw["custom_generate"] = lynx_hf.speculative_generate
    out = model.generate(ids, cache=cache, **kw)
    return out.logits[0][0].float(), out.sequences[0, ids.shape[1]:], dict(cache.stats)


def _metric():
    import evaluate

    return evaluate.load(METRIC)


def run(questions: int = 500, contexts=(512, 1024), model_name: str | None = None, out: str = "docs/results.md",
        residual_after: int = 2, new_tokens: int = 4, lynx_config: str | None = None, as_json: bool = False,
        ruler_samples: int = 50, ruler_cells=None, demo: bool = True, bandwidth_mbps: float = 15.0,
        demo_tokens: int = 1024) -> dict:
    from transformers.utils import logging

    logging.set_verbosity_error()
    model, tok = lynx_hf.load_default_model(model_name)
    cfg = LynxQuantConfig.from_pretrained(lynx_config) if lynx_config else None
    letter_ids = [tok(c, add_special_tokens=False).input_ids for c in mp.LETTERS]
    if any(len(t) != 1 for t in letter_ids):
        raise ValueError("the tokenizer splits an option letter into several tokens; this protocol needs one each")
    letter_ids = torch.tensor([t[0] for t in letter_ids])
    metric, t0 = _metric(), time.time()
    report = {"model": model_name or "HuggingFaceTB/SmolLM2-135M-Instruct (embedded GGUF)", "questions": questions,
              "residual_after": residual_after, "new_tokens": new_tokens, "data": mp.data_path(), "contexts": {}}
    partial = Path(out or "results.md").with_suffix(".partial.jsonl")  # one line per question: a rerun resumes
    done = _resume(partial, model_name, lynx_config, residual_after, new_tokens)
    earlier = set(done)
    for n_ctx in contexts:
        docs = mp.load_longctx(context_tokens=n_ctx, tokenizer=model_name)["test"].select(range(questions))
        recs = []
        for i, doc in enumerate(tqdm(docs, desc=f"results @ {n_ctx} tokens", disable=as_json)):
            key = f"{n_ctx}/{doc['question_id']}"
            if key not in done:
                done[key] = _question(model, tok, doc, cfg, letter_ids, residual_after, new_tokens, with_bits=i == 0)
                with open(partial, "a") as f:
                    f.write(json.dumps({"key": key, **done[key]}) + "\n")
            recs.append(done[key])
            report["resumed"] = report.get("resumed", 0) + (key in earlier)
        targets = [r["target"] for r in recs]
        preds = {m: [r["preds"][m] for r in recs] for m in (*ROWS, "full")}
        rows = {}
        for m in ROWS:
            acc = metric.compute(predictions=preds[m], references=targets)
            agree = metric.compute(predictions=preds[m], references=preds["bf16"])
            rows[m] = {"accuracy": acc["accuracy"], "ci95": [acc["ci_low"], acc["ci_high"]],
                       "agreement_bf16": agree["accuracy"], "kl": sum(r["kl"][m] for r in recs) / len(recs),
                       "bits_per_value": next(r["bits"][m] for r in recs if "bits" in r)}
        same, drafted, accepted = (sum(r[k] for r in recs) for k in ("same", "drafted", "accepted"))
        lengths = [r["tokens"] for r in recs]
        report["contexts"][str(n_ctx)] = {"rows": rows, "lynx_equals_full": same, "n": len(recs),
                                          "mean_tokens": sum(lengths) / len(lengths), "drafted": drafted,
                                          "accepted": accepted}
    ok = all(c["lynx_equals_full"] == c["n"] for c in report["contexts"].values())
    if ruler_samples:
        from lynx_hf.eval.quality import ruler

        partial = str(Path(out or "results.md").with_suffix(".ruler.partial.jsonl"))
        report["ruler"] = ruler.run(model, tok, ruler_cells or ruler.CELLS, ruler_samples,
                                    residual_after=residual_after, partial=partial, model_name=model_name,
                                    quiet=as_json, lynx_config=cfg)
    if demo:
        from lynx_hf.eval.benches import demo as demo_

        methods = {name: mode_config(m, cfg)[0] for m, name in DEMO.items()}
        with contextlib.redirect_stdout(sys.stderr):  # the demo's own JSON line: this command prints one
            report["demo"] = demo_.run(tokens=demo_tokens, bandwidth_bps=bandwidth_mbps * 1e6, as_json=True,
                                       model_name=model_name, methods=methods, repeat=DEMO_ROUNDS)
    report["seconds"] = round(time.time() - t0, 1)
    report["cpu_seconds"] = round(time.process_time(), 1)
    report["lynx_equals_full_tier"] = ok
    if out:
        extra = (f" --ruler-samples {ruler_samples}" if ruler_samples != 50 else "") + \
            (" --ruler-cells " + " ".join(f"{t}@{n}" for t, n in ruler_cells) if ruler_cells else "") + \
            ("" if demo else " --no-demo") + (f" --bandwidth-mbps {bandwidth_mbps:g}" if bandwidth_mbps != 15 else "")
        _write(report, out, model_name, questions, contexts, residual_after, extra)
    print(json.dumps(report) if as_json else f"wrote {out} ({report['seconds']} s); Lynx = full tier: {ok}")
    if not ok:
        raise SystemExit("lynx-hf results: Lynx's output differs from the full tier's on some question")
    return report


def _resume(partial: Path, *setting) -> dict:
    """Per-question records of an interrupted run with the same setting (a different setting starts afresh)."""
    tag = json.dumps(setting)
    if partial.exists():
        lines = partial.read_text().splitlines()
        if lines and lines[0] == tag:
            return {r["key"]: r for r in map(json.loads, lines[1:]) if r}
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text(tag + "\n")
    return {}


@torch.inference_mode()
def _question(model, tok, doc, cfg, letter_ids, residual_after: int, new_tokens: int, with_bits: bool) -> dict:
    """One question at one context length: every mode's prediction and KL, Lynx against the full tier, and (with_bits)
    each mode's bits/value on this prompt's KV."""
    ids = torch.tensor([tok(mp.longctx_prompt(doc), add_special_tokens=False).input_ids])
    kv, logits = prefill(model, ids[:, :-1])
    ref = torch.log_softmax(_decode(model, ids, kv, logits, "identity", cfg, residual_after, 1)[0], -1)
    runs = {m: _decode(model, ids, kv, logits, m, cfg, residual_after, new_tokens if m in ("lynx", "full") else 1)
            for m in (*ROWS, "full")}
    preds = {m: int(lg[letter_ids].argmax()) for m, (lg, _, _) in runs.items()}
    kl = {m: float((ref.exp() * (ref - torch.log_softmax(runs[m][0], -1))).sum()) for m in ROWS}
    same = preds["lynx"] == preds["full"] and torch.equal(runs["lynx"][1], runs["full"][1])
    return {"preds": preds, "kl": kl, "target": int(doc["answer_index"]), "tokens": ids.shape[1], "same": int(same),
            "drafted": runs["lynx"][2]["drafted"], "accepted": runs["lynx"][2]["accepted"],
            **({"bits": {m: _bits(kv, m, cfg) for m in ROWS}} if with_bits else {})}


def _pct(acc: float, ci) -> str:
    return f"{100 * acc:.0f} [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]"


def _paper_table(report: dict) -> list[str]:
    """The paper's table: a row per KV mode, every column measured in this invocation (or resumed)."""
    ctx = list(report["contexts"])[-1]
    mmlu = report["contexts"][ctx]["rows"]
    ruler, demo = report.get("ruler"), report.get("demo")
    cells = list(ruler["cells"]) if ruler else []
    head = ["KV", "bits/value", "MB on the wire", "TTFT s", "decode start s", "TT32T s",
            *(f"RULER {c.split('@')[0]} {int(c.split('@')[1]) // 1024}K" for c in cells),
            f"MMLU-Pro agreement with BF16 ({ctx})", "KL vs exact KV"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for m in ROWS:
        d = demo["methods"].get(DEMO.get(m, "")) if demo else None
        wire = [f"{d['bytes'] / 1e6:.2f}", *(f"{d[k]:.2f}" if d.get(k) is not None else "—"
                                             for k in ("ttft_s", "decode_start_s", "tt32t_s"))] if d else ["—"] * 4
        acc = [_pct(ruler["cells"][c]["rows"][m]["accuracy"], ruler["cells"][c]["rows"][m]["ci"]) for c in cells]
        lines.append(f"| {LABELS[m]} | {mmlu[m]['bits_per_value']:.2f} | " + " | ".join(wire + acc) +
                     f" | {100 * mmlu[m]['agreement_bf16']:.1f} % | {mmlu[m]['kl']:.2e} |")
    notes = [""]
    if demo:
        notes.append(f"Bits/value: on the KV of the MMLU-Pro prompts at {ctx} tokens, metadata and (CacheGen) tables "
                     f"included. MB and times: `lynx-hf demo`'s two processes on loopback, a "
                     f"{demo['prompt_tokens']}-token prompt, the link emulated at {demo['bandwidth_bps'] / 1e6:g} "
                     f"Mbit/s" + (f", medians of {demo['rounds']} rounds" if demo.get("rounds") else "") +
                     "; TTFT runs from the request to the first token, picked from the prefill's logits, which leave "
                     "ahead of the KV (so it is the prefill's for every mode), decode start to the first token that "
                     "needs the KV (Lynx: its first draft, on the anchor), TT32T to 32 verified tokens; CacheGen's "
                     "encoding (prefill side) and decoding (decode side) lie inside them. "
                     f"Lynx's output equals the full tier's: {demo['lynx']['identical_to_full']}."
                     + (" The prefill took more than half of BF16's link time: compute, not the link, shapes these "
                        "TTFTs." if demo.get("prefill_bound") else ""))
    if ruler:
        n = {c["n"] for c in ruler["cells"].values()}
        same = sum(c["lynx_equals_full"] for c in ruler["cells"].values())
        total = sum(c["n"] for c in ruler["cells"].values())
        notes.append(f"RULER: lm-eval's own `niah_*` tasks (offline, synthetic haystacks sized with the model's "
                     f"tokenizer), {'/'.join(map(str, sorted(n)))} samples per cell, accuracy in % with its 95 % "
                     f"Wilson interval; greedy decoding of at most 16 new tokens (40 for `niah_multikey_3`'s UUIDs). "
                     f"Lynx's tokens equal plain decoding on its full tier on **{same} of {total}** samples. "
                     f"This invocation computed {ruler['computed']} samples in {ruler['seconds']:.0f} s wall "
                     f"({ruler['cpu_seconds']:.0f} s CPU, 2 cores) and resumed {ruler['resumed']} from its partial "
                     f"file" + (" (docs/evaluation.md times the run that computed them)." if ruler["resumed"] else "."))
    return lines + [x for n in notes[1:] for x in ("", n)]


def _reading(report: dict) -> list[str]:
    """What the table shows, in words computed from it, and what a 135M model cannot show."""
    out = ["## What the table shows, and what a 135M model cannot", ""]
    para = lambda text: out.extend([text, ""])  # noqa: E731 — one Markdown paragraph
    ruler = report.get("ruler")
    if ruler:
        cells = ruler["cells"]
        able = [c for c, v in cells.items() if v["rows"]["bf16"]["accuracy"] >= 0.5]
        hard = [c for c in cells if c not in able]

        def rng(m, cs):
            a = [100 * cells[c]["rows"][m]["accuracy"] for c in cs]
            return f"{min(a):.0f}–{max(a):.0f} %" if round(min(a)) != round(max(a)) else f"{a[0]:.0f} %"

        def group(cs, what):
            below = {m: [c for c in cs if cells[c]["rows"][m]["ci"][1] < cells[c]["rows"]["bf16"]["accuracy"]]
                     for m in ROWS if m != "bf16"}
            para(f"RULER, {what} ({', '.join(cs)}), BF16 {rng('bf16', cs)}: " +
                       "; ".join(f"{LABELS[m]} {rng(m, cs)}" for m in ROWS if m != "bf16") + ". Below BF16's "
                       "accuracy by more than their own 95 % interval: " +
                       (", ".join(f"{LABELS[m]} ({len(c)} of {len(cs)} cells)" for m, c in below.items() if c)
                        or "none") + ".")

        if able:
            group(able, "where the model finds the needle with BF16 KV")
        if hard:
            group(hard, "where several keys hide in the haystack and the 135M model mostly fails even with BF16 KV")
        para("Lynx's rows equal its full tier's outputs sample for sample (checked above), so whatever its "
                   "anchor loses while drafting is recovered at verification; the anchor-only row shows what "
                   "drafting alone would keep.")
    demo = report.get("demo")
    if demo:
        m = demo["methods"]
        key = "decode_start_s" if all(m[r].get("decode_start_s") for r in DEMO.values() if r in m) else "ttft_s"
        order = sorted((r for r in DEMO.values() if r in m), key=lambda r: m[r][key])
        para(f"{'Decode start' if key != 'ttft_s' else 'TTFT'} at {demo['bandwidth_bps'] / 1e6:g} Mbit/s, shortest "
             "first: " + ", ".join(f"{r} {m[r][key]:.2f} s" for r in order) + f" (prefill {demo['prefill_s']:.2f} s). "
             "A baseline's decoding starts once all of its KV is in; Lynx's once its anchor stream is, so its "
             "decode start follows its anchor's bytes, and its TT32T adds the residual and one verification.")
    out += ["SmolLM2-135M answers 10-option MMLU-Pro questions near chance (10 %), so the MMLU-Pro accuracy "
            "below cannot show the paper's effect (85.2 % for Lynx vs 76.5 % for INT4 on a 32B model): its rows "
            "differ within their intervals. What MMLU-Pro does show: how far each KV mode moves the model's own "
            "predictions (agreement with BF16) and its next-token distribution (KL)." + _ttft_note(report.get("demo")) +
            " The same tables for a model that can answer (any Hub id; downloads the model):", "",
            "```bash", "lynx-hf results --model Qwen/Qwen2.5-7B-Instruct --questions 1000 --contexts 4096 8192",
            "lynx-hf eval --model lynx --model_args pretrained=Qwen/Qwen2.5-7B-Instruct,kv=lynx,dtype=bfloat16 "
            "--tasks mmlu_pro --device cuda",
            "lynx-hf eval --model lynx --model_args pretrained=Qwen/Qwen2.5-7B-Instruct,kv=cachegen,dtype=bfloat16 "
            "--tasks niah_single_1,niah_multikey_2,niah_multikey_3 --metadata '{\"max_seq_lengths\":[4096,16384]}' "
            "--device cuda", "```", ""]
    return out


def _ttft_note(demo) -> str:
    if not demo:
        return ""
    m = demo["methods"]
    return (f" TTFT: the prefill took {demo['prefill_s']:.2f} s of Lynx's {m['Lynx']['ttft_s']:.2f} s here (a 135M "
            f"model on 2 CPU cores at {demo['prompt_tokens']} tokens), the rest the logits' frame; the paper's TTFTs "
            f"are a 32B model's on GPUs at 16K tokens, where the first token waited for the KV.")


def _write(report: dict, out: str, model_name, questions, contexts, residual_after, extra: str = "") -> None:
    cmd = (f"lynx-hf results --questions {questions} --contexts {' '.join(map(str, contexts))}"
           + (f" --model {model_name}" if model_name else "") + f" --residual-after {residual_after}" + extra)
    lines = ["# Results: the paper's table, by KV mode", "",
             f"Generated by `{cmd}` ({report['seconds']:.0f} s for the last invocation on this machine"
             + (f", which reused {report['resumed']} per-question records of earlier invocations"
                if report.get("resumed") else "") + "); the numbers are also in `results.json` beside this file. "
             "Do not edit by hand.", "", f"Model: {report['model']}.", ""]
    if report.get("ruler") or report.get("demo"):
        lines += _paper_table(report) + [""]
    lines += _reading(report)
    lines += ["# Accuracy: MMLU-Pro, many-shot long context, by KV mode", "",
             f"Data: the first {questions} questions (fixed shuffle) of the local MMLU-Pro "
             "test file, each as a `mmlu_pro_longctx` prompt: solved questions of its category (\"... The answer is "
             "(X).\") filling the context, then the question and \"Answer: The answer is (\". The prefill runs all "
             "but the last prompt token in full precision; each KV mode carries that KV to the decode side, which "
             "feeds the last token and predicts the letter (argmax over the option letters). Lynx decodes with "
             f"`speculative_generate`, its residual landing after {residual_after} draft steps. KL: mean "
             "KL(exact KV ‖ mode) of the next-token distribution. Intervals: 95 % Wilson.", ""]
    for n_ctx, c in report["contexts"].items():
        lines += [f"## {n_ctx}-token contexts ({c['n']} questions, mean {c['mean_tokens']:.0f} tokens)", "",
                  "| KV | bits/value | accuracy [95 % CI] | agreement with BF16 | KL vs exact KV |",
                  "|---|---:|---|---:|---:|"]
        for m, r in c["rows"].items():
            lo, hi = r["ci95"]
            lines.append(f"| {LABELS[m]} | {r['bits_per_value']:.2f} | {100 * r['accuracy']:.1f} % "
                         f"[{100 * lo:.1f}, {100 * hi:.1f}] | {100 * r['agreement_bf16']:.1f} % | {r['kl']:.2e} |")
        lines += ["", f"Lynx equals plain greedy decoding on the full tier (letter and first {report['new_tokens']} "
                  f"tokens): **{c['lynx_equals_full']} of {c['n']}** questions; drafts accepted {c['accepted']} of "
                  f"{c['drafted']}.", ""]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    from lynx_hf.eval.benches.bench_session import SECTION  # `lynx-hf bench session --results` owns it: it stays

    old = Path(out).read_text() if Path(out).exists() else ""
    kept = old[old.find(SECTION):] if SECTION in old else ""
    Path(out).write_text("\n".join(lines) + ("\n" + kept if kept else ""))
    Path(out).with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
