"""`Conversation`: what a LynxCache has been asked to serve, turn after turn — the one place the decode side matches a
prefix. A LynxCache owns one (`cache.conversation`); the engine, the in-process prefill side (lynx_hf.local), the
network client (lynx_hf.transfer.decode) and plain `generate` all go through it.

Terms. The *prompt* is the sequence whose KV the cache was last filled with (`expect_prompt` records its ids, mask
and images). Once a generation is over the cache *holds* the conversation: every token's KV but the last one's,
and their ids (`held_ids`). A *turn* is the next generate's `input_ids` [1, L]: `continue_turn` checks
`ids[:, :held]` against what is held (a contradiction is refused in one line naming the first differing position,
or, with `cache.on_mismatch = "crop"`, the KV from there on is dropped) and returns `start`: positions [start, L)
are new (at least the last token: a turn with no new token re-runs it). `begin_range` then makes those positions
the cache's new prompt, to arrive through a loader behind the held KV.

Phases: "fresh" (serves the prompt it was filled with), "busy" (inside speculative_generate), "plain" (inside a plain
`generate`), "held" (a generation is over), "broken" (one failed part-way: what it holds is unknown).

Plain `generate(ids, cache=cache)`. Transformers marks a cache passed to `generate` by setting its
`_is_user_defined` flag, before any forward pass; that is the one signal the cache takes from Transformers'
internals (`LynxCache._is_user_defined`). From then until the call's first forward the cache reports a length of 0,
so Transformers hands that forward the whole `ids` (and mask, and images): the forward pre-hook (`bind`, a torch
hook on the model) checks them here as speculative_generate's arguments are checked, then slices the forward's
inputs to the new positions — nothing is recomputed. That forward's last-position logits are the prefill's exact
ones when it re-runs the prompt's last position (`post_forward`). A plain call ends when the cache is next used
(`settle`). What plain generate cannot give: a streamer of its own (none is needed: Transformers streams itself)."""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import threading
import weakref

import torch

from ..arch import media_inputs, media_key, refuse_encoder_decoder

BUSY = "this LynxCache is in use by a generate call that has not finished (or by a copy being made of it)"
BROKEN = ("a generation on this LynxCache failed part-way, so what it holds is unknown: build a new one from the "
          "prefill (LynxCache.from_prefill or a new request)")
PROMPT_MISMATCH = ("generate got another prompt than the one this LynxCache was prefilled with (its ids or its "
                   "attention mask differ): pass generate the input_ids and attention_mask given to from_prefill "
                   "(a padded batch needs attention_mask= in both)")
ROWS = "num_beams > 1 and num_return_sequences > 1 are not supported"
ONE_ROW = ("continuing a conversation on a LynxCache takes one row: continue each row on its own cache "
           "(copy.deepcopy(cache) then cache.batch_select_indices([row])), or prefill the batch anew with "
           "LynxCache.from_prefill")


