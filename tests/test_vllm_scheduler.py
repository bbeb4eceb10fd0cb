"""Lynx inside vLLM without vLLM: the paged-cache twin, the KV stream between instances, the connector's hook twins
(scheduler.py) and the proposer's draft book — each with the plain data vLLM would hand it. Tolerance 0 everywhere
(codes, frames, token ids, and the dequantized tiers against `quant.dequantize` of the same codes)."""
import os
import threading
import time
from dataclasses import asdict

import numpy as np
import pytest
import torch

from lynx_hf import LynxQuantConfig
from lynx_hf.errors import ConfigError
from lynx_hf.quant import dequantize, encode
from lynx_hf.transfer.wire import SEGMENT_TOKENS
from lynx_hf.vllm import paged
from lynx_hf.vllm.scheduler import (LoadMeta, ParamsError, SaveMeta, SchedulerSide, StepMeta, check_block_size,
                                    full_salt,
                                parse_params)
from lynx_hf.vllm.proposer import DraftBook, LynxProposer, belongs
from lynx_hf.transfer.wire import Stream, WireError
from lynx_hf.vllm import stream
from lynx_hf.vllm.stream import (KVPublisher, KVSpec, Subscription, bundles, encode_layer, segment_tokens, stream_tier,
                                 token_digest)
from lynx_hf.vllm.worker import WorkerSide

SECRET, FP = b"test-secret", "fp"
L, H, D, BS = 3, 3, 64, 32


def _kv(P, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, H, P, D, generator=g), torch.randn(1, H, P, D, generator=g)) for _ in range(L)]



def _wait(pred, timeout=20.0):
    t = time.time() + timeout
    while not pred():
        assert time.time() < t, "timed out"
        time.sleep(0.01)


# -- paged -----------------------------------------------------------------------------------------------------
def test_paged_scatter_gather_roundtrip_and_layout():
    cache = torch.zeros(8, H, BS, 2 * D)
    ids, P = [5, 2, 7], 70
    k, v = torch.randn(1, H, P, D), torch.randn(1, H, P, D)
    paged.scatter(cache, ids, 0, "key", k[:, :, :40])
    paged.scatter(cache, ids, 40, "key", k[:, :, 40:])
    paged.scatter(cache, ids, 0, "value", v)
    k2, v2 = paged.gather(cache, ids, P)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    # the CPU kernel's layout: per (block, head) keys as [D, bs] then values as [bs, D]
    half = cache.view(8, H, 2, BS * D)
    assert torch.equal(half[2, 1, 0].view(D, BS)[:, 3], k[0, 1, BS + 3])
    assert torch.equal(half[7, 0, 1].view(BS, D)[70 - 2 * BS - 1], v[0, 0, P - 1])
    untouched = [b for b in range(8) if b not in ids]
    assert not cache[untouched].any()


def test_paged_refuses_what_does_not_fit():
    cache = torch.zeros(4, H, BS, 2 * D)
    with pytest.raises(ValueError, match="more than"):
        paged.gather(cache, [0], BS + 1)
    with pytest.raises(ValueError, match="does not fit"):
        paged.scatter(cache, [0], 0, "key", torch.zeros(1, H + 1, 4, D))
    with pytest.raises(ValueError, match="paged KV layer"):
        paged.kv_views(torch.zeros(4, H, BS, 2 * D + 1))


# -- stream ----------------------------------------------------------------------------------------------------
def _collect(sub, P):
    _wait(lambda: sub.drain() >= 0 and (sub.full_done or sub.error))
    assert sub.error is None, sub.error
    got = {}
    for tier in ("anchor", "full"):
        pieces = [sub.piece(tier, i) for i in range(sub.count(tier))]
        got[tier] = {(layer, kind, start): x for layer, kind, start, x in pieces}
    return got


@pytest.mark.parametrize("method", ["lynx", "int8", "kivi4", "bf16"])
def test_stream_tiers_equal_the_codec_exactly(method):
    P = SEGMENT_TOKENS + 77
    cfg, spec, kv = LynxQuantConfig(method=method), KVSpec(L, H, D, "float32", P), _kv(P)
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP)
    try:
        pub.publish("x1", cfg, spec, "d", kv)
        sub = Subscription("127.0.0.1", pub.port, SECRET, FP, "x1", cfg, spec, "d", timeout_s=20)
        got = _collect(sub, P)
        split = method == "lynx"
        assert sub.anchor_done == split and sub.full_done
        for i, (k, v) in enumerate(kv):
            for kind, x in (("key", k), ("value", v)):
                u = segment_tokens(cfg)
                for off in range(0, P, u):
                    s = encode(x[:, :, off:off + u].contiguous(), cfg, kind, layer=(i, L))
                    assert torch.equal(got["full"][(i, kind, off)], dequantize(s, "full"))
                    if split:
                        assert torch.equal(got["anchor"][(i, kind, off)], dequantize(s, "anchor"))
        t = sub.times()
        assert not split or t["anchor_at"] <= t["full_at"]
        assert t["bytes"] > t["anchor_bytes"] if split else t["bytes"] == t["anchor_bytes"] > 0
        _wait(lambda: pub.stored_bytes == 0)  # streamed once, then dropped
    finally:
        pub.close()


