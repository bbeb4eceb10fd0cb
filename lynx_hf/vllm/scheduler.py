"""The connector's scheduler-side logic as plain Python, mirrored on vLLM's `KVConnectorBase_V1` hooks but fed plain
data (request ids, token ids, block ids), so tests drive it without vLLM; connector.py only adapts vLLM's objects to
it. The worker side is worker.py.

Terms. A *transfer* (xfer) is one prompt's KV, published by the prefill instance under an id the orchestrator
picks. On the decode instance a transfer feeds at most one *real* request R (tier "full") and any number of
*shadows* S (tier "anchor": anchor-only KV, decode the drafts, output never forwarded). A request names its part in
`kv_transfer_params["lynx"]` (`parse_params`). Baseline methods (bf16, int8, kivi4, ...) have one tier: R alone.
A transfer's *members* are its requests that hold blocks; it is *live* on the decode side from R's first
allocation until R and every member finished, and the decode side holds its codes (the *held copy*) that long, so
a preempted R reloads exactly the same KV. Its *key* is the digest of the members' first P + 1 tokens (prompt +
first token): how the proposer tells its rows apart; a live request outside it whose prompt starts with the
transfer's P prompt tokens is a *rival*, and a transfer with a rival gets no drafts (rows are matched by content,
see proposer.py).

Admission, the rule that keeps KV pressure from deadlocking (docs/vllm.md, "Under traffic"): a waiting load never
depends on another request's blocks — R's load waits only for its stream, a shadow's for its own stream's anchors
and residual share — and a shadow is admitted only after its R holds blocks, while R still waits for its KV, and
not in a step after one where a load could not get blocks (shadows yield first: a shadow that does not fit
would otherwise stop vLLM's queue in front of the next real request), and beside other running requests only when
its drafts are priced to save more than they cost them (pricing.py). A request refused (bad parameters,
a late or preempted shadow, a transfer over the decode side's bound) claims one token asynchronously and fails at
once with the reason (vLLM's `kv_load_failure_policy="fail"`), so it never holds a prompt's worth of blocks.

Hooks: `matched` (→ get_num_new_matched_tokens), `allocated` (update_state_after_alloc), `step_meta`
(build_connector_meta), `worker_meta` (update_connector_output), `finished` (request_finished)."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field

from ..config import LynxQuantConfig
from ..errors import ConfigError
from ..quant import codec
from .pricing import Ledger, Pricing
from .stream import KVSpec, check_xfer_id, segment_tokens, token_digest

log = logging.getLogger("lynx_hf.vllm")
TIERS = ("anchor", "full")
PRICED = "priced out:"  # a shadow the pricing rule refused (pricing.py): its refusal is an operating decision
WAIT = object()  # an admission rule's answer: not yet (matched tells vLLM None: it skips the request this step)
MAX_ENDED = 4096


class ParamsError(ValueError):
    """kv_transfer_params["lynx"] is malformed."""


def codec_config(base: dict, method: str) -> LynxQuantConfig:
    try:
        config = LynxQuantConfig(**{**base, "method": method})
    except (ConfigError, TypeError, ValueError) as e:
        raise ParamsError(str(e)) from None
    if config.anchor_bits == "auto":  # the connector has no per-request link forecast: a width both sides name
        raise ParamsError("anchor_bits 'auto' is chosen per request by lynx-hf's own client (DecodeClient); the vLLM "
                          "connector takes a fixed width: 2, 3 or 4")
    if config.exact:  # its streams carry anchor and residual only
        raise ParamsError("exact=True is not served through the vLLM connector yet: use lynx-hf's own transfer "
                          "(serve-prefill / DecodeClient) for exact mode")
    return config


def full_salt(method: str) -> str:
    """The cache_salt of a real request's blocks: what they hold (method's full tier, under this engine's codec
    settings, which are fixed for its life), never which transfer filled them. A full segment's code is a function
    of its positions' KV alone (stream.py's grid), so a block cached by turn n is bit for bit the block turn n + 1
    would ship: vLLM's prefix cache serves it, and the transfer starts at the first block the decode instance lacks."""
    return f"lynx-full-{method}"


