"""The connector's worker-side logic as plain Python (scheduler.py has the terms and the scheduler side): the paged KV
(`register`), the encoder and publisher on the prefill instance, the transfers and loads on the decode instance.

Hooks: `handle_preemptions` and `begin_step` (start_load_kv) take the step's metadata; `save_layer`
(save_kv_layer) and `end_saves` (wait_for_save); `results` (get_transfer_results); `stats`
(build_connector_worker_meta); `drafting` (what the proposer drafts for).

Decode instance. One `Subscription` per live transfer holds its codes until the scheduler side closes it. A *load*
places one request's tier into its blocks, piece by piece, from its own cursor over the held pieces, so no load
waits for another request (a late one replays what arrived before it). Each `results` call places pieces for at
most as long as the engine ran since the last one returned (the forward, the scheduler, the proposer), and at
least `drain_ms` (and one piece): placement gets at most half the engine's time while there is a backlog, so a fast
link never stalls the batch, and a slow step never starves placement. Real requests first, then waiting shadows,
then upgrades of decoding shadows. R is ready when its full tier is placed; a shadow when its anchors are and its
share (`release`) of the full tier (with `upgrade_shadows`, placed into its own blocks: a shadow drafts on KV that
improves as the residual lands). Writes into a request's blocks stop the step vLLM preempts, aborts or finishes it,
before the next forward."""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from . import paged
from .scheduler import TIERS, LoadMeta, StepMeta, codec_config
from .stream import KVPublisher, KVSpec, Subscription, encode_layer, lower_priority

log = logging.getLogger("lynx_hf.vllm")


def choose_layout(backends, kv_cache_layout: str) -> paged.Layout:
    """The paged KV layout of an engine whose attention layers run `backends` (vLLM's backend names) under vLLM's
    resolved `kv_cache_layout` (a KVCacheLayout name) → paged.Layout, or a RuntimeError in one line."""
    names = sorted(set(backends))
    if len(names) != 1:
        raise RuntimeError(f"LynxConnector reads one attention backend's paged KV; this engine runs {names or 'none'}"
                           f" (supported: {paged.supported()})")
    try:
        return paged.Layout(names[0], kv_cache_layout)
    except ValueError as e:
        raise RuntimeError(f"LynxConnector: {e}") from None


