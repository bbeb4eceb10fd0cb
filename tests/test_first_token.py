"""The first token leaves before the KV (issue 63): the prefill's logits (FIRST) go ahead of every segment frame still
queued, on TCP, TLS, NIXL and the in-process loader alike, so the first token needs the prefill plus one frame and
the second (`decode_start_s`, a draft on the anchor or a verified token) is the first that waits for KV. The tokens
are those of decoding without drafts (0 tolerance: token ids).

A 1 Mbit/s link and a 600-token prompt on the tiny model: 12 anchor frames of ~3 KB (~25 ms each) behind a forward
pass of a few ms, so nearly every segment is still queued when FIRST is."""
import pytest
import torch

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig as Q
from lynx_hf.transfer import nixl
from lynx_hf.transfer import server as S
from lynx_hf.transfer.decode import DecodeClient

from conftest import tiny_ids

SECRET = "first-token-secret"
LINK_BPS = 1e6
PROMPT = tiny_ids(600, 11)


def _arrivals(r: dict, stream: str) -> list[float]:
    """Seconds from the turn's start at which each segment of `stream` landed."""
    return sorted(t - r["t0"] for t, what, *_ in r["events"] if what == stream)


def _check_order(r: dict) -> None:
    anchors, every = _arrivals(r, "anchor"), _arrivals(r, "anchor") + _arrivals(r, "residual")
    assert r["logits_s"] is not None and anchors
    before = sum(t < r["logits_s"] for t in every)
    assert before <= 2, f"{before} of {len(every)} segments landed before the logits"  # the frame(s) on the wire
    assert r["ttft_s"] < anchors[-1]  # the first token waits for no KV
    assert r["decode_start_s"] > anchors[-1]  # the second needs the anchor at least


def _over(client: DecodeClient) -> dict:
    try:
        got = client.generate(PROMPT, Q(), max_new_tokens=8)
        ref = client.generate(PROMPT, Q(), max_new_tokens=8, speculative=False)
    finally:
        client.close()
    assert got["tokens"] == ref["tokens"] and len(got["tokens"]) == 8
    _check_order(got)
    _check_order(ref)
    return got


@pytest.fixture(scope="module")
def want(tiny):
    """The tokens of the in-process path without drafts (every transport must give these)."""
    cache, _ = LynxCache.from_prefill(tiny, torch.tensor([PROMPT]), residual_after_steps=0)
    out = tiny.generate(torch.tensor([PROMPT]), cache=cache, custom_generate=lynx_hf.speculative_generate,
                        max_new_tokens=8, do_sample=False, spec_config=lynx_hf.SpecConfig(max_draft_steps=0))
    return out[0, len(PROMPT):].tolist()


def test_over_tcp(tiny, want):
    srv = S.PrefillServer(tiny, secret=SECRET, bandwidth_bps=LINK_BPS).start()
    try:
        assert _over(DecodeClient(tiny, *srv.address, secret=SECRET))["tokens"] == want
    finally:
        srv.close()


def test_over_tls(tiny, want, certificate):
    cert, key = certificate
    srv = S.PrefillServer(tiny, secret=SECRET, bandwidth_bps=LINK_BPS, tls_cert=cert, tls_key=key).start()
    try:
        assert _over(DecodeClient(tiny, *srv.address, secret=SECRET, tls_ca=cert))["tokens"] == want
    finally:
        srv.close()


@pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed (pip install 'lynx-hf[nixl]')")
def test_over_nixl(tiny, want):
    srv = S.PrefillServer(tiny, secret=SECRET, bandwidth_bps=LINK_BPS, data_plane="nixl").start()
    try:
        got = _over(DecodeClient(tiny, *srv.address, secret=SECRET, data_plane="nixl"))
        assert got["tokens"] == want and got["placed_segments"] > 0
    finally:
        srv.close()


