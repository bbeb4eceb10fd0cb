"""`speculative_generate`: the one draft → verify → decode loop that `model.generate(prompt, cache=LynxCache(...),
custom_generate=speculative_generate, ...)` runs.

The first token comes from the prefill's last-position logits, through the caller's logits processors and
sampling, like any other token. Once all anchors are in, a drafter (greedy: a token tree; sampling: a chain) runs
draft steps on the anchor tier while the residual streams in — at most `spec_config.max_draft_steps`, none once the
residual is due within `verify_lead` steps (`DraftPolicy`). Then the anchor-phase tail is dropped, the prompt
switches to the full tier layer by layer inside the verify pass (each layer as soon as its residual has landed, so
verification overlaps the end of the transfer), and each row keeps what the full tier accepts plus one token.
Decoding goes on with the full tier. The emitted tokens, scores and logits are those of plain `generate` on
full-tier KV (greedy and every deterministic option), or follow its distribution (sampling). The loop owns the
budget, the policy, stopping, streaming and telemetry; the drafters own their passes and their acceptance."""
from __future__ import annotations

import dataclasses
import time

from ..arch import refuse_encoder_decoder
from ..cache import LynxCache
from ..config import SpecConfig
from ..cache.conversation import extend_here
from .drafters import ChainDrafter, TreeDrafter
from .policy import DraftPolicy
from .state import DecodeState
from .support import drafting, refuse_model, refuse_options, warn_narrowed


class _Streams:
    """Where tokens go: `lynx` (a `lynx_streamer=`) and `given` (a `streamer=` when speculative_generate is called
    directly). Both get the prompt, then every verified column once, in order, and `end()` however generation ends;
    a `lynx` streamer that takes them also gets the provisional drafts."""

    def __init__(self, given, lynx):
        self.given, self.lynx = given, lynx
        self.all = [x for x in (given, lynx) if x is not None]
        self._ended = False

    @property
    def provisional(self) -> bool:
        return hasattr(self.lynx, "put_provisional")

    def put(self, value) -> None:
        for st in self.all:
            st.put(value)

    def put_provisional(self, value) -> None:
        self.lynx.put_provisional(value)

    def resolve_provisional(self, n: int) -> None:
        self.lynx.resolve_provisional(n)

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            for st in self.all:
                st.end()


def speculative_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                         synced_gpus: bool = False, streamer=None, lynx_streamer=None, spec_config=None,
                         stop_strings=None, token_healing=None, t0: float | None = None, **model_kwargs):
    """`custom_generate` entry point. input_ids: the prompt whose KV `cache` holds ([B, P]), or the prompt plus the
    prefill's first token ([B, P + 1]), or a conversation that extends what the cache holds. Every logits processor
    and stopping criterion applies to the first token, to drafts and to verified tokens alike. Streaming: pass
    `lynx_streamer=` (any Transformers streamer, or a SpeculativeStreamer to see the provisional drafts too): it gets
    the prompt, exactly the verified tokens plain `generate` would give a streamer, in order, and its `end()` however
    generation ends (an error included), so a `TextIteratorStreamer` consumer's loop always ends. Transformers 5.x
    hands a callable custom_generate only its own extra parameters: a `streamer=` given to `generate` stays with
    Transformers, which gives it the prompt and nothing more (docs/generate.md, "Streaming"); an `assistant_model=`
    is dropped there too. Drafting settings: `spec_config=` (a SpecConfig; default `SpecConfig.for_anchor` of the
    cache's anchor width); `t0=`: the request's start (time.perf_counter(); default: now), from which `cache.stats`'
    times count. For the same reason `tokenizer=` never reaches a callable, so `stop_strings` (declared here, so
    that generate does not fail first) is refused with the way out:
    `stopping_criteria=[StopStringCriteria(tokenizer, stops)]`, which stops at the same tokens (the Hub folder's
    `generate` builds it for you). Whatever cannot equal plain `generate` stops here at once with one error
    (engine/support.py: the prompt must be the one the cache was prefilled with, mask included; no contrastive
    search, DoLa, token healing, encoder-decoders; LongRoPE only within its original range; images only those the
    prompt was prefilled with); drafting narrows (chain in lock-step, or none, with a warning) where a model or a
    logits processor cannot take it. Stopping criteria see verified tokens only. Rows of a batch accept drafts
    independently (`cache.stats["accepted_per_row"]`); the scores of steps a finished, padded row did not run are
    −inf but 0 at the pad token (plain generate runs those rows on: docs/generate.md)."""
    if spec_config is not None and not isinstance(spec_config, SpecConfig):
        raise TypeError(f"spec_config must be a lynx_hf.SpecConfig, got {type(spec_config).__name__}")
    if t0 is not None and not isinstance(t0, float):
        raise TypeError(f"t0 must be a time.perf_counter() float, got {type(t0).__name__}")
    streams = _Streams(streamer, lynx_streamer)
    try:
        return _generate(model, input_ids, logits_processor, stopping_criteria, generation_config, streams,
                         spec_config, stop_strings, token_healing, model_kwargs, t0)
    finally:
        streams.end()