class _Encoder:
    """The prefill instance's encoder thread: a forward copies each layer's prompt KV out of the paged cache (`put`),
    and only once the forward is over (`release`, from wait_for_save) is it encoded and published, so no method's
    codec runs between the prompt's forward and its first token (vLLM's proxies send that token before the decode
    instance asks for any KV). Copies waiting or being encoded are under `max_bytes`: `release` blocks the engine
    until they fit (backpressure, never an unbounded queue)."""

    def __init__(self, publisher: KVPublisher, max_bytes: int):
        self.publisher, self.max_bytes = publisher, max_bytes
        self._step: list = []  # this forward's (xfer, config, layer, num_layers, k, v)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self.queued_bytes = 0
        self._failed: set[str] = set()
        threading.Thread(target=self._run, name="lynx-kv-encode", daemon=True).start()

    def put(self, xfer: str, config, layer: int, num_layers: int, k, v) -> None:
        self._step.append((xfer, config, layer, num_layers, k, v))

    def release(self) -> None:
        """The forward is over: encode what it saved (the step's layers in order)."""
        jobs, self._step = self._step, []
        size = sum(j[4].nbytes + j[5].nbytes for j in jobs)
        with self._cv:
            while self.queued_bytes and self.queued_bytes + size > self.max_bytes:
                self._cv.wait()
            self.queued_bytes += size
        for j in jobs:
            self._jobs.put(j)

    def drained(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything released is encoded and published (tests, shutdown)."""
        with self._cv:
            return self._cv.wait_for(lambda: self.queued_bytes == 0, timeout_s)

    def _run(self) -> None:
        lower_priority(self.publisher.nice)  # the codec yields the core to the engine's next forward
        while True:
            job = self._jobs.get()
            if job is None:
                return
            xfer, config, i, n, k, v = job
            try:
                if xfer not in self._failed:
                    self.publisher.add(xfer, encode_layer(config, i, n, k, v))
                    if i == n - 1:
                        self.publisher.finish(xfer)
            except (ValueError, RuntimeError) as e:  # one transfer fails, never the engine
                self._failed.add(xfer)  # (its subscriber hears that the prefill instance stopped producing it)
                log.warning("transfer %s not published: %s", xfer, e)
            finally:
                if i == n - 1:
                    self._failed.discard(xfer)
                with self._cv:
                    self.queued_bytes -= k.nbytes + v.nbytes
                    self._cv.notify_all()

    def close(self) -> None:
        self._jobs.put(None)


@dataclass
class _Load:
    meta: LoadMeta
    cursor: dict = field(default_factory=lambda: {t: 0 for t in TIERS})
    aborted: bool = False


class WorkerSide:
    def __init__(self, base_config: dict, secret: bytes, fingerprint: str, publisher: KVPublisher | None = None,
                 timeout_s: float = 60.0, upgrade_shadows: bool = True, drain_ms: float = 20.0,
                 clock=time.monotonic, max_encode_mb: float = 512.0):
        codec_config(base_config, "lynx")  # a bad base (exact mode among it) refused at setup, not in a forward
        self.base, self.secret, self.fp, self.publisher, self.timeout_s = base_config, secret, fingerprint, \
            publisher, timeout_s
        self.upgrade_shadows, self.drain_s, self.clock = upgrade_shadows, drain_ms / 1e3, clock
        self.layers: list = []  # per layer, its paged KV tensor [NB, H, bs, 2D] as vLLM registered it
        self.paged: list[paged.PagedLayer] = []  # the same, bound to its layout
        self.layout = paged.CPU
        self.index: dict[str, int] = {}
        self.kv_heads = self.head_dim = 0
        self.dtype = ""
        self._subs: dict[str, Subscription] = {}
        self._loads: dict[str, _Load] = {}     # loads not reported yet
        self._decoding: dict[str, _Load] = {}  # shadows decoding: their prompt KV upgraded as the residual lands
        self._real: dict[str, LoadMeta] = {}     # xfer -> its real request's load (its prefix hit: the shadows')
        self._step_end: float | None = None     # when the last `results` call returned (its forward ran since)
        self._stats: dict[str, dict] = {}
        self._unsaved: set[str] = set()
        self.encoder = None if publisher is None else _Encoder(publisher, int(max_encode_mb * (1 << 20)))
        self.drafting: dict[str, tuple] = {}   # xfer -> (P, key, rows), the latest step's (StepMeta.drafts)

    def register(self, kv_caches: dict, layout: paged.Layout = paged.CPU) -> None:
        """kv_caches: layer name → its paged KV [NB, H, bs, 2D] (in the model's layer order), laid out as `layout`
        (choose_layout); a ValueError naming the layer for a tensor that is not."""
        bound = []
        for name, t in kv_caches.items():
            try:
                bound.append(paged.PagedLayer(t, layout))
            except ValueError as e:
                raise ValueError(f"layer {name!r}: {e}") from None
        shapes = {(b.kv_heads, b.head_dim, b.cache.dtype) for b in bound}
        if len(shapes) > 1:
            raise ValueError(f"the layers' paged KV differ in (KV heads, head size, dtype): {sorted(map(str, shapes))}")
        self.layout, self.paged = layout, bound
        self.index = {name: i for i, name in enumerate(kv_caches)}
        self.layers = list(kv_caches.values())
        self.kv_heads, self.head_dim = bound[0].kv_heads, bound[0].head_dim
        self.dtype = str(self.layers[0].dtype).replace("torch.", "")

    def spec(self, prompt_len: int) -> KVSpec:
        return KVSpec(len(self.layers), self.kv_heads, self.head_dim, self.dtype, prompt_len)

    # -- both -------------------------------------------------------------------------------------------------
    def forget(self, req_ids) -> None:
        """No more writes into these requests' blocks (preempted, finished or aborted)."""
        for rid in req_ids:
            self._decoding.pop(rid, None)
            for xfer in [x for x, m in self._real.items() if m.req_id == rid]:
                del self._real[xfer]  # its blocks are vLLM's again: no shadow copies from them
            if rid in self._loads:
                self._loads[rid].aborted = True

    def begin_step(self, meta: StepMeta) -> None:
        """The step's metadata: preemptions, refusals to publish, transfers ended, new loads, draft permissions."""
        self.forget(meta.preempted)
        for xfer, why in meta.refusals:
            try:
                if self.publisher is not None:
                    self.publisher.refuse(xfer, why)
            except (ValueError, RuntimeError) as e:  # never the forward
                log.warning("transfer %s: refusal not published: %s", xfer, e)
        for xfer in meta.closed:
            self._real.pop(xfer, None)
            sub = self._subs.pop(xfer, None)
            if sub is not None:
                sub.close()
        for rid in meta.yielded:
            ld = self._loads.get(rid)
            if ld is not None and ld.meta.error is None:
                ld.meta.error = "a shadow yields its blocks to a real request waiting for them"
        for m in meta.loads:
            self._start_load(m)
        self.drafting = dict(meta.drafts)

    # -- prefill instance -------------------------------------------------------------------------------------
    def save_layer(self, meta: StepMeta, name: str, layer_cache) -> None:
        """During the forward pass, after layer `name` wrote its KV: copy the step's saves' KV of it for the encoder
        (`end_saves` hands it over once the forward is done)."""
        i = self.index.get(name)
        if i is None:
            return
        if i == 0:
            self._unsaved = set()  # this step's saves that failed: none of their later layers are added
        for s in meta.saves:
            if s.xfer in self._unsaved:
                continue
            try:
                config = codec_config(self.base, s.method)  # (validated by the scheduler side already)
                if i == 0:  # published at once: the decode instance may ask before the encoder gets to it
                    self.publisher.begin(s.xfer, config, self.spec(s.prompt_len), s.digest)
                k, v = paged.gather(self.paged[i], s.block_ids, s.prompt_len)  # copies (vLLM may reuse the blocks)
            except (ValueError, RuntimeError) as e:  # one transfer fails, never the forward
                self._unsaved.add(s.xfer)  # (one that began: its subscriber hears "unknown" or the stream's end)
                log.warning("transfer %s not published: %s", s.xfer, e)
                continue
            self.encoder.put(s.xfer, config, i, len(self.layers), k, v)

    def end_saves(self) -> None:
        """The forward is over (wait_for_save): the encoder encodes and publishes what it saved."""
        if self.encoder is not None:
            self.encoder.release()

    # -- decode instance --------------------------------------------------------------------------------------
    def _start_load(self, m: LoadMeta) -> None:
        self._loads[m.req_id] = _Load(m)
        if m.error is not None:
            return
        if m.tier == "full":
            self._real[m.xfer] = m
        elif m.xfer in self._real:
            self._share_prefix(m, self._real[m.xfer])
            if m.error is not None:
                return
        sub = self._subs.get(m.xfer)
        if sub is not None:  # another member's: the same prompt, codec and geometry, or this load fails
            if (sub.digest, sub.config, sub.spec) != (m.digest, codec_config(self.base, m.method),
                                                      self.spec(m.prompt_len)):
                m.error = f"transfer {m.xfer!r} is another prompt's, codec's or length's"
            elif sub.first > m.start:
                m.error = f"transfer {m.xfer!r} streams from position {sub.first}, and its real request's blocks " \
                          f"below it are gone"
            return
        try:
            self._subs[m.xfer] = Subscription(m.host, m.port, self.secret, self.fp, m.xfer,
                                              codec_config(self.base, m.method), self.spec(m.prompt_len), m.digest,
                                              self.timeout_s, start=m.start)
        except (ValueError, OSError) as e:
            m.error = f"transfer {m.xfer!r} could not start: {e}"

    def _share_prefix(self, m: LoadMeta, real: LoadMeta) -> None:
        """A shadow of a transfer whose real request hit its local prefix cache: the shadow's positions below that
        hit are copied from R's blocks (the full tier, cached by an earlier turn), so it drafts on full-tier KV
        wherever the decode instance holds it and on the anchor tier only beyond (as the HF path's delta turns)."""
        if real.start <= m.start:
            return
        bs = self.paged[0].cache.shape[2]
        lo, hi = m.start // bs, real.start // bs  # (both block-aligned: vLLM's prefix hits are whole blocks)
        try:
            for layer in self.paged:
                paged.copy_blocks(layer, real.block_ids[lo:hi], m.block_ids[lo:hi])
        except ValueError as e:
            m.error = f"transfer {m.xfer!r}: its real request's prefix could not be shared: {e}"
            return
        m.start = real.start  # the stream's pieces below it are never placed into this shadow

    def _place(self, budget_s: float) -> None:
        """Place held pieces into the loads' blocks, for at most `budget_s` (at least one piece)."""
        deadline, cache = self.clock() + budget_s, {}
        waiting = [ld for ld in self._loads.values() if not ld.aborted and ld.meta.error is None]
        work = [(ld, "full") for ld in waiting if ld.meta.tier == "full"] + \
               [(ld, "anchor") for ld in waiting if ld.meta.tier == "anchor"]
        if self.upgrade_shadows:
            work += [(ld, "full") for ld in waiting if ld.meta.tier == "anchor"]
            work += [(ld, "full") for ld in self._decoding.values() if ld.meta.error is None]
        placed = 0
        for ld, tier in work:
            sub = self._subs.get(ld.meta.xfer)
            if sub is None or (tier == "full" and ld.meta.tier == "anchor" and ld.cursor["anchor"] < sub.pieces):
                continue  # a shadow's upgrade starts once its anchors are all placed (never overwritten after)
            while ld.cursor[tier] < sub.count(tier) and (placed == 0 or self.clock() < deadline):
                i = ld.cursor[tier]
                if (ld.meta.xfer, tier, i) not in cache:
                    cache[(ld.meta.xfer, tier, i)] = sub.piece(tier, i)
                layer, kind, start, x = cache[(ld.meta.xfer, tier, i)]
                lo = max(start, ld.meta.start)  # below `start`: the local prefix hit, never written
                try:
                    if lo < start + x.shape[2]:
                        paged.scatter(self.paged[layer], ld.meta.block_ids, lo, kind, x[:, :, lo - start:])
                except ValueError as e:  # (the scheduler side's checks make this unreachable): this load fails alone
                    ld.meta.error = f"transfer {ld.meta.xfer!r}: {e}"
                    break
                ld.cursor[tier] += 1
                placed += 1

    def budget(self, now: float) -> float:
        """Seconds this step may place for: the time since the last call returned (the step's forward, scheduler and
        proposer), at least drain_ms."""
        return max(self.drain_s, 0.0 if self._step_end is None else now - self._step_end)

    def _ready(self, ld: _Load, sub: Subscription | None) -> bool:
        if sub is None:
            return False
        if ld.meta.tier == "full":
            return ld.cursor["full"] == sub.pieces
        full = ld.cursor["full"] if self.upgrade_shadows else sub.count("full")
        return ld.cursor["anchor"] == sub.pieces and full >= ld.meta.release * sub.pieces

    def results(self, finished_req_ids: set) -> tuple[set, set]:
        """Hold what arrived, place what the loads need; → (finished_recving, failed_recving) request ids."""
        self.forget(finished_req_ids)  # aborted while loading: reported below, so vLLM frees its blocks
        budget = self.budget(self.clock())
        for sub in self._subs.values():
            sub.drain()
        self._place(budget)
        done, failed = set(), set()
        for rid, ld in list(self._loads.items()):
            m, sub = ld.meta, self._subs.get(ld.meta.xfer)
            error = m.error or (sub.error if sub is not None else f"transfer {m.xfer!r} has no stream")
            ready = not ld.aborted and m.error is None and self._ready(ld, sub)
            if not (ld.aborted or ready or error):
                continue
            done.add(rid)
            del self._loads[rid]
            if error and not ready and not ld.aborted:
                failed.add(rid)
                log.warning("request %s: %s", rid, error)
            if sub is not None:
                self._stats[rid] = sub.times()
            if ready and m.tier == "anchor" and self.upgrade_shadows:
                self._decoding[rid] = ld  # until vLLM preempts or finishes it
        self._step_end = self.clock()
        return done, failed

    def stats(self) -> dict:
        out, self._stats = self._stats, {}
        return out

    def close(self) -> None:
        for sub in self._subs.values():
            sub.close()
        if self.encoder is not None:
            self.encoder.close()
        if self.publisher is not None:
            self.publisher.close()
