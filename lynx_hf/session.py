"""Conversations, in this process and over the network alike. A `Session` is one conversation: its LynxCache stays
with it between turns, so each turn computes and ships only the positions the cache does not hold. It runs on a
*link*, what computes a turn's prompt KV and hands it to the decode side: `LocalLink(model)` (the in-process
prefill node of lynx_hf.local; optionally over a simulated link) or a `transfer.DecodeClient` (a prefill server
over the network). Both answer `generate(ids, cache=..., keep_cache=..., **options) -> TurnResult` by one set of
rules:

- a turn's arguments are checked before anything is computed or sent (`check_turn`), with one context rule
  (`arch.context_budget`: generation stops where the model's context ends, `finish_reason` "context");
- a turn runs on a branch of the cache (`LynxCache.fork`), which replaces the session's only once the turn
  succeeded: a refused or failed turn leaves the conversation exactly as it was;
- threads may share a link: its turns take turns.

Terms: a *turn* is one generate of the whole conversation so far (ids, or chat messages rendered with the
tokenizer's chat template); `turn_ends` are the positions the cache held after each of this session's turns, which
`rollback(n)` goes back to; `fork()` is an independent branch."""
from __future__ import annotations

import operator
import dataclasses
import threading
import time
from dataclasses import dataclass

import torch

from .arch import context_budget, logits_width, max_prompt_tokens
from .cache import LynxCache
from .cache.conversation import extend_here
from .config import AUTO, LynxQuantConfig, SpecConfig
from .trace import DictReads, Stats
from .width import kept_width


@dataclass
class TurnResult(DictReads):
    """What a link's (and `Session`'s) `generate` returns; reads like a dict too (`r["tokens"]`). Times count from
    the turn's start (over the network: sending the request, = its arrival at the prefill process on loopback): to
    the first token this process produced (draft or verified), to the first verified one (= stats'
    ttft_verified_s), to the 32nd; decode_start_s to the first token after the first (a draft on the anchor, or a
    verified one): the first that needs the KV, since the first token comes from the prefill's logits alone;
    verified_2_s to the second verified token (Lynx: after the verify pass, on the full tier)."""

    tokens: list                 # the generated ids (the first included)
    t0: float                    # perf_counter when the turn started
    cache: LynxCache             # this turn's cache: continue the conversation with it
    held_tokens: int             # tokens the cache held already (not computed or shipped again)
    prefix_hit: int | None       # tokens the prefill server found in its prefix cache (None: in process)
    ttft_s: float | None
    ttft_verified_s: float | None
    tt32t_s: float | None
    prefill_s: float | None      # the prefill side's compute time
    stats: Stats                 # what the engine did (lynx_hf.trace.Stats; reads like a dict too)
    events: list                 # stream arrivals (Trace.events)
    timeline: list               # the decode side's tokens (Trace.timeline)
    bytes: int                   # encoded bytes received, both streams
    anchor_bytes: int
    h2d_bytes: int               # bytes moved onto the cache's device
    cancelled: bool              # an early stop cancelled frames still queued
    dropped_frames: int
    placed_segments: int
    loader_error: str | None
    finish_reason: str = "length"  # "length" (max_new_tokens), "context" (the model's context ended), "stop"
    prefilled_on: str = "prefill"  # where the turn's new positions were computed: "prefill" or "decode" (Placement)
    width: dict | None = None    # anchor_bits "auto": the width chosen, why, each width's forecast (stats.width)
    logits_s: float | None = None  # when the prefill's logits landed (None: they were there before the turn began)
    decode_start_s: float | None = None  # the second token, the first decode-side one (None: one token only)
    verified_2_s: float | None = None    # the second verified token (None: one token only)

    @classmethod
    def of(cls, tokens, t0, cache, held, prefix_hit, loader, max_new: int, clipped: bool,
           prefilled_on: str = "prefill", refused: str | None = None) -> "TurnResult":
        gen, ver = cache.trace.times("draft", "verified"), cache.trace.times("verified")
        error = getattr(loader, "error", None)
        reason = ("context" if clipped else "length") if len(tokens) == max_new else "stop"
        return cls(tokens, t0, cache, held, prefix_hit, gen[0], ver[0], ver[min(32, len(ver)) - 1],
                   getattr(loader, "prefill_s", None), dataclasses.replace(cache.stats, held_refused=refused),
                   list(cache.trace.events),
                   list(cache.trace.timeline), cache.nbytes(), cache.nbytes("anchor"), cache.nbytes("staged"),
                   getattr(loader, "cancelled", False), getattr(loader, "dropped", 0), getattr(loader, "placed", 0),
                   None if error is None else str(error), reason, prefilled_on, cache.stats.width,
                   None if cache.trace.logits_at is None else cache.trace.logits_at - t0,
                   gen[1] if len(gen) > 1 else None, ver[1] if len(ver) > 1 else None)


