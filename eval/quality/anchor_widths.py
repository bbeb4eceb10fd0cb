"""`lynx-hf codec-quality --widths`: the Lynx anchor at every width (4, 3, 2 bits) against a plain code of the same
width and metadata (KIVI-style: keys per channel over 64 tokens, values per token; min and scale fp16), on four
kinds of text — prose (Shakespeare), Python (standard-library source), JSON (MMLU-Pro's records as stored) and
many-shot QA (MMLU-Pro questions with their options and answers) — by next-token KL over `gen` teacher-forced tokens
of `prompts` prompts of `tokens` tokens per kind (kvprobe). Also the anchor with a linear code (α = 0) and the full
tier at each width.

Terms. A kind's KL is the mean over its prompts × positions. Next-token KL is heavy-tailed: one near-tie that flips
can carry most of a prompt's total (measured: one position of 48 carried 0.85 of a prompt's 1.59 nats), so a
comparison on one prompt says little. `p_le` is the paired bootstrap's answer to "is the anchor's KL at most the
plain code's on this kind": the fraction of `BOOT` resamples (positions drawn with replacement, the same draws for
both codes) in which the anchor's mean is below the plain code's, ties counting half — near 1 a clear win, near 0
a clear loss, near 0.5 a tie the data cannot split (positions of one prompt are not independent: it overstates
certainty). Ends with one JSON line {"kl": {method: {kind: KL}}, "bits": {method: bits/value}, "wins": {...},
"p_le": {...}, ...}."""
from __future__ import annotations

import inspect

import torch
from tqdm import tqdm

from lynx_hf import LynxQuantConfig as Q
from lynx_hf import load_default_model

from lynx_hf.eval.lib import data
from lynx_hf.eval.lib.kvprobe import make_probe, score

KINDS = ("prose", "python", "json", "qa")
BOOT = 2000  # bootstrap resamples per comparison


def methods() -> dict:
    """{name: (config, tier)}: per width the Lynx anchor (default α and α = 0), the plain code, the full tier."""
    out = {}
    for b in (4, 3, 2):
        out[f"lynx{b}-anchor"] = (Q(anchor_bits=b), "anchor")
        out[f"lynx{b}-anchor-linear"] = (Q(anchor_bits=b, alpha=0.0), "anchor")
        out[f"kivi{b}"] = (Q(method=f"kivi{b}"), "full")
        out[f"lynx{b}-full"] = (Q(anchor_bits=b), "full")
    return out


def _qa(qs: list[dict]) -> str:
    return "".join(f"Question: {q['question']}\nOptions: " + " ".join(f"({chr(65 + i)}) {o}"
                                                                      for i, o in enumerate(q["options"]))
                   + f"\nAnswer: ({q['answer']})\n\n" for q in qs)


def texts(prompts: int = 3) -> dict:
    """{kind: [text() for each prompt]}: stretches of the shared data and standard-library modules, each well over
    1K tokens; the first prompt of each kind is the one earlier versions of this table used."""
    import configparser, csv, difflib, pathlib, tokenize  # noqa: E401 (their sources are the Python prompts)

    sh = lambda at: lambda: data.shakespeare().read_text()[at:at + 60000]
    lines = lambda at: lambda: "\n".join(data.mmlu_pro().read_text().splitlines()[at:at + 200])
    qa = lambda at: lambda: _qa(data.read_questions(data.mmlu_pro(), at + 100)[at:at + 100])
    src = lambda *mods: lambda: "".join(inspect.getsource(m) for m in mods)
    pools = {"prose": [sh(200000), sh(400000), sh(700000), sh(900000)],
             "python": [src(difflib, configparser), src(tokenize), src(pathlib, csv), src(inspect)],
             "json": [lines(5000), lines(7000), lines(9000), lines(3000)],
             "qa": [qa(2000), qa(3000), qa(3500), qa(1500)]}
    if not 1 <= prompts <= 4:
        raise ValueError(f"prompts must be in [1, 4], got {prompts}")
    return {k: v[:prompts] for k, v in pools.items()}


def p_le(a: list[float], b: list[float], boot: int = BOOT, seed: int = 0) -> float:
    """Paired bootstrap: the fraction of resamples of the positions in which mean(a) < mean(b), a tie counting
    half. (Positions are resampled as if independent; those of one prompt are not, so this overstates certainty.)"""
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(x), (boot, len(x)), generator=g)
    mx, my = x[idx].mean(1), y[idx].mean(1)
    return float(((mx < my).double() + 0.5 * (mx == my).double()).mean())


def run(tokens: int = 1024, gen: int = 48, prompts: int = 3, model_name: str | None = None, out=print) -> dict:
    model, tok = load_default_model(model_name)
    ms, kl, bits, pos = methods(), {}, {}, {}
    for kind, fns in tqdm(texts(prompts).items(), desc="text kinds"):
        for text in fns:
            probe = make_probe(model, tok(text(), return_tensors="pt").input_ids[:, :tokens], gen)
            for name, (cfg, tier) in ms.items():
                r = score(model, probe, cfg, tier)
                pos.setdefault(name, {}).setdefault(kind, []).extend(r["kl_per_position"])
                bits[name] = r["bits_per_value"]
    kl = {name: {k: sum(v) / len(v) for k, v in per.items()} for name, per in pos.items()}
    out(f"\n## The anchor at every width against a plain code of that width ({prompts} prompts of {tokens} tokens "
        f"per kind, next-token KL over {gen} teacher-forced tokens each, mean; lower is better)\n")
    out("| code | bits/value | " + " | ".join(KINDS) + " |")
    out("|---|---:|" + "---:|" * len(KINDS))
    for name in ms:
        out(f"| {name} | {bits[name]:.2f} | " + " | ".join(f"{kl[name][k]:.2e}" for k in KINDS) + " |")
    wins, ple = {}, {}
    for b in (4, 3, 2):
        for v in ("", "-linear"):
            name, plain = f"lynx{b}-anchor{v}", f"kivi{b}"
            ple[name] = {k: p_le(pos[name][k], pos[plain][k]) for k in KINDS}
            wins.setdefault(f"{b} bits", {})[v] = sum(kl[name][k] <= kl[plain][k] for k in KINDS)
    out(f"\nPaired bootstrap over the positions ({BOOT} resamples): how often the anchor's mean KL is below the plain "
        "code's, ties counting half (1: always, 0: never)\n")
    out("| anchor | against | " + " | ".join(KINDS) + " |")
    out("|---|---|" + "---:|" * len(KINDS))
    for name, row in ple.items():
        out(f"| {name} | kivi{name[4]} | " + " | ".join(f"{row[k]:.2f}" for k in KINDS) + " |")
    out("\nKinds of text on which the anchor's mean KL is at most the plain code's: " + "; ".join(
        f"{w}: {c['']} of 4 (α = 0: {c['-linear']})" for w, c in wins.items()))
    return {"kl": kl, "bits": bits, "wins": wins, "p_le": ple, "tokens": tokens, "gen": gen, "prompts": prompts}
