"""`LynxPD`: Lynx's disaggregated prefill/decode over two vLLM engines, each in a process of its own.

    pd = LynxPD(model_path, bandwidth_mbps=15).start()
    r = pd.generate(prompt_ids, max_tokens=32)              # method="lynx": anchor first, drafts, vLLM verifies
    r.tokens, r.ttft_s, r.tt32t_s, r.accepted

One request: the prefill engine runs the prompt (max_tokens=1: its first token) and its connector publishes the
prompt's KV; the decode engine gets the shadow S (tier "anchor", its own cache salt, `draft_budget` tokens, output
never returned) and the real request R (tier "full"), both with prompt + first token. S decodes as soon as every
anchor is in; R runs when the residual has landed, and the `LynxProposer` gives it S's tokens as drafts, which
vLLM's rejection sampler verifies: R's tokens are what decoding the full tier gives. S is aborted when R is done
or has caught up with it. Baselines (bf16, int8, kivi4, ...) ship their whole code and run R alone.
`drafts=False` runs R alone for any method: the reference Lynx must equal."""
from __future__ import annotations

import queue
import secrets as _secrets
import threading
import time
from dataclasses import dataclass, field

from ...config import LynxQuantConfig
from ..scheduler import full_salt
from .engine import EngineFailed, EngineProcess

DEFAULT_PORT = 7411


def shadow_seed(seed: int, i: int) -> int:
    """Shadow i's seed for a request seeded `seed`: a stream of its own, never the request's (a draft must not
    share the randomness that verifies it)."""
    return (seed * 1_000_003 + i + 1) % (1 << 63)


class RequestFailed(RuntimeError):
    """One request failed (its transfer, its engine); the engines serve on."""


@dataclass
class PDResult:
    """Times are seconds from the request's start; `token_s[i]` is when token i+1 (of R's) was produced."""
    tokens: list                      # the first token (prefill) then R's tokens
    first_token_s: float              # the prefill engine's token
    ttft_s: float                     # the first token the decode engine produced (a draft or a verified one)
    ttft_verified_s: float            # R's first token
    token_s: list                     # per token of `tokens`, when it was known verified
    finish_reason: str | None
    drafted: int = 0                  # tokens S decoded on the anchor tier
    accepted: int = 0                 # R's drafts vLLM accepted (a verification step gives them + one token)
    bytes: int = 0                    # bytes the decode engine received for this prompt's KV
    anchor_bytes: int = 0
    anchor_at_s: float | None = None  # every anchor segment in
    full_at_s: float | None = None    # every segment in
    draft_tokens: list = field(default_factory=list)  # S's tokens (after the first)
    extra: dict = field(default_factory=dict)

    def tt(self, n: int) -> float | None:
        """Time to the n-th verified token (n counts the prefill's first token)."""
        return self.token_s[n - 1] if len(self.token_s) >= n else None


