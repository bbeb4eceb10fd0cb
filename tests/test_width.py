"""`anchor_bits="auto"` (lynx_hf.width): the forecast's arithmetic, the choice rule (4 bits while the link is unknown,
else of the widths within the slack of the best forecast TT32T the one whose anchor lands first), what observations
change, the config and
every codec entry refusing an unresolved width, and the width chosen per request in process and over the network
(the tiny model; a loopback server in this process), a continued turn keeping its cache's width."""
import pytest
import torch
from conftest import LOOPBACK_SECRET as SECRET, tiny_ids

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig as Q, SpecConfig
from lynx_hf.errors import ConfigError
from lynx_hf.quant import encode
from lynx_hf.transfer.decode import DecodeClient
from lynx_hf.transfer.serde import segment_bound
from lynx_hf.transfer.wire import RequestRefused
from lynx_hf.vllm.scheduler import ParamsError, codec_config
from lynx_hf.width import (KEPT_PER_STEP, WidthChoice, WidthPolicy, forecast, resolve, step_from_trace,
                           values_per_position)

V = 11520  # the embedded model's values per position (30 layers · 2 · 3 KV heads · 64)


def test_the_forecast_is_the_documented_timeline():
    # 1000 positions, 1 Mbit/s: anchor 4.5 bits → 51.84 s, residual 8.5 → 97.92 s; 0.5 s steps, lead 3
    f = forecast(4, 1000, V, 1e6, 0.5, 0.5, new_tokens=32, lead=3.0, max_steps=200)
    assert f.anchor_s == pytest.approx(1000 * V * 4.5 / 1e6)
    assert f.residual_s == pytest.approx(1000 * V * 8.5 / 1e6)
    assert f.draft_steps == pytest.approx((f.residual_s - f.anchor_s) / 0.5 - 3)
    assert f.kept == 31  # 0.5 · 89 steps caps at N − 1
    assert f.tt32t_s == pytest.approx(f.residual_s)
    assert forecast(4, 1000, V, 1e6, 0.5, 0.5, max_steps=40).draft_steps == 40  # the request's budget caps it
    # compute-bound: both land when the prefill ends, no draft step, every token after the residual
    g = forecast(3, 1000, V, 1e9, 0.1, 1.0, compute_s_per_position=0.01, new_tokens=32)
    assert g.anchor_s == g.residual_s == pytest.approx(10.0)
    assert g.draft_steps == 0 and g.kept == 0 and g.tt32t_s == pytest.approx(10.0 + 31 * 0.1)


def test_an_unknown_link_takes_four_bits():
    c = WidthPolicy().choose(1024, V)
    assert c.bits == 4 and "not known" in c.why and c.forecasts == ()
    assert WidthPolicy(link_bps=15e6).choose(1024, V).bits == 4  # no step time yet either


def test_the_earliest_anchor_within_the_slack_of_the_best_tt32t():
    # a short window (1024 positions at 15 Mbit/s, 0.15 s steps): a narrower anchor buys draft steps
    p = WidthPolicy(link_bps=15e6, step_s={4: 0.15, 3: 0.15, 2: 0.15}, kept_per_step={4: 1.0, 3: 1.0, 2: 1.0})
    c = p.choose(1024, V)
    assert c.bits == 2 and len(c.forecasts) == 3
    best = min(f.tt32t_s for f in c.forecasts)
    assert next(f for f in c.forecasts if f.bits == 2).tt32t_s <= best * 1.02
    # the same link when narrow anchors keep few drafts: 4 bits
    p.kept_per_step = {4: 1.0, 3: 0.3, 2: 0.1}
    assert p.choose(1024, V).bits == 4
    # a long window: every width drafts all 31, so they tie and the earliest anchor (the narrowest) goes
    slow = WidthPolicy(link_bps=1e6, step_s={4: 0.15, 3: 0.15, 2: 0.15}, kept_per_step={4: 1.0, 3: 0.9, 2: 0.9})
    assert slow.choose(1024, V).bits == 2
    d = slow.choose(1024, V).as_dict()
    assert d["anchor_bits"] == 2 and set(d["forecast"]) == {4, 3, 2}
    # a compute-bound prefill: every anchor lands when the prefill ends, so nothing is gained: the wider code
    busy = WidthPolicy(link_bps=1e9, step_s={4: 0.15, 3: 0.15, 2: 0.15}, compute_s_per_position=0.01)
    assert busy.choose(1024, V).bits == 4
    # a request that does not draft: no width keeps anything, so the earliest anchor goes (its first token sooner)
    nodraft = p.choose(1024, V, max_steps=0)
    assert nodraft.bits == 2 and all(f.kept == 0 for f in nodraft.forecasts)
    # a wider tree's dearer step: the same windows buy fewer steps at 3 and 2 bits
    dear = WidthPolicy(link_bps=15e6, step_s={4: 0.15, 3: 0.4, 2: 0.4}, kept_per_step={4: 1.0, 3: 1.0, 2: 1.0})
    assert dear.choose(1024, V).bits == 4


