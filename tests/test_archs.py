"""Exactness across architectures and generation options, on tiny random models built from a transformers config
(sharpened weights, so greedy has no near-ties): `generate(prompt, cache=LynxCache, custom_generate=...)` equals plain
`generate` with the identity codec, and full-tier greedy decoding with the default codec, whether or not drafts ran.
Sliding-window models get prompts longer than their window."""
import pytest
import torch
import transformers as tf

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig as Q
from lynx_hf.arch import layer_windows
from lynx_hf.local import prefill
from reference import full_tier_greedy

V, N = 128, 12
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=1, pad_token_id=0,
            bos_token_id=2, tie_word_embeddings=False)
ARCHS = {
    "llama": (tf.LlamaConfig, {}),
    "qwen2": (tf.Qwen2Config, {}),
    "qwen3": (tf.Qwen3Config, {}),
    "phi3": (tf.Phi3Config, {}),
    "mistral-sliding": (tf.MistralConfig, {"sliding_window": 8}),
    "gemma2": (tf.Gemma2Config, {"sliding_window": 8}),
    "gemma3": (tf.Gemma3TextConfig, {"sliding_window": 8}),
}


def build(arch, scale=3.0):
    cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    m = tf.AutoModelForCausalLM.from_config(cls(**{**BASE, **extra})).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    return m


def options(first: int) -> dict:
    """Each deterministic option, built around plain greedy's first token so that it changes the output."""
    return {"greedy": {}, "suppress_tokens": {"suppress_tokens": [first]},
            "bad_words_ids": {"bad_words_ids": [[first]]},
            "repetition_penalty": {"repetition_penalty": 1.8}, "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
            "min_new_tokens": {"min_new_tokens": 6, "eos_token_id": first}, "eos_first": {"eos_token_id": first}}


def lynx(model, ids, qc, after, **kw):
    cache, _ = LynxCache.from_prefill(model, ids, quant_config=qc, residual_after_steps=after)
    out = model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=N,
                         do_sample=False, **kw)
    return out, cache


@pytest.mark.parametrize("arch", ARCHS)
def test_identity_codec_equals_plain_generate_under_every_option(arch):
    model = build(arch)
    ids = torch.randint(3, V, (1, 40), generator=torch.Generator().manual_seed(1))
    first = int(model.generate(ids, max_new_tokens=1, do_sample=False)[0, -1])
    for name, opt in options(first).items():
        plain = model.generate(ids, max_new_tokens=N, do_sample=False, **opt)
        got, cache = lynx(model, ids, Q(method="identity"), 0, **opt)
        assert got.tolist() == plain.tolist(), (arch, name)
    if ARCHS[arch][1]:  # the sliding layers hold only their window's positions
        assert {l.window for l in cache.layers if l.is_sliding} == {8}


@pytest.mark.parametrize("arch", ARCHS)
def test_default_codec_equals_full_tier_greedy_with_and_without_drafts(arch):
    model = build(arch)
    ids = torch.randint(3, V, (1, 40), generator=torch.Generator().manual_seed(2))
    kv, logits = prefill(model, ids)
    ref = full_tier_greedy(model, ids.shape[1], kv, logits, Q(), N)
    first = ref[0][0]
    for after in (0, 5):
        got, cache = lynx(model, ids, Q(), after)
        assert got[:, ids.shape[1]:].tolist() == ref, (arch, after)
        assert cache.stats["drafted"] == after
    for name, opt in options(first).items():  # drafting never changes the output, whatever the option
        assert lynx(model, ids, Q(), 5, **opt)[0].tolist() == lynx(model, ids, Q(), 0, **opt)[0].tolist(), (arch, name)


@pytest.mark.parametrize("config", [tf.Llama4TextConfig(attention_chunk_size=8), tf.Qwen3NextConfig()],
                         ids=["chunked-attention", "linear-attention"])
def test_unsupported_layers_fail_at_once_with_one_clear_error(config):
    with pytest.raises(ValueError, match="supports full and sliding-window attention layers"):
        layer_windows(config)


def test_batch_with_left_padding_and_eos_as_one_rows_first_token():
    model = build("llama")
    a = torch.randint(3, V, (1, 30), generator=torch.Generator().manual_seed(2))
    b = torch.randint(3, V, (1, 24), generator=torch.Generator().manual_seed(3))
    eos = int(model.generate(b, max_new_tokens=1, do_sample=False)[0, -1])
    ids = torch.cat([a, torch.cat([torch.zeros(1, 6, dtype=torch.long), b], 1)], 0)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    kw = dict(attention_mask=mask, max_new_tokens=N, do_sample=False, eos_token_id=eos, pad_token_id=0)
    plain = model.generate(ids, **kw)
    assert plain[1, 30:].tolist() == [eos] + [0] * (N - 1)  # the case at hand: row 1 stops at its first token
    got = {}
    for name, qc, after in (("identity", Q(method="identity"), 0), ("lynx", Q(), 0), ("lynx, 4 drafts", Q(), 4)):
        cache, _ = LynxCache.from_prefill(model, ids, quant_config=qc, residual_after_steps=after, attention_mask=mask)
        got[name] = model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, **kw).tolist()
    assert got["identity"] == plain.tolist()
    assert got["lynx, 4 drafts"] == got["lynx"] and got["lynx"][1][30:] == plain[1, 30:].tolist()


