"""Typed telemetry of one request: `Stats` (what the engine did) and `Trace` (when things happened: stream arrivals,
the decode-side timeline, the residual's expected arrival). One clock: every `*_s` figure counts from `Trace.t0`,
the request's start — given to `speculative_generate(t0=)` by whoever starts the request (a `DecodeClient` when it
sends it), else the moment it starts. Written by the cache (arrivals) and the engine (tokens); read by anyone."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field


class DictReads:
    """A dataclass that reads like a dict too (`r["key"]`, `r.get`, `"key" in r`, `dict(r)`, `r.as_dict()`)."""

    def __getitem__(self, key: str):
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value) -> None:
        if key not in self.keys():
            raise KeyError(key)
        setattr(self, key, value)

    def get(self, key: str, default=None):
        return getattr(self, key, default) if key in self.keys() else default

    def keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def __contains__(self, key: str) -> bool:
        return key in self.keys()

    def items(self):
        return [(k, getattr(self, k)) for k in self.keys()]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Stats(DictReads):
    """What one generation did. A draft *step* is one forward pass on the anchor tier (a chain step drafts one token
    per row, a tree step a frontier of nodes). Reads like a dict too (`stats["accepted"]`, `dict(stats)`)."""

    drafted: int = 0                 # draft steps
    accepted: float = 0              # accepted drafts per row, mean over the rows still generating at verification
    accepted_per_row: list = field(default_factory=list)  # accepted drafts of each row (0 for rows already done)
    rounds: int = 0                  # verification passes
    tree_nodes: int = 0              # tree nodes verified
    verify_bound: float | None = None  # the last verify pass's least path probability a node needed (drafters.py)
    draft_nodes: list = field(default_factory=list)  # positions each draft step ran per row (a tree's frontier)
    ttft_draft_s: float | None = None     # first draft token
    ttft_verified_s: float | None = None  # first verified token
    verify_s: float = 0.0            # wall time of verification passes
    draft_stop: str | None = None    # what ended drafting: "residual" (it was in), "lead" (due within verify_lead
    #                                  steps), "budget" (max_draft_steps or the length), "drafted out" (no frontier)
    anchors_at_s: float | None = None     # every anchor in (the engine noticed)
    residual_at_s: float | None = None    # the last residual segment landed (negative: before t0)
    held_tokens: int = 0             # a continued turn: tokens whose KV the cache held already (not shipped)
    width: dict | None = None        # anchor_bits "auto": the width chosen, why, each width's forecast (lynx_hf.width)
    held_refused: str | None = None  # the prefill side refused what the cache claimed to hold: the whole shipped


class Trace:
    """Arrivals (`events`: (perf_counter, "anchor" | "residual", layer, kind)), the decode side's tokens
    (`timeline`: (perf_counter, "draft" | "verify_start" | "verified")) and the stats, on one clock from t0."""

    def __init__(self, t0: float | None = None):
        self.t0 = t0
        self.stats = Stats()
        self.events: list = []
        self.timeline: list = []
        self.residual_done_at: float | None = None  # perf_counter when the residual's last segment landed
        self.logits_at: float | None = None  # perf_counter when the prefill's logits landed (the first token's inputs)
        self._res_n = 0
        self._res_first = self._res_last = 0.0

    def start(self, t0: float | None = None) -> float:
        """The request's start: `t0` (when its owner started it: a client sending the request), else now."""
        if t0 is not None:
            self.t0 = t0
        elif self.t0 is None:
            self.t0 = time.perf_counter()
        return self.t0

    def since(self, t: float | None = None) -> float:
        return (time.perf_counter() if t is None else t) - self.start()

    # -- arrivals (the cache, under its lock) ---------------------------------------------------------------------
    def arrived(self, stream: str, layer: int, kind: str, complete: bool = False) -> None:
        """A segment of `stream` landed; `complete`: it was the last the full tier needed (residual codes and, in
        exact mode, corrections: both count towards the full tier's arrival)."""
        t = time.perf_counter()
        self.events.append((t, stream, layer, kind))
        if stream in ("residual", "correction"):
            self._res_first = t if self._res_n == 0 else self._res_first
            self._res_last, self._res_n = t, self._res_n + 1
            if complete:
                self.residual_done_at = t

    def residual_eta(self, missing: int) -> float | None:
        """Seconds until `missing` more residual segments have landed, at the mean interval of those received so far
        (None before two have arrived, e.g. a residual released all at once)."""
        if self._res_n < 2:
            return None
        step = (self._res_last - self._res_first) / (self._res_n - 1)
        return max(0.0, missing * step - (time.perf_counter() - self._res_last))

    # -- the decode side's tokens (the engine) ------------------------------------------------------------------------
    def mark(self, what: str) -> float:
        t = time.perf_counter()
        self.timeline.append((t, what))
        if what == "draft" and self.stats.ttft_draft_s is None:
            self.stats.ttft_draft_s = self.since(t)
        elif what == "verified" and self.stats.ttft_verified_s is None:
            self.stats.ttft_verified_s = self.since(t)
        return t

    def finish(self) -> None:
        """The generation is over: fill in the figures that arrivals determine."""
        if self.residual_done_at is not None:
            self.stats.residual_at_s = self.residual_done_at - self.start()

    def times(self, *what: str) -> list[float]:
        """Seconds from t0 of the timeline entries of the given kinds."""
        return [t - self.start() for t, k in self.timeline if k in what]
