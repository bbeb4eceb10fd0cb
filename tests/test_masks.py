"""The engine's own attention masks (lynx_hf.engine.masks) against brute force: per layer type, a full layer sees
what `vis` allows; a sliding layer holds keys from its offset on and sees only keys less than W positions back;
`sdpa` takes booleans, `eager` an additive float mask. Exact (booleans and 0 / finfo.min)."""
from types import SimpleNamespace

import pytest
import torch

from lynx_hf import LynxCache
from lynx_hf.engine.masks import layer_masks


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_full_and_sliding_layers_with_padding_holes_and_a_tree(impl):
    P, W, B, q = 12, 5, 2, 3
    cache = LynxCache(2, P, sliding_windows=[None, W])        # layer 1 holds the last 5 prompt positions
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation=impl))
    g = torch.Generator().manual_seed(0)
    K = P + 4 + q
    vis = torch.rand(B, q, K, generator=g) < 0.7             # padding, holes, tree ancestry: any pattern
    k_pos = torch.cumsum(torch.rand(B, K, generator=g) < 0.8, 1)  # logical positions skip over holes
    q_pos = k_pos[:, -q:]
    m = layer_masks(model, cache.layers, cache.dtype, vis, q_pos, k_pos)
    assert set(m) == {"full_attention", "sliding_attention"}
    off = P - W
    for kind, offset, window in (("full_attention", 0, None), ("sliding_attention", off, W)):
        got = m[kind]
        assert got.shape == (B, 1, q, K - offset)
        want = torch.zeros(B, 1, q, K - offset, dtype=torch.bool)
        for b in range(B):
            for i in range(q):
                for j in range(offset, K):
                    near = window is None or int(q_pos[b, i]) - int(k_pos[b, j]) < window
                    want[b, 0, i, j - offset] = bool(vis[b, i, j]) and near
        if impl == "sdpa":
            assert torch.equal(got, want)
        else:
            assert got.dtype == cache.dtype and torch.equal(got == 0, want)
            assert torch.equal(got[~want], torch.full_like(got[~want], torch.finfo(cache.dtype).min))


def test_one_layer_type_gives_one_mask():
    cache = LynxCache(3, 8)
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    vis = torch.ones(1, 2, 10, dtype=torch.bool)
    pos = torch.arange(10)[None]
    m = layer_masks(model, cache.layers, cache.dtype, vis, pos[:, -2:], pos)
    assert isinstance(m, torch.Tensor) and m.shape == (1, 1, 2, 10) and bool(m.all())


def test_masked_passes_skip_the_kv_copies_and_give_the_same_logits():
    """A tree pass (4D mask, several query rows) on a GQA model: with `masked_gqa` Transformers' sdpa takes the mask
    with enable_gqa instead of copying K/V per query head; logits within 1e-5 of the copying path."""
    from contextlib import nullcontext

    import transformers as tf
    from transformers import DynamicCache

    from lynx_hf.engine import masks

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=72, intermediate_size=96,
                                               num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                                               head_dim=8)).eval()
    calls = []
    real = tf.integrations.sdpa_attention.use_gqa_in_sdpa
    ids = torch.randint(0, 64, (1, 20))
    vis = torch.rand(1, 6, 26, generator=torch.Generator().manual_seed(1)) < 0.7
    vis[:, :, :20] = True
    mask = vis[:, None]
    out = []
    for on in (False, True):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache)
        with masks.masked_gqa(model, ids.device) if on else nullcontext():
            calls.append(real(mask, torch.zeros(1, 3, 26, 8), torch.zeros(1, 3, 26, 8)))
            out.append(model(input_ids=ids[:, :6], cache=cache, attention_mask=mask,
                             position_ids=torch.arange(20, 26)[None]).logits)
    assert calls == [False, True]
    torch.testing.assert_close(out[1], out[0], atol=1e-5, rtol=0)
