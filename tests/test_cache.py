"""LynxCache mechanics: tiers, tail, crop, batch selection, readiness across threads, loader failures."""
import threading
import time

import pytest
import torch

from lynx_hf import LoaderError, LynxCache, LynxQuantConfig as Q
from lynx_hf.local import InProcessLoader, anchor_only, encode_layers
from lynx_hf.quant import dequantize as decode


def kv(L=2, B=2, H=3, S=70, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g)) for _ in range(L)]


def test_tiers_tail_crop_and_sizes():
    data = kv()
    cache = LynxCache(2, 70)
    InProcessLoader(data, Q(), residual_after_steps=3).attach(cache)
    assert cache.anchors_ready() and not cache.residual_ready()
    cache.set_tier("anchor")
    k_anchor = cache.layers[0].keys.clone()
    assert cache.get_seq_length() == 70 and cache.get_mask_sizes(4, 0) == (74, 0)
    for layer in (0, 1):
        cache.update(torch.ones(2, 3, 5, 16), torch.ones(2, 3, 5, 16), layer)
    assert cache.layers[0].get_seq_length() == 75
    cache.notify_drafted(3)
    assert cache.residual_ready()
    cache.set_tier("full")
    s = encode_layers(data[:1], Q())[0][0]
    assert torch.equal(cache.layers[0].keys[:, :, :70], decode(s, "full"))
    assert not torch.equal(k_anchor, cache.layers[0].keys[:, :, :70])
    assert torch.equal(cache.layers[0].keys[:, :, 70:], torch.ones(2, 3, 5, 16))  # tail kept in place
    cache.crop(-5)
    assert cache.layers[0].get_seq_length() == 70
    with pytest.raises(ValueError, match="prompt"):
        cache.crop(-1)


def test_batch_select_and_reorder():
    cache = LynxCache(2, 70)
    InProcessLoader(kv(), Q(), None).attach(cache)
    cache.set_tier("full")
    full = cache.layers[1].values.clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.layers[1].values, full.flip(0))
    cache.batch_select_indices(torch.tensor([0]))
    assert cache.layers[1].values.shape[0] == 1
    cache.set_tier("anchor")  # codes were selected too
    assert cache.layers[1].values.shape[0] == 1


def test_segments_are_checked():
    data = encode_layers(kv(L=1), Q())
    cache = LynxCache(1, 70)
    sk, sv = data[0]
    with pytest.raises(ValueError, match="before its anchor"):
        cache.put_residual(0, "key", 0, sk.residual)
    cache.put_anchor(0, "key", 0, anchor_only(sk))
    with pytest.raises(ValueError, match="duplicate"):
        cache.put_anchor(0, "key", 0, anchor_only(sk))
    with pytest.raises(ValueError, match="outside"):
        cache.put_anchor(0, "value", 10, anchor_only(sv))
    with pytest.raises(ValueError, match="residual shape"):
        cache.put_residual(0, "key", 0, sk.residual[:, :, :3])
    with pytest.raises(ValueError, match="layer"):
        cache.put_anchor(5, "key", 0, anchor_only(sk))


def test_readiness_from_another_thread_and_failures():
    data = encode_layers(kv(L=1), Q())
    cache = LynxCache(1, 70, timeout_s=5)
    go, anchors_seen = threading.Event(), threading.Event()

    def feed():
        go.wait(5)
        cache.put_anchor(0, "key", 0, anchor_only(data[0][0]))
        cache.put_anchor(0, "value", 0, anchor_only(data[0][1]))
        anchors_seen.wait(5)
        cache.fail(ConnectionError("peer vanished mid-residual"))

    threading.Thread(target=feed).start()
    assert not cache.anchors_ready()  # non-blocking
    go.set()
    cache.wait_anchors()
    anchors_seen.set()
    with pytest.raises(LoaderError, match="peer vanished"):
        cache.wait_residual()
    with pytest.raises(LoaderError):
        cache.residual_ready()


def test_wait_times_out_with_a_clear_error():
    cache = LynxCache(1, 8, timeout_s=0.3)
    t = time.monotonic()
    with pytest.raises(LoaderError, match="timed out"):
        cache.wait_anchors()
    assert time.monotonic() - t < 3


def test_bandwidth_schedule_sends_anchor_first():
    cache = LynxCache(2, 70)
    InProcessLoader(kv(), Q(), bandwidth_bps=16e6).attach(cache)
    cache.wait_anchors(timeout=10)
    cache.wait_residual(timeout=10)
    kinds = [e[1] for e in cache.trace.events]
    assert kinds == ["anchor"] * 4 + ["residual"] * 4