def test_a_layers_segments_go_as_one_frame_per_stream_within_the_bundle_bounds(monkeypatch):
    """A layer's anchor segments travel as one SEGMENT frame and its residual ones as another (INT8's: one), in
    order; a run splits at MAX_BUNDLE segments or BUNDLE_BYTES (a larger segment alone); what the decode instance
    holds is not sent."""
    P = 9 * segment_tokens(LynxQuantConfig()) + 13  # 10 segments a kind
    k, v = _kv(P)[0]
    for method, streams in (("lynx", [Stream.ANCHOR, Stream.RESIDUAL]), ("int8", [Stream.ANCHOR])):
        frames = encode_layer(LynxQuantConfig(method=method), 0, L, k, v)
        runs = bundles(frames, 0)
        assert [st for st, _ in runs] == streams
        assert [p for _, ps in runs for p in ps] == [p for _, _, p in frames]
        first = 2 * segment_tokens(LynxQuantConfig())
        assert [p for _, ps in bundles(frames, first) for p in ps] == [p for _, off, p in frames if off >= first]
    monkeypatch.setattr(stream, "MAX_BUNDLE", 3)
    assert [len(ps) for _, ps in bundles(frames, 0)] == [3, 3, 3, 3, 3, 3, 2]  # INT8's 20 segments (10 K, 10 V)
    big = len(frames[0][2])
    monkeypatch.setattr(stream, "BUNDLE_BYTES", big - 1)
    assert [len(ps) for _, ps in bundles(frames[:4], 0)] == [1, 1, 1, 1]


def test_the_stream_bench_measures_one_request_sent_whole():
    """`lynx-hf bench stream`'s unit: one request's KV encoded, published and received whole by a subscriber in
    another process; CPU seconds and the bytes held are reported."""
    from lynx_hf.eval.benches.bench_stream import one

    P, kv = 2 * segment_tokens(LynxQuantConfig()) + 5, _kv(2 * segment_tokens(LynxQuantConfig()) + 5)
    r = one("lynx", kv, KVSpec(L, H, D, "float32", P), 50e6, "t")
    frames = [encode_layer(LynxQuantConfig(), i, L, k, v) for i, (k, v) in enumerate(kv)]
    assert r["bytes"] == sum(len(p) for f in frames for _, _, p in f)
    assert r["encode_s"] > 0 and r["send_s"] > 0 and r["wall_s"] > 0


def _nice_of(name: str, before: set) -> int | None:
    """The nice value of the thread called `name` started since `before` (Thread objects: idents are reused), None
    if there is none."""
    ts = [t for t in threading.enumerate() if t.name == name and t not in before and t.is_alive()]
    return os.getpriority(os.PRIO_PROCESS, ts[0].native_id) if ts else None


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priorities here")
def test_the_prefill_sides_kv_threads_run_below_the_engine_and_send_as_before():
    """The encoder, the publisher and the sending thread it starts run `nice` below the thread that made them (the
    KV stream's work yields the prefill core to the next forward), and the codes arrive exact; nice=0 keeps the
    engine's priority; anything but an integer 0..19 is refused, naming the setting."""
    for bad in (-1, 20, "10", 2.5, True):
        with pytest.raises(ConfigError, match="kv_nice"):
            KVPublisher("127.0.0.1", 0, SECRET, FP, nice=bad)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    P, cfg = SEGMENT_TOKENS + 5, LynxQuantConfig()
    spec, kv, u = KVSpec(L, H, D, "float32", P), _kv(P), segment_tokens(LynxQuantConfig())
    for nice in (10, 0):
        before, want = set(threading.enumerate()), min(19, base + nice)
        pub = KVPublisher("127.0.0.1", 0, SECRET, FP, bandwidth_bps=2e6, nice=nice)  # ~1.3 s of stream
        w = WorkerSide({}, SECRET, FP, pub)
        try:
            _wait(lambda: _nice_of("lynx-kv-publisher", before) == want and _nice_of("lynx-kv-encode", before) == want)
            pub.publish("x1", cfg, spec, "d", kv)
            sub = Subscription("127.0.0.1", pub.port, SECRET, FP, "x1", cfg, spec, "d", timeout_s=20)
            _wait(lambda: _nice_of("lynx-kv-send", before) is not None)
            assert _nice_of("lynx-kv-send", before) == want
            got = _collect(sub, P)
            for i, (k, v) in enumerate(kv):
                want_k = dequantize(encode(k[:, :, :u].contiguous(), cfg, "key", layer=(i, L)), "full")
                assert torch.equal(got["full"][(i, "key", 0)], want_k)
        finally:
            w.close()
            pub.close()


def test_a_stream_starts_at_the_first_segment_the_decode_instance_lacks():
    """REQUEST names the first position the decode instance lacks (its prefix hit); the publisher streams from the
    grid's segment holding it, and the codes are those a fresh transfer carries there."""
    P, cfg = 300, LynxQuantConfig()
    u, kv = segment_tokens(cfg), _kv(P)
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP)
    try:
        for xfer, start, first in (("a", 128, 128), ("b", 100, 64), ("c", 0, 0)):
            pub.publish(xfer, cfg, KVSpec(L, H, D, "float32", P), "d", kv)
            sub = Subscription("127.0.0.1", pub.port, SECRET, FP, xfer, cfg, KVSpec(L, H, D, "float32", P), "d",
                               timeout_s=20, start=start)
            got = _collect(sub, P)
            assert sub.first == first and sub.pieces == L * 2 * len(range(first, P, u))
            assert {key[2] for key in got["full"]} == set(range(first, P, u))
            for (i, kind, off), x in got["full"].items():
                ref = stream_tier(kv[i][kind == "value"], cfg, kind, (i, L), "full")
                assert torch.equal(x, ref[:, :, off:off + x.shape[2]])
            if xfer == "a":
                fresh = sub.times()["bytes"]
        assert fresh < 0.6 * sub.times()["bytes"]  # (c: the whole prompt)
        with pytest.raises(ValueError, match="start"):
            Subscription("127.0.0.1", pub.port, SECRET, FP, "z", cfg, KVSpec(L, H, D, "float32", P), "d", start=P)
        with pytest.raises(ValueError, match="start must be an int"):
            pub._claim({"xfer": "a", "spec": asdict(KVSpec(L, H, D, "float32", P)), "start": -1})
    finally:
        pub.close()