def check_block_size(block_size: int, config: LynxQuantConfig) -> None:
    """A cached block must hold whole segments of the stream's grid (else a block of turn n holds part of a segment
    coded over other positions than turn n + 1's): a ValueError naming both flags otherwise."""
    unit = segment_tokens(config)
    if block_size % unit:
        raise ValueError(f"LynxConnector: --block-size {block_size} is not a multiple of the {config.method} codec's "
                         f"segment of {unit} tokens (kv_connector_extra_config quant.chunk_size {config.chunk_size}, "
                         f"group_size {config.group_size}): pass --block-size {math.lcm(block_size, unit)}")


def parse_params(params, base: dict | None = None) -> dict | None:
    """kv_transfer_params → the validated "lynx" part, or None when the request is not Lynx's. Every field checked,
    the method against the engine's codec settings `base` (so nothing a request names can fail in a forward).
    produce: {"role": "produce", "xfer", "method"}; consume: {"role": "consume", "xfer", "method", "tier",
    "shadow" (R: whether shadows share the transfer), "host", "port", "prompt_len", optionally "release" (a shadow:
    the fraction of the full tier placed before it starts decoding; default 0, at the last anchor)}."""
    if not isinstance(params, dict) or "lynx" not in params:
        return None
    p = params["lynx"]
    if not isinstance(p, dict):
        raise ParamsError("kv_transfer_params['lynx'] must be an object")
    role = p.get("role")
    want = {"produce": {"role", "xfer", "method"},
            "consume": {"role", "xfer", "method", "tier", "shadow", "host", "port", "prompt_len"}}.get(role)
    if want is None:
        raise ParamsError(f"kv_transfer_params['lynx']['role'] must be 'produce' or 'consume', got {role!r}")
    if set(p) != want and not (role == "consume" and set(p) == want | {"release"}):
        raise ParamsError(f"kv_transfer_params['lynx'] for {role!r} takes exactly {sorted(want)}, got {sorted(p)}")
    try:
        check_xfer_id(p["xfer"])
    except ValueError as e:
        raise ParamsError(str(e)) from None
    if not isinstance(p["method"], str):
        raise ParamsError("kv_transfer_params['lynx']['method'] must be a string")
    split = codec(codec_config(base or {}, p["method"])).split
    if role == "consume":
        _check_consume(p, split)
    return p


def _check_consume(p: dict, split: bool) -> None:
    if p["tier"] not in TIERS or not isinstance(p["shadow"], bool):
        raise ParamsError(f"tier must be one of {TIERS} and shadow a bool, got {p['tier']!r}, {p['shadow']!r}")
    if (p["tier"] == "anchor" or p["shadow"]) and not split:
        raise ParamsError(f"method {p['method']!r} ships one tier: no shadow, no tier 'anchor'")
    if not isinstance(p["host"], str) or not isinstance(p["port"], int) or isinstance(p["port"], bool) \
            or not 0 < p["port"] < 65536:
        raise ParamsError(f"host must be a string and port in [1, 65535], got {p['host']!r}, {p['port']!r}")
    r = p.get("release", 0.0)
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
        raise ParamsError(f"release must be a number in [0, 1], got {r!r}")
    n = p["prompt_len"]
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1 << 20:
        raise ParamsError(f"prompt_len must be an int in [1, 2^20], got {n!r}")


def _salt_refusal(p: dict, salt) -> str | None:
    """With prefix caching on, a consume request's cache_salt says what its blocks may serve: a real request's (its
    method's full tier) `full_salt(method)`, or one naming its transfer (ending "-<xfer>": never shared); a shadow's
    (anchor tier, upgraded in place) must name its transfer, so no other request ever hits anchor-tier KV."""
    own = isinstance(salt, str) and salt.endswith("-" + p["xfer"]) and salt != full_salt(p["method"])
    if p["tier"] == "anchor" and not own:
        return (f"with prefix caching on, a shadow's cache_salt must name its transfer (end with '-{p['xfer']}', e.g. "
                f"'lynx-anchor-{p['xfer']}'), got {salt!r}: its anchor-tier blocks must serve no other request")
    if p["tier"] == "full" and not own and salt != full_salt(p["method"]):
        return (f"with prefix caching on, a real request's cache_salt must be {full_salt(p['method'])!r} (its blocks "
                f"serve later turns' prefix hits) or name its transfer (end with '-{p['xfer']}'), got {salt!r}")
    return None