def test_sampled_first_token_follows_the_options():
    """temperature=2 over a flat tiny model: the first token varies from run to run (it used to be the argmax)."""
    model = build("llama", scale=1.0)
    ids = torch.randint(3, V, (1, 32), generator=torch.Generator().manual_seed(4))
    cache0, _ = LynxCache.from_prefill(model, ids, quant_config=Q(method="identity"), residual_after_steps=0)
    kv, logits = prefill(model, ids)
    firsts = set()
    for s in range(40):
        cache = LynxCache.from_kv(model, ids.shape[1], kv, logits, Q(method="identity"), residual_after_steps=0)
        torch.manual_seed(s)
        out = model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=1,
                             do_sample=True, temperature=2.0, top_k=0)
        torch.manual_seed(s)
        plain = model.generate(ids, max_new_tokens=1, do_sample=True, temperature=2.0, top_k=0)
        assert out.tolist() == plain.tolist()  # same logits, same processors, same generator draw
        firsts.add(int(out[0, -1]))
    assert len(firsts) >= 10


def test_plain_generate_without_custom_generate_decodes_on_the_full_tier(recwarn):
    model = build("gemma3")
    ids = torch.randint(3, V, (1, 40), generator=torch.Generator().manual_seed(5))
    plain = model.generate(ids, max_new_tokens=N, do_sample=False, repetition_penalty=1.3)
    cache, _ = LynxCache.from_prefill(model, ids, quant_config=Q(method="identity"), residual_after_steps=3)
    got = model.generate(ids, cache=cache, max_new_tokens=N, do_sample=False, repetition_penalty=1.3)
    assert got.tolist() == plain.tolist()
    hints = [w for w in recwarn.list if "custom_generate=lynx_hf.speculative_generate" in str(w.message)]
    assert len(hints) == 1 and cache.layers[0].tier == "full" and cache.stats["drafted"] == 0


@pytest.mark.parametrize("kw", [{"num_beams": 2}, {"num_return_sequences": 2, "do_sample": True}])
def test_beams_and_multiple_sequences_are_one_clear_error(kw):
    model = build("llama")
    ids = torch.randint(3, V, (1, 20), generator=torch.Generator().manual_seed(6))
    for custom in ({"custom_generate": lynx_hf.speculative_generate}, {}):
        cache, _ = LynxCache.from_prefill(model, ids, residual_after_steps=0)
        with pytest.raises(ValueError, match="num_beams > 1 and num_return_sequences > 1"):
            model.generate(ids, cache=cache, max_new_tokens=4, **custom, **kw)


def test_scores_and_logits_match_plain_generate():
    """Token ids exactly; scores and raw logits within 1e-4 (the verify pass runs several positions in one forward,
    which reorders float sums), with the same -inf entries."""
    model = build("qwen3")
    ids = torch.randint(3, V, (1, 30), generator=torch.Generator().manual_seed(7))
    kw = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True,
              output_logits=True, repetition_penalty=1.5)
    plain = model.generate(ids, **kw)
    for after in (0, 3):
        cache, _ = LynxCache.from_prefill(model, ids, quant_config=Q(method="identity"), residual_after_steps=after)
        got = model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, **kw)
        assert got.sequences.tolist() == plain.sequences.tolist()
        assert len(got.scores) == len(got.logits) == len(plain.scores) == 8 and got.cache is cache
        for mine, theirs in [*zip(got.scores, plain.scores), *zip(got.logits, plain.logits)]:
            assert torch.equal(torch.isinf(mine), torch.isinf(theirs))
            fin = torch.isfinite(theirs)
            torch.testing.assert_close(mine[fin], theirs[fin], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tree", [True, False], ids=["tree", "chain"])
@pytest.mark.parametrize("arch", ["llama", "mistral-sliding", "gemma2", "gemma3"])
def test_ragged_batch_with_left_padding_and_sliding_windows(arch, tree):
    """A left-padded batch whose rows accept different numbers of drafts (the published +7 anchor on a tiny random
    model is often wrong): the holes this leaves in the shorter rows, the padding and the sliding windows all go
    through the engine's own masks, and every row equals decoding the same batch on the full tier without drafts."""
    model = build(arch)
    spec = None if tree else lynx_hf.SpecConfig(tree_width=1, tree_branch=1)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, V, (3, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5], mask[2, :11] = 0, 0
    ids = ids.masked_fill(mask == 0, 0)
    runs = {}
    for after in (0, 8):
        cache, _ = LynxCache.from_prefill(model, ids, Q(anchor="paper"), residual_after_steps=after,
                                          attention_mask=mask)
        out = model.generate(ids, attention_mask=mask, cache=cache, custom_generate=lynx_hf.speculative_generate,
                             spec_config=spec, max_new_tokens=N, do_sample=False)
        runs[after] = (out.tolist(), cache.stats["accepted_per_row"])
    assert runs[8][0] == runs[0][0]
    assert len(set(runs[8][1])) > 1, runs[8][1]  # the rows really accepted different numbers of drafts