def test_in_process_the_logits_are_in_before_any_segment(tiny, want):
    """The in-process loader hands the logits over before its link thread starts (a simulated 1 Mbit/s link)."""
    cache, _ = LynxCache.from_prefill(tiny, torch.tensor([PROMPT]), bandwidth_bps=LINK_BPS)
    out = tiny.generate(torch.tensor([PROMPT]), cache=cache, custom_generate=lynx_hf.speculative_generate,
                        max_new_tokens=8, do_sample=False)
    assert out[0, len(PROMPT):].tolist() == want
    first_segment = min(t for t, *_ in cache.trace.events)
    assert cache.trace.logits_at < first_segment
    marks = sorted(t for t, k in cache.trace.timeline if k in ("draft", "verified"))  # perf_counter, as events
    last_anchor = max(t for t, what, *_ in cache.trace.events if what == "anchor")
    assert marks[0] < last_anchor < marks[1]  # the first token before the anchor, the second after it


def test_exact_mode_computes_its_corrections_after_the_logits_leave(tiny, monkeypatch):
    """Exact mode's correction (its dearest encode step; its stream goes last anyway) is computed only once FIRST is
    built: the forward pass, the first token's only wait, never waits for one. The tokens are plain generate's."""
    from lynx_hf.transfer import prefill as P

    calls = []
    for name in ("correction", "pack_logits"):
        real = getattr(P, name)
        monkeypatch.setattr(P, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    srv = S.PrefillServer(tiny, secret=SECRET, bandwidth_bps=LINK_BPS).start()
    try:
        cli = DecodeClient(tiny, *srv.address, secret=SECRET)
        r = cli.generate(PROMPT, Q(exact=True), max_new_tokens=8)
        cli.close()
    finally:
        srv.close()
    plain = tiny.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT):].tolist()
    assert r["tokens"] == plain
    assert calls[0] == "pack_logits" and calls.count("correction") == 2 * 2 * 3  # layers × K/V × segments
    assert min(_arrivals(r, "correction")) > r["logits_s"]
    _check_order(r)


def _layer_1_waits_for_the_logits(tiny, monkeypatch, want, **settings):
    """With prefill's `settings` patched: the tokens are `want`, and only layer 0 (K/V × 3 segments) is encoded
    before FIRST is built, layer 1 right after it."""
    from lynx_hf.transfer import prefill as P

    calls = []
    for name, value in settings.items():
        monkeypatch.setattr(P, name, value)
    for name in ("encode", "pack_logits"):
        real = getattr(P, name)
        monkeypatch.setattr(P, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    srv = S.PrefillServer(tiny, secret=SECRET, bandwidth_bps=LINK_BPS).start()
    try:
        got = _over(DecodeClient(tiny, *srv.address, secret=SECRET))
    finally:
        srv.close()
    assert got["tokens"] == want
    first = calls.index("pack_logits")
    assert calls[:first] == ["encode"] * 2 * 3  # layer 0: K/V × 3 segments; layer 1 waited for the logits
    assert calls[first + 1:first + 1 + 2 * 3] == ["encode"] * 2 * 3


def test_before_the_logits_a_layer_is_encoded_only_while_the_link_needs_it(tiny, monkeypatch, want):
    """With a lead of 10 ms (1.25 KB at 1 Mbit/s), layer 0's anchor frames already feed the link when layer 1's KV
    arrives: layer 1 is encoded after FIRST is built, not inside the forward pass. Same tokens."""
    _layer_1_waits_for_the_logits(tiny, monkeypatch, want, LEAD_S=0.01)


def test_before_the_logits_encoding_takes_no_more_than_its_budget(tiny, monkeypatch, want):
    """A codec dearer than its link's pace (CacheGen's coder on a CPU) must not slow the forward pass: with no
    encoding budget (ENCODE_SHARE 0) and a link that is never fed, only layer 0 is encoded before FIRST is built
    (one layer at least), the rest after it. Same tokens."""
    _layer_1_waits_for_the_logits(tiny, monkeypatch, want, ENCODE_SHARE=0.0, LEAD_S=1e9)
