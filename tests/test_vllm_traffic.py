"""Lynx's connector under traffic, without vLLM: a scripted engine with vLLM 0.32's scheduling rules (as far as the
connector sees them) drives the real scheduler and worker sides, the real publisher and subscriptions on loopback,
with more concurrent prompts than its KV holds and decodes long enough to be preempted. Every request completes
or fails alone with a reason, no write lands in a block its request does not own, every real request's blocks
hold exactly the full tier when its load completes (again after a preemption), nothing is left behind."""
import itertools
import time

import pytest
import torch

from lynx_hf import LynxQuantConfig
from lynx_hf.vllm import paged, worker
from lynx_hf.vllm.scheduler import SchedulerSide
from lynx_hf.vllm.stream import KVPublisher, KVSpec, stream_tier, token_digest

SECRET, FP = b"traffic", "fp"
L, H, D, BS = 2, 2, 16, 16


class Req:
    def __init__(self, rid, ids, params, max_tokens, xfer=None, tier=None):
        self.id, self.ids, self.params, self.max_tokens, self.xfer, self.tier = rid, list(ids), params, \
            max_tokens, xfer, tier
        self.computed, self.out, self.blocks, self.state, self.reason, self.preemptions = 0, [], [], "waiting", \
            None, 0

    @property
    def tokens(self):
        return self.ids + self.out


class MockEngine:
    """vLLM 0.32's scheduler as the connector sees it (v1/core/sched/scheduler.py): running requests first — one
    that needs a block and finds none preempts the newest running request (blocks freed, num_computed = 0, back to
    the front of the queue, named in preempted_req_ids); then the FCFS queue: a request with nothing computed asks
    the connector (None: skipped this pass), an async load allocates blocks for its external tokens and waits until
    the worker reports it; an allocation that fails ends the pass. A finished, failed or aborted request's blocks
    are freed at once (a loading one's once the worker reported it). Each running request computes all its
    uncomputed tokens in one step and samples one token (a function of its sequence: the same request, the same
    tokens)."""

    def __init__(self, sched, work, num_blocks):
        self.sched, self.work, self.free = sched, work, list(range(num_blocks))
        self.owner = {}  # block -> request id
        self.queue, self.running, self.loading, self.done = [], [], {}, {}
        self.finished_ids, self.preempted, self.recv = set(), set(), set()
        self.preemptions = 0

    def add(self, r):
        self.queue.append(r)

    def abort(self, rid):
        for r in list(self.queue) + self.running:
            if r.id == rid:
                self._finish(r, "abort")

    def _alloc(self, r, n):
        need = -(-n // BS) - len(r.blocks)
        if need > len(self.free):
            return False
        for _ in range(max(0, need)):
            b = self.free.pop(0)
            self.owner[b] = r.id
            r.blocks.append(b)
        return True

    def _release(self, r):
        for b in r.blocks:
            del self.owner[b]
            self.free.append(b)
        r.blocks = []

    def _finish(self, r, reason):
        if r in self.queue:
            self.queue.remove(r)
        if r in self.running:
            self.running.remove(r)
        r.state, r.reason = "finished", reason
        if r.id in self.loading:  # vLLM frees a loading request's blocks once the worker reports it
            self.finished_ids.add(r.id)
            return
        self._release(r)
        self._end(r)

    def _end(self, r):
        self.done[r.id] = r
        self.finished_ids.add(r.id)
        self.sched.finished(r.id, r.params)

    def step(self):
        new, cached, scheduled = [], [], {}
        for r in list(self.running):  # running first: a block each may need, preempting the newest
            while r in self.running and not self._alloc(r, len(r.tokens) + 1):
                victim = self.running.pop()
                self._release(victim)
                victim.computed, victim.state = 0, "waiting"
                victim.preemptions += 1
                self.preemptions += 1
                self.queue.insert(0, victim)
                self.preempted.add(victim.id)
            if r in self.running:
                scheduled[r.id] = len(r.tokens) - r.computed
                cached.append((r.id, None, r.computed))
        for r in list(self.queue) if not self.preempted else ():  # (no admission in a step that preempted)
            if r.state == "loading":
                continue
            hit = 0
            ext, is_async = self.sched.matched(r.id, r.ids, r.params, hit) if r.computed == 0 else (0, False)
            if ext is None:
                continue
            if is_async:
                if not self._alloc(r, hit + ext):
                    break
                self.sched.allocated(r.id, r.ids, r.params, list(r.blocks), ext)
                r.state, r.computed = "loading", hit + ext
                self.loading[r.id] = r
                continue
            if not self._alloc(r, len(r.tokens) + 1):
                break
            self.queue.remove(r)
            self.running.append(r)
            r.state = "running"
            scheduled[r.id] = len(r.tokens) - r.computed
            new.append((r.id, list(r.blocks), r.computed))
        meta = self.sched.step_meta(new, cached, scheduled, self.preempted, ())
        self.preempted = set()
        self.work.begin_step(meta)
        for r in self.running:  # the forward
            r.computed = len(r.tokens)
            r.out.append(1000 + (sum(r.tokens) * 7 + len(r.tokens)) % 50)
            if len(r.out) >= r.max_tokens:
                self._finish(r, "length")
        done, failed = self.work.results(self.finished_ids)
        self.finished_ids = set()
        for rid in done:
            r = self.loading.pop(rid)
            if r.state == "finished":  # aborted while loading
                self._release(r)
                self._end(r)
            elif rid in failed:
                self._finish(r, "error")
            else:
                self.recv.add(rid)
                r.state = "waiting"
        for r in list(self.queue):  # a loaded request runs in the next pass's queue order
            if r.id in self.recv:
                self.recv.discard(r.id)
                self.queue.remove(r)
                self.running.append(r)
                r.state = "running"


def _kv(P, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, H, P, D, generator=g), torch.randn(1, H, P, D, generator=g)) for _ in range(L)]


