"""`lynx-hf codec-quality`: every method on real KV of a model over long real text, at several context lengths.

Per method: bits/value (metadata included), relative K/V error, next-token KL against full-precision KV, greedy
agreement and accepted prefix over 32 teacher-forced tokens; then an α × C ablation of the Lynx anchor. Ends with
one JSON line {"methods": {...}, "default": NAME, ...}."""
from __future__ import annotations

import json

import torch
from tqdm import tqdm

from lynx_hf import LynxQuantConfig, load_default_model
from lynx_hf.errors import ConfigError

from .kvprobe import make_probe, score

METHODS = {
    "bf16": (LynxQuantConfig(method="bf16"), "full"),
    "int8": (LynxQuantConfig(method="int8"), "full"),
    "kivi4": (LynxQuantConfig(method="kivi4"), "full"),
    "kivi2": (LynxQuantConfig(method="kivi2"), "full"),
    "paper-anchor": (LynxQuantConfig.paper(), "anchor"),
    "paper-full": (LynxQuantConfig.paper(), "full"),
    "lynx-anchor": (LynxQuantConfig(), "anchor"),
    "lynx-full": (LynxQuantConfig(), "full"),
}
DEFAULT = "lynx-anchor"
KEYS = ("bits_per_value", "kl", "agreement", "accepted_prefix", "rel_err_k", "rel_err_v")


def run(text_path, contexts=(512, 1024, 2048, 4096), gen=32, ablation=True, model_name=None, out=print):
    model, tok = load_default_model(model_name)
    text = open(text_path, encoding="utf-8", errors="replace").read()
    ids_all = tok(text[: 8 * max(contexts) + 1000], return_tensors="pt").input_ids
    if ids_all.shape[1] < max(contexts):
        raise ConfigError(f"{text_path} has only {ids_all.shape[1]} tokens; need {max(contexts)}")
    per = {m: [] for m in METHODS}
    probes = {}
    for n in tqdm(contexts, desc="contexts"):
        # a different stretch of text for each length
        start = min(ids_all.shape[1] - n, n)
        probes[n] = make_probe(model, ids_all[:, start:start + n], gen)
        for m, (cfg, tier) in METHODS.items():
            per[m].append(score(model, probes[n], cfg, tier))
    summary = {m: {k: sum(r[k] for r in rows) / len(rows) for k in KEYS} for m, rows in per.items()}
    out(f"\n## Methods (mean over contexts {list(contexts)}, {gen} teacher-forced tokens)\n")
    out("| method | bits/value | KL | greedy agreement | accepted prefix | rel err K | rel err V |")
    out("|---|---|---|---|---|---|---|")
    for m, s in summary.items():
        out(f"| {m} | {s['bits_per_value']:.3f} | {s['kl']:.2e} | {s['agreement']:.3f} | {s['accepted_prefix']:.1f} "
            f"| {s['rel_err_k']:.4f} | {s['rel_err_v']:.4f} |")
    out("\n## Per context length: KL\n")
    out("| method | " + " | ".join(str(n) for n in contexts) + " |")
    out("|---|" + "---|" * len(contexts))
    for m, rows in per.items():
        out(f"| {m} | " + " | ".join(f"{r['kl']:.2e}" for r in rows) + " |")
    abl = {}
    if ablation:
        n = 1024 if 1024 in probes else contexts[0]
        out(f"\n## Ablation: Lynx anchor KL over α × C (context {n}; KIVI-4 {summary['kivi4']['kl']:.2e} "
            f"averaged over contexts, {per['kivi4'][list(contexts).index(n)]['kl']:.2e} here)\n")
        alphas, chunks = (0.0, 0.25, 0.5, 1.0, 2.0, 8.0), (32, 64, 128)
        out("| α \\ C | " + " | ".join(f"{c} ({4 + 32 / c:.2f} b)" for c in chunks) + " |")
        out("|---|" + "---|" * len(chunks))
        for a in tqdm(alphas, desc="ablation"):
            row = []
            for c in chunks:
                r = score(model, probes[n], LynxQuantConfig(alpha=a, chunk_size=c, page_size=max(256, c)), "anchor")
                abl[f"alpha={a},C={c}"] = r["kl"]
                row.append(f"{r['kl']:.2e}")
            out(f"| {a} | " + " | ".join(row) + " |")
    result = {"methods": {m: {k: summary[m][k] for k in ("bits_per_value", "kl", "accepted_prefix", "agreement")}
                          for m in METHODS},
              "default": DEFAULT, "contexts": list(contexts), "ablation": abl,
              "config": LynxQuantConfig().to_dict()}
    return result