def test_sliding_layer_holds_its_window_and_says_so_in_the_mask_sizes():
    data = [(torch.randn(1, 3, 70, 16), torch.randn(1, 3, 70, 16)),
            (torch.randn(1, 3, 16, 16), torch.randn(1, 3, 16, 16))]  # layer 1: sliding window 16 → last 16 positions
    cache = LynxCache(2, 70, Q(method="identity"), sliding_windows=[None, 16])
    full, sliding = cache.layers
    assert (sliding.window, sliding.offset, sliding.is_sliding) == (16, 54, True) and full.offset == 0
    # before the first forward the prompt's last position is left for generate() to re-run
    assert (cache.get_seq_length() == 69 and cache.get_mask_sizes(1, 1) == (16, 54)
            and cache.get_mask_sizes(1, 0) == (70, 0))
    with pytest.raises(ValueError, match=r"outside the layer's prompt KV \[54, 70\)"):
        cache.put_anchor(1, "key", 0, encode_layers([data[0]], Q(method="identity"))[0][0])
    InProcessLoader(data, Q(method="identity")).attach(cache)
    cache.set_tier("full")
    assert cache.get_seq_length() == 70 and cache.get_mask_sizes(3, 1) == (19, 54)
    assert torch.equal(sliding.keys, data[1][0])
    cache.update(torch.ones(1, 3, 3, 16), torch.ones(1, 3, 3, 16), 1)
    assert sliding.get_seq_length() == 73 and sliding.get_mask_sizes(1) == (20, 54)
    sliding.crop(-2)
    assert sliding.get_seq_length() == 71
    with pytest.raises(ValueError, match="prompt"):
        sliding.crop(-2)
    with pytest.raises(ValueError, match="negative"):
        sliding.crop(3)


def test_plain_forward_reruns_the_prompts_last_position_once():
    data = kv(L=1, B=1)
    cache = LynxCache(1, 70, Q(method="identity"))
    InProcessLoader(data, Q(method="identity"), residual_after_steps=2).attach(cache)
    with pytest.warns(UserWarning, match="custom_generate"):
        k, v = cache.update(torch.zeros(1, 3, 2, 16), torch.ones(1, 3, 2, 16), 0)  # positions 69 (re-run) and 70
    assert (k.shape[2] == 71 and torch.equal(k[:, :, :70], data[0][0])
            and torch.equal(v[:, :, 70:], torch.ones(1, 3, 1, 16)))
    with pytest.raises(ValueError, match="num_beams"):
        cache.update(torch.zeros(2, 3, 1, 16), torch.zeros(2, 3, 1, 16), 0)


def test_prefill_logits_are_checked():
    cache = LynxCache(1, 8)
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        cache.put_logits(torch.zeros(5))
    with pytest.raises(ValueError, match="NaN"):
        cache.put_logits(torch.tensor([[0.0, float("nan")]]))
    cache.put_logits(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="duplicate"):
        cache.put_logits(torch.zeros(1, 4))
    assert cache.wait_logits(timeout=0.1).shape == (1, 4)
    with pytest.raises(LoaderError, match="timed out"):
        LynxCache(1, 8).wait_logits(timeout=0.2)


def test_overlapping_segments_are_refused():
    """Coverage is a set of disjoint intervals: [0, 2) + [1, 3) of a 4-token prompt is not 'complete'."""
    x = encode_layers([(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4))], Q(method="identity"))[0][0]
    cache = LynxCache(1, 4, Q(method="identity"))
    cache.put_anchor(0, "key", 0, x)
    with pytest.raises(ValueError, match=r"overlaps \[0, 2\)"):
        cache.put_anchor(0, "key", 1, x)
    cache.put_anchor(0, "key", 2, x)
    assert cache.layers[0].store.covered("key") == 4


def test_a_used_cache_is_freed_by_reference_counting(model_and_tok):
    """No cache ↔ loader cycle survives a request: with the cyclic collector off, a dropped cache is gone (before
    the fix, each evaluation question left its KV to the collector and memory grew ~40 MB per 1K-token question)."""
    import gc
    import weakref

    import lynx_hf

    model, tok = model_and_tok
    ids = tok("The quick brown fox jumps over the lazy dog, and then", return_tensors="pt").input_ids
    gc.collect()
    gc.disable()
    try:
        for how in ("pinned", "speculative", "bandwidth"):
            kw = {"bandwidth_bps": 1e9} if how == "bandwidth" else {"residual_after_steps": 2}
            cache, _ = LynxCache.from_prefill(model, ids, **kw)
            if how == "pinned":
                model.generate(ids, cache=cache.pin_tier("full"), max_new_tokens=3, do_sample=False)
            else:
                model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=3,
                               do_sample=False)
            ref = weakref.ref(cache)
            del cache
            for _ in range(50):  # a simulated link's thread notices the stop within its pacing interval
                if ref() is None:
                    break
                time.sleep(0.01)
            assert ref() is None, how
    finally:
        gc.enable()