def test_stream_refusals_name_the_problem():
    P = 40
    cfg, spec = LynxQuantConfig(), KVSpec(L, H, D, "float32", P)
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP, timeout_s=2)
    try:
        pub.publish("x", cfg, spec, "d", _kv(P))
        cases = [(dict(secret=b"wrong"), "secret"), (dict(fp="other"), "different model"),
                 (dict(cfg=LynxQuantConfig(alpha=2.0)), "codec mismatch"),
                 (dict(spec=KVSpec(L, H, D, "float32", P + 1)), "geometry mismatch"),
                 (dict(digest="e"), "prompt differs"), (dict(xfer="nope"), "unknown transfer")]
        for kw, why in cases:
            sub = Subscription("127.0.0.1", pub.port, kw.get("secret", SECRET), kw.get("fp", FP), kw.get("xfer", "x"),
                               kw.get("cfg", cfg), kw.get("spec", spec), kw.get("digest", "d"), timeout_s=10)
            _wait(lambda: sub.error is not None)
            assert why in sub.error, (why, sub.error)
        # after all that the transfer is still served to the right subscriber
        sub = Subscription("127.0.0.1", pub.port, SECRET, FP, "x", cfg, spec, "d")
        assert not _collect(sub, P) == {}
        prompt = {"xfer": "x", "quant_config": cfg.to_dict(), "spec": asdict(spec), "start": 0,
                  "segments": {"anchor": sub.expected[0], "residual": sub.expected[1]}}
        with pytest.raises(WireError, match="same lynx-hf on both instances"):  # a publisher from before bundling
            sub._check_prompt(prompt)
        sub._check_prompt({**prompt, "bundled": True})
    finally:
        pub.close()


def test_publisher_holds_at_most_its_bound_and_evicts_unclaimed_first():
    P = 64
    cfg, spec = LynxQuantConfig(), KVSpec(L, H, D, "float32", P)
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP)
    try:
        pub.publish("a", cfg, spec, "d", _kv(P))
        one = pub.stored_bytes
        pub.max_bytes = int(one * 1.5)
        pub.publish("b", cfg, spec, "d", _kv(P, 1))  # evicts "a" (unclaimed) to fit
        assert pub.stored_bytes == one and list(pub._entries) == ["b"]
        pub.max_bytes = one // 2
        pub.publish("c", cfg, spec, "d", _kv(P, 2))  # larger than the whole bound: dropped, never held
        assert pub.stored_bytes <= pub.max_bytes and "c" not in pub._entries
    finally:
        pub.close()


def test_prefill_dying_mid_stream_fails_the_subscription_in_one_line():
    P = 3 * SEGMENT_TOKENS
    cfg, spec = LynxQuantConfig(), KVSpec(L, H, D, "float32", P)
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP, bandwidth_bps=4e5, timeout_s=5)  # ~19 s of stream
    pub.publish("x", cfg, spec, "d", _kv(P))
    sub = Subscription("127.0.0.1", pub.port, SECRET, FP, "x", cfg, spec, "d", timeout_s=5)
    _wait(lambda: sub.times()["bytes"] > 0)
    pub.close()
    _wait(lambda: sub.error is not None)
    assert "prefill instance" in sub.error and "\n" not in sub.error


# -- hook twins: scheduler side ---------------------------------------------------------------------------------
def _consume(tier, shadow=True, P=100, port=1, xfer="x", method="lynx", **extra):
    return {"lynx": {"role": "consume", "xfer": xfer, "method": method, "tier": tier, "shadow": shadow,
                     "host": "127.0.0.1", "port": port, "prompt_len": P, **extra}}


def test_params_are_validated():
    assert parse_params(None) is None and parse_params({"other": 1}) is None
    for bad in ({"lynx": 1}, {"lynx": {"role": "x"}}, {"lynx": {"role": "produce", "xfer": "x"}},
                _consume("mid"), _consume("full", port=0), _consume("full", P=0), _consume("full", xfer="bad id\n"),
                _consume("full", method="no-such-codec"), _consume("anchor", method="int8", shadow=False),
                _consume("full", method="int8", shadow=True), _consume("anchor", release=1.5),
                {"lynx": {"role": "produce", "xfer": "x", "method": 3}}):
        with pytest.raises(ParamsError):
            parse_params(bad)
    with pytest.raises(ParamsError, match="exact"):
        parse_params(_consume("full"), {"exact": True})


def _empty(s: SchedulerSide) -> bool:
    """Nothing left behind once every request finished."""
    return not any((s._produce, s._saved, s._new_loads, s._loading, s._refuse, s._xfers, s._prompts, s._seen_at,
                    s._stats)) and s.held == 0


def test_scheduler_side_asks_for_the_prompt_and_refuses_a_bad_request_with_one_token():
    s = SchedulerSide("kv_consumer")
    ids = list(range(101))
    assert s.matched("r", ids, _consume("full"), 0) == (100, True)
    assert s.matched("r", ids, _consume("full"), 64) == (36, True)     # beyond the local prefix hit
    assert s.matched("hit", ids, _consume("full", xfer="h"), 100) == (0, False)  # the whole prompt is a local hit
    assert s.matched("plain", ids, None, 0) == (0, False)
    for rid, ids_, params in (("short", ids[:100], _consume("full", xfer="s")),  # no first token
                              ("bad", ids, {"lynx": {"role": "x"}}), ("codec", ids, _consume("full", method="nope"))):
        assert s.matched(rid, ids_, params, 0) == (1, True)  # refused: claims one token, fails once allocated
        assert s.matched(rid, ids_, params, 0) == (1, True)  # (the same answer on every pass)
        s.allocated(rid, ids_, params, [9], 1)
    s.allocated("r", ids, _consume("full"), [3, 4, 5, 6], 100)
    loads = {m.req_id: m for m in s.step_meta([], [], {}).loads}
    assert "prompt_len 100" in loads["short"].error and "role" in loads["bad"].error
    assert "nope" in loads["codec"].error
    assert loads["r"].error is None and loads["r"].start == 0 and loads["r"].digest == token_digest(ids[:100])
    assert s.step_meta([], [], {}).loads == []  # each load is announced once
    s.worker_meta({"r": {"bytes": 7}, "gone": {"bytes": 1}})  # stats of a request it never loaded: dropped
    done = s.finished("r", _consume("full"))
    assert {"admitted", "first_step", "last_step", "steps", "batch_mean"} <= set(done["lynx"].pop("timeline"))
    assert done == {"lynx": {"xfer": "x", "tier": "full", "start": 0, "prompt_len": 100, "bytes": 7}}
    for rid in ("short", "bad", "codec", "hit", "plain"):
        assert s.finished(rid, None) is None
    assert s.step_meta([], [], {}).closed == ["x"] and _empty(s)


