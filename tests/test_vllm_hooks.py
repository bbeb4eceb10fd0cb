"""Lynx inside vLLM without vLLM: the paged-cache twin, the KV stream between instances, the connector's hook twins
(hooks.py) and the proposer's draft book — each with the plain data vLLM would hand it. Tolerance 0 everywhere
(codes, frames, token ids, and the dequantized tiers against `quant.dequantize` of the same codes)."""
import time

import numpy as np
import pytest
import torch

from lynx_hf import LynxQuantConfig
from lynx_hf.quant import dequantize, encode
from lynx_hf.transfer.wire import SEGMENT_TOKENS
from lynx_hf.vllm import paged
from lynx_hf.vllm.hooks import LoadMeta, ParamsError, SaveMeta, SchedulerSide, StepMeta, WorkerSide, parse_params
from lynx_hf.vllm.proposer import DraftBook, LynxProposer, belongs
from lynx_hf.vllm.stream import KVPublisher, KVSpec, Subscription, StreamError, token_digest

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
    got = {"anchor": {}, "full": {}}

    def sink(tier, layer, kind, start, x):
        got[tier][(layer, kind, start)] = x.clone()
        return True

    _wait(lambda: sub.drain(sink) >= 0 and (sub.full_done or sub.error))
    assert sub.error is None, sub.error
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
                for off in range(0, P, SEGMENT_TOKENS):
                    s = encode(x[:, :, off:off + SEGMENT_TOKENS].contiguous(), cfg, kind, layer=(i, L))
                    assert torch.equal(got["full"][(i, kind, off)], dequantize(s, "full"))
                    if split:
                        assert torch.equal(got["anchor"][(i, kind, off)], dequantize(s, "anchor"))
        assert not split or sub.arrived_at["anchor"] <= sub.arrived_at["full"]
        _wait(lambda: pub.stored_bytes == 0)  # streamed once, then dropped
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
        assert not _collect(Subscription("127.0.0.1", pub.port, SECRET, FP, "x", cfg, spec, "d"), P) == {}
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
    _wait(lambda: sub.bytes_in[1] > 0)
    pub.close()
    _wait(lambda: sub.error is not None)
    assert "prefill instance" in sub.error and "\n" not in sub.error


# -- hook twins ------------------------------------------------------------------------------------------------
def _consume(tier, shadow=True, P=100, port=1, xfer="x"):
    return {"lynx": {"role": "consume", "xfer": xfer, "method": "lynx", "tier": tier, "shadow": shadow,
                     "host": "127.0.0.1", "port": port, "prompt_len": P}}


def test_params_are_validated():
    assert parse_params(None) is None and parse_params({"other": 1}) is None
    for bad in ({"lynx": 1}, {"lynx": {"role": "x"}}, {"lynx": {"role": "produce", "xfer": "x"}},
                {"lynx": {**_consume("mid")["lynx"]}}, {"lynx": {**_consume("full")["lynx"], "port": 0}},
                {"lynx": {**_consume("full")["lynx"], "prompt_len": 0}},
                {"lynx": {**_consume("full")["lynx"], "xfer": "bad id\n"}}):
        with pytest.raises(Exception):
            parse_params(bad)


def test_scheduler_side_asks_for_the_prompt_and_saves_when_its_last_prefill_step_runs():
    s = SchedulerSide("kv_consumer")
    ids = list(range(101))
    assert s.matched("r", ids, _consume("full"), 0) == (100, True)
    assert s.matched("r", ids, _consume("full"), 64) == (36, True)      # beyond the local prefix hit
    assert s.matched("r", ids[:100], _consume("full"), 0) == (0, False)  # no first token: computed locally
    assert s.matched("r", ids, {"lynx": {"role": "x"}}, 0) == (0, False)
    s.allocated("r", ids, _consume("full"), [3, 4, 5, 6], 100)
    meta = s.step_meta([], [], {})
    assert [m.req_id for m in meta.loads] == ["r"] and meta.loads[0].start == 0
    assert meta.loads[0].digest == token_digest(ids[:100])
    assert s.step_meta([], [], {}).loads == []  # each load is announced once
    s.worker_meta({"r": {"bytes": 7}})
    assert s.finished("r", _consume("full")) == {"lynx": {"xfer": "x", "tier": "full", "bytes": 7}}
    assert s.finished("s", _consume("anchor")) is None and s.step_meta([], [], {}).dropped == [("x", "anchor")]

    p = SchedulerSide("kv_producer")
    prod = {"lynx": {"role": "produce", "xfer": "y", "method": "int8"}}
    p.allocated("q", list(range(300)), prod, [1, 2], 0)
    assert p.step_meta([("q", [1, 2, 3], 0)], [], {"q": 200}).saves == []  # prefilled in steps: not the last one
    saves = p.step_meta([], [("q", [9], 200)], {"q": 100}).saves
    assert [(x.xfer, x.prompt_len, x.block_ids) for x in saves] == [("y", 300, [1, 2, 3, 9])]