def _generate(model, input_ids, logits_processor, stopping_criteria, gc, streams: _Streams, spec, stop_strings,
              token_healing, model_kwargs, t0):
    cache = model_kwargs.get("cache")
    if not isinstance(cache, LynxCache):
        raise ValueError("speculative_generate needs cache=LynxCache(...) (e.g. from LynxCache.from_prefill)")
    conv = cache.conversation
    conv.listening = False  # generate marked the cache as given to it; this call takes it (no plain forward)
    # until it returns: a copy or fork of the cache, or another generate on it, is refused
    with conv.claim(holder="generate"):
        return _generate_claimed(model, input_ids, logits_processor, stopping_criteria, gc, streams, spec,
                                 stop_strings, token_healing, model_kwargs, cache, t0)


def _generate_claimed(model, input_ids, logits_processor, stopping_criteria, gc, streams: _Streams, spec,
                      stop_strings, token_healing, model_kwargs, cache, t0):
    conv = cache.conversation
    spec = spec or SpecConfig.for_anchor(cache.quant_config.anchor_bits)
    if cache.quant_config.exact:  # k drafts verified in one forward round unlike k one-token steps: no drafts
        spec = dataclasses.replace(spec, max_draft_steps=0)
    if (gc.num_beams or 1) > 1 or (gc.num_return_sequences or 1) > 1:
        raise ValueError("speculative_generate decodes one sequence per prompt row: num_beams > 1 and "
                         "num_return_sequences > 1 are not supported")
    if gc.output_attentions or gc.output_hidden_states:
        raise ValueError("speculative_generate does not return attentions or hidden states")
    if stop_strings:
        raise ValueError("stop_strings cannot work with custom_generate=speculative_generate: Transformers does not "
                         "hand a callable custom_generate its tokenizer. Pass stopping_criteria=[transformers."
                         "StopStringCriteria(tokenizer, stop_strings)] instead (the same stopping points)")
    refuse_options(gc, token_healing=bool(token_healing))
    refuse_encoder_decoder(model)
    conv.check_media(model_kwargs)  # their KV is in the cache: never run again here
    mask = model_kwargs.get("attention_mask")
    n_in = input_ids.shape[1]
    if conv.continues(input_ids):
        # a conversation goes on: only the new positions run here (their KV joins the held KV in full precision)
        extend_here(model, cache, input_ids, conv.continue_turn(input_ids, mask))
    P = cache.prompt_len
    if n_in not in (P, P + 1):
        raise ValueError(f"input_ids must be the {P} prompt tokens whose KV the cache holds (optionally followed by "
                         f"the prefill's first token), got {n_in} tokens")
    conv.check_prompt(input_ids[:, :P], None if mask is None else mask[:, :P])
    max_length = getattr(stopping_criteria, "max_length", None)
    max_pos = None if max_length is None else \
        (P if mask is None else int(mask[:, :P].sum(-1).max())) + max_length - P - 1
    refuse_model(model, max_pos)
    conv.start_generate(cache.pinned)
    cache.trace.start(t0)
    s = DecodeState(model, input_ids, cache, mask, logits_processor, stopping_criteria, gc,
                    streams if streams.all else None, spec)
    plan = drafting(model, logits_processor, stopping_criteria, s.do_sample, max_pos)
    if spec.draft_while_waiting and spec.max_draft_steps > 0:
        warn_narrowed(plan)
    s.ragged = plan.ragged
    ok = False
    try:
        _run(s, plan.mode, bare=n_in == P)
        ok = True
    except BaseException:
        s.resolve(0)  # provisional drafts never become final when verification did not happen
        raise
    finally:
        conv.end_generate(s.sequences() if ok else None)  # the cache now holds the conversation (or is broken)
        cache.trace.finish()
    ids = s.sequences()
    if gc.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        T = ids.shape[1]
        return GenerateDecoderOnlyOutput(
            sequences=ids, cache=cache,
            scores=s.stacked(s.scores, n_in, T) if s.scores is not None else None,
            logits=s.stacked(s.logits, n_in, T) if s.logits is not None else None)
    return ids