class LynxPD:
    def __init__(self, model: str, *, bandwidth_mbps: float | None = None, port: int = DEFAULT_PORT,
                 quant: LynxQuantConfig | None = None, num_speculative_tokens: int = 8, draft_budget: int = 31,
                 secret: str | None = None, dtype: str = "float32", max_model_len: int = 4096,
                 block_size: int = 128, timeout_s: float = 60.0, shadow_release: tuple = (0.0, 0.5),
                 upgrade_shadows: bool = True, engine_kwargs: dict | None = None,
                 cores: tuple[list, list] | None = None):
        """cores: (the prefill engine's CPU ids, the decode engine's), e.g. engine.disjoint_cores(); None: both
        engines share every core (their work then slows each other, which no disaggregated deployment has)."""
        if quant is not None and quant.exact:
            raise ValueError("exact=True is not served through the vLLM connector yet: use lynx-hf's own transfer "
                             "(serve-prefill / DecodeClient) for exact mode")
        base = (quant or LynxQuantConfig()).to_dict()
        base.pop("method")
        self.port, self.draft_budget, self.timeout_s = port, draft_budget, timeout_s
        self.release = tuple(float(r) for r in shadow_release)
        if not self.release or not all(0.0 <= r <= 1.0 for r in self.release):
            raise ValueError(f"shadow_release must be fractions in [0, 1], one per shadow, got {shadow_release!r}")
        self.secret = secret or _secrets.token_hex(16)  # loopback demo: a fresh shared secret per pair
        extra = {"host": "127.0.0.1", "port": port, "quant": base, "secret": self.secret, "timeout_s": timeout_s,
                 "upgrade_shadows": upgrade_shadows}
        common = dict(model=model, dtype=dtype, max_model_len=max_model_len, block_size=block_size,
                      enforce_eager=True, max_num_seqs=16, **(engine_kwargs or {}))
        conn = {"kv_connector": "LynxConnector", "kv_connector_module_path": "lynx_hf.vllm.connector",
                "kv_load_failure_policy": "fail"}
        self.prefill = EngineProcess({**common, "kv_transfer_config": {
            **conn, "kv_role": "kv_producer",
            "kv_connector_extra_config": {**extra, "bandwidth_mbps": bandwidth_mbps or 0}}}, name="prefill",
            cores=cores[0] if cores else None)
        self.decode = EngineProcess({**common, "disable_log_stats": False,
                                     "speculative_config": {"method": "custom_class",
                                                            "model": "lynx_hf.vllm.proposer.LynxProposer",
                                                            "num_speculative_tokens": num_speculative_tokens},
                                     "kv_transfer_config": {**conn, "kv_role": "kv_consumer",
                                                            "kv_connector_extra_config": extra}}, name="decode",
                                    cores=cores[1] if cores else None)
        self.cores = cores
        self._one = threading.Lock()  # generate() runs one request at a time (its counters are the engine's)

    def start(self) -> "LynxPD":
        errors = []

        def go(e):
            try:
                e.start()
            except EngineFailed as x:
                errors.append(x)

        ts = [threading.Thread(target=go, args=(e,)) for e in (self.prefill, self.decode)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errors:
            self.close()
            raise errors[0]
        return self

    @property
    def version(self) -> str:
        return self.decode.version

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def _next(self, q: queue.Queue, what: str, deadline: float):
        try:
            ev = q.get(timeout=max(0.01, deadline - time.time()))
        except queue.Empty:
            raise RequestFailed(f"{what}: no output for {self.timeout_s:g} s") from None
        if ev is None:
            raise RequestFailed(f"{what}: the engine process died")
        return ev

    def generate(self, prompt_ids: list, max_tokens: int = 32, method: str = "lynx", drafts: bool = True,
                 temperature: float = 0.0, seed: int | None = None, top_p: float = 1.0, top_k: int = -1,
                 xfer: str | None = None) -> PDResult:
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        with self._one:
            return self._generate(list(prompt_ids), max_tokens, method, drafts, temperature, seed, top_p, top_k,
                                  xfer or _secrets.token_hex(8))

    def _generate(self, ids, max_tokens, method, drafts, temperature, seed, top_p, top_k, xfer) -> PDResult:
        sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
        LynxQuantConfig(method=method)  # an unknown method is refused here, before anything is sent
        t0 = time.time()
        q = self.prefill.add(f"p-{xfer}", ids, {**sampling, "max_tokens": 1, "extra_args": {
            "kv_transfer_params": {"lynx": {"role": "produce", "xfer": xfer, "method": method}}}})
        deadline = t0 + self.timeout_s
        ev = self._next(q, "prefill", deadline)
        while not ev.finished:
            ev = self._next(q, "prefill", deadline)
        self.prefill.forget(f"p-{xfer}")
        if ev.finish_reason not in ("length", "stop") or not ev.tokens:
            raise RequestFailed(f"prefill failed: {ev.finish_reason} {ev.extra.get('error', '')}".strip())
        first, t_first = ev.tokens[0], ev.t
        res = PDResult([first], t_first - t0, 0.0, 0.0, [t_first - t0], None)
        if max_tokens == 1:
            res.ttft_s = res.ttft_verified_s = res.first_token_s
            return res
        ids1 = ids + [first]
        split = LynxQuantConfig(method=method).method in ("lynx", "paper")
        shadow = drafts and split
        kv = {"role": "consume", "xfer": xfer, "method": method, "shadow": shadow, "host": "127.0.0.1",
              "port": self.port, "prompt_len": len(ids)}
        before = self.decode.counters()
        s_ids = [f"s{i}-{xfer}" for i in range(len(self.release) if shadow else 0)]
        sqs = []
        for i, sid in enumerate(s_ids):  # each shadow decodes as R does, starting when its share of the residual is in
            sp = sampling if seed is None else {**sampling, "seed": shadow_seed(seed, i)}
            sqs.append(self.decode.add(sid, ids1, {**sp, "max_tokens": self.draft_budget, "extra_args": {
                "kv_transfer_params": {"lynx": {**kv, "tier": "anchor", "release": self.release[i]}}}},
                cache_salt=f"lynx-anchor-{xfer}"))
        rq = self.decode.add(f"r-{xfer}", ids1, {**sampling, "max_tokens": max_tokens - 1, "extra_args": {
            "kv_transfer_params": {"lynx": {**kv, "tier": "full"}}}}, cache_salt=full_salt(method))
        try:
            self._collect(res, t0, rq, sqs, s_ids)
        finally:
            if s_ids:
                self.decode.abort(s_ids)
            self.decode.forget(f"r-{xfer}")
        after = self.decode.counters()  # every row of the transfer: a later shadow verifies an earlier one's chain too
        res.extra["engine_draft_tokens"] = after["draft"] - before["draft"]
        res.extra["engine_accepted_tokens"] = after["accepted"] - before["accepted"]
        return res

    def _collect(self, res: PDResult, t0: float, rq, sqs: list, s_ids: list) -> None:
        """R's tokens as they come; the shadows' drafts on the side (aborted once R has passed them all)."""
        drafts = [[] for _ in sqs]
        live, first_decode, deadline = set(range(len(sqs))), None, time.time() + self.timeout_s
        while True:
            for i in list(live):
                try:
                    while True:
                        ev = sqs[i].get_nowait()
                        if ev is None:
                            raise RequestFailed("the decode engine process died")
                        if ev.tokens and first_decode is None:
                            first_decode = ev.t
                        drafts[i] += ev.tokens
                        if ev.finished:
                            live.discard(i)
                            break
                except queue.Empty:
                    pass
            try:
                ev = rq.get(timeout=0.005)
            except queue.Empty:
                if time.time() > deadline:
                    raise RequestFailed(f"decode: no verified token for {self.timeout_s:g} s") from None
                continue
            if ev is None:
                raise RequestFailed("the decode engine process died")
            deadline = time.time() + self.timeout_s
            if ev.tokens:
                res.accepted += len(ev.tokens) - 1  # a step gives the drafts it accepted and one token of its own
                if len(res.tokens) == 1:
                    res.ttft_verified_s = ev.t - t0
                    first_decode = ev.t if first_decode is None else min(first_decode, ev.t)
                res.tokens += ev.tokens
                res.token_s += [ev.t - t0] * len(ev.tokens)
            if live and len(res.tokens) - 1 >= max(map(len, drafts)):
                self.decode.abort(s_ids)  # R passed every shadow: their drafts can no longer help
                live.clear()
            if ev.finished:
                res.finish_reason = ev.finish_reason
                if ev.finish_reason not in ("length", "stop"):
                    raise RequestFailed(f"decode failed ({ev.finish_reason}): the KV transfer failed (the decode "
                                        f"engine's log names the cause)")
                lynx = (ev.kv_params or {}).get("lynx", {})
                res.bytes, res.anchor_bytes = lynx.get("bytes", 0), lynx.get("anchor_bytes", 0)
                res.anchor_at_s = lynx["anchor_at"] - t0 if "anchor_at" in lynx else None
                res.full_at_s = lynx["full_at"] - t0 if "full_at" in lynx else None
                break
        res.drafted = sum(map(len, drafts))
        res.draft_tokens = drafts[0] if drafts else []
        res.ttft_s = (first_decode or t0) - t0