@pytest.mark.parametrize("num_blocks, stagger", [(40, 0), (64, 0), (600, 0), (48, 25)])
def test_more_long_prompts_than_the_kv_holds_all_complete_exactly_and_nothing_writes_into_others_blocks(
        num_blocks, stagger, monkeypatch):
    """All at once (40, 64 blocks: vLLM preempts; shadows yield), room for all (600), or one transfer every
    `stagger` steps (the first shadows decode, later ones yield)."""
    cfg = LynxQuantConfig()
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP, bandwidth_bps=8e6)
    sched = SchedulerSide("kv_consumer", {}, (L, H, D, "float32"), 1 << 30, timeout_s=30)
    work = worker.WorkerSide({}, SECRET, FP, None, timeout_s=30, drain_ms=5)
    work.register({f"layers.{i}": torch.zeros(num_blocks, H, BS, 2 * D) for i in range(L)})
    eng = MockEngine(sched, work, num_blocks)
    bad_writes, checked = [], []
    scatter = paged.scatter

    def owned_scatter(cache, block_ids, start, kind, x):  # every block a write touches: the writing load's own
        rid, = {ld.meta.req_id for ld in [*work._loads.values(), *work._decoding.values()] if ld.meta.block_ids is
                block_ids}  # (the load whose table this is)
        touched = {block_ids[p // BS] for p in range(start, start + x.shape[2])}
        owners = {eng.owner.get(b) for b in touched}
        live = rid in eng.loading or any(r.id == rid and r.tier == "anchor" for r in eng.running)
        if owners != {rid} or not live:
            bad_writes.append((rid, sorted(touched), owners))
        scatter(cache, block_ids, start, kind, x)

    monkeypatch.setattr(worker.paged, "scatter", owned_scatter)
    results = work.results

    def checked_results(finished):  # a real request's blocks hold exactly the full tier when its load completes
        done, failed = results(finished)
        for rid in done - failed:
            r = eng.loading.get(rid)
            if r is not None and r.tier == "full" and r.state != "finished":
                for i, (k, v) in enumerate(kvs[r.xfer]):
                    for j, (x, kind) in enumerate(((k, "key"), (v, "value"))):
                        want = stream_tier(x, cfg, kind, (i, L), "full")
                        assert torch.equal(paged.gather(work.layers[i], r.blocks, r.computed)[j], want), rid
                checked.append(rid)
        return done, failed

    monkeypatch.setattr(work, "results", checked_results)
    kvs, reals = {}, []
    try:
        arrivals = []
        for n in range(12):  # 12 transfers of 150-200 positions (10-13 blocks each, +60 tokens decoded)
            P, xfer = 150 + 5 * n, f"x{n}"
            kvs[xfer] = kv = _kv(P, n)
            ids = [n * 1000 + t for t in range(P)] + [7]
            pub.publish(xfer, cfg, KVSpec(L, H, D, "float32", P), token_digest(ids[:P]), kv)
            common = {"role": "consume", "xfer": xfer, "method": "lynx", "shadow": True, "host": "127.0.0.1",
                      "port": pub.port, "prompt_len": P}
            wave = [Req(f"s{i}-{xfer}", ids, {"lynx": {**common, "tier": "anchor", "release": release}}, 40,
                        xfer, "anchor") for i, release in enumerate((0.0, 0.5))]
            reals.append(Req(f"r-{xfer}", ids, {"lynx": {**common, "tier": "full"}}, 60, xfer, "full"))
            arrivals.append(wave + [reals[-1], Req(f"plain-{n}", list(range(5000 + n, 5040 + n)), None, 30)])
        t = time.time() + 120
        for step in itertools.count():
            if arrivals and step >= stagger * (12 - len(arrivals)):
                for r in arrivals.pop(0):
                    eng.add(r)
            eng.step()
            for r in reals:  # the orchestrator: a finished R takes its shadows with it
                if r.id in eng.done:
                    for i in range(2):
                        eng.abort(f"s{i}-{r.xfer}")
            if not arrivals and all(r.id in eng.done for r in reals) and not (eng.queue or eng.running or eng.loading):
                break
            assert time.time() < t, f"stalled: running {[r.id for r in eng.running]}, loading {list(eng.loading)}"
            time.sleep(0.002)
        assert not bad_writes, bad_writes[:3]
        assert all(eng.done[r.id].reason == "length" and len(eng.done[r.id].out) == 60 for r in reals)
        plain = [r for r in eng.done.values() if r.id.startswith("plain")]
        assert len(plain) == 12 and all(r.reason == "length" for r in plain)
        assert set(checked) >= {r.id for r in reals}
        if num_blocks == 40:
            assert eng.preemptions > 0 and any(r.preemptions for r in reals)  # the reload path ran
        shadows = [r for r in eng.done.values() if r.tier == "anchor"]
        assert len(shadows) == 24 and all(r.reason in ("length", "abort", "error") for r in shadows)
        if num_blocks == 600:  # room for everyone: every shadow drafts (decodes), none is refused
            assert all(r.out for r in shadows) and not any(r.reason == "error" for r in shadows)
        assert sorted(eng.free) == list(range(num_blocks)) and not eng.owner  # no block leaked
        assert not any((sched._xfers, sched._loading, sched._prompts, sched._refuse, sched._stats)) and sched.held == 0
        work.begin_step(sched.step_meta([], [], {}))  # the next step brings the last finishes and closes
        work.results(eng.finished_ids)
        assert not work._subs and not work._loads and not work._decoding
    finally:
        pub.close()
        work.close()
