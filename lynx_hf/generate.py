"""The draft → verify → decode loop that `model.generate(prompt, cache=LynxCache(...), custom_generate=
speculative_generate, ...)` runs.

Input: the prompt whose KV the LynxCache holds (or, as before, the prompt plus the prefill's first token). The first
token comes from the prefill's last-position logits, through the caller's logits processors and sampling, like any
other token. Once all anchors are in, drafting runs on the anchor tier until the residual is (nearly) in, at most
`spec_config.max_draft_tokens` steps: greedy grows a token tree and verifies it in one pass (tree_draft.py);
sampling drafts a chain, and when the residual is in, the prompt switches to the full tier, the draft-phase tail is
dropped (it was computed against the anchor tier), and one forward pass over [last verified token, drafts] verifies
them (`spec.verify_chain`). Decoding then goes on with the full tier. The emitted tokens, scores
and logits are those of plain `generate` on full-tier KV (greedy and every deterministic option), or follow its
distribution (sampling). Knows nothing about tokenization or transport."""
from __future__ import annotations

import time

import torch
from torch import nn

from .cache import LynxCache
from .policy import DraftPolicy
from .spec import verify_chain
from .tree_draft import draft_tree, use_tree, verify_tree


class _Run:
    """State of one call: verified ids, the attention mask, stopping, outputs, streaming."""

    def __init__(self, model, input_ids, cache, model_kwargs, logits_processor, stopping_criteria, generation_config,
                 streamer):
        gc = generation_config
        self.model, self.cache, self.streamer = model, cache, streamer
        self.ids = input_ids  # [B, T]: verified ids, prompt included
        self.mask = model_kwargs.get("attention_mask")
        self.lp, self.sc = logits_processor, stopping_criteria
        self.do_sample = bool(gc.do_sample)
        has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
        pad = gc._pad_token_tensor
        # as plain generate: finished rows get the pad token only when an EOS criterion is present
        self.pad = pad.to(input_ids.device) if has_eos and pad is not None else None
        self.unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        keep = gc.return_dict_in_generate
        self.scores = [] if keep and gc.output_scores else None
        self.logits = [] if keep and gc.output_logits else None
        self.unstreamed: list[torch.Tensor] = []
        self.provisional = hasattr(streamer, "put_provisional")
        self.pending_drafts = 0
        self.t0 = time.perf_counter()

    def live(self) -> torch.Tensor:
        """Rows whose next tokens are real: unfinished rows when finished ones are padded, else every row."""
        return self.unfinished if self.pad is not None else torch.ones_like(self.unfinished)

    def pad_mask(self, length: int) -> torch.Tensor | None:
        """The 2D attention mask over the first `length` positions ([B, length] bool), None without padding."""
        if self.mask is None:
            return None
        extra = length - self.mask.shape[1]
        if extra > 0:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], extra)], dim=-1)
        return self.mask[:, :length].bool()

    def forward(self, new_ids: torch.Tensor, n_logits: int) -> torch.Tensor:
        """Run new_ids after the cache's current content; float32 logits of the last n_logits positions."""
        kw = {}
        am = self.pad_mask(self.cache.get_seq_length() + new_ids.shape[1])
        if am is not None:
            kw = {"attention_mask": am, "position_ids": (am.long().cumsum(-1) - 1).clamp_min(0)[:, -new_ids.shape[1]:]}
        out = self.model(input_ids=new_ids, cache=self.cache, use_cache=True, logits_to_keep=n_logits, **kw)
        return out.logits[:, -n_logits:].float()

    def process(self, ctx: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Processed scores [B, V] for the token after ctx, from raw logits [B, V] (left untouched)."""
        return self.lp(ctx, logits.to(copy=True, dtype=torch.float32))

    def pick(self, scores: torch.Tensor):
        """(token [B], probs [B, V] or None) from processed scores."""
        if self.do_sample:
            probs = nn.functional.softmax(scores, dim=-1)
            return torch.multinomial(probs, 1).squeeze(1), probs
        return scores.argmax(-1), None

    def pad_finished(self, tok: torch.Tensor) -> torch.Tensor:
        return tok if self.pad is None else torch.where(self.unfinished, tok, self.pad)

    def emit(self, tok: torch.Tensor, scores: torch.Tensor | None = None, logits: torch.Tensor | None = None) -> bool:
        """Append one verified token per row (streamed at the next flush); True when every row has stopped."""
        tok = self.pad_finished(tok)
        self.ids = torch.cat([self.ids, tok[:, None]], dim=-1)
        if self.scores is not None:
            self.scores.append(scores)
        if self.logits is not None:
            self.logits.append(logits.float())
        self.cache.timeline.append((time.perf_counter(), "verified"))
        if self.cache.stats["ttft_verified_s"] is None:
            self.cache.stats["ttft_verified_s"] = time.perf_counter() - self.t0
        self.unstreamed.append(tok)
        self.unfinished &= ~self.sc(self.ids, tuple(self.scores) if self.scores is not None else None)
        return not bool(self.unfinished.any())

    def resolve(self, n_kept: int) -> None:
        """Tell a provisional streamer how many of its pending drafts stood (the rest are retracted)."""
        if self.provisional and self.pending_drafts:
            self.streamer.resolve_provisional(n_kept)
        self.pending_drafts = 0

    def flush(self) -> None:
        if self.streamer is not None:
            for tok in self.unstreamed:
                self.streamer.put(tok.cpu())
        self.unstreamed.clear()


def speculative_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                         synced_gpus: bool = False, streamer=None, lynx_streamer=None, **model_kwargs):
    """`custom_generate` entry point. input_ids: the prompt whose KV `cache` holds ([B, P]), or the prompt plus the
    prefill's first token ([B, P + 1]). Every logits processor and stopping criterion applies to the first token,
    to drafts and to verified tokens alike. Streaming: transformers 5.x forwards only a callable's *extra*
    parameters, so `generate(streamer=...)` never reaches this function; pass the streamer as `lynx_streamer=`
    (any Transformers streamer; a SpeculativeStreamer also gets the provisional drafts). For the same reason
    `stop_strings=`/`tokenizer=` cannot reach generate's criteria builder; pass
    `stopping_criteria=[StopStringCriteria(tokenizer, stops)]`."""
    gc = generation_config
    cache = model_kwargs.get("cache")
    if not isinstance(cache, LynxCache):
        raise ValueError("speculative_generate needs cache=LynxCache(...) (e.g. from LynxCache.from_prefill)")
    if (gc.num_beams or 1) > 1 or (gc.num_return_sequences or 1) > 1:
        raise ValueError("speculative_generate decodes one sequence per prompt row: num_beams > 1 and "
                         "num_return_sequences > 1 are not supported")
    if gc.output_attentions or gc.output_hidden_states:
        raise ValueError("speculative_generate does not return attentions or hidden states")
    P, n_in = cache.prompt_len, input_ids.shape[1]
    if n_in not in (P, P + 1):
        raise ValueError(f"input_ids must be the {P} prompt tokens whose KV the cache holds (optionally followed by "
                         f"the prefill's first token), got {n_in} tokens")
    if cache.used:
        raise ValueError("this LynxCache was already used for a generation; build a new one per request")
    cache.used = True
    streamer = lynx_streamer if lynx_streamer is not None else streamer
    run = _Run(model, input_ids, cache, model_kwargs, logits_processor, stopping_criteria, gc, streamer)
    try:
        _generate(run, bare=n_in == P)
    except BaseException:
        run.resolve(0)  # provisional drafts never become final when verification did not happen
        raise
    finally:
        cache.close()
        if streamer is not None:
            streamer.end()
    if gc.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=run.ids, cache=cache,
                                         scores=tuple(run.scores) if run.scores is not None else None,
                                         logits=tuple(run.logits) if run.logits is not None else None)
    return run.ids


def _generate(run: _Run, bare: bool) -> None:
    cache, spec, P = run.cache, run.cache.spec_config, run.cache.prompt_len
    if run.streamer is not None:
        run.streamer.put(run.ids[:, :P].cpu())
    if bare:  # the first token, from the prefill's logits (no KV needed yet)
        logits = cache.wait_logits()
        if logits.shape[0] != run.ids.shape[0]:
            raise ValueError(f"the prefill's logits have {logits.shape[0]} rows, input_ids {run.ids.shape[0]}")
        logits = logits.to(run.ids.device)
        scores = run.process(run.ids, logits)
        done = run.emit(run.pick(scores)[0], scores, logits)
    else:  # the caller appended the prefill's first token
        run.unstreamed.append(run.ids[:, P])
        run.unfinished &= ~run.sc(run.ids, None)
        done = not bool(run.unfinished.any())
    run.flush()
    if done:
        return
    cache.wait_anchors()
    cache.stats["anchors_at_s"] = time.perf_counter() - run.t0
    drafting = spec.draft_while_waiting and spec.max_draft_tokens > 0 and not cache.residual_ready()
    if not drafting:
        cache.wait_residual()
    cache.set_tier("anchor" if drafting else "full")
    if drafting:
        if use_tree(run):
            tree, main = draft_tree(run)
            if cache.loader is not None:
                cache.loader.on_wait()  # a token-count schedule releases the residual now
            done = verify_tree(run, tree, main)
            if cache.residual_done_at is not None:
                cache.stats["residual_at_s"] = cache.residual_done_at - run.t0
        else:
            drafts, probs = _draft(run)
            cache.wait_residual()
            cache.stats["residual_at_s"] = time.perf_counter() - run.t0
            done = _verify(run, drafts, probs)
        if done:
            return
    # ordinary decoding on the full tier; the cache holds every verified token but the last
    while True:
        logits = run.forward(run.ids[:, -1:], 1)[:, -1]
        scores = run.process(run.ids, logits)
        done = run.emit(run.pick(scores)[0], scores, logits)
        run.flush()
        if done:
            return


def _draft(run: _Run):
    """Draft on the anchor tier until the residual is in, the budget is spent, or the drafts say stop (EOS, stop
    string, length) for every row. Returns (drafts [B, n], draft probs [B, n, V] or None)."""
    cache, spec = run.cache, run.cache.spec_config
    ctx, drafts, probs = run.ids, [], []
    going = run.unfinished.clone()
    max_len = getattr(run.sc, "max_length", None)
    policy = DraftPolicy(cache)
    while going.any() and len(drafts) < spec.max_draft_tokens and policy.another_step() and (
            max_len is None or ctx.shape[1] < max_len):
        t = time.perf_counter()
        tok, q = run.pick(run.process(ctx, run.forward(ctx[:, -1:], 1)[:, -1]))
        tok = run.pad_finished(tok)
        ctx = torch.cat([ctx, tok[:, None]], dim=-1)
        drafts.append(tok)
        probs.append(q)
        cache.timeline.append((time.perf_counter(), "draft"))
        if cache.stats["ttft_draft_s"] is None:
            cache.stats["ttft_draft_s"] = time.perf_counter() - run.t0
        if run.provisional:
            run.streamer.put_provisional(tok.cpu())
            run.pending_drafts += 1
        cache.stats["drafted"] += 1
        policy.stepped(time.perf_counter() - t)
        cache.notify_drafted(len(drafts))
        going &= ~run.sc(ctx, None)
    stacked = torch.stack(drafts, 1) if drafts else run.ids.new_zeros(run.ids.shape[0], 0)
    return stacked, (torch.stack(probs, 1) if run.do_sample and drafts else None)


def _verify(run: _Run, drafts: torch.Tensor, draft_probs) -> bool:
    """Switch to the full tier, re-run [last verified token, drafts] in one pass, keep the prefix that every live row
    accepted plus one token. Returns True when generation is over."""
    cache, P, n = run.cache, run.cache.prompt_len, drafts.shape[1]
    t = time.perf_counter()
    cache.timeline.append((t, "verify_start"))
    cache.set_tier("full")
    cache.crop(P - cache.get_seq_length())  # the draft-phase tail was computed against the anchor tier
    logits = run.forward(torch.cat([run.ids[:, P:], drafts], 1), n + 1)  # [B, n+1, V]: after each verified/draft
    ctx, L = torch.cat([run.ids, drafts], 1), run.ids.shape[1]
    scores = torch.stack([run.process(ctx[:, :L + j], logits[:, j]) for j in range(n + 1)], 1)  # [B, n+1, V]
    accepted, tokens = verify_chain(drafts, scores, draft_probs)
    live = run.live()
    keep = int(accepted[live].min()) if live.any() else n  # drafts that every live row accepted
    cache.stats["verify_s"] += time.perf_counter() - t
    cache.stats["rounds"] += 1
    emitted, done = 0, False
    while emitted <= keep and not done:
        done = run.emit(tokens[:, emitted], scores[:, emitted], logits[:, emitted])
        emitted += 1
    kept = min(emitted, keep)  # emitted drafts that verification accepted
    cache.stats["accepted"] += kept
    run.resolve(kept)
    run.flush()
    cache.crop(run.ids.shape[1] - 1 - cache.get_seq_length())  # keep every verified token but the last
    return done
