"""The KV modes under evaluation, and how a prompt's KV reaches the model in each of them.

    bf16    the KV cast to bfloat16 (the paper's BF16 row; on a bf16 model it is lossless)
    int8    uniform 8-bit per token
    int4    KIVI-4 (keys per channel, values per token, groups of 64): the paper's INT4 row
    kivi2   KIVI-2
    cachegen  CacheGen (per-token quantization, more bins in early layers, arithmetic-coded; the paper's fifth row)
    anchor  Lynx's 4-bit anchor alone, never verified (what drafting sees; an ablation)
    lynx    Lynx: drafts on the anchor, verified against the full tier, so outputs equal the full tier's
    identity  the KV untouched (the reference the others are measured against)

Every mode goes through `LynxCache` exactly as on a decode node: the prompt's KV is encoded with the mode's codec,
delivered by a loader and materialised at the mode's tier; tokens computed after the prompt keep full precision (they
are the decode node's own). In generation every mode's first token comes from the prefill's logits (a prefill node
sends them, as Lynx's does; plain `generate` on a LynxCache takes them too), so modes differ from the second token on.
Scoring (`continuation_logprobs`) re-runs the prompt's last position against the
transferred KV, so every scored token depends on the mode, the first one included."""
from __future__ import annotations

import torch

from lynx_hf import LynxCache, LynxQuantConfig
from lynx_hf.errors import ConfigError
# internal: one prefill's (KV, logits), reused by every KV mode (LynxCache.from_prefill runs its own)
from lynx_hf.local import prefill

MODES = ("bf16", "int8", "int4", "kivi2", "cachegen", "anchor", "lynx", "identity")
_BASELINE = {"bf16": "bf16", "int8": "int8", "int4": "kivi4", "kivi2": "kivi2", "cachegen": "cachegen",
             "identity": "identity"}


def mode_config(mode: str, lynx_config: LynxQuantConfig | None = None) -> tuple[LynxQuantConfig, str]:
    """(codec, tier) of a mode; `lynx_config` sets the codec of "anchor" and "lynx" (default: LynxQuantConfig())."""
    if mode in _BASELINE:
        return LynxQuantConfig(method=_BASELINE[mode]), "full"
    if mode in ("anchor", "lynx"):
        cfg = lynx_config or LynxQuantConfig()
        if cfg.method not in ("lynx", "paper"):
            raise ConfigError(f"lynx_config must be a Lynx codec (method 'lynx' or 'paper'), got {cfg.method!r}")
        return cfg, "anchor" if mode == "anchor" else "full"
    raise ConfigError(f"kv must be one of {MODES}, got {mode!r}")


def transferred_cache(model, kv, logits, prompt_len: int, mode: str, lynx_config: LynxQuantConfig | None = None,
                      residual_after: int | None = None, bandwidth_bps: float | None = None) -> LynxCache:
    """A decode node's cache for a prefill's (kv, logits) in `mode`. "lynx" is left streaming (its residual after
    `residual_after` draft steps, or over a simulated link) for `speculative_generate`; every other mode is pinned
    to its tier, ready for plain decoding or scoring."""
    cfg, tier = mode_config(mode, lynx_config)
    streaming = mode == "lynx"
    cache = LynxCache.from_kv(model, prompt_len, kv, logits, cfg,
                              residual_after_steps=residual_after if streaming else None,
                              bandwidth_bps=bandwidth_bps if streaming else None)
    return cache if streaming else cache.pin_tier(tier)


@torch.inference_mode()
def continuation_logprobs(model, context: list[int], continuations: list[list[int]], mode: str,
                          lynx_config: LynxQuantConfig | None = None, prefilled=None) -> list[torch.Tensor]:
    """Log-probabilities [len(c), V] (float32) of each continuation's positions, given `context`'s KV in `mode`
    ("lynx" scores on its full tier: the residual has landed, as when verification runs). The prompt's last
    position is re-run against the transferred KV. `prefilled`: the context's `loader.prefill` output, to reuse."""
    if not context or any(not c for c in continuations):
        raise ValueError("context and every continuation need at least one token")
    ids = torch.tensor([context], dtype=torch.long, device=model.device)
    kv, logits = prefilled if prefilled is not None else prefill(model, ids)
    cfg, tier = mode_config(mode, lynx_config)
    cache = LynxCache.from_kv(model, len(context), kv, logits, cfg).pin_tier(tier)
    rows = [[context[-1], *c[:-1]] for c in continuations]   # row g: the last prompt token, then c_g but its last
    L = max(len(r) for r in rows)
    pad = context[-1]  # right padding: causal attention never lets a real position see it
    inp = torch.tensor([r + [pad] * (L - len(r)) for r in rows], dtype=torch.long, device=model.device)  # [G, L]
    if len(rows) > 1:
        cache.batch_repeat_interleave(len(rows))
    out = model(input_ids=inp, cache=cache, use_cache=True).logits.float()      # [G, L, V]
    logp = torch.log_softmax(out, -1)
    return [logp[g, : len(c)] for g, c in enumerate(continuations)]