def test_observations_move_the_kept_drafts_and_the_link():
    p = WidthPolicy()
    p.observe(3, drafted=20, accepted=0.0)
    assert p.kept_per_step[3] == pytest.approx(0.5 * KEPT_PER_STEP[3])
    p.observe(3, drafted=3, accepted=0.0)  # too few steps to say anything
    assert p.kept_per_step[3] == pytest.approx(0.5 * KEPT_PER_STEP[3])
    p.observe(4, drafted=10, accepted=10.0)
    assert p.kept_per_step[4] == 1.0
    p.observe_link(1_000_000, 2.0, compute_s=1.0, positions=500)
    assert p.link_bps == 4e6 and p.compute_s_per_position == pytest.approx(0.002)
    p.observe_link(1_000, 0.5, compute_s=0.9, positions=64)  # a short request: mostly fixed costs, says nothing
    assert p.link_bps == 4e6 and p.compute_s_per_position == pytest.approx(0.002)
    p.observe_link(1_000_000, 4.0, positions=500)
    assert p.link_bps == 4e6  # a slower sample (paced by compute) is a lower bound: the largest stays
    p.observe_link(1_000_000, 1.0, positions=500)
    assert p.link_bps == 8e6
    hinted = WidthPolicy(link_bps=15e6)
    hinted.observe_link(1_000_000, 4.0, positions=500)
    assert hinted.link_bps == 15e6  # a hint stays
    assert step_from_trace([0.0, 0.1]) is None and step_from_trace([1.0, 1.2, 1.4, 1.6]) == pytest.approx(0.2)
    for bad in (0, True, float("inf")):
        with pytest.raises(ValueError, match="link_bps"):
            WidthPolicy(link_bps=bad)
    with pytest.raises(ValueError, match="step_s"):
        WidthPolicy(link_bps=1e6, step_s={4: 0.1, 3: 0.0, 2: 0.1})


def test_auto_is_a_setting_the_codec_refuses_unresolved(tiny):
    cfg = Q(anchor_bits="auto")
    assert Q.from_dict(cfg.to_dict()) == cfg
    assert resolve(cfg, WidthChoice(3, "test")) == Q(anchor_bits=3)
    with pytest.raises(ConfigError, match="anchor_bits"):
        Q(method="int8", anchor_bits="auto")
    with pytest.raises(ConfigError, match="chosen per request"):
        encode(torch.randn(1, 2, 8, 16), cfg)
    with pytest.raises(ConfigError, match="one anchor width"):
        LynxCache(2, 8, cfg)
    with pytest.raises(ConfigError, match="auto"):
        segment_bound(cfg, "key", (1, 2, 8, 16), torch.float32)
    with pytest.raises(ParamsError, match="auto"):
        codec_config({"anchor_bits": "auto"}, "lynx")  # the vLLM connector takes a fixed width
    assert values_per_position({"num_layers": 30, "kv_heads": 3, "head_dim": 64}) == V


def test_from_prefill_resolves_auto_for_its_link(tiny, monkeypatch):
    from lynx_hf import local

    ids = torch.tensor([tiny_ids(40, 1)])
    cache, _ = LynxCache.from_prefill(tiny, ids, quant_config=Q(anchor_bits="auto"), residual_after_steps=2)
    assert cache.quant_config.anchor_bits == 4  # no link: nothing to gain from a narrower anchor
    assert cache.stats["width"]["anchor_bits"] == 4 and "not known" in cache.stats["width"]["why"]
    fixed, _ = LynxCache.from_prefill(tiny, ids, quant_config=Q(anchor_bits=3), residual_after_steps=2)
    assert fixed.stats["width"] is None  # a width the caller named: nothing was chosen
    # a slow link, drafts as cheap as a microsecond: every width drafts all it can, the earliest anchor goes
    monkeypatch.setattr(local, "step_times", lambda model, positions: {4: 1e-6, 3: 1e-6, 2: 1e-6})
    cache, _ = LynxCache.from_prefill(tiny, ids, quant_config=Q(anchor_bits="auto"), bandwidth_bps=2e4)
    assert cache.quant_config.anchor_bits == 2 and cache.stats["width"]["anchor_bits"] == 2
    assert set(cache.stats["width"]["forecast"]) == {2, 3, 4}
    with pytest.raises(ConfigError, match="bandwidth_bps"):
        LynxCache.from_prefill(tiny, ids, quant_config=Q(anchor_bits="auto"), bandwidth_bps=0)
    out = tiny.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=6,
                        do_sample=False)
    plain, _ = LynxCache.from_prefill(tiny, ids, quant_config=cache.quant_config)  # that width, no drafts
    ref = tiny.generate(ids, cache=plain, custom_generate=lynx_hf.speculative_generate, max_new_tokens=6,
                        do_sample=False, spec_config=SpecConfig(max_draft_steps=0))
    assert out.tolist() == ref.tolist()