def _live(s, ids, xfer="x", blocks=(0, 1, 2, 3)):
    """R of `xfer` allocated (prompt ids[:-1], first token ids[-1])."""
    R = _consume("full", P=len(ids) - 1, xfer=xfer)
    assert s.matched(f"r-{xfer}", ids, R, 0) == (len(ids) - 1, True)
    s.allocated(f"r-{xfer}", ids, R, list(blocks), len(ids) - 1)
    return R


def test_shadows_come_after_their_real_request_and_yield_under_kv_pressure():
    t = [0.0]
    s = SchedulerSide("kv_consumer", timeout_s=5, clock=lambda: t[0])
    ids = list(range(101))
    S0, S1 = _consume("anchor"), _consume("anchor", release=0.5)
    assert s.matched("s0", ids, S0, 0) == (None, False)  # R first: a shadow never holds blocks R needs
    _live(s, ids)
    s.step_meta([], [], {})
    assert s.matched("s0", ids, S0, 0) == (100, True)
    s.allocated("s0", ids, S0, [4, 5, 6, 7], 100)
    meta = s.step_meta([], [], {})
    assert meta.drafts == {"x": (100, token_digest(ids), 2, 100)}
    # another transfer's real request does not get blocks this pass: waiting shadows yield, new ones wait
    R2 = _consume("full", xfer="y")
    assert s.matched("r-y", list(range(500, 601)), R2, 0) == (100, True)  # (vLLM found no blocks for it)
    meta = s.step_meta([], [], {})
    assert meta.yielded == ["s0"]
    assert s.matched("s1", ids, S1, 0) == (None, False)
    s.step_meta([], [], {})
    assert s.matched("s1", ids, S1, 0) == (100, True)  # no pressure in the last pass
    s.allocated("s1", ids, S1, [8, 9, 10, 11], 100)
    s.finished("s0", S0)  # (the worker failed it)
    s.step_meta([], [], {"s1": 1})  # s1 decodes
    # R gets its KV and runs: a shadow now would come too late
    s.step_meta([], [], {"r-x": 1})
    assert s.matched("s2", ids, _consume("anchor"), 0) == (1, True)
    # preempted: R reloads the held copy, a shadow is refused
    meta = s.step_meta([], [], {}, preempted={"r-x", "s1"})
    assert meta.preempted == ["r-x", "s1"]
    assert s.matched("r-x", ids, _consume("full"), 0) == (100, True)
    assert s.matched("s1", ids, S1, 0) == (1, True)
    # a shadow whose real request never comes is refused after timeout_s
    assert s.matched("lone", list(range(50)), _consume("anchor", P=49, xfer="z"), 0) == (None, False)
    t[0] = 6.0
    assert s.matched("lone", list(range(50)), _consume("anchor", P=49, xfer="z"), 0) == (1, True)
    for rid in ("s1", "s2", "lone", "r-x"):
        s.finished(rid, None)
    assert s.step_meta([], [], {}).closed == ["x"]
    assert s.matched("late", ids, S0, 0) == (1, True)  # its transfer ended
    s.finished("late", None)
    s.finished("r-y", None)
    assert _empty(s)


def test_a_shadow_must_be_its_transfers_prompt_and_a_salt_must_name_the_transfer_with_prefix_caching():
    s = SchedulerSide("kv_consumer", salted=True)
    ids = list(range(101))
    R = _consume("full")
    assert s.matched("r-x", ids, R, 0) == (1, True)  # no cache_salt: its blocks would serve others' prefix hits
    assert "cache_salt" in s._refuse["r-x"]
    s.finished("r-x", None)
    assert s.matched("r-x", ids, R, 0, salt="lynx-full-other") == (1, True)  # a salt of another transfer
    s.finished("r-x", None)
    assert s.matched("r-x", ids, R, 0, salt="lynx-full-x") == (100, True)
    s.finished("r-x", None)
    assert s.matched("r-x", ids, R, 0, salt=full_salt("int8")) == (1, True)  # another method's full tier
    s.finished("r-x", None)
    assert s.matched("r-x", ids, R, 64, salt=full_salt("lynx")) == (36, True)  # what it holds: later turns hit it
    s.allocated("r-x", ids, R, [0, 1, 2, 3], 36)
    s.step_meta([], [], {})
    for rid, sids, S in (("s-short", ids[:51], _consume("anchor", P=50)),          # another length
                         ("s-other", [7] + ids[1:], _consume("anchor")),         # another prompt
                         ("s-codec", ids, _consume("anchor", method="paper"))):  # another codec
        assert s.matched(rid, sids, S, 0, salt="lynx-anchor-x") == (1, True), rid
        assert "differ from its transfer" in s._refuse[rid]
    assert s.matched("s-full", ids, _consume("anchor"), 0, salt=full_salt("lynx")) == (1, True)  # anchor tier
    assert "shadow's cache_salt must name its transfer" in s._refuse["s-full"]
    assert s.matched("s", ids, _consume("anchor"), 0, salt="lynx-anchor-x") == (100, True)
    # vLLM loads nothing for a request that skips reading the prefix cache: it computes its prompt, exactly
    assert s.matched("logprobs", ids, _consume("full", xfer="lp"), 0, salt="-lp", local=True) == (0, False)
    assert "logprobs" not in s._pass_load


