"""The draft → verify → decode loop that `model.generate(..., custom_generate=speculative_generate)` runs.

Input: `input_ids` = prompt (whose KV is in the LynxCache) + the prefill node's first token. Once all anchors are in,
tokens are drafted on the anchor tier (checking for the residual between steps, at most
`spec_config.max_draft_tokens`); when the residual is in, the prompt switches to the full tier, the draft-phase tail
is dropped (it was computed against the anchor tier), one forward pass over [first token, drafts] verifies them,
and decoding goes on with the full tier. The emitted tokens are exactly those of full-tier decoding (greedy) or
follow its distribution (sampling). Knows nothing about tokenization or transport."""
from __future__ import annotations

import time

import torch
from torch import nn

from .cache import LynxCache
from .spec import greedy_verify, rejection_verify


class _Run:
    """State of one call: verified ids, the attention mask, stopping, streaming."""

    def __init__(self, model, input_ids, cache, model_kwargs, logits_processor, stopping_criteria, generation_config,
                 streamer):
        self.model, self.cache, self.streamer = model, cache, streamer
        self.ids = input_ids
        self.mask = model_kwargs.get("attention_mask")
        self.lp, self.sc = logits_processor, stopping_criteria
        self.do_sample = bool(generation_config.do_sample)
        self.pad = generation_config._pad_token_tensor
        self.has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
        self.unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        self.t0 = time.perf_counter()

    def forward(self, new_ids: torch.Tensor, n_logits: int) -> torch.Tensor:
        """Run new_ids after the cache's current content; float32 logits of the last n_logits positions."""
        kw = {}
        if self.mask is not None:
            total = self.cache.get_seq_length() + new_ids.shape[1]
            extra = total - self.mask.shape[1]
            if extra > 0:
                self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], extra)], dim=-1)
            am = self.mask[:, :total]
            kw = {"attention_mask": am, "position_ids": (am.long().cumsum(-1) - 1).clamp_min(0)[:, -new_ids.shape[1]:]}
        out = self.model(input_ids=new_ids, cache=self.cache, use_cache=True, logits_to_keep=n_logits, **kw)
        return out.logits[:, -n_logits:].float()

    def pick(self, scores: torch.Tensor):
        """(token [B], probs [B, V] or None) from processed scores."""
        if self.do_sample:
            probs = nn.functional.softmax(scores, dim=-1)
            return torch.multinomial(probs, 1).squeeze(1), probs
        return scores.argmax(-1), None

    def emit(self, tok: torch.Tensor) -> bool:
        """Append one verified token per row; returns True when every row has stopped."""
        if self.has_eos and self.pad is not None:
            tok = torch.where(self.unfinished, tok, self.pad.to(tok.device))
        self.ids = torch.cat([self.ids, tok[:, None]], dim=-1)
        self.cache.timeline.append((time.perf_counter(), "verified"))
        if self.cache.stats["ttft_verified_s"] is None:
            self.cache.stats["ttft_verified_s"] = time.perf_counter() - self.t0
        if self.streamer is not None:
            self.streamer.put(tok.cpu())
        self.unfinished &= ~self.sc(self.ids, None)
        return not bool(self.unfinished.any())


