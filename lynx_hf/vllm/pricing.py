"""Shadows only where they pay: the decode instance prices a transfer's shadows, from its own engine's steps,
before it admits one (scheduler.py calls `Pricing.admit`).

Terms. A *step* is one scheduler step of the decode engine: the time from one `build_connector_meta` call to the
next while requests run (the forward, the sampler, the proposer, and the worker's KV placement), and the tokens n
vLLM scheduled in it (drafts included). The *step model* T(n) = a + b·n is the least-squares line through the last
`WINDOW` such steps: b is what one more token in a step costs every request in it. A Lynx transfer's *ledger*,
kept while it is live: S, the tokens its shadows were scheduled; S_R, those in steps its real request R ran too;
D and A, the drafts R verified and kept (R's first step left out: vLLM gives every request that loaded remote KV K
placeholder drafts there, whatever the method). The expected ledger of a *kind* — greedy or sampled: a sampled
shadow draws with a seed of its own, so its chain rarely stays on R's — is the mean over the last `HISTORY`
transfers of that kind that had shadows (`PRIOR` until one ends). *Others* N: the real requests beside the
transfer's — running and no transfer's shadow, or another transfer's R still loading (it runs soon); n̄: the tokens
of the engine's last step.

Rule. Each token a transfer adds to a step makes that step b longer for every request in it, so its shadows cost
the others N·b·(S + D − A) request-seconds (the shadows' tokens and R's rejected drafts) and R itself
b·(S_R + D − A); they save R the A steps its kept drafts stand for, A·T(max(n̄, N + 1)). A transfer's shadows are
admitted iff the saving is larger, decided once per transfer (its shadows come or go together). Alone (N = 0)
they cost no other request but still R's own steps: sampled shadows, whose drafts R rarely keeps, are refused even
then. One transfer in `EXPLORE` of a kind refused in a row is admitted anyway where it has at most `EXPLORE_OTHERS`
others, so the ledger keeps being measured where a wrong guess is cheap (under load exploring cost every running
request: measured at 0.4 requests/s, 2/3 of the shadows admitted were explorers). As the engine fills, the cost
grows with N while the saving grows only with the step, so shadows yield; as it empties they return. The figures
behind it are in `state()`; docs/vllm.md ("Under load") states the rule with the figures measured."""
from __future__ import annotations

import collections
from dataclasses import dataclass, replace

from ..floors import line

WINDOW = 256            # steps in the step model
HISTORY = 32            # transfers in the expected ledger
MIN_STEPS = 16          # below this many steps (or without spread in n) b is not identified: shadows admitted
MAX_STEP_S = 30.0       # a longer gap is the engine idling between requests, not a step
EXPLORE = 8             # one transfer in this many refused in a row is admitted anyway (the ledger stays measured) ...
EXPLORE_OTHERS = 1      # ... if it has at most this many others: a wrong guess then costs one request at most


@dataclass(frozen=True)
class Ledger:
    """One transfer's shadow tokens S, drafts its real request verified D and kept A, and S_R (`overlap`): the
    shadow tokens of steps R ran in too."""
    shadow_tokens: float
    drafted: float
    accepted: float
    overlap: float = 0.0

    def plus(self, **more: float) -> "Ledger":
        """This ledger with `more` added to the named terms."""
        return replace(self, **{k: getattr(self, k) + v for k, v in more.items()})


PRIOR = Ledger(shadow_tokens=62.0, drafted=31.0, accepted=27.0, overlap=16.0)  # one request alone: 2 x 31, 27 kept


class Pricing:
    """`step(t, tokens)` each scheduler step; `ended(ledger, greedy)` each transfer with shadows;
    `admit(others, tokens, greedy)` once per transfer."""

    def __init__(self, window: int = WINDOW, history: int = HISTORY):
        self._steps: collections.deque = collections.deque(maxlen=window)  # (tokens, seconds)
        self._ledgers = {kind: collections.deque(maxlen=history) for kind in (True, False)}  # greedy, sampled
        self._last: tuple[float, int] | None = None  # (when the last step was scheduled, its tokens)
        self.admitted = self.refused = self.explored = 0
        self._run = {True: 0, False: 0}  # transfers of each kind refused in a row

    def step(self, t: float, tokens: int) -> None:
        """A step scheduled at time t with `tokens` tokens; the previous step's duration is t minus its start."""
        if self._last is not None and self._last[1] > 0 and 0 < t - self._last[0] < MAX_STEP_S:
            self._steps.append((self._last[1], t - self._last[0]))
        self._last = (t, tokens)

    def ended(self, ledger: Ledger, greedy: bool) -> None:
        self._ledgers[bool(greedy)].append(ledger)

    def model(self) -> tuple[float, float] | None:
        """(a, b) of T(n) = a + b·n from the recent steps (a, b >= 0), or None while b is not identified."""
        # (n spread less than a token a step: a and b not apart)
        fit = line(self._steps, len(self._steps)) if len(self._steps) >= MIN_STEPS else None
        if fit is None:
            return None
        slope, mn, ms = fit
        b = max(0.0, slope)
        a = ms - b * mn
        return (a, b) if a >= 0 else (0.0, ms / mn)

    def expected(self, greedy: bool) -> Ledger:
        past = self._ledgers[bool(greedy)]
        if not past:
            return PRIOR
        k = len(past)
        return Ledger(*(sum(getattr(x, f) for x in past) / k
                        for f in ("shadow_tokens", "drafted", "accepted", "overlap")))

    def price(self, others: int, tokens: int, greedy: bool) -> tuple[float, float] | None:
        """(saving, cost) in request-seconds of a transfer's shadows (greedy or sampled) beside `others` real
        requests, the last step having had `tokens` tokens (None: not priced yet, b unknown)."""
        ab = self.model()
        if ab is None:
            return None
        a, b = ab
        e = self.expected(greedy)
        rejected = max(0.0, e.drafted - e.accepted)
        saving = e.accepted * (a + b * max(tokens, others + 1))
        return saving, others * b * (e.shadow_tokens + rejected) + b * (e.overlap + rejected)

    def admit(self, others: int, tokens: int, greedy: bool) -> bool:
        """Whether a transfer's shadows are worth admitting beside `others` real requests (counted)."""
        p = self.price(others, tokens, greedy)
        ok = p is None or p[0] > p[1]
        g = bool(greedy)
        self._run[g] = 0 if ok else self._run[g] + 1
        if self._run[g] >= EXPLORE and others <= EXPLORE_OTHERS:
            ok, self._run[g] = True, 0
            self.explored += 1
        self.admitted += ok
        self.refused += not ok
        return ok

    def state(self) -> dict:
        """The figures behind the rule now (for logs and the bench's JSON)."""
        ab = self.model()
        return {"a_s": None if ab is None else round(ab[0], 6), "b_s": None if ab is None else round(ab[1], 6),
                "steps": len(self._steps), "transfers": {("greedy" if k else "sampled"): len(v)
                                                          for k, v in self._ledgers.items()},
                "expected": {("greedy" if k else "sampled"): self.expected(k).__dict__ for k in (True, False)},
                "admitted": self.admitted, "refused": self.refused, "explored": self.explored}
