"""`lynx-hf calibrate`: search the Lynx codec's settings for a model and write `lynx_config.json`.

Objective: the anchor tier's mean next-token KL on calibration text (eval/lib/kvprobe.py: prompts of `contexts` tokens,
`gen` greedy tokens teacher-forced), ties broken by the longer accepted prefix (anchor argmax = exact argmax). The
search sees one stretch of the text; the next, disjoint stretch validates: the searched setting is written only if it
also beats the defaults there, else the defaults are (a search on ~1.5K tokens can fit noise; both are reported).
Search: coordinate descent from the defaults over α, the chunk size C, the key and the value grouping axes
(separately: that is where per-K/V settings pay) and the anchor's reconstruction rule, each sweep trying every value
of one coordinate with the others fixed, until no coordinate improves or `budget` settings have been scored.
Per-layer settings are not searched (the wire format carries one codec per request). The chosen setting's full-tier
KL is reported beside it."""
from __future__ import annotations

import dataclasses
import json

from tqdm import tqdm

import lynx_hf
from lynx_hf import LynxQuantConfig
from lynx_hf.errors import ConfigError

from lynx_hf.eval.lib import kvprobe

SPACE = {
    "alpha": (0.0, 0.25, 0.5, 1.0, 2.0, 4.0),
    "chunk_size": (32, 64, 128),
    "key_axis": ("auto", "channel", "token"),
    "value_axis": ("auto", "channel", "token"),
    "anchor": ("center", "centroid"),
}


def _valid(cfg: dict) -> LynxQuantConfig | None:
    try:
        return LynxQuantConfig(**cfg)
    except ValueError:
        return None


def search(score, start: LynxQuantConfig, budget: int, progress=None) -> tuple[LynxQuantConfig, dict, list]:
    """Coordinate descent. score(cfg) → (kl, -accepted_prefix, ...) tuple to minimise. Returns (best, its score
    dict, every (config dict, score) tried). Pure: `score` is the only contact with a model."""
    if budget < 1:
        raise ConfigError(f"budget must be >= 1, got {budget}")
    tried: dict = {}

    def measure(cfg: LynxQuantConfig):
        key = json.dumps(cfg.to_dict(), sort_keys=True)
        if key not in tried:
            tried[key] = score(cfg)
            if progress is not None:
                progress.update(1)
        return tried[key]

    best = start
    best_s = measure(best)
    improved = True
    while improved and len(tried) < budget:
        improved = False
        for name, values in SPACE.items():
            for v in values:
                if len(tried) >= budget:
                    break
                cand = _valid({**best.to_dict(), name: v})
                if cand is None or cand == best:
                    continue
                s = measure(cand)
                if s["objective"] < best_s["objective"]:
                    best, best_s, improved = cand, s, True
    history = [(json.loads(k), v) for k, v in tried.items()]
    return best, best_s, history


def run(model_name: str | None = None, text: str | None = None, budget: int = 24, out: str = "lynx_config",
        contexts=(512, 1024), gen: int = 32, as_json: bool = False) -> dict:
    from lynx_hf.eval.lib import data

    model, tok = lynx_hf.load_default_model(model_name)
    path = text or str(data.shakespeare())
    with open(path) as f:
        body = f.read(16 * sum(contexts) + 2000)
    ids = tok(body, return_tensors="pt").input_ids
    need = 2 * sum(contexts)
    if ids.shape[1] < need:
        raise ConfigError(f"{path} has {ids.shape[1]} tokens; calibration and validation at {list(contexts)} need "
                         f"{need}")
    probes, held_out, at = [], [], 0
    for group in (probes, held_out):  # disjoint stretches of the text: search on the first, validate on the next
        for n in contexts:
            group.append(kvprobe.make_probe(model, ids[:, at: at + n], gen))
            at += n

    def score(cfg: LynxQuantConfig, on=probes) -> dict:
        rows = [kvprobe.score(model, p, cfg, "anchor") for p in on]
        kl = sum(r["kl"] for r in rows) / len(rows)
        prefix = sum(r["accepted_prefix"] for r in rows) / len(rows)
        return {"objective": (kl, -prefix), "kl_anchor": kl, "accepted_prefix": prefix}

    bar = tqdm(total=budget, desc="calibrate", disable=as_json)
    default = LynxQuantConfig()
    best, best_s, history = search(score, default, budget, bar)
    bar.close()
    default_s = next(s for c, s in history if c == default.to_dict())
    # the search saw only `probes`; keep its choice only if it also wins on text it never saw
    val_best, val_default = score(best, held_out), score(default, held_out)
    searched = best
    if val_best["objective"] >= val_default["objective"]:
        best, best_s = default, default_s
    full = [kvprobe.score(model, p, best, "full") for p in probes]
    calib = {"objective": "mean anchor-tier KL, then accepted prefix", "text": path, "contexts": list(contexts),
             "gen": gen, "evaluated": len(history), "budget": budget,
             "kl_anchor": best_s["kl_anchor"], "accepted_prefix": best_s["accepted_prefix"],
             "kl_full": sum(r["kl"] for r in full) / len(full),
             "default": {"kl_anchor": default_s["kl_anchor"], "accepted_prefix": default_s["accepted_prefix"]},
             "searched": searched.to_dict(), "kept": "searched" if best == searched else "default",
             "held_out": {"searched": {k: val_best[k] for k in ("kl_anchor", "accepted_prefix")},
                          "default": {k: val_default[k] for k in ("kl_anchor", "accepted_prefix")}},
             "model": model_name or "embedded SmolLM2-135M-Instruct"}
    path_out = best.save_pretrained(out, calib)
    changed = {f.name: getattr(best, f.name) for f in dataclasses.fields(best)
               if getattr(best, f.name) != getattr(default, f.name)}
    res = {"path": path_out, "config": best.to_dict(), "changed": changed, **calib}
    if not as_json:
        print(f"search: {len(history)} settings; best {searched.to_dict()}\n"
              f"held-out text: anchor KL {val_default['kl_anchor']:.3e} (defaults) vs {val_best['kl_anchor']:.3e} "
              f"(searched), accepted prefix {val_default['accepted_prefix']:.1f} vs {val_best['accepted_prefix']:.1f} "
              f"of {gen}: kept the {calib['kept']} setting {changed or ''}; full-tier KL {calib['kl_full']:.2e}; "
              f"wrote {path_out}")
    print(json.dumps(res))
    return res