def speculative_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                         synced_gpus: bool = False, streamer=None, lynx_streamer=None, **model_kwargs):
    """`custom_generate` entry point. Streaming: transformers 5.x forwards only a callable's *extra* parameters, so
    `generate(streamer=...)` sees the prompt and nothing else; pass the streamer as `lynx_streamer=` instead (any
    Transformers streamer; a SpeculativeStreamer also gets the provisional drafts). For the same reason
    `stop_strings=`/`tokenizer=` cannot reach generate's criteria builder; pass
    `stopping_criteria=[StopStringCriteria(tokenizer, stops)]`. All stopping criteria and logits processors apply
    to drafts and to verified tokens alike."""
    if lynx_streamer is not None:
        streamer = lynx_streamer
        streamer.put(input_ids.cpu())
    cache = model_kwargs.get("cache")
    if not isinstance(cache, LynxCache):
        raise ValueError("speculative_generate needs cache=LynxCache(...) (e.g. from LynxCache.from_prefill)")
    P = cache.prompt_len
    if input_ids.shape[1] != P + 1:
        raise ValueError(f"input_ids must be the {P} prompt tokens plus the prefill's first token "
                         f"({P + 1} in all), got {input_ids.shape[1]}")
    if cache.get_seq_length() not in (0, P):
        raise ValueError("this LynxCache was already used for a generation; build a new one per request")
    run = _Run(model, input_ids, cache, model_kwargs, logits_processor, stopping_criteria, generation_config, streamer)
    spec = cache.spec_config
    provisional = hasattr(streamer, "put_provisional")

    cache.wait_anchors()
    cache.stats["anchors_at_s"] = time.perf_counter() - run.t0
    drafting = spec.draft_while_waiting and spec.max_draft_tokens > 0 and not cache.residual_ready()
    if not drafting:
        cache.wait_residual()
    cache.set_tier("anchor" if drafting else "full")
    if run.sc(run.ids, None).all():
        return _finish(run, generation_config)

    drafts, qs = [], []
    ctx = run.ids  # verified ids + drafts so far
    max_len = getattr(run.sc, "max_length", None)
    while drafting:
        if cache.residual_ready() or len(drafts) >= spec.max_draft_tokens or (
                max_len is not None and ctx.shape[1] >= max_len):
            break
        scores = run.lp(ctx, run.forward(ctx[:, -1:], 1)[:, -1])
        tok, probs = run.pick(scores)
        ctx = torch.cat([ctx, tok[:, None]], dim=-1)
        drafts.append(tok)
        qs.append(probs)
        cache.timeline.append((time.perf_counter(), "draft"))
        if cache.stats["ttft_draft_s"] is None:
            cache.stats["ttft_draft_s"] = time.perf_counter() - run.t0
        if provisional:
            streamer.put_provisional(tok.cpu())
        cache.stats["drafted"] += 1
        cache.notify_drafted(len(drafts))
        if run.sc(ctx, None).all():
            break  # the drafts say stop (EOS, stop string, length): verify before anything becomes final

    if drafting:
        cache.wait_residual()
        cache.stats["residual_at_s"] = time.perf_counter() - run.t0
        if _verify(run, drafts, qs, provisional):
            return _finish(run, generation_config)
    # ordinary decoding on the full tier; the cache holds every verified token but the last
    while True:
        scores = run.lp(run.ids, run.forward(run.ids[:, -1:], 1)[:, -1])
        tok, _ = run.pick(scores)
        if run.emit(tok):
            return _finish(run, generation_config)


def _verify(run: _Run, drafts, qs, provisional: bool) -> bool:
    """Switch to the full tier, re-run [first token, drafts] in one pass, accept a prefix, emit the correction.
    Returns True when generation is over."""
    cache, P, n = run.cache, run.cache.prompt_len, len(drafts)
    t = time.perf_counter()
    cache.timeline.append((t, "verify_start"))
    cache.set_tier("full")
    cache.crop_to(P)  # the draft-phase tail was computed against the anchor tier
    seq = torch.cat([run.ids[:, P:], *[d[:, None] for d in drafts]], dim=-1) if n else run.ids[:, P:]
    logits = run.forward(seq, seq.shape[1])  # [B, 1 + n, V]: position j predicts the token after seq[:, :j+1]
    cache.stats["verify_s"] += time.perf_counter() - t
    cache.stats["rounds"] += 1
    accepted_all = 0
    done = False
    for j in range(n + 1):
        scores = run.lp(run.ids, logits[:, j])
        if j == n:  # every draft accepted: the bonus token
            tok, _ = run.pick(scores)
            ok = torch.zeros_like(tok, dtype=torch.bool)
        elif run.do_sample:
            ok, tok = rejection_verify(drafts[j], nn.functional.softmax(scores, dim=-1), qs[j])
        else:
            ok, tok = greedy_verify(drafts[j], scores)
        all_ok = bool(ok[run.unfinished].all()) if j < n else False
        done = run.emit(tok)
        if all_ok and not done:
            accepted_all += 1
            continue
        break
    cache.stats["accepted"] += accepted_all
    if provisional:
        run.streamer.resolve_provisional(accepted_all)
    cache.crop_to(run.ids.shape[1] - 1)
    return done


def _finish(run: _Run, generation_config):
    if run.streamer is not None:
        run.streamer.end()
    if generation_config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=run.ids, cache=run.cache)
    return run.ids