PLACES = ("auto", "prefill", "decode")


class Placement:
    """Where a continued turn's new positions are computed — on the prefill node (their KV then crosses the link,
    anchor first) or here on the decode node, in full precision (NVIDIA Dynamo calls this conditional
    disaggregation). `mode` "prefill" or "decode" forces one; "auto" picks the one expected to give the first token
    sooner, from rates measured online: the prefill node's is the last remote turn's time to its first token per
    new position (what a short turn costs is then over-, never under-estimated: the fixed costs are spread over more
    positions), this node's the last local turn's compute per new position (before the first: one timed forward).
    A first turn (nothing held) always goes to the prefill node."""

    def __init__(self, mode: str = "prefill"):
        if mode not in PLACES:
            raise ValueError(f"prefill_on must be one of {', '.join(PLACES)}, got {mode!r}")
        self.mode = mode
        self.remote_s_per_token: float | None = None
        self.local_s_per_token: float | None = None

    def choose(self, new_tokens: int, held: int, probe=None, mode: str | None = None) -> str:
        """"prefill" or "decode" for a turn of `new_tokens` new positions behind `held` held ones; `probe()`
        returns this node's seconds per position when nothing has been measured here yet; `mode` overrides this
        placement's for one turn."""
        mode = self.mode if mode is None else mode
        if mode not in PLACES:
            raise ValueError(f"prefill_on must be one of {', '.join(PLACES)}, got {mode!r}")
        if held == 0 or mode == "prefill":
            return "prefill"
        if mode == "decode":
            return "decode"
        if self.remote_s_per_token is None:
            return "prefill"
        if self.local_s_per_token is None and probe is not None:
            self.local_s_per_token = probe()
        local = self.local_s_per_token
        return "decode" if local is not None and local < self.remote_s_per_token else "prefill"

    def observe(self, where: str, new_tokens: int, seconds: float | None) -> None:
        if seconds is None or new_tokens < 1:
            return
        if where == "prefill":
            self.remote_s_per_token = seconds / new_tokens
        else:
            self.local_s_per_token = seconds / new_tokens


def decode_turn(model, ids: torch.Tensor, cache: LynxCache, spec: SpecConfig, max_new: int, gen_kwargs: dict,
                t0: float):
    """The decode side's generate of one turn on `cache`, for every link: a `streamer=` is handed to
    speculative_generate as its `lynx_streamer` (Transformers would keep a streamer= itself), greedy by default;
    every time counts from `t0`, the turn's start."""
    from .engine import speculative_generate

    if "streamer" in gen_kwargs and "lynx_streamer" not in gen_kwargs:
        gen_kwargs = {**gen_kwargs, "lynx_streamer": gen_kwargs["streamer"]}
        del gen_kwargs["streamer"]
    return model.generate(ids, cache=cache, custom_generate=speculative_generate, spec_config=spec, t0=t0,
                          max_new_tokens=max_new, **{"do_sample": False, **gen_kwargs})


