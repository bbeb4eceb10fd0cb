"""`LynxQuantConfig(anchor_bits="auto")`: the anchor width a request takes, chosen before it is sent.

Contract. `WidthPolicy.choose(positions, values_per_position, new_tokens)` → a `WidthChoice` (the width, the
forecast of every width, why); `observe(bits, drafted, accepted)` after a request that drafted tells the policy what
a draft step kept at that width; `observe_link(bytes, seconds, compute_s, positions)` what the link delivered and
the prefill computed. `resolve(config, choice)` is the config with that width. The network client owns one policy
(`DecodeClient.width`, so a `Session` learns across its turns); `LynxCache.from_prefill(..., bandwidth_bps=...)`
resolves a config with a policy on that simulated link. A continued turn keeps its cache's width (the held KV's
digest names it; `kept_width`). The choice is said in `cache.stats["width"]` (and `TurnResult.width`).

Terms, per request: P the positions shipped, V the values one position carries (layers · 2 · KV heads · head
dim), bw the link's rate (bits/s), c the prefill node's compute per position (0 until measured: a link-bound
guess), s(b) one draft step's time at width b on this node (its tree's frontier), κ(b) the drafts verification
keeps per draft step at width b, N the verified tokens the forecast is about (32, or max_new_tokens when fewer, at
least 2), m the anchor's metadata (μ and σ in fp16 per group of C values: 32 / C bits a value), lead the steps
before the residual's arrival at which drafting stops (SpecConfig.verify_lead), budget the request's
max_draft_steps (0: it does not draft).

Forecast — the timeline of `lynx-hf simulate` with the prefill's compute in it (layers stream as they are computed):
  anchor in      T_a(b) = max(c·P, P·V·(b + m) / bw)
  residual in    T_r    = max(c·P, P·V·(8 + m) / bw)          the same at every width: anchor + residual = the code
  draft steps    n(b)   = min(budget, max(0, (T_r − T_a(b)) / s(b) − lead))   s(b): its own tree's step
  drafts kept    k(b)   = min(N − 1, κ(b) · n(b))
  TT32T(b)       = T_r + (N − 1 − k(b)) · s(b)                (the first token is the prefill's, at T_a(b); the
                                                               tail costed at a draft step's price: an upper bound)
Rule: of the widths whose forecast TT32T is within `slack` (2 %) of the best width's, the one whose anchor lands
first (its first token comes sooner, its verified tokens no later; a tie — a compute-bound prefill — goes to the
wider, better code); 4 bits while the link's rate is unknown (no hint, no Lynx request of MIN_COMPUTE_POSITIONS
yet). κ starts from the acceptance measured on many-shot prompts (docs/drafting.md, "Anchor width") and follows
what this policy's requests keep (the mean of the prior and each observation, newest weighted half)."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from .config import ANCHOR_BITS, LynxQuantConfig

# drafts kept per draft step, residual after 31 steps, many-shot MMLU-Pro prompts of 1K and 2K tokens (check_accept's
# protocol; docs/drafting.md): 4 bits 31.0 of 31, 3 bits 25.4, 2 bits 10.8
KEPT_PER_STEP = {4: 1.0, 3: 25.4 / 31, 2: 10.8 / 31}
SLACK = 0.02
MIN_OBSERVED_STEPS = 4  # a request that drafted fewer steps says too little about κ
MIN_COMPUTE_POSITIONS = 256  # a shorter prefill's time is mostly fixed costs, not a rate per position


@dataclass(frozen=True)
class Forecast:
    bits: int
    anchor_s: float    # T_a: the first token, about
    residual_s: float  # T_r
    draft_steps: float
    kept: float
    tt32t_s: float


@dataclass(frozen=True)
class WidthChoice:
    bits: int
    why: str
    forecasts: tuple = ()

    def as_dict(self) -> dict:
        return {"anchor_bits": self.bits, "why": self.why,
                "forecast": {f.bits: {"anchor_s": round(f.anchor_s, 3), "tt32t_s": round(f.tt32t_s, 3),
                                      "kept": round(f.kept, 1)} for f in self.forecasts}}


def kept_width(bits: int) -> WidthChoice:
    """A continued turn's width: its cache's (the held KV and the new positions are one code)."""
    return WidthChoice(bits, "a continued turn keeps its cache's width")


def forecast(bits: int, positions: int, values_per_position: int, link_bps: float, step_s: float,
             kept_per_step: float, compute_s_per_position: float = 0.0, new_tokens: int = 32, lead: float = 3.0,
             chunk: int = 64, max_steps: int = 64) -> Forecast:
    """The forecast above for one width (`max_steps`: the request's draft budget, 0 when it does not draft)."""
    m = 32 / chunk
    compute = compute_s_per_position * positions
    t_a = max(compute, positions * values_per_position * (bits + m) / link_bps)
    t_r = max(compute, positions * values_per_position * (8 + m) / link_bps)
    n = min(max_steps, max(0.0, (t_r - t_a) / step_s - lead))
    kept = min(new_tokens - 1, kept_per_step * n)
    return Forecast(bits, t_a, t_r, n, kept, t_r + (new_tokens - 1 - kept) * step_s)


@dataclass
class WidthPolicy:
    """Chooses `anchor_bits` per request (the module's rule) from what it is told and what it measures."""

    link_bps: float | None = None                 # a hint, or measured by observe_link
    step_s: dict | None = None                    # {width: a draft step's seconds here} (its tree's own size)
    compute_s_per_position: float = 0.0
    slack: float = SLACK
    kept_per_step: dict = field(default_factory=lambda: dict(KEPT_PER_STEP))

    def __post_init__(self):
        ok = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")
        if self.link_bps is not None and not ok(self.link_bps):
            raise ValueError(f"link_bps must be a number > 0 (bits/s), got {self.link_bps!r}")
        if self.step_s is not None and not (isinstance(self.step_s, dict) and set(self.step_s) == set(ANCHOR_BITS)
                                            and all(ok(v) for v in self.step_s.values())):
            raise ValueError(f"step_s must map every width {ANCHOR_BITS} to seconds > 0, got {self.step_s!r}")
        self._hinted = self.link_bps is not None

    def choose(self, positions: int, values_per_position: int, new_tokens: int = 32, lead: float = 3.0,
               chunk: int = 64, max_steps: int = 64) -> WidthChoice:
        """The width for a request of `positions` shipped positions; `new_tokens` (N: at least 2, at most 32),
        `lead` and `max_steps` are the request's own (its SpecConfig; 0 steps: it does not draft)."""
        if self.link_bps is None or self.step_s is None:
            return WidthChoice(4, "the link's rate is not known yet: 4 bits (the widest anchor)")
        n = max(2, min(32, new_tokens))
        fs = tuple(forecast(b, positions, values_per_position, self.link_bps, self.step_s[b], self.kept_per_step[b],
                            self.compute_s_per_position, n, lead, chunk, max_steps)
                   for b in sorted(ANCHOR_BITS, reverse=True))
        best = min(f.tt32t_s for f in fs)
        near = [f for f in fs if f.tt32t_s <= best * (1 + self.slack)]
        pick = min(near, key=lambda f: (round(f.anchor_s, 6), -f.bits))  # the first token soonest; a tie: wider
        why = (f"of the widths whose forecast TT32T is within {self.slack:.0%} of the best ({best:.2f} s), the one "
               f"whose anchor lands first ({pick.anchor_s:.2f} s)")
        return WidthChoice(pick.bits, why, fs)

    def observe(self, bits: int, drafted: int, accepted: float) -> None:
        """A request at width `bits` drafted `drafted` steps of which verification kept `accepted`."""
        if bits in self.kept_per_step and drafted >= MIN_OBSERVED_STEPS:
            self.kept_per_step[bits] = 0.5 * self.kept_per_step[bits] + 0.5 * min(1.0, accepted / drafted)

    def observe_link(self, nbytes: int, seconds: float | None, compute_s: float | None = None,
                     positions: int = 0) -> None:
        """A Lynx request of `positions` computed positions whose `nbytes` were delivered `seconds` after it was
        sent (its last segment), its forward passes taking `compute_s`. Requests under MIN_COMPUTE_POSITIONS say
        nothing (fixed costs). A rate given as a hint stays; else the link's rate is the largest measured (a
        sample the prefill's compute paced is a lower bound of it)."""
        if positions < MIN_COMPUTE_POSITIONS:
            return
        if seconds is not None and seconds > 0 and nbytes > 0 and not self._hinted:
            self.link_bps = max(self.link_bps or 0.0, 8 * nbytes / seconds)
        if compute_s is not None:
            self.compute_s_per_position = compute_s / positions


def resolve(config: LynxQuantConfig, choice: WidthChoice) -> LynxQuantConfig:
    """`config` with the chosen width."""
    return dataclasses.replace(config, anchor_bits=choice.bits)


def values_per_position(geometry: dict) -> int:
    """V from a KV geometry (arch.kv_geometry): layers · 2 (K and V) · KV heads · head dim."""
    return geometry["num_layers"] * 2 * geometry["kv_heads"] * geometry["head_dim"]


MAX_TIMED_POSITIONS = 4096  # the cache a draft step is timed over: at most this long (its memory, its time)


def time_step(model, positions: int, tokens: int = 8) -> float:
    """A draft step's seconds on this node: one timed forward of `tokens` positions (a tree step's frontier) over a
    cache of `positions` positions (at most MAX_TIMED_POSITIONS; random KV of the model's shapes: attention costs
    the same whatever the values), after an untimed one."""
    import torch
    from transformers import DynamicCache

    from .arch import kv_geometry

    g, dev, P = kv_geometry(model), next(model.parameters()).device, max(1, min(positions, MAX_TIMED_POSITIONS))
    cache = DynamicCache(config=model.config)
    for i in range(g["num_layers"]):
        k = torch.randn(1, g["kv_heads"], P, g["head_dim"], dtype=getattr(torch, g["dtype"]), device=dev)
        cache.update(k, torch.randn_like(k), i)
    ids = torch.full((1, tokens), 3, dtype=torch.long, device=dev)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        t = time.perf_counter()
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t


def step_times(model, positions: int) -> dict:
    """{width: a draft step's seconds}, each timed with its width's tree frontier (SpecConfig.for_anchor)."""
    from .config import SpecConfig

    sizes = {b: SpecConfig.for_anchor(b).tree_width for b in ANCHOR_BITS}
    timed = {n: time_step(model, positions, n) for n in set(sizes.values())}
    return {b: timed[n] for b, n in sizes.items()}


def step_from_trace(times: list[float]) -> float | None:
    """A draft step's seconds from a request's draft marks (Trace.times("draft")): their mean spacing, when there
    are at least MIN_OBSERVED_STEPS (a one-token decode step is no measure of a tree step: ~2.6× cheaper here)."""
    if len(times) < MIN_OBSERVED_STEPS:
        return None
    return (times[-1] - times[0]) / (len(times) - 1)