@dataclass
class SaveMeta:
    """Prefill instance: encode and publish this request's prompt KV in this step's forward."""
    req_id: str
    xfer: str
    method: str
    prompt_len: int
    block_ids: list
    digest: str


@dataclass
class LoadMeta:
    """Decode instance: fill this request's blocks with its tier of a transfer (positions [start, prompt_len))."""
    req_id: str
    xfer: str
    method: str
    tier: str
    shadow: bool
    host: str
    port: int
    prompt_len: int
    start: int
    block_ids: list
    digest: str
    error: str | None = None  # refused: fail the request at once with this reason
    release: float = 0.0      # a shadow starts once this fraction of the full tier is placed too

    @classmethod
    def refused(cls, req_id: str, why: str) -> "LoadMeta":
        return cls(req_id, "", "", "full", False, "", 0, 0, 0, [], "", error=why)


@dataclass
class StepMeta:
    saves: list = field(default_factory=list)
    loads: list = field(default_factory=list)
    refusals: list = field(default_factory=list)   # (xfer, why): the publisher answers these instead of KV
    preempted: list = field(default_factory=list)  # request ids whose blocks vLLM took back this step
    closed: list = field(default_factory=list)     # transfers ended: the decode side drops their held copies
    drafts: dict = field(default_factory=dict)     # xfer -> (P, key, members, first token): whose rows get drafts
    yielded: list = field(default_factory=list)    # shadows still loading, failed to free blocks for a real request


@dataclass
class _Job:
    """Prefill instance: a request whose prompt KV is to be published once its last prefill step runs."""
    p: dict        # its parsed kv_transfer_params
    blocks: list   # its block table so far
    P: int         # its prompt's length
    digest: str    # token_digest of its prompt


@dataclass(frozen=True)
class _Seen:
    """A live request's prompt and the transfer it claims (None: none)."""
    ids: list
    claims: str | None


@dataclass
class _Steps:
    """One member's timeline on the scheduler clock (s): admitted (got blocks for its load), its first and last step,
    its steps and the sum of the batch sizes it ran in."""
    admitted: float
    first_step: float | None = None
    last_step: float | None = None
    steps: int = 0
    batch: int = 0


@dataclass
class _Xfer:
    """A live transfer (decode instance, scheduler side)."""
    P: int
    key: str       # the digest of the first P + 1 tokens (the proposer's)
    prompt: str    # the digest of the first P: a live request outside the transfer that starts with them is a rival
    method: str
    bound: int
    first: int     # the first token (prompt_ids[P]): the proposer hashes only rows that have it there
    r: str | None = None
    r_state: str = "loading"                     # "loading" | "running" | "preempted" | "done"
    members: set = field(default_factory=set)
    shadows: bool = False                        # a shadow was ever admitted
    loading: set = field(default_factory=set)    # shadows holding blocks, not scheduled yet
    preempted: set = field(default_factory=set)  # shadows vLLM preempted: never reloaded
    rivals: set = field(default_factory=set)
    verdict: bool | None = None                  # the pricing rule's, for all its shadows (asked once)
    greedy: bool = False                         # its shadows decode greedily (the ledger's kind)
    ledger: Ledger = field(default_factory=lambda: Ledger(0, 0, 0, 0))  # pricing.py's S, D, A, S_R
    r_last: tuple | None = None                  # R's (computed, scheduled) in the last step it ran
    times: dict[str, _Steps] = field(default_factory=dict)  # member -> its timeline (`_timeline`)
    others: int | None = None                    # requests beside it when its first shadow was priced
    priced_out: int = 0                          # shadows the pricing rule refused