class _Worker(WorkerSide):
    """WorkerSide over hand-made paged caches."""

    def __init__(self, publisher=None, blocks=16, upgrade=True):
        super().__init__({}, SECRET, FP, publisher, timeout_s=10, upgrade_shadows=upgrade)
        self.register({f"model.layers.{i}.attn": torch.zeros(blocks, H, BS, 2 * D) for i in range(L)})


@pytest.mark.parametrize("upgrade", [False, True])
def test_worker_side_prefill_to_decode_fills_shadow_and_real_blocks_with_their_tiers(upgrade):
    """S gets the anchor tier (upgraded to the full tier as the residual lands, when asked), R the full tier."""
    P = 100
    kv = _kv(P)
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP)
    try:
        pw, dw = _Worker(pub), _Worker(upgrade=upgrade)
        src_blocks = [0, 1, 2, 3]
        for i, (k, v) in enumerate(kv):  # the prefill's own forward wrote its KV
            paged.scatter(pw.layers[i], src_blocks, 0, "key", k)
            paged.scatter(pw.layers[i], src_blocks, 0, "value", v)
        save = StepMeta(saves=[SaveMeta("p", "x", "lynx", P, src_blocks, "dg")])
        for name, cache in zip(pw.index, pw.layers):
            pw.save_layer(save, name, cache)
        common = dict(xfer="x", method="lynx", shadow=True, host="127.0.0.1", port=pub.port, prompt_len=P,
                      digest="dg")
        s_blocks, r_blocks = [4, 5, 6, 7], [8, 9, 10, 11]
        dw.begin_step(StepMeta(loads=[LoadMeta("s", tier="anchor", start=0, block_ids=s_blocks, **common),
                                      LoadMeta("r", tier="full", start=0, block_ids=r_blocks, **common)]))
        assert dw.drafting == {"x": (P, "dg")}
        done, failed = set(), set()
        t = time.time() + 20
        while done != {"s", "r"}:
            d, f = dw.results(set())
            done |= d
            failed |= f
            assert time.time() < t
            time.sleep(0.01)
        assert not failed
        cfg = LynxQuantConfig()
        for i, (k, v) in enumerate(kv):
            ks, vs = paged.gather(dw.layers[i], s_blocks, P)
            kr, vr = paged.gather(dw.layers[i], r_blocks, P)
            for x, got_a, got_f, kind in ((k, ks, kr, "key"), (v, vs, vr, "value")):
                s = encode(x, cfg, kind, layer=(i, L))  # one segment: P < SEGMENT_TOKENS
                assert torch.equal(got_a, dequantize(s, "full" if upgrade else "anchor"))
                assert torch.equal(got_f, dequantize(s, "full"))
        assert {"bytes", "anchor_bytes", "anchor_at", "full_at"} <= set(dw.stats()["r"])
        dw.results({"s", "r"})
        assert dw.drafting == {}  # both finished: the proposer stops drafting for this transfer
    finally:
        pub.close()


def test_worker_side_fails_a_load_it_cannot_start_and_frees_an_aborted_one():
    dw = _Worker()
    common = dict(xfer="x", method="lynx", shadow=False, host="127.0.0.1", port=1, prompt_len=40, digest="d")
    dw.begin_step(StepMeta(loads=[LoadMeta("r", tier="full", start=0, block_ids=[0, 1], **common)]))
    t = time.time() + 20
    done = failed = set()
    while not done:
        done, failed = dw.results(set())
        assert time.time() < t
    assert done == failed == {"r"}  # connection refused: R fails (vLLM: finish_reason "error"), blocks freed
    dw.begin_step(StepMeta(loads=[LoadMeta("a", tier="full", start=0, block_ids=[2], **{**common, "xfer": "y"})]))
    done, failed = dw.results({"a"})  # aborted while waiting: reported so vLLM frees its blocks, not failed
    assert "a" in done and "a" not in failed


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


def test_proposer_drafts_only_for_rows_of_a_live_transfer():
    prompt = list(range(100, 120))  # P = 19 shipped + the first token
    P = 19
    live = {"x": (P, token_digest(prompt[:P]))}
    prop = LynxProposer(_Cfg, live=lambda: live)
    S = prompt + [1, 2, 3, 4, 5, 6]
    R = prompt + [1]
    other = list(range(200, 221))
    tok = np.zeros((3, 64), dtype=np.int32)
    for i, seq in enumerate((S, R, other)):
        tok[i, :len(seq)] = seq
    n = np.array([len(S), len(R), len(other)])
    out = prop.propose([[6], [1], [7]], n, tok)
    assert out == [[], [2, 3, 4, 5], []]  # S extends nothing; R gets S's next K; the other row gets none
    assert prop.propose([[6], [], [7]], n, tok)[1] == []  # a row still prefilling gets none
    live.clear()
    assert prop.propose([[6], [1], [7]], n, tok) == [[], [], []] and len(prop.book) == 0
    assert belongs({"x": (P, token_digest(prompt[:P]))}, np.array(prompt)) == "x"
    assert belongs({"x": (P, token_digest(prompt[:P]))}, np.array(prompt[:P])) is None  # no first token yet


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
