"""`lynx-hf acceptance`: how many anchor-tier drafts verification accepts, per anchor design, on the 20 evaluation
prompts (256–2048 tokens). The residual lands after `drafts` draft tokens; greedy; one verification round."""
from __future__ import annotations

import json

from tqdm import tqdm

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig
from lynx_hf.loader import prefill

from .data import eval_prompts

DESIGNS = {"paper": LynxQuantConfig.paper(), "lynx (default)": LynxQuantConfig(), "kivi4-like (lynx, alpha=0)":
           LynxQuantConfig(alpha=0.0)}


def run(drafts: int = 31, as_json=False, model_name=None):
    model, tok = lynx_hf.load_default_model(model_name)
    res = {n: [] for n in DESIGNS}
    for ids in tqdm(eval_prompts(tok), desc="prompts", disable=as_json):
        kv, logits = prefill(model, ids)
        for name, cfg in DESIGNS.items():
            cache = LynxCache.from_kv(model, ids.shape[1], kv, logits, cfg, residual_after_tokens=drafts)
            model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate,
                           max_new_tokens=drafts + 2, do_sample=False)  # first token, drafts, one more
            res[name].append((cache.stats["accepted"], cache.stats["drafted"]))
    summary = {n: {"mean_accepted_fraction": sum(a / max(d, 1) for a, d in r) / len(r),
                   "accepted": sum(a for a, _ in r), "drafted": sum(d for _, d in r)} for n, r in res.items()}
    if not as_json:
        print(f"\n| anchor design | mean accepted fraction | accepted / drafted (20 prompts, {drafts} drafts each) |")
        print("|---|---|---|")
        for n, s in summary.items():
            print(f"| {n} | {s['mean_accepted_fraction']:.3f} | {s['accepted']} / {s['drafted']} |")
    print(json.dumps({"drafts": drafts, "designs": summary}))
    return summary