def _run(s: DecodeState, mode: str, bare: bool) -> None:
    cache, spec, stats = s.cache, s.spec, s.cache.stats
    if s.streamer is not None:
        s.streamer.put(s.seq[:, :s.P].cpu())
    if bare:  # the first token, from the prefill's logits (no KV needed yet)
        logits = cache.wait_logits()
        if logits.shape[0] != s.B:
            raise ValueError(f"the prefill's logits have {logits.shape[0]} rows, input_ids {s.B}")
        logits = logits.to(s.seq.device)
        scores = s.process(logits, s.seq[:, :s.P])
        s.emit(s.pick(scores)[0], scores, logits)
    else:  # the caller appended the prefill's first token
        done = s.sc(s.seq[:, :s.P + 1], None)
        for b, d in enumerate(done.tolist()):
            if d:
                s.finished[b], s.finish_len[b], s.parked[b] = True, s.P + 1, s.pad is not None
    s.flush()
    if s.all_done():
        return
    cache.wait_anchors()
    stats.anchors_at_s = cache.trace.since()
    if mode != "none" and spec.draft_while_waiting and spec.max_draft_steps > 0 and not cache.residual_ready():
        cache.set_tier("anchor")
        _draft_and_verify(s, spec, mode == "tree" and (spec.tree_width > 1 or spec.tree_branch > 1))
    else:
        cache.wait_residual()
        cache.set_tier("full")
    while not s.all_done():  # ordinary decoding on the full tier; the cache holds every verified token but the last
        n = list(s.n)
        logits = s.forward(s.last_tokens(), s.position([m - 1 for m in n])[:, None], 1)[:, -1]
        scores = s.process(logits, s.row_contexts)
        s.emit(s.pick(scores)[0], scores, logits)
        s.flush()


def _draft_and_verify(s: DecodeState, spec, tree: bool) -> None:
    """Draft steps on the anchor tier while the residual is (not nearly) in, then one verification pass."""
    cache, trace = s.cache, s.cache.trace
    drafter = TreeDrafter(s) if tree else ChainDrafter(s)
    budget = spec.max_draft_steps if s.max_length is None else min(spec.max_draft_steps, s.max_length - drafter.n0)
    policy = DraftPolicy(cache, spec.verify_lead)
    while drafter.steps < budget and drafter.can_step() and policy.another_step(nodes := drafter.next_nodes()):
        t = time.perf_counter()
        drafter.step()
        drafter.steps += 1
        trace.mark("draft")
        trace.stats.drafted += 1
        trace.stats.draft_nodes.append(nodes)
        policy.stepped(time.perf_counter() - t, nodes)
        cache.notify_drafted(drafter.steps)
    cache.need_residual()  # a step-count schedule releases the residual now; a real link just goes on
    trace.stats.draft_stop = policy.stop or ("budget" if drafter.steps >= budget else "drafted out")
    t = trace.mark("verify_start")
    s.drop_tail(s.P)  # the draft-phase tail was computed against the anchor tier
    cache.set_tier("full", per_layer=True)  # the verify pass runs each layer once its residual is in
    live = s.active_rows()
    accepted, stood = drafter.verify()
    trace.stats.verify_s += time.perf_counter() - t
    trace.stats.rounds += 1
    trace.stats.accepted_per_row = [int(a) for a in accepted]
    counted = [a for a, l in zip(accepted, live) if l]
    trace.stats.accepted = sum(counted) / len(counted) if counted else 0
    s.resolve(stood)
    s.flush()
