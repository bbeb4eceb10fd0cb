"""What one generation may do, decided before its first token, so that its output is plain `generate`'s on the
full-tier KV or it stops at once with one clear error — never a silent difference.

  * `refuse_options(gc, token_healing)`: generation modes and options Lynx cannot reproduce (contrastive search,
    DoLa, assisted decoding, token healing) raise ValueError.
  * `drafting(model, lp, sc, do_sample, max_position)` → `Drafting(mode, ragged, why)`: "tree", "chain" or "none",
    and whether rows may accept drafts independently. Stopping criteria only ever see verified tokens, once per
    emitted column; rows accept independently only with Transformers' own criteria (a row group per length would
    call a criterion of the caller's more often than plain generate does). Drafting needs three things a model or
    an option may not give:
      - logits processors without state: a draft or a verify pass calls them on contexts that may never be emitted
        (classifier-free guidance keeps its own cache, SynthID its watermark state); known stateless processors
        are listed, one of ours declares `lynx_stateless = True`; any other turns drafting off.
      - rotary frequencies that do not depend on the pass: dynamic RoPE rescales by the largest position in a pass,
        so multi-token passes are exact only while every position stays inside the original range.
      - positions taken from `position_ids` and the 4D mask used as given (tree passes, holes in ragged rows):
        probed once per model (`honours_tree_inputs`) plus the models a short probe cannot expose; where it fails,
        the chain in lock-step.
  * `refuse_model(model, max_position)`: LongRoPE models whose generate recomputes the whole cache once the
    sequence passes `original_max_position_embeddings` (a transferred KV cannot follow) raise ValueError."""
from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from transformers import DynamicCache
from transformers.generation import logits_process as lp_mod
from transformers.generation import stopping_criteria as sc_mod
from transformers.generation.configuration_utils import GenerationMode

from ..arch import layer_windows
from .masks import attn_impl, layer_masks, takes_custom_masks

# pure functions of (input_ids, scores): calling them on drafts changes nothing that later calls see
STATELESS_PROCESSORS = tuple(getattr(lp_mod, n) for n in (
    "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "TemperatureLogitsWarper",
    "RepetitionPenaltyLogitsProcessor", "TopPLogitsWarper", "TopKLogitsWarper", "TopHLogitsWarper",
    "MinPLogitsWarper", "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper",
    "NoRepeatNGramLogitsProcessor", "SequenceBiasLogitsProcessor", "NoBadWordsLogitsProcessor",
    "PrefixConstrainedLogitsProcessor", "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor",
    "InfNanRemoveLogitsProcessor", "ExponentialDecayLengthPenalty", "LogitNormalization",
    "SuppressTokensAtBeginLogitsProcessor", "SuppressTokensLogitsProcessor", "WatermarkLogitsProcessor")
    if hasattr(lp_mod, n))


STATELESS_CRITERIA = (sc_mod.MaxLengthCriteria, sc_mod.MaxTimeCriteria, sc_mod.StopStringCriteria,
                      sc_mod.EosTokenCriteria, sc_mod.ConfidenceCriteria)


@dataclass(frozen=True)
class Drafting:
    mode: str          # "tree" | "chain" | "none"
    ragged: bool       # rows accept drafts independently (the engine's masks are honoured)
    why: str = ""      # why drafting is narrower than it could be ("" when it is not)


def refuse_options(gc, token_healing: bool = False) -> None:
    """token_healing: asked for as a generate argument (a callable custom_generate receives it apart from gc)."""
    mode = gc.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"speculative_generate decodes greedily or by sampling; this generation config asks for "
                         f"{mode.value.replace('_', ' ')} (penalty_alpha, dola_layers, num_beams, an assistant or "
                         f"prompt lookup), which it cannot reproduce")
    if token_healing or gc.token_healing:
        raise ValueError("token_healing rewrites the prompt's last tokens, whose KV the cache already holds: heal the "
                         "prompt before the prefill (model.heal_tokens(ids, tokenizer)) and build the cache from it")


def stateful_processors(lp) -> list[str]:
    """Names of the logits processors that may keep state between calls."""
    return [type(p).__name__ for p in lp
            if not (isinstance(p, STATELESS_PROCESSORS) or getattr(p, "lynx_stateless", False))]


def _rotary(model):
    mods = model.modules() if hasattr(model, "modules") else []
    return [m for m in mods if hasattr(m, "rope_type") and hasattr(m, "original_max_seq_len")]


def _rope_types(model) -> set[str]:
    out = set()
    for m in _rotary(model):
        t = m.rope_type
        out.update(t.values() if isinstance(t, dict) else [t])
    return out


def _original_max(model) -> int | None:
    c = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    rp = getattr(c, "rope_parameters", None) or {}
    if isinstance(rp, dict) and "original_max_position_embeddings" in rp:
        return int(rp["original_max_position_embeddings"])
    v = getattr(c, "original_max_position_embeddings", None)
    if v is not None:
        return int(v)
    lens = [int(m.original_max_seq_len) for m in _rotary(model)]
    return min(lens) if lens else None