class Conversation:
    def __init__(self, cache):
        self._cache = weakref.ref(cache)  # the cache owns this object: no reference cycle keeps its KV alive
        self.phase, self._turns = "fresh", 0
        self.tokens: torch.Tensor | None = None  # [B, N] CPU long: the ids by absolute position
        self.prompt: tuple | None = None  # (key, mask [B, P] bool) of the prompt (expect_prompt)
        self.visible: torch.Tensor | None = None  # [B, P] bool: the prompt's mask, kept through batch maps
        self.media_key: str | None = None  # digest of the images / audio the prompt was prefilled with
        self.encoded_key: str | None = None  # digest of those images' encoder outputs (what generate passes on)
        self.listening = False  # a plain generate was entered and has not run its first forward yet
        self._before, self._ran, self._first, self._substitute = "fresh", False, False, False
        self._strip: list = []  # media inputs a plain generate passes that its forwards must not run again
        self._claim = threading.Lock()  # held by speculative_generate for the whole call, and by a branch being made
        self._holder: str | None = None  # which of the two holds it

    @property
    def cache(self):
        return self._cache()

    # -- the prompt ---------------------------------------------------------------------------------------------------
    def expect_prompt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        P = self.cache.prompt_len
        if input_ids.dim() != 2 or input_ids.shape[1] != P:
            raise ValueError(f"expect_prompt: input_ids must be [B, {P}], got {tuple(input_ids.shape)}")
        mask = norm_mask(attention_mask, input_ids)
        self.prompt, self.visible = (prompt_key(input_ids, mask), mask), mask
        self.tokens = input_ids.detach().long().cpu().clone()

    def check_prompt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Raise ValueError unless [B, L >= P] input_ids start with the recorded prompt (ids and mask)."""
        P = self.cache.prompt_len
        if input_ids.shape[1] < P:
            raise ValueError(f"generate got {input_ids.shape[1]} tokens but this LynxCache holds a {P}-token prompt: "
                             f"pass that prompt (or a conversation extending it)")
        if self.prompt is None:
            return
        if input_ids.shape[0] != self.prompt[1].shape[0]:
            raise ValueError(f"LynxCache holds {self.prompt[1].shape[0]} sequence(s) but generate runs "
                             f"{input_ids.shape[0]}: {ROWS}")
        mask = None if attention_mask is None else attention_mask[:, :P]
        if prompt_key(input_ids[:, :P], norm_mask(mask, input_ids[:, :P])) != self.prompt[0]:
            raise ValueError(PROMPT_MISMATCH)

    def check_media(self, kwargs: dict) -> list:
        """Images / audio given to generate must be the ones the prompt was prefilled with (their KV is in the cache;
        they are not run again); returns their names, for the caller to keep out of forward passes."""
        media = media_inputs(kwargs)
        encoded = kwargs.get("mm_encoder_outputs")  # {modality: output} Transformers encoded ahead; {}: none
        strip = sorted(set(media) | ({"mm_encoder_outputs"} if encoded else set()))
        if not strip:
            return []
        names = ", ".join(sorted(media)) or "images (as their encoder outputs)"
        if self.media_key is None:
            raise ValueError(f"generate got {names}, but this LynxCache was prefilled without them: pass the same "
                             f"inputs to LynxCache.from_prefill(model, input_ids, pixel_values=...) so that its KV "
                             f"holds them")
        if media and media_key(media) != self.media_key or encoded and not media and \
                encoded_key(encoded) != self.encoded_key:
            raise ValueError(f"generate's {names} differ from the ones this LynxCache was prefilled with")
        return strip

    # -- what it holds ------------------------------------------------------------------------------------------------
    @property
    def turns(self) -> int:
        """Generations run on this cache."""
        self.settle()
        return self._turns

    def held_ids(self) -> torch.Tensor | None:
        self.settle()
        if self.phase != "held":
            return None
        return self.tokens[:, :min(self.cache.layers[0].end, self.tokens.shape[1])]

    def holds(self) -> bool:
        """A generation is over: the cache holds the conversation (see the module)."""
        self.settle()
        return self.phase == "held"

    def continues(self, input_ids: torch.Tensor) -> bool:
        """Whether a generate of `input_ids` [B, L] continues what the cache holds: a conversation after a generation,
        or a fresh prompt that the ids extend by more than one token (rather than the prompt it was filled with)."""
        self.settle()
        return self.phase == "held" or (self.phase == "fresh" and input_ids.shape[1] > self.cache.prompt_len + 1
                                        and self.tokens is not None)

    def continue_turn(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Make a held cache (or a fresh one, whose prompt `input_ids` extends) ready for the turn `input_ids` [1, L]
        and return `start`: positions [start, L) are new (start < L)."""
        self.settle()
        self.refuse_busy()
        if self.tokens is None:
            raise ValueError("this LynxCache does not know the ids it holds (built without expect_prompt): it cannot "
                             "be continued")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or self.tokens.shape[0] != 1:
            raise ValueError(ONE_ROW)
        if self.visible is not None and not bool(self.visible.all()):
            pads = int((~self.visible).sum())
            raise ValueError(f"this LynxCache row holds {pads} positions of padding (its prompt was padded in a "
                             f"batch), which a continued turn would attend to: prefill the row's conversation "
                             f"unpadded instead, LynxCache.from_prefill(model, ids[:, mask[0].bool()])")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("a continued turn cannot have padding (its attention_mask has zeros)")
        cache = self.cache
        cache.seal()
        self.phase = "held"
        held, L = cache.layers[0].end, input_ids.shape[1]
        known, ids = self.tokens[0, :held], input_ids[0].detach().cpu().long()
        m = min(held, L)
        diff = (ids[:m] != known[:m]).nonzero()
        if len(diff):
            d = int(diff[0])
            if cache.on_mismatch != "crop":
                raise ValueError(f"input_ids contradict the conversation this LynxCache holds: position {d} is token "
                                 f"{int(ids[d])} here but {int(known[d])} in the cache ({held} tokens held). Pass the "
                                 f"conversation as the cache holds it (cache.held_ids, then the new tokens), or set "
                                 f"cache.on_mismatch = 'crop' to drop the cached KV from position {d} on and "
                                 "recompute it")
            m = d
        start = min(m, L - 1)
        if start < held:
            for l in cache.layers:
                l.crop_to(start)
        self.tokens = ids[None].clone()
        return start

    def rewind(self, length: int) -> None:
        """Go back to the conversation's first `length` positions (1 <= length <= what is held): the KV and ids
        after them are dropped — the transferred prompt's as well as what this side computed — so that the next
        turn continues from there (an agent undoing a turn, a branch trying another reply)."""
        self.settle()
        self.refuse_busy("rewind: ")
        if self.tokens is None or self.tokens.shape[0] != 1:
            raise ValueError("rewind takes a one-row LynxCache that knows its ids (one built by a prefill)")
        cache = self.cache
        cache.seal()
        self.phase, held = "held", cache.layers[0].end
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= held:
            raise ValueError(f"rewind to {length!r} tokens: this LynxCache holds {held} (give 1 to {held})")
        for l in cache.layers:
            l.crop_to(length)
        self.tokens = self.tokens[:, :length].clone()

    def begin_range(self, input_ids: torch.Tensor, extend=None, quant_config=None) -> None:
        """After `continue_turn`: `input_ids` [1, L] become the cache's prompt, positions [start, L) new — to arrive
        through a loader (extend None; encoded with `quant_config`, default the cache's) or appended here in full
        precision (extend: the layers' `append_sealed`). The turn's stats start with `held_tokens` = start."""
        cache, L = self.cache, input_ids.shape[1]
        start = cache.layers[0].end
        if quant_config is not None:
            cache.quant_config = quant_config
        for l in cache.layers:
            l.append_sealed(L) if extend else l.begin_range(L)
        cache.begin_turn(L, start)
        self.expect_prompt(input_ids)
        self.phase = "fresh"

    # -- a generate call ----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def claim(self, what: str = "", holder: str = "branch"):
        """This conversation, for one generate call (holder "generate") or one branch being made, from its first
        step to its last. A branch is refused at once while anything holds it (a copy made while a turn extends the
        KV would hold half of it); a generate waits for a branch being made, and is refused by another generate."""
        if self.listening:
            raise ValueError(f"{what}{BUSY}")
        while not self._claim.acquire(timeout=0.01):
            if holder == "branch" or self._holder != "branch":
                raise ValueError(f"{what}{BUSY}")
        self._holder = holder
        try:
            yield self
        finally:
            self._holder = None
            self._claim.release()

    def refuse_busy(self, what: str = "") -> None:
        if self.phase in ("busy", "plain", "broken"):
            raise ValueError(f"{what}{BROKEN if self.phase == 'broken' else BUSY}")

    def start_generate(self, pinned: bool) -> None:
        """speculative_generate takes the cache (fresh: its prompt was checked)."""
        self.listening = False
        if self.phase != "fresh" or pinned:
            raise ValueError(BUSY if self.phase in ("busy", "plain") else BROKEN if self.phase == "broken" else
                             "this LynxCache was pinned to a tier for plain generate")
        self.phase = "busy"

    def end_generate(self, sequences: torch.Tensor | None) -> None:
        """The generation is over: the cache holds `sequences` [B, T] (but the last token's KV); None: it failed."""
        cache = self.cache
        if sequences is None:
            self.phase = "broken"
            cache.close()
            return
        self.tokens, self.phase = sequences.detach().long().cpu().clone(), "held"
        self._turns += 1
        if cache.landed():
            cache.close()

    def settle(self) -> None:
        """A plain generate call that ran is over once anything else touches the cache: it holds what was run."""
        if self.phase == "plain":
            self.phase = "held" if self._ran else self._before
            if self._ran:
                self._turns += 1
                self.cache.close()

    def enter_plain(self) -> None:
        """Transformers' generate took this cache: its first forward will carry the whole input (see the module)."""
        self.settle()
        self.listening = True

    def pre_forward(self, model, kwargs: dict):
        """The bound model's forward pre-hook on this cache. Returns the forward's kwargs when it changes them."""
        if self.listening:
            return self._first_plain_forward(model, kwargs)
        if self.phase == "plain":
            self._record(kwargs.get("input_ids"))
            self._ran = True
            if self._strip:  # the prompt's images are in the KV: positions re-run are text
                return {k: v for k, v in kwargs.items() if k not in self._strip}
        return None

    def post_forward(self, output) -> None:
        if self.phase == "plain" and self._first:
            self._first = False
            if self._substitute:  # the re-run last prompt position: the prefill's exact logits
                output.logits[:, -1] = self.cache.wait_logits().to(output.logits.device, output.logits.dtype)

    def _first_plain_forward(self, model, kwargs: dict) -> dict:
        self.listening = False
        self.refuse_busy()
        refuse_encoder_decoder(model)
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if ids is None:
            raise ValueError("plain generate on a LynxCache takes input_ids (not inputs_embeds)")
        strip = self.check_media(kwargs)
        self._before, self._ran = self.phase, True
        if self.phase == "held":
            start, self._first = self.continue_turn(ids, mask), False
        else:
            self.check_prompt(ids, mask)
            P = self.cache.prompt_len
            start, self._first, self._substitute = P - 1, True, ids.shape[1] == P
            for l in self.cache.layers:
                l.rerun = 1  # the re-run position's streamed KV stands
        self._strip, self.phase = strip, "plain"
        self._record(ids[:, start:], start)
        L = ids.shape[1]
        return {k: (v[..., start:] if isinstance(v, torch.Tensor) and k != "attention_mask" and v.dim() >= 2
                    and v.shape[-1] == L else v) for k, v in kwargs.items() if k not in strip}

    def _record(self, ids: torch.Tensor | None, pos: int | None = None) -> None:
        """The ids a plain generate runs, by position (the cache's length before the forward)."""
        if ids is None or self.tokens is None:
            return
        pos, n = self.cache.get_seq_length() if pos is None else pos, ids.shape[1]
        if self.tokens.shape[1] < pos + n:
            grow = self.tokens.new_zeros(self.tokens.shape[0], pos + n - self.tokens.shape[1])
            self.tokens = torch.cat([self.tokens, grow], 1)
        self.tokens[:, pos:pos + n] = ids.detach().cpu()

    # -- branches -----------------------------------------------------------------------------------------------------
    def branch(self, memo: dict, what: str, share: bool):
        """A new cache holding this conversation: its KV deep-copied, or (share) the sealed KV itself."""
        with self.claim(f"{what}: "):
            return self._branch(memo, what, share)

    def _branch(self, memo: dict, what: str, share: bool):
        cache = self.cache
        self.settle()
        self.refuse_busy(f"{what}: ")
        cache.seal()
        self.phase = "held"
        if share:  # sealed KV is never written in place: a branch may share it
            memo.update({id(t): t for l in cache.layers for t in (l.keys, l.values) if t is not None})
        new = cache.branch_copy(memo)
        new.conversation = c = Conversation(new)
        c.phase, c._turns, c.tokens, c.prompt, c.visible = "held", self._turns, self.tokens.clone(), self.prompt, \
            self.visible
        c.media_key, c.encoded_key = self.media_key, self.encoded_key
        model = cache.bound_model()
        if model is not None:
            new.bind(model)
        return new


