"""Shadows only where they pay: the decode instance prices a transfer's shadows, from its own engine's steps,
before it admits one (hooks.py calls `Pricing.admit`).

Terms. A *step* is one scheduler step of the decode engine: the time from one `build_connector_meta` call to the
next while requests run, and the tokens n vLLM scheduled in it (drafts included). The *step model* T(n) = a + b·n is
the least-squares line through the last `WINDOW` such steps: b is what one more token in a step costs every request
in it. A Lynx transfer's *ledger*, kept while it is live: S, the tokens its shadows were scheduled (their decoding);
D and A, the drafts its real request R verified and the drafts R kept. The expected ledger is the mean over the last
`HISTORY` transfers that had shadows (`PRIOR` until one ends). *Others* N: the requests the engine ran in its last
step that are not the transfer's.

Rule. Each token a transfer adds to a step makes that step b longer for every request in it, so its shadows cost
the others N·b·(S + D − A) request-seconds (the shadows' tokens and R's rejected drafts) and R itself b·(D − A),
and they save R the A steps its kept drafts stand for, A·T(N + 1). A shadow is admitted iff the saving is larger.
Alone (N = 0) a shadow costs no other request: admitted (which also keeps the ledger measured). As the engine
fills, the cost grows with N while the saving grows only with T(N + 1), so shadows yield; as it empties they return.
Both shadows of a transfer are priced by the same figures (the ledger is per transfer), so they come or go
together. The figures that set the rule are in `state()`, and docs/vllm.md ("Under load")."""
from __future__ import annotations

import collections
from dataclasses import dataclass

WINDOW = 256            # steps in the step model
HISTORY = 32            # transfers in the expected ledger
MIN_STEPS = 16          # below this many steps (or without spread in n) b is not identified: shadows admitted
MAX_STEP_S = 30.0       # a longer gap is the engine idling between requests, not a step


@dataclass(frozen=True)
class Ledger:
    """One transfer's shadow tokens S, drafts its real request verified D and kept A."""
    shadow_tokens: float
    drafted: float
    accepted: float


PRIOR = Ledger(shadow_tokens=62.0, drafted=31.0, accepted=27.0)  # one request alone (docs/vllm.md: 2 x 31, 27 kept)


class Pricing:
    """`step(t, tokens)` each scheduler step; `ended(ledger)` each transfer with shadows; `admit(others)`."""

    def __init__(self, window: int = WINDOW, history: int = HISTORY):
        self._steps: collections.deque = collections.deque(maxlen=window)  # (tokens, seconds)
        self._ledgers: collections.deque = collections.deque(maxlen=history)
        self._last: tuple[float, int] | None = None  # (when the last step was scheduled, its tokens)
        self.admitted = self.refused = 0

    def step(self, t: float, tokens: int) -> None:
        """A step scheduled at time t with `tokens` tokens; the previous step's duration is t minus its start."""
        if self._last is not None and self._last[1] > 0 and 0 < t - self._last[0] < MAX_STEP_S:
            self._steps.append((self._last[1], t - self._last[0]))
        self._last = (t, tokens)

    def ended(self, ledger: Ledger) -> None:
        self._ledgers.append(ledger)

    def model(self) -> tuple[float, float] | None:
        """(a, b) of T(n) = a + b·n from the recent steps (a, b >= 0), or None while b is not identified."""
        if len(self._steps) < MIN_STEPS:
            return None
        n = [x for x, _ in self._steps]
        s = [y for _, y in self._steps]
        mn, ms = sum(n) / len(n), sum(s) / len(s)
        var = sum((x - mn) ** 2 for x in n)
        if var < len(n):  # (n spread less than a token: a and b not apart)
            return None
        b = max(0.0, sum((x - mn) * (y - ms) for x, y in zip(n, s)) / var)
        a = ms - b * mn
        return (a, b) if a >= 0 else (0.0, ms / mn)

    def expected(self) -> Ledger:
        if not self._ledgers:
            return PRIOR
        k = len(self._ledgers)
        return Ledger(*(sum(getattr(x, f) for x in self._ledgers) / k
                        for f in ("shadow_tokens", "drafted", "accepted")))

    def price(self, others: int) -> tuple[float, float] | None:
        """(saving, cost) in request-seconds of a transfer's shadows beside `others` requests (None: not priced
        yet, b unknown)."""
        ab = self.model()
        if ab is None:
            return None
        a, b = ab
        e = self.expected()
        rejected = max(0.0, e.drafted - e.accepted)
        return e.accepted * (a + b * (others + 1)), others * b * (e.shadow_tokens + rejected) + b * rejected

    def admit(self, others: int) -> bool:
        """Whether a shadow is worth admitting beside `others` requests (counted)."""
        p = None if others == 0 else self.price(others)
        ok = p is None or p[0] > p[1]
        self.admitted += ok
        self.refused += not ok
        return ok

    def state(self) -> dict:
        """The figures behind the rule now (for logs and the bench's JSON)."""
        ab, e = self.model(), self.expected()
        return {"a_s": None if ab is None else round(ab[0], 6), "b_s": None if ab is None else round(ab[1], 6),
                "steps": len(self._steps), "transfers": len(self._ledgers), "expected": e.__dict__,
                "admitted": self.admitted, "refused": self.refused}