def test_a_block_must_hold_whole_segments_of_the_stream_when_blocks_are_shared():
    for bs in (64, 128, 192, 256):
        check_block_size(bs, LynxQuantConfig())
    with pytest.raises(ValueError, match=r"--block-size 32 .*chunk_size 64.* pass --block-size 64"):
        check_block_size(32, LynxQuantConfig())
    with pytest.raises(ValueError, match="--block-size 64 .*group_size 128"):
        check_block_size(64, LynxQuantConfig(method="kivi4", group_size=128))
    s = SchedulerSide("kv_consumer", base={"group_size": 128}, salted=True, block_size=64)
    ids = list(range(101))
    assert s.matched("r", ids, _consume("full", shadow=False, method="kivi4"), 0, salt="lynx-full-kivi4") == (1, True)
    assert "--block-size 64" in s._refuse["r"]


def test_the_decode_side_holds_at_most_its_bound_of_live_transfers():
    s0 = SchedulerSide("kv_consumer", geometry=(L, H, D, "float32"))
    one = s0._bound(100, "lynx")
    s = SchedulerSide("kv_consumer", geometry=(L, H, D, "float32"), max_held_bytes=int(one * 1.5))
    a, b = list(range(101)), list(range(200, 301))
    _live(s, a, "a")
    assert s.held == one
    assert s.matched("r-b", b, _consume("full", xfer="b"), 0) == (None, False)  # waits for room
    big = list(range(1000, 1000 + 301))
    assert s.matched("r-big", big, _consume("full", P=300, xfer="big"), 0) == (1, True)  # never fits: refused
    s.finished("r-a", None)
    assert s.step_meta([], [], {}).closed == ["a"] and s.held == 0
    assert s.matched("r-b", b, _consume("full", xfer="b"), 0) == (100, True)


def test_rows_that_could_be_mistaken_for_a_transfer_switch_its_drafts_off():
    s = SchedulerSide("kv_consumer")
    a = list(range(101))
    _live(s, a, "x")
    assert s.matched("s", a, _consume("anchor"), 0) == (100, True)
    s.allocated("s", a, _consume("anchor"), [9], 100)
    assert set(s.step_meta([], [], {}).drafts) == {"x"}
    for plain in (a + [5, 6], a[:100]):  # plain requests sharing the transfer's first P + 1, or P, tokens
        s.matched("plain", plain, None, 0)
        assert s.step_meta([], [], {}).drafts == {}
        s.finished("plain", None)
        assert set(s.step_meta([], [], {}).drafts) == {"x"}
    _live(s, a, "dup", blocks=[20])  # another transfer with the same prompt: both ambiguous
    s.matched("s-dup", a, _consume("anchor", xfer="dup"), 0)
    s.allocated("s-dup", a, _consume("anchor", xfer="dup"), [21], 100)
    assert s.step_meta([], [], {}).drafts == {}
    s.finished("r-dup", None), s.finished("s-dup", None)
    longer = a + [7, 8, 9]  # a transfer whose prompt extends x's: x is ambiguous, it is not
    _live(s, longer, "ext", blocks=[30])
    s.matched("s-ext", longer, _consume("anchor", P=103, xfer="ext"), 0)
    s.allocated("s-ext", longer, _consume("anchor", P=103, xfer="ext"), [31], 103)
    assert set(s.step_meta([], [], {}).drafts) == {"ext"}


def test_producer_side_saves_when_its_last_prefill_step_runs_and_reads_a_resumed_table_afresh():
    p = SchedulerSide("kv_producer")
    prod = {"lynx": {"role": "produce", "xfer": "y", "method": "int8"}}
    p.allocated("q", list(range(300)), prod, [1, 2], 0)
    assert p.step_meta([("q", [1, 2, 3], 0)], [], {"q": 200}).saves == []  # prefilled in steps: not the last one
    p.step_meta([], [], {}, preempted={"q"})  # vLLM took its blocks back
    p.allocated("q", list(range(300)), prod, [7], 0)  # (allocated again when resumed: the job is kept)
    saves = p.step_meta([], [("q", [7, 8, 9], 0)], {"q": 300}, resumed={"q"}).saves
    assert [(x.xfer, x.prompt_len, x.block_ids) for x in saves] == [("y", 300, [7, 8, 9])]
    p.allocated("q", list(range(300)), prod, [4], 0)  # preempted after its save and back: published once
    assert p.step_meta([("q", [4, 5, 6], 0)], [], {"q": 300}).saves == []
    prod2 = {"lynx": {"role": "produce", "xfer": "y2", "method": "int8"}}
    p.allocated("c", list(range(300)), prod2, [1], 0)
    assert [x.block_ids for x in p.step_meta([("c", [1], 0)], [("c", [2], 1)], {"c": 299}).saves] == [[1, 2]]
    p.allocated("dup", list(range(9)), prod, [3], 0)  # another request naming y: not published (nor refused: y's
    assert p.step_meta([("dup", [3], 0)], [], {"dup": 9}) == StepMeta()  # consumers would hear it)
    p.allocated("b", [1, 2], {"lynx": {"role": "produce", "xfer": "z", "method": "nope"}}, [5], 0)
    p.allocated("e", [1, 2], {"lynx": {"role": "produce", "xfer": "bad id\n", "method": "lynx"}}, [5], 0)
    (xfer, why), = p.step_meta([], [], {}).refusals  # (an id the wire cannot carry reaches nobody: no refusal)
    assert xfer == "z" and "nope" in why
    for rid in ("q", "c", "b", "dup", "e"):
        p.finished(rid, None)
    assert _empty(p)


