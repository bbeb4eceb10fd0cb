"""`python -m lynx_hf.eval.quality.segment_quality`: the Lynx codec as vLLM's publisher applies it — segments of a few
tokens on an absolute grid, each encoded alone with its own "auto" axis — against 256-token segments and fixed axes
(keys per channel, values per token): next-token KL, greedy agreement and accepted prefix over 32 teacher-forced
tokens, anchor and full tier, on the default model's KV of the shared tinyshakespeare text. Ends with one JSON line
(docs/codec.md quotes it)."""
from __future__ import annotations

import json

import torch
from tqdm import tqdm

from lynx_hf import LynxQuantConfig, load_default_model, quant

from lynx_hf.eval.lib.data import require, shakespeare
from lynx_hf.eval.lib.kvprobe import _teacher_forced, make_probe

ARMS = {"auto-256": (LynxQuantConfig(), 256), "auto-64": (LynxQuantConfig(), 64),
        "fixed-64": (LynxQuantConfig(key_axis="channel", value_axis="token"), 64)}


def on_grid(x: torch.Tensor, config: LynxQuantConfig, kind: str, segment: int, layer: tuple, tier: str):
    """x [1, H, P, D] → its `tier` as a stream of `segment`-token segments carries it."""
    return torch.cat([quant.dequantize(quant.encode(x[:, :, o:o + segment].contiguous(), config, kind, layer=layer),
                                       tier) for o in range(0, x.shape[2], segment)], 2)


def score(model, probe, config, segment: int, tier: str) -> dict:
    n = len(probe.keys)
    K = [on_grid(k, config, "key", segment, (i, n), tier) for i, k in enumerate(probe.keys)]
    V = [on_grid(v, config, "value", segment, (i, n), tier) for i, v in enumerate(probe.values)]
    logp, ref = torch.log_softmax(_teacher_forced(model, K, V, probe.cont), -1), probe.ref_logp
    agree = logp.argmax(-1) == ref.argmax(-1)
    return {"kl": float((ref.exp() * (ref - logp)).sum(-1).mean()), "agreement": float(agree.float().mean()),
            "accepted_prefix": int(agree.long().cumprod(0).sum())}


def main(contexts=(512, 1024, 2048)) -> dict:
    require("segment_quality", needs_text=True, text_flag=None)
    model, tok = load_default_model()
    ids = tok(open(shakespeare(), encoding="utf-8").read()[:40000], return_tensors="pt").input_ids
    rows: dict[str, list] = {}
    for n in tqdm(contexts, desc="contexts"):
        probe = make_probe(model, ids[:, n:2 * n], 32)
        for name, (config, segment) in ARMS.items():
            for tier in ("anchor", "full"):
                rows.setdefault(f"{name}-{tier}", []).append(score(model, probe, config, segment, tier))
    out = {k: {m: sum(r[m] for r in v) / len(v) for m in v[0]} for k, v in rows.items()}
    for k, v in out.items():
        print(f"{k:<16} KL {v['kl']:.3e}  agreement {v['agreement']:.3f}  accepted prefix {v['accepted_prefix']:.1f}")
    print(json.dumps({"contexts": list(contexts), "arms": out}))
    return out


if __name__ == "__main__":
    main()
