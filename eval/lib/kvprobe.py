"""Teacher-forced KV quality probe: how much does replacing a prompt's KV by a codec's reconstruction change the
next-token distribution over a greedy continuation? The engine of `lynx-hf codec-quality`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from lynx_hf import quant


@dataclass
class Probe:
    """Full-precision KV of a prompt and the reference logits of a greedy continuation."""
    keys: list       # per layer [B, H_kv, S, D]
    values: list
    cont: torch.Tensor       # [1, T] greedy continuation (first token from the prefill)
    ref_logp: torch.Tensor   # [T-1, V] log-probs with the exact KV


@torch.inference_mode()
def make_probe(model, ids: torch.Tensor, gen: int = 32) -> Probe:
    c = DynamicCache(config=model.config)
    out = model(input_ids=ids, cache=c, use_cache=True)
    K = [l.keys.clone() for l in c.layers]
    V = [l.values.clone() for l in c.layers]
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    cont = [nxt]
    for _ in range(gen - 1):
        nxt = model(input_ids=nxt, cache=c, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        cont.append(nxt)
    cont = torch.cat(cont, 1)
    ref = _teacher_forced(model, K, V, cont)
    return Probe(K, V, cont, torch.log_softmax(ref, -1))


@torch.inference_mode()
def _teacher_forced(model, K, V, cont) -> torch.Tensor:
    cc = DynamicCache(config=model.config)
    for i in range(len(K)):
        cc.update(K[i], V[i], i)
    return model(input_ids=cont, cache=cc, use_cache=True).logits[0, :-1].float()


@torch.inference_mode()
def score(model, probe: Probe, config, tier: str) -> dict:
    """KL(ref ‖ codec) (mean, and per teacher-forced position), greedy agreement and accepted prefix over the
    continuation; bits/value and K/V errors."""
    K, V, nbytes, numel, ek, ev = [], [], 0, 0, 0.0, 0.0
    for i, (k, v) in enumerate(zip(probe.keys, probe.values)):
        where = (i, len(probe.keys))
        sk, sv = quant.encode(k, config, "key", layer=where), quant.encode(v, config, "value", layer=where)
        dk, dv = quant.dequantize(sk, tier), quant.dequantize(sv, tier)
        K.append(dk), V.append(dv)
        nbytes += sk.nbytes(tier) + sv.nbytes(tier)
        numel += k.numel() + v.numel()
        ek += float((dk - k).pow(2).sum() / k.pow(2).sum())
        ev += float((dv - v).pow(2).sum() / v.pow(2).sum())
    logp = torch.log_softmax(_teacher_forced(model, K, V, probe.cont), -1)
    p = probe.ref_logp
    per_position = (p.exp() * (p - logp)).sum(-1)
    kl = float(per_position.mean())
    agree = (logp.argmax(-1) == p.argmax(-1))
    prefix = int(agree.long().cumprod(0).sum())
    n = len(probe.keys)
    return {"bits_per_value": 8 * nbytes / numel, "kl": kl, "agreement": float(agree.float().mean()),
            "accepted_prefix": prefix, "rel_err_k": (ek / n) ** 0.5, "rel_err_v": (ev / n) ** 0.5,
            "kl_per_position": per_position.tolist()}