def test_the_receiver_keeps_putting_while_a_tier_is_materialised(monkeypatch):
    """Dequantization runs outside the cache's lock: while set_tier is inside a (held) dequantization, the loader's
    thread stores the whole residual. Scripted with events; on a lock held throughout, the puts would block."""
    import lynx_hf.cache.layer as layer_mod

    data = encode_layers(kv(L=2), Q())
    cache = LynxCache(2, 70)
    for i, (sk, sv) in enumerate(data):
        cache.put_anchor(i, "key", 0, anchor_only(sk))
        cache.put_anchor(i, "value", 0, anchor_only(sv))
    inside, release = threading.Event(), threading.Event()
    real = layer_mod.dequantize

    def held(seg, tier, **kw):
        inside.set()
        release.wait(10)
        return real(seg, tier, **kw)

    monkeypatch.setattr(layer_mod, "dequantize", held)
    tier = threading.Thread(target=cache.set_tier, args=("anchor",))
    tier.start()
    assert inside.wait(10)

    def put_residuals():
        for i, (sk, sv) in enumerate(data):
            cache.put_residual(i, "key", 0, sk.residual)
            cache.put_residual(i, "value", 0, sv.residual)

    receiver = threading.Thread(target=put_residuals)
    receiver.start()
    receiver.join(10)
    done_while_held = not receiver.is_alive() and cache.residual_ready()
    release.set()
    tier.join(10)
    assert done_while_held and cache.layers[1].tier == "anchor"


def test_codes_cross_devices_and_dequantized_kv_does_not(monkeypatch):
    """The network path's tensors arrive on the host; a cache on another device (here `meta`, the stand-in for a
    GPU) stages the codes and metadata there as they are stored, and dequantizes on that device into its own
    buffers: no floating-point tensor of the KV's size crosses devices."""
    import lynx_hf.cache.layer as layer_mod

    data = kv(L=2, B=1)
    splits = encode_layers(data, Q())
    cache = LynxCache(2, 70, device="meta")
    crossings = []
    real_to = torch.Tensor.to

    def spy_to(self, *a, **k):
        out = real_to(self, *a, **k)
        if out.device != self.device:
            crossings.append((self.dtype, self.numel()))
        return out

    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    for i, (sk, sv) in enumerate(splits):
        for kind, s in (("key", sk), ("value", sv)):
            cache.put_anchor(i, kind, 0, anchor_only(s))
            cache.put_residual(i, kind, 0, s.residual)
    seg = cache.layers[0].store.segments["key"][0]
    assert seg.anchor.device.type == seg.residual.device.type == "meta"
    dequantized = []
    monkeypatch.setattr(layer_mod, "dequantize", lambda seg, tier, out: dequantized.append(
        (seg.anchor.device.type, out.device.type)) or out)
    cache.set_tier("full")
    kv_numel = data[0][0].numel()
    assert crossings and all(dt == torch.uint8 or n < kv_numel // 8 for dt, n in crossings)  # codes, small meta
    assert sum(n for dt, n in crossings if dt == torch.uint8) == sum(
        s.anchor.numel() + s.residual.numel() for pair in splits for s in pair)
    assert dequantized == [("meta", "meta")] * 4 and cache.layers[0].keys.device.type == "meta"
    assert cache.nbytes("staged") == sum(s.nbytes("full") for pair in splits for s in pair)


def test_batch_maps_refuse_while_the_residual_streams():
    cache = LynxCache(2, 70)
    InProcessLoader(kv(), Q(), residual_after_steps=3).attach(cache)
    cache.set_tier("anchor")
    with pytest.raises(ValueError, match="residual is still streaming"):
        cache.batch_select_indices(torch.tensor([0]))


def test_drafting_settings_belong_to_the_generate_call_not_the_cache():
    """The cache stores; speculative_generate is told its settings: the old keyword is refused with the new place."""
    from lynx_hf import SpecConfig

    with pytest.raises(TypeError, match=r"generate\(.*spec_config=SpecConfig"):
        LynxCache(1, 8, spec_config=SpecConfig())
    assert not hasattr(LynxCache(1, 8), "spec_config")