# -- hook twins: worker side ----------------------------------------------------------------------------------
class _Worker(WorkerSide):
    """WorkerSide over hand-made paged caches."""

    def __init__(self, publisher=None, blocks=24, upgrade=True, drain_ms=20.0, clock=time.monotonic):
        super().__init__({}, SECRET, FP, publisher, timeout_s=10, upgrade_shadows=upgrade, drain_ms=drain_ms,
                         clock=clock)
        self.register({f"model.layers.{i}.attn": torch.zeros(blocks, H, BS, 2 * D) for i in range(L)})


def _publish(pub, P, xfer="x", method="lynx", seed=0):
    """A prefill worker's forward wrote a prompt's KV; its save publishes it. → the KV."""
    kv, pw = _kv(P, seed), _Worker(pub)
    src = list(range((P + BS - 1) // BS))
    for i, (k, v) in enumerate(kv):
        paged.scatter(pw.layers[i], src, 0, "key", k)
        paged.scatter(pw.layers[i], src, 0, "value", v)
    save = StepMeta(saves=[SaveMeta("p", xfer, method, P, src, "dg")])
    for name, cache in zip(pw.index, pw.layers):
        pw.save_layer(save, name, cache)
    pw.end_saves()
    return kv


def _load(rid, tier, blocks, port, P=100, xfer="x", start=0, **kw):
    return LoadMeta(rid, xfer, "lynx", tier, True, "127.0.0.1", port, P, start, list(blocks), "dg", **kw)


def _until(dw, want: set, finished=()):
    done, failed, t = set(), set(), time.time() + 20
    while not want <= done:
        d, f = dw.results(set(finished))
        done |= d
        failed |= f
        assert time.time() < t, (done, failed)
        time.sleep(0.005)
    return done, failed


def _assert_tier(dw, kv, blocks, tier, P=100, start=0):
    cfg = LynxQuantConfig()
    for i, (k, v) in enumerate(kv):
        for x, got, kind in ((k, paged.gather(dw.layers[i], blocks, P)[0], "key"),
                             (v, paged.gather(dw.layers[i], blocks, P)[1], "value")):
            want = stream_tier(x, cfg, kind, (i, L), tier)
            assert torch.equal(got[:, :, start:], want[:, :, start:]), (i, kind, tier)


@pytest.mark.parametrize("upgrade", [False, True])
def test_worker_side_fills_shadow_and_real_blocks_with_their_tiers_whatever_the_order(upgrade):
    """A shadow released at half the residual starts without its R; R, registered after the whole stream
    landed, gets every piece replayed from the held copy (no load waits for another request)."""
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP)
    try:
        kv, dw = _publish(pub, 100), _Worker(upgrade=upgrade)
        dw.begin_step(StepMeta(loads=[_load("s", "anchor", [4, 5, 6, 7], pub.port, release=0.5)]))
        assert _until(dw, {"s"}) == ({"s"}, set())
        _wait(lambda: dw.results(set()) is not None and dw._subs["x"].full_done)
        dw.results(set())
        dw.begin_step(StepMeta(loads=[_load("r", "full", [8, 9, 10, 11], pub.port, start=32)]))
        assert _until(dw, {"r"}) == ({"r"}, set())
        _assert_tier(dw, kv, [4, 5, 6, 7], "full" if upgrade else "anchor")
        _assert_tier(dw, kv, [8, 9, 10, 11], "full", start=32)  # below `start` (a local prefix hit): untouched
        assert not dw.layers[0][8].any()
        assert {"bytes", "anchor_bytes", "anchor_at", "full_at"} <= set(dw.stats()["r"])
        dw.begin_step(StepMeta(closed=["x"]))
        assert dw._subs == {}
    finally:
        pub.close()


def test_a_shadow_of_a_continued_turn_drafts_on_the_full_tier_its_real_request_holds_and_the_anchor_beyond():
    """R hit the decode instance's prefix cache (blocks of an earlier turn, full tier): the stream starts at its
    first missing segment, and its shadow (its own salt: no hit) gets R's prefix blocks copied, never the anchor
    tier where the full tier is held."""
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP)
    try:
        kv, dw, cfg = _publish(pub, 100), _Worker(upgrade=False), LynxQuantConfig()
        for i, (k, v) in enumerate(kv):  # an earlier turn left positions [0, 64) in blocks 8 and 9
            paged.scatter(dw.layers[i], [8, 9], 0, "key", stream_tier(k, cfg, "key", (i, L), "full")[:, :, :64])
            paged.scatter(dw.layers[i], [8, 9], 0, "value", stream_tier(v, cfg, "value", (i, L), "full")[:, :, :64])
        dw.begin_step(StepMeta(loads=[_load("r", "full", [8, 9, 10, 11], pub.port, start=64),
                                      _load("s", "anchor", [4, 5, 6, 7], pub.port)]))
        assert _until(dw, {"r", "s"}) == ({"r", "s"}, set())
        assert dw._subs["x"].first == 64 and dw._subs["x"].pieces == L * 2  # one segment a layer and kind
        _assert_tier(dw, kv, [8, 9, 10, 11], "full")
        for i in range(L):
            for j, kind in enumerate(("key", "value")):
                got, ref = paged.gather(dw.layers[i], [4, 5, 6, 7], 100)[j], stream_tier(kv[i][j], cfg, kind, (i, L),
                                                                                         "full")
                assert torch.equal(got[:, :, :64], ref[:, :, :64])
                anchor = stream_tier(kv[i][j], cfg, kind, (i, L), "anchor")
                assert torch.equal(got[:, :, 64:], anchor[:, :, 64:]) and not torch.equal(anchor[:, :, 64:],
                                                                                          ref[:, :, 64:])
        late = _load("s2", "anchor", [12, 13, 14, 15], pub.port)
        dw.begin_step(StepMeta(preempted=["r"], loads=[late]))
        assert _until(dw, {"s2"}) == ({"s2"}, {"s2"})  # R's prefix blocks are gone: the shadow fails, alone
        assert "blocks below it are gone" in late.error
    finally:
        pub.close()