def test_the_client_chooses_per_request_and_a_turn_keeps_its_width(tiny, loopback_server):
    cli = DecodeClient(tiny, *loopback_server.address, secret=SECRET, link_bps=2e5)
    try:
        ids = tiny_ids(60, 2)
        r = cli.generate(ids, Q(anchor_bits="auto"), max_new_tokens=6, keep_cache=True)
        bits = r.cache.quant_config.anchor_bits
        assert r.width["anchor_bits"] == bits in (2, 3, 4) and set(r.width["forecast"]) == {2, 3, 4}
        assert r.cache.stats["width"] == r.width  # the cache's stats say it too
        r2 = cli.generate(ids + r.tokens + tiny_ids(10, 3), Q(anchor_bits="auto"), max_new_tokens=6, cache=r.cache)
        assert r2.cache.quant_config.anchor_bits == bits and "keeps" in r2.width["why"]
        r3 = cli.generate(ids + r.tokens + tiny_ids(10, 3), Q(anchor_bits="auto"), max_new_tokens=3, cache=r.cache,
                          prefill_on="decode")  # its new positions computed here: the same width, said the same way
        assert r3.prefilled_on == "decode" and "keeps" in r3.width["why"] and r3.cache.stats["width"] == r3.width
        assert r2.held_tokens > 0
        # an unresolved width on the wire is the server's refusal of that request; the connection goes on
        with pytest.raises(RequestRefused, match="auto"):
            cli._request(torch.tensor([ids]), Q(anchor_bits="auto"), 0)
        assert cli.generate(ids, Q(), max_new_tokens=3)["tokens"]
    finally:
        cli.close()
    fresh = DecodeClient(tiny, *loopback_server.address, secret=SECRET)  # no hint: the first requests measure
    try:
        assert fresh.generate(tiny_ids(40, 6), Q(anchor_bits="auto"), max_new_tokens=3).width["anchor_bits"] == 4
        assert fresh.width.link_bps is None  # 40 positions: fixed costs, no rate
        fresh.generate(tiny_ids(300, 7), Q(), max_new_tokens=3)
        assert fresh.width.link_bps > 0 and fresh.width.compute_s_per_position > 0
        assert set(fresh.generate(tiny_ids(300, 8), Q(anchor_bits="auto"), max_new_tokens=3).width["forecast"]) == {
            2, 3, 4}
    finally:
        fresh.close()


def test_end_times_are_kept_only_when_they_are_times():
    from lynx_hf.transfer.decode import NetworkLoader

    n = NetworkLoader.__new__(NetworkLoader)
    n._times({"prefill_s": 1.5, "compute_s": 0.5})
    assert (n.prefill_s, n.compute_s) == (1.5, 0.5)
    for bad in ("1.5", True, -1, float("nan"), 1e12, None, [1]):
        n._times({"prefill_s": bad, "compute_s": bad})
        assert (n.prefill_s, n.compute_s) == (None, None), bad


def test_a_local_session_resolves_auto_and_drafts_with_that_widths_settings(tiny):
    from lynx_hf.session import LocalLink

    link = LocalLink(tiny, bandwidth_bps=2e5)
    ids = tiny_ids(50, 4)
    r = link.generate(ids, Q(anchor_bits="auto"), max_new_tokens=6, keep_cache=True)
    bits = r.cache.quant_config.anchor_bits
    assert r.width["anchor_bits"] == bits and set(r.width["forecast"]) == {2, 3, 4}  # as the network client says
    assert len(r.tokens) == 6  # (before the fix: SpecConfig.for_anchor("auto") refused the turn)
    wide = SpecConfig.for_anchor(bits).tree_width
    assert r.stats.draft_nodes and max(max(n) if isinstance(n, list) else n for n in r.stats.draft_nodes) <= wide
    r2 = link.generate(ids + r.tokens + tiny_ids(8, 5), Q(anchor_bits="auto"), max_new_tokens=4, cache=r.cache)
    assert r2.cache.quant_config.anchor_bits == bits and r2.held_tokens > 0 and len(r2.tokens) == 4
    assert r2.width["anchor_bits"] == bits and "keeps" in r2.width["why"]
    assert link.generate(ids, Q(anchor_bits=4), max_new_tokens=2).width is None