def encoded_key(encoded: dict) -> str | None:
    """A digest of encoder outputs ({modality: ModelOutput}, as Transformers' generate passes `mm_encoder_outputs`)."""
    flat = {}
    for modality, out in (encoded or {}).items():
        for field, v in (out.items() if hasattr(out, "items") else [("", out)]):
            for i, t in enumerate(v if isinstance(v, (tuple, list)) else [v]):
                flat[f"{modality}.{field}.{i}"] = t
    return media_key(flat)


def norm_mask(mask: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """The prompt's mask as a CPU bool tensor [B, P] (None: all visible)."""
    if mask is None:
        return torch.ones(ids.shape, dtype=torch.bool)
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
    return mask.detach().bool().cpu()


def prompt_key(ids: torch.Tensor, mask: torch.Tensor) -> str:
    h = hashlib.sha256(str(tuple(ids.shape)).encode())
    h.update(ids.detach().long().cpu().numpy().tobytes())
    h.update(mask.numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def extend_here(model, cache, input_ids: torch.Tensor, start: int) -> None:
    """Run the new positions [start, L) of `input_ids` through `model` on `cache` (after `continue_turn`), as
    Transformers does with its own caches: their KV joins the held KV in full precision and the last position's
    logits become the turn's first-token logits. The cache then serves `input_ids` as a fresh prompt."""
    L = input_ids.shape[1]
    kw = {}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kw["position_ids"] = torch.arange(start, L, device=input_ids.device)[None]
    out = model(input_ids=input_ids[:, start:], cache=cache, use_cache=True, logits_to_keep=1, **kw)
    cache.conversation.begin_range(input_ids, extend=True)
    cache.prefill_logits = out.logits[:, -1]