def test_no_write_into_the_blocks_of_a_preempted_shadow_and_a_preempted_real_request_reloads_the_same_kv():
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP, bandwidth_bps=2e6)  # the residual still on the link
    try:
        kv, dw = _publish(pub, 100), _Worker()
        dw.begin_step(StepMeta(loads=[_load("s", "anchor", [4, 5, 6, 7], pub.port),
                                      _load("r", "full", [8, 9, 10, 11], pub.port)]))
        _until(dw, {"s"})
        assert dw._subs["x"].count("full") < dw._subs["x"].pieces
        dw.begin_step(StepMeta(preempted=["s"]))  # vLLM took s's blocks back before this step's forward
        for b in (4, 5, 6, 7):  # ... and gave them to someone else, whose KV is now there
            for layer in dw.layers:
                layer[b] = 7.0
        _until(dw, {"r"})
        assert all(bool((layer[[4, 5, 6, 7]] == 7.0).all()) for layer in dw.layers)  # never written again
        _assert_tier(dw, kv, [8, 9, 10, 11], "full")
        dw.begin_step(StepMeta(preempted=["r"], loads=[_load("r", "full", [12, 13, 14, 15], pub.port)]))
        _until(dw, {"r"})  # back from a preemption: the held copy, exactly
        _assert_tier(dw, kv, [12, 13, 14, 15], "full")
    finally:
        pub.close()


def test_worker_side_fails_what_it_cannot_load_and_frees_what_was_aborted():
    dw = _Worker()
    dw.begin_step(StepMeta(loads=[_load("r", "full", [0, 1], 1, P=40)]))
    assert _until(dw, {"r"}) == ({"r"}, {"r"})  # connection refused: R fails (vLLM: finish_reason "error")
    dw.begin_step(StepMeta(loads=[_load("a", "full", [2], 1, P=40, xfer="y")]))
    done, failed = dw.results({"a"})  # aborted while waiting: reported so vLLM frees its blocks, not failed
    assert "a" in done and "a" not in failed
    dw.begin_step(StepMeta(loads=[LoadMeta.refused("bad", "a reason")]))
    assert dw.results(set()) == ({"bad"}, {"bad"})
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP, bandwidth_bps=2e5)
    try:
        _publish(pub, 100)
        dw.begin_step(StepMeta(loads=[_load("s", "anchor", [4, 5], pub.port, P=100)]))
        dw.begin_step(StepMeta(yielded=["s"]))  # a real request waits for blocks: the loading shadow yields
        assert dw.results(set()) == ({"s"}, {"s"})
    finally:
        pub.close()


def test_a_load_of_another_prompt_on_a_live_stream_and_a_write_that_cannot_fit_fail_that_load_alone():
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP)
    try:
        kv, dw = _publish(pub, 100), _Worker()
        dw.begin_step(StepMeta(loads=[_load("r", "full", [0, 1, 2, 3], pub.port)]))
        other = LoadMeta("o", "x", "lynx", "anchor", True, "127.0.0.1", pub.port, 100, 0, [4, 5, 6, 7], "other")
        small = _load("t", "anchor", [8], pub.port)  # (one block: the scheduler side never lets this through)
        dw.begin_step(StepMeta(loads=[other, small]))
        done, failed = _until(dw, {"r", "o", "t"})
        assert failed == {"o", "t"} and "another prompt" in other.error and "blocks" in small.error
        _assert_tier(dw, kv, [0, 1, 2, 3], "full")
        assert not dw.layers[0][4:8].any()
    finally:
        pub.close()


def test_the_forward_only_copies_its_kv_and_encoding_starts_once_it_is_over(monkeypatch):
    """No codec runs inside the prefill's forward (the first token leaves before any KV is asked for): save_layer
    copies, end_saves (wait_for_save) hands the copies to the encoder thread, which publishes every layer in order."""
    import lynx_hf.vllm.worker as worker

    calls = []
    real = worker.encode_layer
    monkeypatch.setattr(worker, "encode_layer", lambda *a: calls.append(a[1]) or real(*a))
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP)
    try:
        pw, kv = _Worker(pub), _kv(100)
        src = [0, 1, 2, 3]
        for i, (k, v) in enumerate(kv):
            paged.scatter(pw.layers[i], src, 0, "key", k)
            paged.scatter(pw.layers[i], src, 0, "value", v)
        save = StepMeta(saves=[SaveMeta("p", "x", "lynx", 100, src, "dg")])
        for name, cache in zip(pw.index, pw.layers):
            pw.save_layer(save, name, cache)
        for layer in pw.layers:
            layer.zero_()  # vLLM may hand the blocks to another request once the step is over: copies were taken
        time.sleep(0.05)
        assert calls == [] and pub._entries["x"].frames == [] and not pub._entries["x"].done
        pw.end_saves()
        assert pw.encoder.drained(30) and calls == list(range(L)) and pub._entries["x"].done
        dw = _Worker()
        dw.begin_step(StepMeta(loads=[_load("r", "full", [0, 1, 2, 3], pub.port)]))
        assert _until(dw, {"r"}) == ({"r"}, set())
        _assert_tier(dw, kv, [0, 1, 2, 3], "full")
    finally:
        pub.close()


def test_a_bad_refusal_or_a_failed_save_never_reaches_the_forward():
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP)
    try:
        pw = _Worker(pub)
        pw.begin_step(StepMeta(refusals=[("bad id\n", "why")]))  # logged, not raised
        _publish(pub, 100, xfer="y")
        kv = _kv(100)
        save = StepMeta(saves=[SaveMeta("p2", "y", "lynx", 100, [0, 1, 2, 3], "dg")])  # y is published already
        for name, cache in zip(pw.index, pw.layers):
            pw.save_layer(save, name, cache)  # begin fails: no later layer is added into y's stream
        pw.end_saves()
        dw = _Worker()
        dw.begin_step(StepMeta(loads=[_load("r", "full", [0, 1, 2, 3], pub.port, xfer="y")]))
        assert _until(dw, {"r"}) == ({"r"}, set())
        _assert_tier(dw, kv, [0, 1, 2, 3], "full")
    finally:
        pub.close()


