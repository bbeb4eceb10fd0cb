"""The connector's logic as plain Python, mirrored on vLLM's `KVConnectorBase_V1` hooks but fed plain data (request
ids, token ids, block ids), so tests drive it without vLLM; connector.py only adapts vLLM's objects to it.

Terms. A *transfer* (xfer) is one prompt's KV, published by the prefill instance under an id the orchestrator
picks. On the decode instance a transfer feeds at most two requests: the *shadow* S (tier "anchor": anchor-only
KV, decodes the drafts, output never forwarded) and the *real* request R (tier "full"). A request names its part in
`kv_transfer_params["lynx"]` (see `parse_params`). Baseline methods (bf16, int8, kivi4, ...) have one tier: R alone.

Scheduler side (`SchedulerSide`): `matched` (→ vLLM's get_num_new_matched_tokens), `allocated`
(update_state_after_alloc), `step_meta` (build_connector_meta), `finished` (request_finished), `worker_meta`
(update_connector_output). Worker side (`WorkerSide`): `begin_step` (start_load_kv), `save_layer` (save_kv_layer),
`results` (get_transfer_results), `stats` (build_connector_worker_meta)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..config import LynxQuantConfig
from ..errors import ConfigError
from . import paged
from ..transfer.wire import Stream
from .stream import KVPublisher, KVSpec, Subscription, check_xfer_id, encode_layer, token_digest

log = logging.getLogger("lynx_hf.vllm")
TIERS = ("anchor", "full")


class ParamsError(ValueError):
    """kv_transfer_params["lynx"] is malformed."""


def parse_params(params) -> dict | None:
    """kv_transfer_params → the validated "lynx" part, or None when the request is not Lynx's.
    produce: {"role": "produce", "xfer", "method"}; consume: {"role": "consume", "xfer", "method", "tier",
    "shadow" (R: whether an S shares the transfer), "host", "port", "prompt_len", optionally "release" (a shadow:
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
    check_xfer_id(p["xfer"])
    if not isinstance(p["method"], str):
        raise ParamsError("kv_transfer_params['lynx']['method'] must be a string")
    if role == "consume":
        if p["tier"] not in TIERS or not isinstance(p["shadow"], bool):
            raise ParamsError(f"tier must be one of {TIERS} and shadow a bool, got {p['tier']!r}, {p['shadow']!r}")
        if not isinstance(p["host"], str) or not isinstance(p["port"], int) or not 0 < p["port"] < 65536:
            raise ParamsError(f"host must be a string and port in [1, 65535], got {p['host']!r}, {p['port']!r}")
        r = p.get("release", 0.0)
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise ParamsError(f"release must be a number in [0, 1], got {r!r}")
        n = p["prompt_len"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ParamsError(f"prompt_len must be a positive int, got {n!r}")
    return p


def codec_config(base: dict, method: str) -> LynxQuantConfig:
    try:
        config = LynxQuantConfig(**{**base, "method": method})
    except (ConfigError, TypeError) as e:
        raise ParamsError(str(e)) from None
    if config.anchor_bits == "auto":  # the connector has no per-request link forecast: a width both sides name
        raise ParamsError("anchor_bits 'auto' is chosen per request by lynx-hf's own client (DecodeClient); the vLLM "
                          "connector takes a fixed width: 2, 3 or 4")
    if config.exact:  # its streams carry anchor and residual only
        raise ParamsError("exact=True is not served through the vLLM connector yet: use lynx-hf's own transfer "
                          "(serve-prefill / DecodeClient) for exact mode")
    return config


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
    error: str | None = None  # the request's params were refused: fail it at once
    release: float = 0.0      # a shadow starts once this fraction of the full tier is placed too


@dataclass
class StepMeta:
    saves: list = field(default_factory=list)
    loads: list = field(default_factory=list)
    dropped: list = field(default_factory=list)  # (xfer, tier) of requests that finished before their load began


class SchedulerSide:
    def __init__(self, role: str):
        self.role = role  # "kv_producer" | "kv_consumer" | "kv_both"
        self._produce: dict[str, dict] = {}   # req_id -> {params, block_ids, prompt_len, digest}
        self._new_loads: list[LoadMeta] = []
        self._loading: dict[str, LoadMeta] = {}
        self._dropped: list[str] = []
        self._stats: dict[str, dict] = {}

    def matched(self, req_id: str, prompt_ids: list, params, num_computed: int) -> tuple[int, bool]:
        """Tokens to load beyond the local prefix hit `num_computed`, and whether asynchronously."""
        try:
            p = parse_params(params)
        except ParamsError as e:
            log.warning("request %s: %s (computed locally)", req_id, e)
            return 0, False
        if p is None or p["role"] != "consume" or self.role == "kv_producer":
            return 0, False
        P = p["prompt_len"]
        if P > len(prompt_ids) - 1:  # the decode request is the prompt and its first token, at least
            log.warning("request %s: prompt_len %d needs a prompt of at least %d tokens, got %d (computed locally)",
                        req_id, P, P + 1, len(prompt_ids))
            return 0, False
        return (P - num_computed, True) if P > num_computed else (0, False)

    def allocated(self, req_id: str, prompt_ids: list, params, block_ids: list, num_external: int) -> None:
        try:
            p = parse_params(params)
        except ParamsError:
            return
        if p is None:
            return
        if p["role"] == "produce" and self.role != "kv_consumer" and req_id not in self._produce:
            self._produce[req_id] = {"p": p, "blocks": list(block_ids), "P": len(prompt_ids),
                                     "digest": token_digest(prompt_ids)}
        elif p["role"] == "consume" and num_external > 0:
            P = p["prompt_len"]
            load = LoadMeta(req_id, p["xfer"], p["method"], p["tier"], p["shadow"], p["host"], p["port"], P,
                            P - num_external, list(block_ids), token_digest(prompt_ids[:P]),
                            release=float(p.get("release", 0.0)))
            self._new_loads.append(load)
            self._loading[req_id] = load

    def step_meta(self, new_reqs: list, cached: list, num_scheduled: dict) -> StepMeta:
        """new_reqs: [(req_id, block_ids, num_computed)]; cached: [(req_id, new_block_ids or None,
        num_computed)] of this step; num_scheduled: req_id → tokens scheduled now."""
        meta = StepMeta(loads=self._new_loads, dropped=self._dropped)
        self._new_loads, self._dropped = [], []
        steps = [(r, b, c, False) for r, b, c in new_reqs] + [(r, b, c, True) for r, b, c in cached]
        for rid, blocks, computed, more in steps:
            job = self._produce.get(rid)
            if job is None:
                continue
            if blocks:  # a new request's whole table, or the blocks a running one gained
                job["blocks"] = job["blocks"] + list(blocks) if more else list(blocks)
            if computed + num_scheduled.get(rid, 0) >= job["P"]:  # the prompt's last prefill step runs now
                del self._produce[rid]
                p = job["p"]
                meta.saves.append(SaveMeta(rid, p["xfer"], p["method"], job["P"], job["blocks"], job["digest"]))
        return meta

    def worker_meta(self, stats: dict | None) -> None:
        for rid, s in (stats or {}).items():
            self._stats.setdefault(rid, {}).update(s)

    def finished(self, req_id: str, params) -> dict | None:
        """The kv_transfer_params a finished request returns: its transfer's bytes and arrival times."""
        self._produce.pop(req_id, None)
        load = self._loading.pop(req_id, None)
        stats = self._stats.pop(req_id, None)
        if load is None:
            try:
                p = parse_params(params)
            except ParamsError:
                p = None
            if p is not None and p["role"] == "consume":  # finished before its blocks were allocated
                self._dropped.append((p["xfer"], p["tier"]))
            return None
        return {"lynx": {"xfer": load.xfer, "tier": load.tier, **(stats or {})}}


@dataclass
class _Load:
    meta: LoadMeta
    done: bool = False
    aborted: bool = False


class WorkerSide:
    """Holds the paged KV (`register`), the publisher (prefill) and the subscriptions (decode)."""

    def __init__(self, base_config: dict, secret: bytes, fingerprint: str, publisher: KVPublisher | None = None,
                 timeout_s: float = 60.0, upgrade_shadows: bool = True):
        codec_config(base_config, "lynx")  # a bad base (exact mode among it) refused at setup, not in a forward
        self.base, self.secret, self.fp, self.publisher, self.timeout_s = base_config, secret, fingerprint, \
            publisher, timeout_s
        self.layers: list = []  # per layer, its paged KV tensor [NB, H, bs, 2D]
        self.index: dict[str, int] = {}
        self.kv_heads = self.head_dim = 0
        self.dtype = ""
        self._loads: dict[str, _Load] = {}
        self._subs: dict[str, Subscription] = {}
        self._dropped: set[tuple[str, str]] = set()  # (xfer, tier) whose request finished or will never come
        self._idle: dict[str, float] = {}  # xfer -> since when no request reads it
        self.drafting: dict[str, tuple[int, str]] = {}  # live transfers with a shadow: xfer -> (P, prompt digest)
        self._members: dict[str, set] = {}  # xfer -> ids of its S and R not finished yet
        self._upgrade: dict[str, tuple[str, list]] = {}  # decoding shadows: req_id -> (xfer, block ids)
        self.upgrade_shadows = upgrade_shadows
        self._stats: dict[str, dict] = {}

    def register(self, kv_caches: dict) -> None:
        """kv_caches: layer name → [NB, H, bs, 2D] (in the model's layer order)."""
        self.index = {name: i for i, name in enumerate(kv_caches)}
        self.layers = list(kv_caches.values())
        _, self.kv_heads, _, d2 = self.layers[0].shape
        self.head_dim = d2 // 2
        self.dtype = str(self.layers[0].dtype).replace("torch.", "")

    def spec(self, prompt_len: int) -> KVSpec:
        return KVSpec(len(self.layers), self.kv_heads, self.head_dim, self.dtype, prompt_len)

    # -- prefill instance -------------------------------------------------------------------------------------
    def begin_step(self, meta: StepMeta) -> None:
        """The step's new loads (vLLM calls this after the forward pass on steps with no synchronous load)."""
        self._dropped.update(map(tuple, meta.dropped))
        for m in meta.loads:
            if m.req_id not in self._loads:
                self._start_load(m)

    def save_layer(self, meta: StepMeta, name: str, layer_cache) -> None:
        """During the forward pass, after layer `name` wrote its KV: encode and queue the step's saves' KV of it."""
        i = self.index.get(name)
        if i is None:
            return
        for s in meta.saves:
            config = codec_config(self.base, s.method)
            if i == 0:
                try:
                    self.publisher.begin(s.xfer, config, self.spec(s.prompt_len), s.digest)
                except (ValueError, RuntimeError) as e:  # a refused transfer: its subscriber hears "unknown"
                    log.warning("transfer %s not published: %s", s.xfer, e)
                    continue
            k, v = paged.gather(layer_cache, s.block_ids, s.prompt_len)
            self.publisher.add(s.xfer, encode_layer(config, i, len(self.layers), k, v))
            if i == len(self.layers) - 1:
                self.publisher.finish(s.xfer)

    # -- decode instance --------------------------------------------------------------------------------------
    def _start_load(self, m: LoadMeta) -> None:
        self._loads[m.req_id] = _Load(m)
        if m.shadow:  # the proposer drafts for this transfer's rows until both its requests finished
            self.drafting[m.xfer] = (m.prompt_len, m.digest)
            self._members.setdefault(m.xfer, set()).add(m.req_id)
        if m.xfer in self._subs and self._subs[m.xfer].placed(m.tier):
            m.error = f"request joined transfer {m.xfer!r} after its first {m.tier}-tier pieces were placed"
        if m.error is not None or m.xfer in self._subs:
            return
        try:
            self._subs[m.xfer] = Subscription(m.host, m.port, self.secret, self.fp, m.xfer,
                                              codec_config(self.base, m.method), self.spec(m.prompt_len), m.digest,
                                              self.timeout_s)
        except (ValueError, OSError) as e:
            m.error = f"transfer {m.xfer!r} could not start: {e}"

    def _sink(self, xfer: str):
        def sink(tier, layer, kind, start, x):
            targets = [ld for ld in self._loads.values() if ld.meta.xfer == xfer and ld.meta.tier == tier]
            if not targets:  # no request of this tier registered: drop the piece if none is coming, else wait
                if (xfer, tier) in self._dropped:
                    return True
                return tier == "anchor" and not any(ld.meta.xfer == xfer and ld.meta.shadow
                                                    for ld in self._loads.values())
            blocks = [(ld.meta.block_ids, ld.meta.start) for ld in targets if not ld.aborted]
            if tier == "full" and self.upgrade_shadows:  # shadows (waiting or decoding) draft on their prompt KV,
                # upgraded as the residual lands
                blocks += [(ld.meta.block_ids, ld.meta.start) for ld in self._loads.values()
                           if ld.meta.xfer == xfer and ld.meta.tier == "anchor" and not ld.aborted]
                blocks += [(b, 0) for x_, b in self._upgrade.values() if x_ == xfer]
            for block_ids, first in blocks:
                lo = max(start, first)
                if lo < start + x.shape[2]:  # below `first`: the local prefix hit, kept
                    paged.scatter(self.layers[layer], block_ids, lo, kind, x[:, :, lo - start:])
            return True
        return sink

    def results(self, finished_req_ids: set) -> tuple[set, set]:
        """Drain every subscription; → (finished_recving, failed_recving) request ids for this step."""
        done, failed = set(), set()
        for rid in finished_req_ids:  # aborted while loading: stop writing into its blocks, let vLLM free them
            self._upgrade.pop(rid, None)
            if rid in self._loads:
                self._loads[rid].aborted = True
        for xfer, members in list(self._members.items()):
            members -= set(finished_req_ids)
            if not members:
                del self._members[xfer], self.drafting[xfer]
        for xfer, sub in list(self._subs.items()):
            sub.drain(self._sink(xfer))
        for rid, ld in list(self._loads.items()):
            m, sub = ld.meta, self._subs.get(ld.meta.xfer)
            error = m.error or (sub.error if sub is not None else f"transfer {m.xfer!r} has no stream")
            ready = sub is not None and (sub.full_done if m.tier == "full" else sub.anchor_done and (
                sub.placed("full") >= m.release * sub.expected[1]))
            if ld.aborted or ready or error:
                done.add(rid)
                if error and not ready and not ld.aborted:
                    failed.add(rid)
                    log.warning("request %s: %s", rid, error)
                if sub is not None:
                    self._stats[rid] = {"bytes": sum(sub.bytes_in.values()), "anchor_bytes": sub.bytes_in[Stream.ANCHOR],
                                        **{f"{t}_at": v for t, v in sub.arrived_at.items()}}
                self._dropped.add((m.xfer, m.tier))  # whatever of its tier still arrives has no reader
                if m.tier == "anchor" and ready and not ld.aborted and self.upgrade_shadows:
                    self._upgrade[rid] = (m.xfer, m.block_ids)  # until it finishes (finished_req_ids)
                del self._loads[rid]
        now = time.monotonic()
        for xfer, sub in list(self._subs.items()):
            if any(ld.meta.xfer == xfer for ld in self._loads.values()):
                self._idle.pop(xfer, None)
            elif sub.full_done or sub.error or now - self._idle.setdefault(xfer, now) > self.timeout_s:
                self._subs.pop(xfer).close()  # (a request that never came: its pieces wait `timeout_s` at most)
                self._idle.pop(xfer, None)
                self._dropped -= {(xfer, t) for t in TIERS}
        return done, failed

    def stats(self) -> dict:
        out, self._stats = self._stats, {}
        return out

    def close(self) -> None:
        for sub in self._subs.values():
            sub.close()
        if self.publisher is not None:
            self.publisher.close()
