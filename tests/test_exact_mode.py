"""Exact mode (`LynxQuantConfig(exact=True)`): the correction stream gives back the KV's own bits (tolerance 0), is
framed and bounded before anything is unpacked, and the output equals plain `generate` with a DynamicCache in the
same dtype — per architecture family on tiny bf16 models (the residual and correction at once or later), on the real
model in bf16 over three turns (Transformers' multi-turn pattern: one DynamicCache for every turn) in process and over
the network (slow tier)."""
import warnings

import pytest
import torch
from transformers import DynamicCache

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig as Q
from lynx_hf.errors import ConfigError
from lynx_hf.quant import dequantize, encode, exact, stream_shapes
from lynx_hf.transfer.serde import check_correction
from lynx_hf.transfer.wire import WireError
from test_exactness import ARCHS, build, prompt

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(INT[a.dtype]), b.view(INT[b.dtype]))


def edge_values(dtype) -> torch.Tensor:
    f = torch.finfo(dtype)
    return torch.tensor([0.0, -0.0, f.max, -f.max, f.tiny, -f.tiny, f.tiny / 4, -f.tiny / 4, 1.0, -1.0], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_correction_gives_back_every_bit(dtype):
    """Any x̂ of the same shape (a poor one, a sign flip, ±0, denormals, the dtype's extremes): x exactly."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 37, 8, generator=g) * 3).to(dtype)
    x.view(-1)[:10] = edge_values(dtype)
    for x_hat in ((x.float() * (1 + 0.01 * torch.randn(x.shape, generator=g))).to(dtype), -x, torch.zeros_like(x),
                  x.flip(-1)):
        data = exact.encode_correction(x, x_hat)
        assert data.dtype == torch.uint8 and data.numel() <= exact.max_nbytes(x.numel(), dtype)
        assert same_bits(exact.correct(x_hat, data), x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["lynx", "paper"])
def test_an_exact_configs_full_tier_is_the_input(dtype, method):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(1, 2, 150, 16, generator=g) * 2).to(dtype)
    x[..., 3] *= 40  # an outlier channel
    cfg = Q(method=method, exact=True)
    for kind in ("key", "value"):
        split = encode(x, cfg, kind)
        assert same_bits(dequantize(split, "full"), x)
        plain = encode(x, Q(method=method), kind)  # the anchor and the 8-bit code are those of the default mode
        assert torch.equal(split.anchor, plain.anchor) and torch.equal(split.residual, plain.residual)
        assert split.nbytes("full") == plain.nbytes("full") + split.correction.numel()
        spec = stream_shapes(cfg, kind, x.shape, dtype, axis=split.axis)
        assert split.correction.numel() <= spec.correction.nbytes and spec.correction.shape is None


def test_a_malformed_correction_is_refused_before_it_is_unpacked():
    x = torch.randn(1, 1, 64, 8).to(torch.bfloat16)
    x_hat = (x.float() * 1.01).to(torch.bfloat16)
    good = exact.encode_correction(x, x_hat)
    blocks = -(-x.numel() // exact.BLOCK)
    wide = good.clone()
    wide[exact.HEAD] = 18  # a bf16 correction needs at most 17 bits a value
    for bad, why in ((good[:-1], "add up"), (torch.cat([good, good[:4]]), "add up"), (wide, "width"),
                     (good[:blocks - 1], "cannot hold"), (good.view(-1, 1), "cannot hold"),
                     (good.to(torch.int16), "cannot hold")):
        with pytest.raises(ValueError, match=why):
            exact.check_correction(bad, tuple(x.shape), x.dtype)
        with pytest.raises(WireError):
            check_correction({"codes": bad}, Q(exact=True), tuple(x.shape), x.dtype)
    with pytest.raises(WireError):  # a correction for a codec that has none
        check_correction({"codes": good}, Q(), tuple(x.shape), x.dtype)


def test_a_reconstruction_that_rounds_otherwise_is_refused_not_corrected():
    """The correction carries the CRC-32 of the encoder's values: a decode side whose x̂ differs (another build or
    device rounding otherwise) is told so instead of ending with other values."""
    x = torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    x_hat = (x.float() * 1.01).to(torch.bfloat16)
    data = exact.encode_correction(x, x_hat)
    other = x_hat.clone()
    other.view(-1)[7] = -other.view(-1)[7]
    with pytest.raises(ValueError, match="checksum"):
        exact.correct(other, data)


def test_the_config_says_which_codecs_take_exact_mode():
    assert "exact" not in Q().to_dict() and Q(exact=True).to_dict()["exact"] is True  # default dicts as before
    assert Q.from_dict(Q(exact=True).to_dict()) == Q(exact=True)
    with pytest.raises(ConfigError, match="'lynx' or 'paper'"):
        Q(method="int8", exact=True)
    with pytest.raises(ConfigError, match="exact already"):
        Q(method="identity", exact=True)
    with pytest.raises(ConfigError, match="True or False"):
        Q(exact=1)


def test_the_correction_stream_lands_after_its_anchor_once():
    from lynx_hf.local import anchor_only

    x = torch.randn(1, 2, 16, 8).to(torch.bfloat16)
    split = encode(x, Q(exact=True), "key")
    cache = LynxCache(1, 16, Q(exact=True), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="before its anchor"):
        cache.put_residual(0, "key", 0, split.correction, "correction")
    cache.put_anchor(0, "key", 0, anchor_only(split))
    cache.put_residual(0, "key", 0, split.residual)
    assert not cache.layers[0].store.residual_complete()
    cache.put_residual(0, "key", 0, split.correction, "correction")
    with pytest.raises(ValueError, match="duplicate correction"):
        cache.put_residual(0, "key", 0, split.correction, "correction")
    other = LynxCache(1, 16, Q(), dtype=torch.bfloat16)
    other.put_anchor(0, "key", 0, anchor_only(encode(x, Q(), "key")))
    with pytest.raises(ValueError, match="no correction stream"):
        other.put_residual(0, "key", 0, split.correction, "correction")


FAST_FAMILIES = ("llama", "deepseek-v3-mla", "gpt-neo-local", "falcon-alibi")


def exact_equals_plain(name: str) -> None:
    cls, kw = ARCHS[name]
    model = build(cls, **kw).to(torch.bfloat16)
    ids = prompt(3)
    plain = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    for after in (0, 5):  # the residual and correction at once, or after 5 steps (exact mode never drafts)
        cache, _ = LynxCache.from_prefill(model, ids, Q(exact=True), residual_after_steps=after)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=12,
                                 min_new_tokens=12, do_sample=False)
        assert out.tolist() == plain.tolist(), (name, after)
        assert cache.stats.drafted == 0  # k drafts verified in one forward would round unlike k one-token steps


@pytest.mark.parametrize("name", FAST_FAMILIES)
def test_exact_mode_equals_plain_generate_in_bf16(name):
    exact_equals_plain(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in ARCHS if n not in FAST_FAMILIES])
def test_exact_mode_equals_plain_generate_in_bf16_every_family(name):
    exact_equals_plain(name)


def transformers_turns(model, turns, n):
    """Transformers' own multi-turn pattern: one DynamicCache passed to every turn."""
    dc, conv, out = DynamicCache(config=model.config), [], []
    for t in turns:
        ids = torch.tensor([conv + t])
        o = model.generate(ids, cache=dc, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(o[0, ids.shape[1]:].tolist())
        conv = o[0].tolist()
    return out


@pytest.fixture(scope="module")
def bf16_model(model_and_tok):
    import copy

    model, tok = model_and_tok
    return copy.deepcopy(model).to(torch.bfloat16), tok


def three_turns(shakespeare_ids):
    return [shakespeare_ids[0, i * 400:i * 400 + 220].tolist() for i in range(3)]


@pytest.mark.slow
def test_exact_mode_equals_plain_generate_on_the_real_model_in_process(bf16_model, shakespeare_ids):
    model, _ = bf16_model
    turns, n = three_turns(shakespeare_ids), 16
    want = transformers_turns(model, turns, n)
    sess = lynx_hf.Session(model, quant_config=Q(exact=True), max_new_tokens=n, min_new_tokens=n)
    conv = []
    for t, ref in zip(turns, want):
        r = sess.generate(conv + t)
        assert r.tokens == ref
        conv = conv + t + r.tokens


@pytest.mark.slow
def test_exact_mode_equals_plain_generate_on_the_real_model_over_the_network(bf16_model, shakespeare_ids):
    """Over loopback, 3 turns: the first turn's KV computed by the prefill server and shipped in exact mode, the next
    turns' new positions computed here over the held KV (where Transformers' own multi-turn computes them)."""
    from lynx_hf.transfer import server as S
    from lynx_hf.transfer.decode import DecodeClient

    model, _ = bf16_model
    turns, n = three_turns(shakespeare_ids), 16
    want = transformers_turns(model, turns, n)
    srv = S.PrefillServer(model, secret="exact", prefix_cache_mb=64).start()
    try:
        cli = DecodeClient(model, *srv.address, secret="exact")
        sess = cli.session(quant_config=Q(exact=True), max_new_tokens=n, min_new_tokens=n)
        conv = []
        for t, ref in zip(turns, want):
            r = sess.generate(conv + t)
            assert r.tokens == ref and r.prefilled_on == ("decode" if conv else "prefill")
            if not conv:  # the first turn's KV crossed the link with its correction; the next ones computed here
                assert r.bytes > r.anchor_bytes and any(e[1] == "correction" for e in r.events)
            conv = conv + t + r.tokens
        cli.close()
    finally:
        srv.close()


def test_batch_maps_keep_the_kv_exact():
    """A correction spans the batch rows: selecting, reordering or repeating rows makes the rows' own again."""
    from lynx_hf.local import anchor_only

    x = torch.randn(3, 2, 16, 8, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for apply, rows in ((lambda c: c.batch_select_indices([2, 0]), [2, 0]),
                        (lambda c: c.reorder_cache(torch.tensor([1, 2, 0])), [1, 2, 0]),
                        (lambda c: c.batch_repeat_interleave(2), [0, 0, 1, 1, 2, 2])):
        cache = LynxCache(1, 16, Q(exact=True), dtype=torch.bfloat16)
        for kind in ("key", "value"):
            s = encode(x, Q(exact=True), kind)
            cache.put_anchor(0, kind, 0, anchor_only(s))
            cache.put_residual(0, kind, 0, s.residual)
            cache.put_residual(0, kind, 0, s.correction, "correction")
        apply(cache)
        cache.set_tier("full")
        assert same_bits(cache.layers[0].keys, x[rows]) and same_bits(cache.layers[0].values, x[rows])


def test_a_server_serves_exact_mode_in_one_forward_and_turns_go_on_here(tiny):
    """A prompt longer than the server's prefill step is refused in exact mode, naming the flag, and the connection
    goes on; a continued turn's new positions are computed on the decode node (nothing crosses the link)."""
    from conftest import LOOPBACK_SECRET, tiny_ids
    from lynx_hf.transfer import server as S
    from lynx_hf.transfer.decode import DecodeClient
    from lynx_hf.transfer.wire import RequestRefused

    srv = S.PrefillServer(tiny, secret=LOOPBACK_SECRET, prefill_step=32).start()
    try:
        cli = DecodeClient(tiny, *srv.address, secret=LOOPBACK_SECRET)
        with pytest.raises(RequestRefused, match="--prefill-step"):
            cli.generate(tiny_ids(40, 1), quant_config=Q(exact=True), max_new_tokens=4)
        r1 = cli.generate(tiny_ids(30, 2), quant_config=Q(exact=True), max_new_tokens=4, keep_cache=True)
        assert r1.prefilled_on == "prefill" and any(e[1] == "correction" for e in r1.events)
        conv = tiny_ids(30, 2) + r1.tokens + tiny_ids(12, 3)
        r2 = cli.generate(conv, cache=r1.cache, max_new_tokens=4, prefill_on="prefill")
        assert r2.prefilled_on == "decode" and r2.bytes == 0
        dc = DynamicCache(config=tiny.config)  # Transformers' own two turns
        o1 = tiny.generate(torch.tensor([tiny_ids(30, 2)]), cache=dc, max_new_tokens=4, do_sample=False)
        o2 = tiny.generate(torch.tensor([conv]), cache=dc, max_new_tokens=4, do_sample=False)
        assert r1.tokens == o1[0, 30:].tolist() and r2.tokens == o2[0, len(conv):].tolist()
        cli.close()
    finally:
        srv.close()


def test_add_turn_refuses_exact_mode_with_the_way_out(tiny):
    from conftest import tiny_ids

    ids = torch.tensor([tiny_ids(20, 4)])
    cache, _ = LynxCache.from_prefill(tiny, ids, Q(exact=True))
    out = tiny.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=3)
    with pytest.raises(ValueError, match="exact mode continues a conversation on the decode side"):
        cache.add_turn(tiny, torch.cat([out, ids[:, :5]], 1))
