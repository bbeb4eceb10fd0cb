"""`lynx-hf results`: the accuracy table of docs/results.md (and docs/results.json, which `lynx-hf card` reads).

Protocol, per question of `mmlu_pro_longctx` (data read with `datasets` through the task's own loader) and per context
length: the prefill node runs the prompt but its last token in full precision; each KV mode moves that KV into a
LynxCache; the decode node feeds the last token ("(") and predicts the option letter, the argmax of the letters'
logits. "lynx" decodes with `speculative_generate` (residual after `residual_after` draft steps: drafts on the
anchor, then verification), every other mode with plain `generate` on its tier. Reported per mode: accuracy with a
95 % Wilson interval and agreement with BF16's predictions (both through the `evaluate` metric in
eval/metrics/accuracy_ci), and the mean KL(exact KV ‖ mode) of the next-token distribution. The script checks that
Lynx's letter and its first `new_tokens` greedy tokens equal plain greedy decoding on the full tier, for every
question, and fails otherwise."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig
from lynx_hf.local import prefill

from .kv_modes import mode_config, transferred_cache
from .tasks import lynx_mmlu_pro as mp

ROWS = ("bf16", "int8", "int4", "kivi2", "anchor", "lynx")
LABELS = {"bf16": "BF16", "int8": "INT8", "int4": "INT4 (KIVI-4)", "kivi2": "KIVI-2", "anchor": "Lynx anchor only",
          "lynx": "Lynx"}
METRIC = str(Path(__file__).resolve().parent / "metrics" / "accuracy_ci")


def _bits(kv, mode: str, lynx_config) -> float:
    """Bits per value on the wire for this mode (both streams for "lynx"; the anchor stream for "anchor")."""
    from lynx_hf import quant

    cfg, tier = mode_config(mode, lynx_config)
    nbytes = numel = 0
    for k, v in kv:
        for x, kind in ((k, "key"), (v, "value")):
            nbytes += quant.encode(x, cfg, kind).nbytes(tier)
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
        residual_after: int = 2, new_tokens: int = 4, lynx_config: str | None = None, as_json: bool = False) -> dict:
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
    report["seconds"] = round(time.time() - t0, 1)
    ok = all(c["lynx_equals_full"] == c["n"] for c in report["contexts"].values())
    report["lynx_equals_full_tier"] = ok
    if out:
        _write(report, out, model_name, questions, contexts, residual_after)
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


def _write(report: dict, out: str, model_name, questions, contexts, residual_after) -> None:
    cmd = (f"lynx-hf results --questions {questions} --contexts {' '.join(map(str, contexts))}"
           + (f" --model {model_name}" if model_name else "") + f" --residual-after {residual_after}")
    lines = ["# Accuracy: MMLU-Pro, many-shot long context, by KV mode", "",
             f"Generated by `{cmd}` ({report['seconds']:.0f} s for the last invocation on this machine"
             + (f", which reused {report['resumed']} per-question records of earlier, interrupted ones"
                if report.get("resumed") else "") + "); the numbers are also in `results.json` beside this file. "
             "Do not edit by hand.", "",
             f"Model: {report['model']}. Data: the first {questions} questions (fixed shuffle) of the local MMLU-Pro "
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
    lines += ["## What a 135M model can and cannot show", "",
              "SmolLM2-135M answers 10-option MMLU-Pro questions near chance (10 %), so its accuracy column cannot "
              "show the paper's effect (85.2 % for Lynx vs 76.5 % for INT4 on a 32B model): differences between rows "
              "are within the intervals. What it does show: how far each KV mode moves the model's own predictions "
              "(agreement with BF16) and its next-token distribution (KL), which is what quantization changes, and "
              "that Lynx's output is the full tier's on every question. The same table for a model that can answer "
              "(any Hub id; downloads the model):", "",
              "```bash", "lynx-hf results --model Qwen/Qwen2.5-7B-Instruct --questions 1000 --contexts 4096 8192",
              "lynx-hf eval --model lynx --model_args pretrained=Qwen/Qwen2.5-7B-Instruct,kv=lynx,dtype=bfloat16 "
              "--tasks mmlu_pro --device cuda", "```", ""]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n".join(lines))
    Path(out).with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
