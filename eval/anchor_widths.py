"""`lynx-hf codec-quality --widths`: the Lynx anchor at every width (4, 3, 2 bits) against a plain code of the same
width and metadata (KIVI-style: keys per channel over 64 tokens, values per token; min and scale fp16), on four
kinds of text — prose (Shakespeare), Python (standard-library source), JSON (MMLU-Pro's records as stored) and
many-shot QA (MMLU-Pro questions with their options and answers) — by next-token KL over `gen` teacher-forced tokens
of a `tokens`-token prompt (kvprobe). Also the anchor with a linear code (α = 0) and the full tier at each width.
Ends with one JSON line {"kl": {method: {kind: KL}}, "bits": {method: bits/value}, "wins": {...}, ...}."""
from __future__ import annotations

import inspect

from tqdm import tqdm

from lynx_hf import LynxQuantConfig as Q
from lynx_hf import load_default_model

from . import data
from .kvprobe import make_probe, score

KINDS = ("prose", "python", "json", "qa")


def methods() -> dict:
    """{name: (config, tier)}: per width the Lynx anchor (default α and α = 0), the plain code, the full tier."""
    out = {}
    for b in (4, 3, 2):
        out[f"lynx{b}-anchor"] = (Q(anchor_bits=b), "anchor")
        out[f"lynx{b}-anchor-linear"] = (Q(anchor_bits=b, alpha=0.0), "anchor")
        out[f"kivi{b}"] = (Q(method=f"kivi{b}"), "full")
        out[f"lynx{b}-full"] = (Q(anchor_bits=b), "full")
    return out


def texts() -> dict:
    """The four kinds of text, from the shared data and the standard library (each well over 1K tokens)."""
    import configparser
    import difflib

    qs = data.read_questions(data.mmlu_pro(), 3000)[2000:2100]
    return {"prose": lambda: data.shakespeare().read_text()[200000:260000],
            "python": lambda: inspect.getsource(difflib) + inspect.getsource(configparser),
            "json": lambda: "\n".join(data.mmlu_pro().read_text().splitlines()[5000:5200]),
            "qa": lambda: "".join(f"Question: {q['question']}\nOptions: "
                                  + " ".join(f"({chr(65 + i)}) {o}" for i, o in enumerate(q["options"]))
                                  + f"\nAnswer: ({q['answer']})\n\n" for q in qs)}


def run(tokens: int = 1024, gen: int = 48, model_name: str | None = None, out=print) -> dict:
    model, tok = load_default_model(model_name)
    ms, kl, bits = methods(), {}, {}
    for kind, text in tqdm(texts().items(), desc="text kinds"):
        ids = tok(text(), return_tensors="pt").input_ids[:, :tokens]
        probe = make_probe(model, ids, gen)
        for name, (cfg, tier) in ms.items():
            r = score(model, probe, cfg, tier)
            kl.setdefault(name, {})[kind] = r["kl"]
            bits[name] = r["bits_per_value"]
    out(f"\n## The anchor at every width against a plain code of that width ({tokens}-token prompts, next-token KL "
        f"over {gen} teacher-forced tokens; lower is better)\n")
    out("| code | bits/value | " + " | ".join(KINDS) + " |")
    out("|---|---:|" + "---:|" * len(KINDS))
    for name in ms:
        out(f"| {name} | {bits[name]:.2f} | " + " | ".join(f"{kl[name][k]:.2e}" for k in KINDS) + " |")
    wins = {f"{b} bits": {v: sum(kl[f"lynx{b}-anchor{v}"][k] <= kl[f"kivi{b}"][k] for k in KINDS)
                          for v in ("", "-linear")} for b in (4, 3, 2)}
    out("\nKinds of text on which the anchor's KL is at most the plain code's: " + "; ".join(
        f"{w}: {c['']} of 4 (α = 0: {c['-linear']})" for w, c in wins.items()))
    return {"kl": kl, "bits": bits, "wins": wins, "tokens": tokens, "gen": gen}