def refuse_model(model, max_position: int | None) -> None:
    """max_position: the largest logical position this generation can reach (None: unbounded)."""
    if "longrope" in _rope_types(model):
        limit = _original_max(model)
        if limit is not None and (max_position is None or max_position + 1 > limit):
            raise ValueError(f"this model's LongRoPE switches frequencies once the sequence passes "
                             f"original_max_position_embeddings ({limit}), where Transformers' generate recomputes "
                             f"the whole cache; a transferred KV cannot follow: keep prompt + new tokens within "
                             f"{limit}")


def drafting(model, lp, sc, do_sample: bool, max_position: int | None) -> Drafting:
    stateful = stateful_processors(lp)
    if stateful:
        return Drafting("none", False, f"logits processors that may keep state between calls ({', '.join(stateful)}) "
                                       f"must not see drafts; set `lynx_stateless = True` on one that has none")
    if any("dynamic" in t for t in _rope_types(model)):
        limit = _original_max(model)
        if limit is None or max_position is None or max_position + 1 > limit:
            return Drafting("none", False, f"dynamic RoPE rescales by a pass's largest position once past {limit}: "
                                           f"only one-token passes are exact there")
    ok, why = honours_tree_inputs(model)
    if not ok:
        return Drafting("chain", False, why)
    ragged = all(isinstance(c, STATELESS_CRITERIA) for c in sc)
    return Drafting("chain" if do_sample else "tree", ragged)


def warn_narrowed(d: Drafting) -> None:
    if d.why:
        warnings.warn(f"Lynx drafts {'nothing' if d.mode == 'none' else 'a chain in lock-step'} here: {d.why}",
                      stacklevel=4)


# -- does the model take positions from position_ids and the 4D mask as given? ------------------------------------
_PROBED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _known_offender(model) -> str | None:
    """What a short probe cannot expose: effects that appear only far along the sequence."""
    c = model.config.get_text_config(decoder=True)
    if "local" in (getattr(c, "attention_layers", None) or []):
        return "its local attention layers apply their window by cache index"
    if getattr(c, "attn_temperature_tuning", False) and 0 in (getattr(c, "no_rope_layers", None) or []):
        return "its NoPE layers scale attention by the cache index"
    return None


def honours_tree_inputs(model) -> tuple[bool, str]:
    """(True, "") when the model takes positions from `position_ids` and uses a custom 4D mask as given, checked once
    per model, attention implementation and dtype: a tree-shaped pass after a cached prefix must give the logits
    of the same tokens run in order. A model may declare `lynx_tree_inputs = True` to skip the probe."""
    if not takes_custom_masks(model):
        return False, f"the {attn_impl(model)!r} attention takes no custom 4D mask"
    if getattr(model, "lynx_tree_inputs", False):
        return True, ""
    key = (attn_impl(model), str(next(model.parameters()).dtype))
    hit = _PROBED.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    why = _known_offender(model)
    verdict = (False, why) if why else _probe(model)
    _PROBED[model] = (key, verdict)
    return verdict


@torch.no_grad()
def _probe(model) -> tuple[bool, str]:
    name = getattr(model.config, "model_type", "model")
    dev = next(model.parameters()).device
    V = int(model.config.get_text_config().vocab_size)
    pad = getattr(model.config, "pad_token_id", None)
    toks = [t for t in range(3, min(V, 64)) if t != pad]
    if len(toks) < 6:
        return True, ""
    g = torch.Generator().manual_seed(0)
    pick = [toks[int(i)] for i in torch.randperm(len(toks), generator=g)[:6]]
    prefix = torch.tensor([pick[:3]], device=dev)                       # positions 0..2
    b, c, d = pick[3:]
    windows = layer_windows(model.config)
    layers = [SimpleNamespace(is_sliding=w is not None, offset=0, sliding_window=w) for w in windows]
    dtype = next(model.parameters()).dtype
    try:
        ref = _run_prefix(model, prefix)
        r = model(input_ids=torch.tensor([[c, d]], device=dev), cache=ref, use_cache=True,
                  position_ids=torch.tensor([[3, 4]], device=dev)).logits[0].float()         # [2, V]
        cache = _run_prefix(model, prefix)
        # the tree pass: b and c both at position 3 (siblings), d at 4 under c; each sees the prefix and its path
        vis = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 1, 1]], dtype=torch.bool,
                           device=dev)[None]                                                  # [1, 3, 6]
        q_pos = torch.tensor([[3, 3, 4]], device=dev)
        k_pos = torch.tensor([[0, 1, 2, 3, 3, 4]], device=dev)
        t = model(input_ids=torch.tensor([[b, c, d]], device=dev), cache=cache, use_cache=True, position_ids=q_pos,
                  attention_mask=layer_masks(model, layers, dtype, vis, q_pos, k_pos)).logits[0, 1:].float()
    except Exception as e:  # noqa: BLE001 — a model that cannot take the tree's inputs at all
        return False, f"{name} fails on a tree pass ({type(e).__name__}: {str(e)[:120]})"
    tol = (1e-3 if dtype == torch.float32 else 3e-2) * (1.0 + float(r.abs().max()))
    err = float((t - r).abs().max())
    if not err <= tol:
        return False, f"{name} does not take positions from position_ids and the 4D mask as given (probe error " \
                      f"{err:.3g})"
    return True, ""


def _run_prefix(model, prefix):
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix, cache=cache, use_cache=True,
          position_ids=torch.arange(prefix.shape[1], device=prefix.device)[None])
    return cache