class SchedulerSide:
    """geometry: (layers, kv_heads, head_dim, dtype) of the model's KV — what a held copy's bound is computed from
    (None: no bound, tests only); max_held_bytes: the decode side's bound on held copies; timeout_s: how long a
    shadow waits for its real request; salted: prefix caching is on (a consume request's cache_salt must name its
    transfer, so its blocks never serve another request's prefix hit); price_shadows: shadows beside other running
    requests only where pricing.py's rule admits them."""

    def __init__(self, role: str, base: dict | None = None, geometry: tuple | None = None,
                 max_held_bytes: int = 1 << 30, timeout_s: float = 60.0, clock=time.monotonic, salted: bool = False,
                 block_size: int = 0, price_shadows: bool = True):
        self.role, self.salted = role, salted  # role: "kv_producer" | "kv_consumer" | "kv_both"
        self.block_size, self._sized = block_size, set()  # (0: unchecked, tests) methods whose segments fit a block
        codec_config(base or {}, "lynx")  # a bad base refused at setup
        self.base, self.geometry, self.max_held, self.timeout_s, self.clock = base or {}, geometry, \
            max_held_bytes, timeout_s, clock
        self._produce: dict[str, _Job] = {}   # req_id -> its publishing job
        self._saved: set[str] = set()
        self._published: dict[str, float] = {}  # xfer -> when a request took it (the last MAX_ENDED: duplicates)
        self._refusals: list[tuple[str, str]] = []
        self._new_loads: list[LoadMeta] = []
        self._loading: dict[str, LoadMeta] = {}
        self._refuse: dict[str, str] = {}     # req_id -> why (claims one token, fails when allocated)
        self._xfers: dict[str, _Xfer] = {}
        self._ended: dict[str, float] = {}    # xfer -> when it ended (late shadows are refused)
        self._closed: list[str] = []
        self._prompts: dict[str, _Seen] = {}  # live requests
        self._seen_at: dict[str, float] = {}
        self._pass_load: dict[str, str] = {}  # requests matched for a load in this scheduling pass (-> tier) ...
        self._pass_alloc: set[str] = set()    # ... and those that got blocks
        self._pass_bytes = 0                  # held bytes new transfers matched in this pass would add
        self._pressure = False                # some load could not get blocks in the last pass
        self._stats: dict[str, dict] = {}
        self.pricing, self._running, self._tokens = Pricing(), set(), 0  # the last step's requests and tokens
        self.price_shadows = price_shadows
        self.held = 0                         # bytes the decode side may hold for live transfers

    # ---- get_num_new_matched_tokens ------------------------------------------------------------------------
    def matched(self, req_id: str, prompt_ids: list, params, num_computed: int, salt: str | None = None,
                local: bool = False, greedy: bool = False) -> tuple[int | None, bool]:
        """Tokens to load beyond the local prefix hit `num_computed` and whether asynchronously; (None, False):
        not now (vLLM skips the request this step). salt: the request's cache_salt (with `self.salted`, prefix
        caching on, a consume request's must name its transfer); local: vLLM will not load for it (it skips reading
        the prefix cache, e.g. prompt_logprobs): it computes its prompt itself, exact, without Lynx; greedy: it
        decodes greedily (a shadow's drafts are priced by what greedy or sampled transfers kept)."""
        if self.role == "kv_producer":
            return 0, False
        if req_id in self._refuse:
            return 1, True
        try:
            p = parse_params(params, self.base)
        except ParamsError as e:
            self._note(req_id, prompt_ids, None)
            return self.refuse(req_id, str(e))
        self._note(req_id, prompt_ids, p["xfer"] if p and p["role"] == "consume" else None)
        if p is None or p["role"] != "consume":
            return 0, False
        if local:
            log.warning("request %s skips reading the prefix cache: it computes its prompt locally, without Lynx",
                        req_id)
            return 0, False
        why = self.salted and _salt_refusal(p, salt)
        if why:
            return self.refuse(req_id, why)
        if self.block_size and p["method"] not in self._sized:
            try:
                check_block_size(self.block_size, codec_config(self.base, p["method"]))
            except ValueError as e:
                return self.refuse(req_id, str(e))
            self._sized.add(p["method"])
        P = p["prompt_len"]
        if P > len(prompt_ids) - 1:
            return self.refuse(req_id, f"prompt_len {P} needs a prompt of at least {P + 1} tokens (the prompt "
                                         f"and its first token), got {len(prompt_ids)}")
        why = self._admit_real(req_id, p) if p["tier"] == "full" else self._admit_shadow(req_id, p, prompt_ids,
                                                                                          greedy)
        if why is WAIT:
            return None, False
        if why:
            return self.refuse(req_id, why, quiet=why.startswith(PRICED))
        if P <= num_computed:  # the local prefix cache holds the whole prompt (its own blocks: never written)
            return 0, False
        self._pass_load[req_id] = p["tier"]
        return P - num_computed, True

    def refuse(self, req_id: str, why: str, quiet: bool = False) -> tuple[int, bool]:
        """Fail request `req_id` with `why` (get_num_new_matched_tokens' answer: one token, loaded asynchronously, whose
        load fails); `quiet`: an operating decision (a priced-out shadow), logged at INFO, not a fault."""
        if req_id not in self._refuse:
            (log.info if quiet else log.warning)("request %s refused: %s", req_id, why)
        self._refuse[req_id] = why
        return 1, True

    def _bound(self, P: int, method: str) -> int:
        if self.geometry is None:
            return 0
        L, H, D, dtype = self.geometry
        return KVSpec(L, H, D, dtype, P).held_bound(codec_config(self.base, method))

    def _admit_real(self, req_id: str, p: dict):
        x = self._xfers.get(p["xfer"])
        if x is not None:
            return None if x.r in (None, req_id) else f"transfer {p['xfer']!r} has a real request already"
        if p["xfer"] in self._ended:
            return f"transfer {p['xfer']!r} ended already"
        bound = self._bound(p["prompt_len"], p["method"])
        if bound > self.max_held:
            return (f"a transfer of {p['prompt_len']} positions may hold {bound / 2**20:.0f} MiB on the decode "
                    f"instance, over its max_held_mb ({self.max_held / 2**20:.0f} MiB)")
        if self._xfers and self.held + self._pass_bytes + bound > self.max_held:
            return WAIT
        self._pass_bytes += bound
        return None

    def _admit_shadow(self, req_id: str, p: dict, prompt_ids: list, greedy: bool = False):
        x, now = self._xfers.get(p["xfer"]), self.clock()
        waited = now - self._seen_at.setdefault(req_id, now)
        if x is None or x.r is None:
            if p["xfer"] in self._ended:
                return "its transfer's real request finished already: its drafts would come too late"
            return f"no real request for transfer {p['xfer']!r} within {self.timeout_s:g} s" \
                if waited > self.timeout_s else WAIT
        if req_id in x.preempted:
            return "a preempted shadow is not reloaded (it only drafts; its real request goes on)"
        if x.r_state != "loading":
            return "its real request has its KV already: its drafts would come too late"
        if self._pressure:
            return WAIT
        # (hashed once, when it would be admitted: a shadow waiting out pressure is matched every pass)
        if (p["prompt_len"], p["method"]) != (x.P, x.method) or token_digest(prompt_ids[:x.P + 1]) != x.key:
            return (f"its prompt_len, method or first {x.P + 1} tokens differ from its transfer's real request "
                    f"({x.P}, {x.method!r})")
        if self.price_shadows:
            if x.verdict is None:  # once per transfer: its shadows come or go together
                x.others, x.greedy = self._others(x), greedy
                x.verdict = self.pricing.admit(x.others, self._tokens, greedy)
            if not x.verdict:
                x.priced_out += 1
                saving, cost = self.pricing.price(x.others, self._tokens, x.greedy)
                return (f"{PRICED} beside {x.others} real requests its transfer's drafts would save "
                        f"{saving:.2f} request-s and cost {cost:.2f} (pricing.py; {self.pricing.state()})")
        return None

    def _others(self, x: _Xfer) -> int:
        """pricing.py's N for transfer x: the real requests beside its own — running and no transfer's shadow, or
        another transfer's R still loading."""
        shadows = set().union(*(y.members - {y.r} for y in self._xfers.values()))
        loading = {y.r for y in self._xfers.values() if y.r is not None and y.r_state == "loading"}
        return len(((self._running - shadows) | loading) - {x.r})

    def _note(self, req_id: str, prompt_ids, claims: str | None) -> None:
        """A request seen: a rival of every live transfer whose key its prompt starts with (unless it claims it)."""
        if req_id in self._prompts:
            return
        self._prompts[req_id] = _Seen(prompt_ids, claims)
        for xfer, x in self._xfers.items():
            if xfer != claims and _starts_with(prompt_ids, x):
                x.rivals.add(req_id)

    # ---- update_state_after_alloc --------------------------------------------------------------------------
    def allocated(self, req_id: str, prompt_ids: list, params, block_ids: list, num_external: int) -> None:
        if req_id in self._refuse:
            if num_external > 0:
                self._new_loads.append(LoadMeta.refused(req_id, self._refuse[req_id]))
            return
        try:
            p = parse_params(params, self.base)
        except ParamsError as e:  # (a consume request was refused in matched already)
            if self.role != "kv_consumer" and req_id not in self._saved:
                self._saved.add(req_id)
                log.warning("request %s: not published: %s", req_id, e)
                xfer = params["lynx"].get("xfer") if isinstance(params.get("lynx"), dict) else None
                if _valid_xfer(xfer):  # its consumers hear why (an id the wire cannot carry reaches nobody)
                    self._refusals.append((xfer, str(e)))
            return
        if p is None:
            return
        if p["role"] == "produce" and self.role != "kv_consumer":
            if req_id in self._produce or req_id in self._saved:  # (a resumed one keeps its job)
                return
            if p["xfer"] in self._published:  # refusing it would fail the first one's consumers: not published
                self._saved.add(req_id)
                log.warning("request %s: transfer %r is published by another request already: not published",
                            req_id, p["xfer"])
                return
            self._published[p["xfer"]] = self.clock()
            while len(self._published) > MAX_ENDED:
                del self._published[next(iter(self._published))]
            self._produce[req_id] = _Job(p, list(block_ids), len(prompt_ids), token_digest(prompt_ids))
        elif p["role"] == "consume" and num_external > 0:
            self._add_member(req_id, prompt_ids, p, block_ids, num_external)

    def _add_member(self, req_id: str, prompt_ids: list, p: dict, block_ids: list, num_external: int) -> None:
        P, xfer = p["prompt_len"], p["xfer"]
        x = self._xfers.get(xfer)
        if x is None:
            x = self._xfers[xfer] = _Xfer(P, token_digest(prompt_ids[:P + 1]), token_digest(prompt_ids[:P]),
                                          p["method"], self._bound(P, p["method"]), int(prompt_ids[P]))
            self.held += x.bound
            x.rivals = {r for r, seen in self._prompts.items() if seen.claims != xfer and _starts_with(seen.ids, x)}
        x.members.add(req_id)
        x.times.setdefault(req_id, _Steps(self.clock()))  # (a preempted R reloading keeps its first admission)
        self._pass_alloc.add(req_id)
        if p["tier"] == "full":
            x.r, x.r_state = req_id, "loading"
        else:
            x.shadows = True
            x.loading.add(req_id)
        load = LoadMeta(req_id, xfer, p["method"], p["tier"], p["shadow"], p["host"], p["port"], P,
                        P - num_external, list(block_ids), token_digest(prompt_ids[:P]),
                        release=float(p.get("release", 0.0)))
        self._new_loads.append(load)
        self._loading[req_id] = load

    # ---- build_connector_meta ------------------------------------------------------------------------------
    def step_meta(self, new_reqs: list, cached: list, num_scheduled: dict, preempted=(), resumed=()) -> StepMeta:
        """new_reqs: [(req_id, block_ids, num_computed)]; cached: [(req_id, new_block_ids or None, num_computed)]
        of this step; num_scheduled: req_id → tokens scheduled now; preempted: ids whose blocks vLLM took back;
        resumed: cached ids whose new_block_ids are their whole table (back from a preemption)."""
        meta = StepMeta(loads=self._new_loads, refusals=self._refusals, closed=self._closed,
                        preempted=sorted(preempted))
        self._new_loads, self._refusals, self._closed = [], [], []
        self._saves(meta, new_reqs, cached, num_scheduled, set(preempted), set(resumed))
        self._account(new_reqs, cached, num_scheduled)
        for rid in preempted:
            self._preempted(rid)
        blocked = set(self._pass_load) - self._pass_alloc
        real_waits = any(self._pass_load[r] == "full" for r in blocked)
        for x in self._xfers.values():
            if x.r in num_scheduled and x.r_state == "loading":
                x.r_state = "running"
            x.loading -= set(num_scheduled) | set(preempted)
            if real_waits:  # shadows yield: a real request could not get blocks
                meta.yielded += sorted(x.loading)
                x.preempted |= x.loading
                x.loading = set()
        self._pressure = bool(blocked)
        self._pass_load, self._pass_alloc, self._pass_bytes = {}, set(), 0
        meta.drafts = {xfer: (x.P, x.key, len(x.members), x.first) for xfer, x in self._xfers.items()
                       if x.shadows and not x.rivals and x.r_state in ("loading", "running")}
        return meta

    def _account(self, new_reqs, cached, num_scheduled: dict) -> None:
        """The step model's step and each transfer's ledger (pricing.py): its shadows' tokens; R's drafts verified
        in the last step it ran (scheduled beyond its one token) and kept (how far its computed tokens moved on)."""
        now, self._tokens = self.clock(), sum(num_scheduled.values())
        self.pricing.step(now, self._tokens)
        self._running = set(num_scheduled)
        computed = {r: c for r, _, c in new_reqs} | {r: c for r, _, c in cached}
        for x in self._xfers.values():
            for m in ((x.members | {x.r}) & self._running) - {None}:
                t = x.times.get(m)
                if t is not None:
                    t.first_step = now if t.first_step is None else t.first_step
                    t.last_step, t.steps, t.batch = now, t.steps + 1, t.batch + len(num_scheduled)
            if not x.shadows:
                continue
            s_tokens = sum(num_scheduled.get(m, 0) for m in x.members if m != x.r)
            x.ledger = x.ledger.plus(shadow_tokens=s_tokens)
            if x.r not in num_scheduled or x.r not in computed:
                continue
            x.ledger = x.ledger.plus(overlap=s_tokens)
            self._book(x, computed[x.r])
            # (R's first step: vLLM's K placeholder drafts for a request that loaded remote KV, whatever the method)
            x.r_last = (computed[x.r], 1 if x.r_last is None else num_scheduled[x.r])

    @staticmethod
    def _book(x: _Xfer, computed: int) -> None:
        """R's drafts of the last step it ran, verified (scheduled beyond its one token) and kept (how far its
        computed tokens moved on since): `computed` is R's count now."""
        if x.r_last is not None and x.r_last[1] > 1:
            k = x.r_last[1] - 1
            x.ledger = x.ledger.plus(drafted=k, accepted=min(k, max(0, computed - x.r_last[0] - 1)))

    def _saves(self, meta: StepMeta, new_reqs, cached, num_scheduled, preempted: set, resumed: set) -> None:
        for rid in preempted & set(self._produce):  # its blocks are gone: a resumed one brings a whole new table
            self._produce[rid].blocks = []
        steps = [(r, b, c, False) for r, b, c in new_reqs] + [(r, b, c, r not in resumed) for r, b, c in cached]
        for rid, blocks, computed, more in steps:
            job = self._produce.get(rid)
            if job is None:
                continue
            if blocks:  # a new or resumed request's whole table, or the blocks a running one gained
                job.blocks = job.blocks + list(blocks) if more else list(blocks)
            if computed + num_scheduled.get(rid, 0) >= job.P:  # the prompt's last prefill step runs now
                del self._produce[rid]
                self._saved.add(rid)
                meta.saves.append(SaveMeta(rid, job.p["xfer"], job.p["method"], job.P, job.blocks, job.digest))

    def _preempted(self, rid: str) -> None:
        for x in self._xfers.values():
            if rid in x.members:
                x.members.discard(rid)
                if rid == x.r:
                    x.r_state, x.r_last = "preempted", None  # it comes back through matched, reloads the held copy
                else:
                    x.preempted.add(rid)

    # ---- update_connector_output / request_finished --------------------------------------------------------
    def worker_meta(self, stats: dict | None) -> None:
        for rid, s in (stats or {}).items():
            if rid in self._loading:
                self._stats.setdefault(rid, {}).update(s)

    def finished(self, req_id: str, params, num_computed: int | None = None) -> dict | None:
        """The kv_transfer_params a finished request returns: its transfer's bytes and arrival times, and its
        timeline. num_computed: its computed tokens at the end (books a real request's last verification)."""
        x = next((x for x in self._xfers.values() if x.r == req_id), None)
        if x is not None and x.shadows and num_computed is not None:
            self._book(x, num_computed)
            x.r_last = None
        for d in (self._produce, self._refuse, self._prompts, self._seen_at):
            d.pop(req_id, None)
        self._saved.discard(req_id)
        load, stats = self._loading.pop(req_id, None), self._stats.pop(req_id, None)
        timeline = next((self._timeline(x, req_id) for x in self._xfers.values() if req_id in x.times), None)
        for xfer, x in list(self._xfers.items()):
            x.rivals.discard(req_id)
            x.members.discard(req_id)
            if req_id == x.r:
                x.r_state = "done"
            if x.r_state == "done" and not x.members:
                self._end(xfer)
        if load is None or load.error is not None:
            return None
        return {"lynx": {"xfer": load.xfer, "tier": load.tier, "start": load.start, "prompt_len": load.prompt_len,
                         **(stats or {}), **({"timeline": timeline} if timeline else {})}}

    def _timeline(self, x: _Xfer, req_id: str) -> dict:
        """A member's timeline (scheduler clock, seconds): admitted (got blocks for its load), first and last step
        it ran, its steps and the mean batch it ran in; for R also its transfer's ledger at R's end (shadow tokens,
        R's drafts verified and kept — not counting vLLM's placeholders on its first step, which /metrics counts —,
        shadow tokens in R's steps), the shadows priced out and the real requests beside it when priced."""
        t = x.times.pop(req_id)
        out = {"admitted": t.admitted, "first_step": t.first_step, "last_step": t.last_step, "steps": t.steps,
               "batch_mean": round(t.batch / t.steps, 2) if t.steps else None}
        if req_id == x.r:
            out.update(asdict(x.ledger), priced_out=x.priced_out, others=x.others)
        return out

    def _end(self, xfer: str) -> None:
        x = self._xfers.pop(xfer)
        self.held -= x.bound
        if x.shadows:
            self.pricing.ended(x.ledger, x.greedy)
        self._closed.append(xfer)
        self._ended[xfer] = self.clock()
        while len(self._ended) > MAX_ENDED:
            del self._ended[next(iter(self._ended))]


def _starts_with(ids, x: _Xfer) -> bool:
    """ids start with the transfer's prompt (whatever follows: its first token, or a turn of its own)."""
    return len(ids) >= x.P and token_digest(ids[:x.P]) == x.prompt


def _valid_xfer(xfer) -> bool:
    try:
        check_xfer_id(xfer)
        return True
    except (TypeError, ValueError):
        return False