def check_turn(model, vocab: int, context: int, input_ids, max_new_tokens, cache) -> tuple[torch.Tensor, int]:
    """A turn's arguments, checked before anything is computed, sent or any cache touched: ids a non-empty list of
    ints within the vocabulary and the model's context, max_new_tokens an int >= 1, `cache` one that can be
    continued. Returns the ids as [1, L] on the model's device and the tokens it may generate (`context_budget`)."""
    bad = ValueError(f"input_ids must be a non-empty list of token ids (one sequence), got {str(input_ids)[:80]}")
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() > 2 or input_ids.dim() == 2 and input_ids.shape[0] != 1 or input_ids.is_floating_point():
            raise bad
        input_ids = input_ids.reshape(-1).tolist()
    try:
        ids = [operator.index(i) for i in input_ids]
    except TypeError:
        raise bad from None
    if not ids:
        raise bad
    if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"token id out of range [0, {vocab})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if cache is not None and not isinstance(cache, LynxCache):
        raise TypeError(f"cache must be a LynxCache (a previous result's \"cache\"), got {type(cache).__name__}")
    return (torch.tensor([ids], device=next(model.parameters()).device),
            context_budget(context, len(ids), max_new_tokens))


class LocalLink:
    """The in-process link: this process prefills each turn's new positions in full precision, encodes them, and
    hands them to the decode side anchor first (at once, after `residual_after_steps` draft steps, or over a
    simulated link of `bandwidth_bps`), exactly as a prefill server's answer arrives — lynx_hf.local's
    `from_prefill` for a first turn, `add_turn` after."""

    def __init__(self, model, residual_after_steps: int | None = None, bandwidth_bps: float | None = None):
        self.model, self.residual_after_steps, self.bandwidth_bps = model, residual_after_steps, bandwidth_bps
        self.context = max_prompt_tokens(model)
        self.vocab = logits_width(model)
        self._lock = threading.Lock()  # one turn at a time on the model

    def generate(self, input_ids, quant_config: LynxQuantConfig | None = None, max_new_tokens: int = 32,
                 speculative: bool = True, spec_config: SpecConfig | None = None, cache: LynxCache | None = None,
                 keep_cache: bool = False, **gen_kwargs) -> TurnResult:
        """As `DecodeClient.generate`, in this process (the same arguments, result and failure rules)."""
        from . import local  # (the prefill side registers LynxCache's constructors)

        ids, max_new = check_turn(self.model, self.vocab, self.context, input_ids, max_new_tokens, cache)
        cfg = cache.quant_config if cache is not None and quant_config is None else quant_config or LynxQuantConfig()
        with self._lock:
            t0 = time.perf_counter()
            keep = keep_cache or cache is not None
            if cache is None:
                cache, _ = local.LynxCache.from_prefill(self.model, ids, cfg, self.residual_after_steps,
                                                        bandwidth_bps=self.bandwidth_bps)
                held = 0
            else:  # the turn runs on a branch: whatever fails, `cache` stays as it was
                cache = cache.fork()
                if cfg.exact:  # exact mode: the new positions over the held KV, here, as Transformers' turn does
                    held = cache.conversation.continue_turn(ids)
                    extend_here(self.model, cache, ids, held)
                else:
                    local.add_turn(self.model, cache, ids, self.residual_after_steps, self.bandwidth_bps)
                    held = cache.stats.held_tokens
                if cfg.anchor_bits == AUTO:  # wherever its new positions were computed
                    cache.trace.stats.width = kept_width(cache.quant_config.anchor_bits).as_dict()
            loader = cache.loader
            spec = spec_config or SpecConfig.for_anchor(cache.quant_config.anchor_bits,  # (auto: the width taken)
                                                        max_draft_steps=64 if speculative else 0)
            out = decode_turn(self.model, ids, cache, spec, max_new, gen_kwargs, t0)
            if not keep:
                cache.close()  # an early stop ends the simulated link
        tokens = out[0, ids.shape[1]:].tolist()
        return TurnResult.of(tokens, t0, cache, held, None, loader, max_new, max_new < max_new_tokens,
                             "decode" if held and cfg.exact else "prefill")

    def session(self, cache: LynxCache | None = None, tokenizer=None, **defaults) -> "Session":
        return Session(self, cache=cache, tokenizer=tokenizer, **defaults)


