"""Conversation turns on a LynxCache (a mixin of `LynxCache`): what the cache holds once a generation is over (`held_ids`),
how a later `generate` continues it (`continue_turn`, then the new positions run here — `extend_here` — or arrive
through a loader behind the held prefix — `begin_range`, `add_turn`), which images a generate may bring
(`check_media`), and `copy.deepcopy` as a branch. State: `_phase` is "fresh" (serves the prompt it was filled
with), "busy" / "plain" (inside a generate call: custom_generate / plain), "held" (a generation is over) or
"broken" (one failed part-way); `_tokens` [B, N] are the ids by absolute position."""
from __future__ import annotations

import copy
import inspect
import sys
import threading

import torch

from ..arch import media_inputs, media_key, refuse_encoder_decoder
from ..trace import Trace

BUSY = "this LynxCache is in use by a generate call that has not finished"
BROKEN = ("a generation on this LynxCache failed part-way, so what it holds is unknown: build a new one from the prefill "
          "(LynxCache.from_prefill or a new request)")


class Turns:
    """Methods of LynxCache for conversations; the state lives in LynxCache.__init__."""

    @property
    def turns(self) -> int:
        """Generations run on this cache."""
        self._settle()
        return self._turns

    @property
    def held_ids(self) -> torch.Tensor | None:
        """[B, held]: the ids whose KV this cache holds once a generation is over (None before)."""
        self._settle()
        if self._phase != "held":
            return None
        return self._tokens[:, :min(self.layers[0].end, self._tokens.shape[1])]

    def continues(self, input_ids: torch.Tensor) -> bool:
        """Whether a generate of `input_ids` [B, L] continues what the cache holds: a conversation after a generation,
        or a fresh prompt that the ids extend by more than one token (rather than the prompt it was filled with)."""
        self._settle()
        return self._phase == "held" or (self._phase == "fresh" and input_ids.shape[1] > self.prompt_len + 1
                                         and self._tokens is not None)

    def _settle(self) -> None:
        """A plain generate call that ran is over once anything else touches the cache: it holds what was run."""
        if self._phase == "plain":
            self._phase = "held" if self._ran else self._before
            if self._ran:
                self._turns += 1
                self.close()

    def _enter_plain_generate(self) -> None:
        self._settle()
        g = generate_locals()
        if g is not None and callable(g.get("custom_generate")):
            return  # speculative_generate takes the call
        if self._phase in ("busy", "broken"):
            raise ValueError(BUSY if self._phase == "busy" else BROKEN)
        if g is not None and isinstance(g.get("self"), torch.nn.Module):
            refuse_encoder_decoder(g["self"])
            if not self._bound:
                self.bind(g["self"])
        self._strip = self.check_media((g or {}).get("model_kwargs") or {})
        self._before, self._ran = self._phase, False
        if self._phase == "held":
            if g is None:
                raise ValueError("continuing a LynxCache needs Transformers' own generate (its input_ids were not found)")
            mask = (g.get("model_kwargs") or {}).get("attention_mask")
            self.continue_turn(g["input_ids"], mask)
            self._first_plain = False
        else:
            if g is not None and g.get("input_ids") is not None:  # the whole prompt, not only its last token
                ids, mask = g["input_ids"], (g.get("model_kwargs") or {}).get("attention_mask")
                if ids.shape[1] < self.prompt_len:
                    raise ValueError(f"generate got {ids.shape[1]} tokens but this LynxCache holds a "
                                     f"{self.prompt_len}-token prompt: pass that prompt (or a conversation extending it)")
                P = self.prompt_len
                if self._prompt is not None and ids.shape[0] != len(self._prompt[1]):
                    raise ValueError(f"LynxCache holds {len(self._prompt[1])} sequence(s) but generate runs "
                                     f"{ids.shape[0]}: num_beams > 1 and num_return_sequences > 1 are not supported")
                self.check_prompt(ids[:, :P], None if mask is None else mask[:, :P])
            self._first_plain = True
        self._phase = "plain"

    def _record(self, ids: torch.Tensor) -> None:
        """The ids a plain generate runs, by position (the cache's length before the forward)."""
        pos, n = self.get_seq_length(), ids.shape[1]
        if self._tokens is None:
            return
        if self._tokens.shape[1] < pos + n:
            grow = self._tokens.new_zeros(self._tokens.shape[0], pos + n - self._tokens.shape[1])
            self._tokens = torch.cat([self._tokens, grow], 1)
        self._tokens[:, pos:pos + n] = ids.detach().cpu()

    def _seal_all(self) -> None:
        """Make the conversation plain full-precision KV (waiting for the residual if it is still streaming)."""
        if all(l.sealed for l in self.layers):
            return
        if any(l.tier != "full" for l in self.layers):
            with self._lock:
                gone = self.loader is None and not self._complete("residual")
            if gone:
                raise ValueError("this LynxCache cannot be continued: its residual stream was stopped before it landed "
                                 "(a cache pinned to the anchor tier, or a cancelled request)")
            self.wait_residual()
            with self._lock:
                snaps = [self._snapshot(l) for l in self.layers]
            for l, snap in zip(self.layers, snaps):
                if l.tier != "full":
                    l.materialise("full", snap, self.dtype, self.device)
        self.close()
        for l in self.layers:
            l.rerun = 0
            l.seal()
        if self._tokens is not None and self.layers[0].end > self._tokens.shape[1]:  # KV of drafts past an EOS
            for l in self.layers:
                l.crop_to(self._tokens.shape[1])

    def continue_turn(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Make a held cache (or a fresh one, whose prompt `input_ids` extends) ready for the turn `input_ids` [1, L]:
        check `input_ids[:, :held]` against the ids it holds, drop what a contradiction (`on_mismatch="crop"`) or a
        turn without a new token leaves behind, and return `start`: positions [start, L) are new (start < L)."""
        self._settle()
        if self._phase in ("busy", "plain", "broken"):
            raise ValueError(BROKEN if self._phase == "broken" else BUSY)
        if self._tokens is None:
            raise ValueError("this LynxCache does not know the ids it holds (built without expect_prompt): it cannot "
                             "be continued")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or self._tokens.shape[0] != 1:
            raise ValueError("continuing a conversation on a LynxCache takes one row: continue each row on its own "
                             "cache (copy.deepcopy(cache) then cache.batch_select_indices([row])), or prefill the "
                             "batch anew with LynxCache.from_prefill")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("a continued turn cannot have padding (its attention_mask has zeros)")
        self._seal_all()
        self._phase = "held"
        held, L = self.layers[0].end, input_ids.shape[1]
        known, ids = self._tokens[0, :held], input_ids[0].detach().cpu().long()
        m = min(held, L)
        diff = (ids[:m] != known[:m]).nonzero()
        if len(diff):
            d = int(diff[0])
            if self.on_mismatch != "crop":
                raise ValueError(f"input_ids contradict the conversation this LynxCache holds: position {d} is token "
                                 f"{int(ids[d])} here but {int(known[d])} in the cache ({held} tokens held). Pass the "
                                 f"conversation as the cache holds it (cache.held_ids, then the new tokens), or set "
                                 f"cache.on_mismatch = 'crop' to drop the cached KV from position {d} on and recompute it")
            m = d
        start = min(m, L - 1)
        if start < held:
            for l in self.layers:
                l.crop_to(start)
        self._tokens = ids[None].clone()
        return start

    @torch.no_grad()
    def extend_here(self, model, input_ids: torch.Tensor, start: int) -> None:
        """Run the new positions [start, L) of `input_ids` through `model` on this cache (after `continue_turn`), as
        Transformers does with its own caches: their KV joins the held KV in full precision and the last position's
        logits become the turn's first-token logits. The cache then serves `input_ids` as a fresh prompt."""
        L = input_ids.shape[1]
        kw = {}
        if "position_ids" in inspect.signature(model.forward).parameters:
            kw["position_ids"] = torch.arange(start, L, device=input_ids.device)[None]
        out = model(input_ids=input_ids[:, start:], cache=self, use_cache=True, logits_to_keep=1, **kw)
        for l in self.layers:
            l.append_sealed(L)
        self._new_prompt(input_ids)
        self.prefill_logits = out.logits[:, -1]

    def begin_range(self, input_ids: torch.Tensor) -> "Turns":
        """After `continue_turn`: positions [start, L) of `input_ids` [1, L] will arrive through a loader (anchor
        first, then residual, then the last position's logits), in front of which the held KV stays."""
        L = input_ids.shape[1]
        for l in self.layers:
            l.begin_range(L)
        self._new_prompt(input_ids)
        return self

    def _new_prompt(self, input_ids: torch.Tensor) -> None:
        self.prompt_len = input_ids.shape[1]
        self.prefill_logits, self._error = None, None
        self._pending_full = [False] * len(self.layers)
        self.trace = Trace()
        self.expect_prompt(input_ids)
        self._phase = "fresh"

    def start_generate(self) -> None:
        """speculative_generate takes the cache (fresh: its prompt was checked)."""
        if self._phase != "fresh" or self._pinned:
            raise ValueError(BUSY if self._phase in ("busy", "plain") else BROKEN if self._phase == "broken" else
                             "this LynxCache was pinned to a tier for plain generate")
        self._phase = "busy"

    def end_generate(self, sequences: torch.Tensor | None) -> None:
        """The generation is over: the cache holds `sequences` [B, T] (but the last token's KV); None: it failed.
        The loader is released once everything it delivers has landed (a held cache is sealed from it)."""
        if sequences is None:
            self._phase = "broken"
            self.close()
            return
        self._tokens, self._phase = sequences.detach().long().cpu().clone(), "held"
        self._turns += 1
        with self._lock:
            complete = self._complete("residual") and self.prefill_logits is not None
        if complete:
            self.close()

    def __deepcopy__(self, memo):
        """An independent branch of a held conversation (a fresh cache is sealed first: its residual awaited)."""
        return self._branch(memo, "copy.deepcopy(LynxCache)")

    def fork(self) -> "Turns":
        """A branch of a held conversation that shares its sealed KV instead of copying it: sealed KV is never
        written in place (a turn crops by slicing, appends by concatenating, materialises into new buffers), so a
        turn on the branch — successful or failed half-way — leaves this cache as it was. What a network
        conversation's turn runs on."""
        return self._branch({}, "LynxCache.fork()", share=True)

    def _branch(self, memo, what: str, share: bool = False):
        self._settle()
        if self._phase in ("busy", "plain", "broken"):
            raise ValueError(f"{what}: {BROKEN if self._phase == 'broken' else BUSY}")
        self._seal_all()
        if share:  # the sealed KV itself, not a copy, in the branch
            memo.update({id(t): t for l in self.layers for t in (l.keys, l.values) if t is not None})
        self._phase = "held"
        new = type(self).__new__(type(self))
        skip = {"_lock", "_changed", "loader", "_hooks", "_model", "trace"}
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k not in skip:
                setattr(new, k, copy.deepcopy(v, memo))
        new._lock = threading.Lock()
        new._changed = threading.Condition(new._lock)
        new.loader, new._hooks, new._model, new.trace, new._bound = None, [], None, Trace(), False
        model = self._model() if self._model is not None else None
        if model is not None:
            new.bind(model)
        return new

    def check_media(self, kwargs: dict) -> dict:
        """Images / audio given to generate must be the ones the prompt was prefilled with (their KV is in the cache;
        they are not run again); returns them, for the caller to keep out of forward passes."""
        g = generate_locals()  # the caller's own arguments: Transformers may have encoded the images already
        media = media_inputs({**((g or {}).get("kwargs") or {}), **kwargs})
        encoded = kwargs.get("mm_encoder_outputs")  # {modality: output} Transformers encoded ahead; {}: none
        strip = sorted(set(media_inputs(kwargs)) | ({"mm_encoder_outputs"} if encoded else set()))
        if not media and not strip:
            return []
        names = ", ".join(sorted(media)) or "mm_encoder_outputs"
        if self._media_key is None:
            raise ValueError(f"generate got {names}, but this LynxCache was prefilled without them: pass the same "
                             f"inputs to LynxCache.from_prefill(model, input_ids, {names.split(', ')[0]}=...) so that "
                             f"its KV holds them")
        if media and media_key(media) != self._media_key:
            raise ValueError(f"generate's {names} differ from the ones this LynxCache was prefilled with")
        return strip

    def add_turn(self, model, input_ids: torch.Tensor, residual_after_steps: int | None = None,
                 bandwidth_bps: float | None = None) -> torch.Tensor:
        """The in-process prefill node's answer to a new turn of the conversation this cache holds: it prefills
        `input_ids` [1, L] in full precision (as a prefill server recomputes what it never saw) and ships only the new
        positions [held, L), anchor first, with the last position's logits; the held KV stays. Then
        `model.generate(input_ids, cache=cache, custom_generate=speculative_generate)` drafts on the held prefix plus
        the new range's anchor and verifies once its residual lands (schedule as in `from_prefill`). Returns the
        first token [1, 1] (the logits' argmax)."""
        from ..local import InProcessLoader, prefill

        start = self.continue_turn(input_ids)
        kv, logits = prefill(model, input_ids)
        self.begin_range(input_ids)
        kv = [(k[:, :, k.shape[2] - (self.prompt_len - l.store.offset):], v[:, :, v.shape[2] - (self.prompt_len -
               l.store.offset):]) for (k, v), l in zip(kv, self.layers)]  # each layer's positions of the range
        self.put_logits(logits)
        InProcessLoader(kv, self.quant_config, residual_after_steps, bandwidth_bps).attach(self)
        self.trace.stats.held_tokens = start
        return logits.argmax(-1, keepdim=True)



def generate_locals() -> dict | None:
    """The locals of the Transformers `generate` call on the stack (its input_ids, model_kwargs, custom_generate, the
    model as `self`), or None."""
    f = sys._getframe(1)
    for _ in range(16):
        if f is None:
            return None
        if f.f_code.co_name == "generate" and f.f_globals.get("__name__") == "transformers.generation.utils":
            return f.f_locals
        f = f.f_back
    return None