def test_a_refused_prefill_request_is_heard_at_once_with_its_reason():
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP, timeout_s=30)
    try:
        pw = _Worker(pub)
        pw.begin_step(StepMeta(refusals=[("z", "kv_transfer_params: unknown method 'nope'")]))
        t = time.time()
        sub = Subscription("127.0.0.1", pub.port, SECRET, FP, "z", LynxQuantConfig(), KVSpec(L, H, D, "float32", 9),
                           "d", timeout_s=30)
        _wait(lambda: sub.error is not None)
        assert "refused by the prefill instance" in sub.error and "nope" in sub.error and time.time() - t < 10
    finally:
        pub.close()


def test_each_step_places_for_at_most_its_drain_budget_and_always_makes_progress():
    """The budget: max(drain_ms, the last forward's time). With both 0 (a clock that stands still), one piece a
    step, never none."""
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP)
    try:
        _publish(pub, 100)
        dw = _Worker(drain_ms=0.0, clock=lambda: 0.0)
        dw.begin_step(StepMeta(loads=[_load("r", "full", [0, 1, 2, 3], pub.port)]))
        sub = dw._subs["x"]
        _wait(lambda: sub.drain() is not None and sub.full_done)  # all held, none placed yet
        steps = 1
        while not dw.results(set())[0]:
            steps += 1
        assert steps == sub.pieces  # one piece a step
    finally:
        pub.close()
    t = [1.0]
    dw = _Worker(drain_ms=5.0, clock=lambda: t[0])
    assert dw.budget(1.0) == 0.005  # no step yet: drain_ms
    dw.results(set())
    assert dw.budget(1.05) == pytest.approx(0.05) and dw.budget(1.001) == 0.005  # the forward's time, >= drain_ms


# -- proposer --------------------------------------------------------------------------------------------------
def test_draft_book_proposes_the_longest_extending_source():
    b = DraftBook()
    b.record("x", [1, 2, 3, 4, 5, 6])
    b.record("x", [1, 2, 3, 9])
    assert b.propose("x", [1, 2, 3], 2) == [4, 5]
    assert b.propose("x", [1, 2, 3, 9], 4) == []
    assert b.propose("x", [1, 2, 7], 4) == [] and b.propose("y", [1, 2, 3], 4) == []
    b.record("x", [1, 2, 3, 4])  # an earlier step of a known source: nothing changes
    assert len(b) == 2
    b.keep([])
    assert len(b) == 0 and b.propose("x", [1, 2, 3], 2) == []


class _Cfg:
    class speculative_config:
        num_speculative_tokens = 4

    class model_config:
        max_model_len = 64


def _rows(*seqs):
    tok = np.zeros((len(seqs), 64), dtype=np.int32)
    for i, seq in enumerate(seqs):
        tok[i, :len(seq)] = seq
    return tok, np.array([len(q) for q in seqs])


def test_proposer_drafts_only_for_the_rows_of_a_live_transfer():
    prompt = list(range(100, 120))  # P = 19 shipped, then the first token
    P = 19
    live = {"x": (P, token_digest(prompt), 2, prompt[P])}
    prop = LynxProposer(_Cfg, live=lambda: live)
    S, R, other = prompt + [1, 2, 3, 4, 5, 6], prompt + [1], list(range(200, 221))
    tok, n = _rows(S, R, other)
    out = prop.propose([[6], [1], [7]], n, tok)
    assert out == [[], [2, 3, 4, 5], []]  # S extends nothing; R gets S's next K; the other row gets none
    assert prop.propose([[6], [], [7]], n, tok)[1] == []  # a row still prefilling gets none
    tok3, n3 = _rows(S, R, R)  # more rows match than the transfer has requests: none of them is trusted
    assert prop.propose([[6], [1], [1]], n3, tok3) == [[], [], []]
    live.clear()
    assert prop.propose([[6], [1], [7]], n, tok) == [[], [], []] and len(prop.book) == 0
    two = {"x": (P, token_digest(prompt), 2, prompt[P]), "y": (P + 2, token_digest(S[:P + 3]), 2, S[P + 2])}
    assert belongs(two, np.array(S)) == "y" and belongs(two, np.array(R + [9])) == "x"  # the longest prompt wins
    assert belongs(two, np.array(prompt)) == "x" and belongs(two, np.array(prompt[:P])) is None
    assert belongs({"x": (P, token_digest(prompt), 2, prompt[P])}, np.array(prompt[:P] + [2])) is None  # another
    assert belongs({"x": (P, token_digest(prompt), 2, 2)}, np.array(prompt[:P] + [2])) is None  # first token


def test_a_transfer_that_never_completes_fails_within_the_timeouts():
    P = 40
    cfg, spec = LynxQuantConfig(), KVSpec(L, H, D, "float32", P)
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP, timeout_s=1.0)
    try:
        pub.begin("x", cfg, spec, "d")  # begun, never produced (a prefill that stalled)
        sub = Subscription("127.0.0.1", pub.port, SECRET, FP, "x", cfg, spec, "d", timeout_s=30)
        _wait(lambda: sub.error is not None, timeout=15)
        assert "stopped producing" in sub.error
        pub.begin("y", cfg, spec, "d")
        pub.add("y", [])
        silent = Subscription("127.0.0.1", pub.port, SECRET, FP, "y", cfg, spec, "d", timeout_s=0.5)
        _wait(lambda: silent.error is not None, timeout=15)  # whichever side's clock runs out first, one line
        assert "\n" not in silent.error
    finally:
        pub.close()