class Session:
    """One conversation on a link (`LocalLink`, `DecodeClient`; a model: a LocalLink of it): the LynxCache stays
    here between turns, so each turn says what it holds and only the new positions are computed and shipped.
    `generate(conversation, **kw)` takes the whole conversation so far — token ids, or chat messages rendered with
    the tokenizer's chat template — and returns a TurnResult.

    A turn is transactional: it runs on a branch of the cache, which replaces `cache` only once the turn succeeded.
    A refused turn (a bad argument, the context, the server's refusal) leaves the conversation and the connection
    as they were; a failed connection (`client.broken`) leaves the conversation, to go on over another
    (`reconnect`). `fork()` branches the conversation; `rollback(n)` undoes the last n turns."""

    def __init__(self, client, on_mismatch: str = "crop", cache: LynxCache | None = None, tokenizer=None,
                 **defaults):
        """client: the link (a model: `LocalLink(model)`). on_mismatch: what a turn whose ids contradict the held
        ones does — "crop" (a chat re-templated each turn may re-tokenize earlier text: the cache keeps the common
        prefix, the rest is computed again) or "error". cache: the conversation so far (None: a new one).
        tokenizer: renders chat messages (its chat template). defaults: the link's generate options, every turn."""
        if on_mismatch not in ("crop", "error"):
            raise ValueError(f"on_mismatch must be 'crop' or 'error', got {on_mismatch!r}")
        if isinstance(client, torch.nn.Module):
            client = LocalLink(client)
        self.client, self.defaults, self.cache, self.on_mismatch = client, defaults, cache, on_mismatch
        self.tokenizer = tokenizer
        self.turn_ends: list[int] = []  # positions the cache held after each turn of this session

    def generate(self, conversation, tools: list | None = None, **kw) -> TurnResult:
        """The next turn: `conversation` is the ids so far, or a list of chat messages ({"role", "content"}; with
        `tools=` passed to the template) rendered with `add_generation_prompt`."""
        ids = self.render(conversation, tools)
        if self.cache is not None:
            self.cache.on_mismatch = self.on_mismatch
        r = self.client.generate(ids, cache=self.cache, keep_cache=True, **{**self.defaults, **kw})
        self.cache = r.cache
        self.turn_ends.append(len(ids) + len(r.tokens) - 1)
        return r

    def render(self, conversation, tools: list | None = None) -> list[int]:
        """Token ids of `conversation` (ids pass through; messages through the tokenizer's chat template)."""
        if isinstance(conversation, (list, tuple)) and conversation and all(isinstance(m, dict) for m in conversation):
            if self.tokenizer is None:
                raise ValueError("chat messages need a tokenizer: client.session(tokenizer=tok)")
            out = self.tokenizer.apply_chat_template(list(conversation), tools=tools, add_generation_prompt=True,
                                                     tokenize=True)
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        if tools is not None:
            raise ValueError("tools= goes with chat messages (a list of {'role', 'content'}), not token ids")
        return conversation

    def fork(self, client=None) -> "Session":
        """An independent branch of this conversation (its cache copied; the KV shared until either side writes),
        on this session's connection or on `client`."""
        s = Session(client or self.client, self.on_mismatch, None if self.cache is None else self.cache.fork(),
                    self.tokenizer, **self.defaults)
        s.turn_ends = list(self.turn_ends)
        return s

    def rollback(self, n_turns: int = 1) -> "Session":
        """Undo the last `n_turns` turns of this session: the cache goes back to what it held after the turn before
        them (every turn undone: a new conversation), so the next turn continues from there."""
        if isinstance(n_turns, bool) or not isinstance(n_turns, int) or not 1 <= n_turns <= len(self.turn_ends):
            raise ValueError(f"rollback takes 1 to {len(self.turn_ends)} turns (this session's), got {n_turns!r}")
        keep = self.turn_ends[:-n_turns]
        if keep:
            self.cache.conversation.rewind(keep[-1])
        else:
            self.cache = None
        self.turn_ends = keep
        return self

    def reconnect(self, client) -> "Session":
        """Go on with this conversation over another connection (e.g. after `client.broken`): its next turn says
        what the cache holds, so only the new positions are shipped."""
        self.client = client
        return self

    @property
    def held_ids(self) -> list[int]:
        """The conversation as the cache holds it (every token but the last reply's last one)."""
        return [] if self.cache is None or self.cache.held_ids is None else self.cache.held_ids[0].tolist()
