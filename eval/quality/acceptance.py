"""`lynx-hf acceptance`: how many anchor-tier drafts verification accepts, chain versus tree, on the 20 evaluation
prompts (256–2048 tokens, many-shot MMLU-Pro and Shakespeare). The residual lands after `drafts` draft steps (one
forward pass each); greedy; one verification pass. Per prompt and drafting: accepted tokens, tree nodes verified,
verify-pass seconds. The output is the full tier's greedy decoding in every run (tests/test_generate.py)."""
from __future__ import annotations

import json

from tqdm import tqdm

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig, SpecConfig
# internal: one prefill's (KV, logits), reused by every KV mode (LynxCache.from_prefill runs its own)
from lynx_hf.local import prefill

from lynx_hf.eval.lib.data import eval_prompts

CHAIN = SpecConfig(tree_width=1, tree_branch=1)
RUNS = {"chain, paper anchor": (LynxQuantConfig.paper(), CHAIN),
        "chain, lynx anchor": (LynxQuantConfig(), CHAIN),
        "tree, lynx anchor (default)": (LynxQuantConfig(), SpecConfig())}


def run(drafts: int = 31, as_json=False, model_name=None):
    model, tok = lynx_hf.load_default_model(model_name)
    res = {n: [] for n in RUNS}
    for ids in tqdm(eval_prompts(tok), desc="prompts", disable=as_json):
        kv, logits = prefill(model, ids)
        for name, (cfg, spec) in RUNS.items():
            cache = LynxCache.from_kv(model, ids.shape[1], kv, logits, cfg, residual_after_steps=drafts)
            model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, spec_config=spec,
                           max_new_tokens=drafts + 2, do_sample=False)  # first token, drafts, one more
            st = cache.stats
            res[name].append((st["accepted"], st["drafted"], st["tree_nodes"] or st["drafted"], st["verify_s"]))
    n = len(next(iter(res.values())))
    summary = {name: {"mean_accepted": sum(r[0] for r in rows) / n, "min_accepted": min(r[0] for r in rows),
                      "full_requests": sum(r[0] == r[1] for r in rows),
                      "mean_nodes_verified": sum(r[2] for r in rows) / n,
                      "mean_verify_s": sum(r[3] for r in rows) / n, "accepted": [r[0] for r in rows]}
               for name, rows in res.items()}
    if not as_json:
        print(f"\n| drafting, anchor | mean accepted of {drafts} | min | all {drafts} kept | nodes verified "
              "| verify s |")
        print("|---|---|---|---|---|---|")
        for name, s in summary.items():
            print(f"| {name} | {s['mean_accepted']:.1f} | {s['min_accepted']:g} | {s['full_requests']}/{n} | "
                  f"{s['mean_nodes_verified']:.0f} | {s['mean_verify_s']:.2f} |")
    print(json.dumps({"drafts": drafts, "runs": summary}))
    return summary
