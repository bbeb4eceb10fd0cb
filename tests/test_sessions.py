"""Conversations on one LynxCache: a later generate continues what the cache holds exactly as Transformers continues
its own caches (one DynamicCache passed to every turn), a contradiction is refused by position (or cropped and
recomputed when asked), a turn with no new token re-runs the last one, deepcopy branches, batches are refused with
the way out, and a turn whose new KV streams in (anchor first) equals the same KV decoded without drafts. Tiny
random models with weights ×3 (greedy has no near-ties); the lossless codec where equality with Transformers'
own pattern is asserted, the test-only noisy anchor where drafts must really be verified."""
import copy
import warnings

import pytest
import torch
import transformers as tf
from transformers import DynamicCache

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig as Q, SpecConfig
from reference import noisy_anchor

V = 128
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, eos_token_id=1, pad_token_id=0, bos_token_id=2,
            tie_word_embeddings=False)
KW = dict(max_new_tokens=8, do_sample=False)
SPEC = dict(custom_generate=lynx_hf.speculative_generate)
IDENT = Q(method="identity")
MODELS = {"llama": (tf.LlamaConfig, {}), "mistral-sliding-8": (tf.MistralConfig, {"sliding_window": 8}),
          "gemma2-mixed": (tf.Gemma2Config, {"sliding_window": 8, "head_dim": 16})}


def build(name="llama"):
    cls, extra = MODELS[name]
    torch.manual_seed(0)
    m = tf.AutoModelForCausalLM.from_config(cls(**{**BASE, **extra})).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0)
    return m


def toks(n, seed):
    return torch.randint(3, V, (1, n), generator=torch.Generator().manual_seed(seed))


def hf_turns(m, turns):
    """Transformers' own multi-turn pattern: one DynamicCache passed to every turn, the whole chat each time."""
    dc, ids, outs = DynamicCache(config=m.config), None, []
    for new in turns:
        ids = new if ids is None else torch.cat([outs[-1], new], 1)
        outs.append(m.generate(ids, cache=dc, **KW))
    return outs


def lynx_turns(m, turns, custom=True, cfg=IDENT):
    cache, outs = None, []
    for new in turns:
        ids = new if cache is None else torch.cat([outs[-1], new], 1)
        if cache is None:
            cache, _ = LynxCache.from_prefill(m, ids, quant_config=cfg, residual_after_steps=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs.append(m.generate(ids, cache=cache, **(SPEC if custom else {}), **KW))
    return outs, cache


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("custom", [True, False], ids=["custom_generate", "plain"])
def test_three_turns_equal_transformers_multi_turn_pattern(name, custom):
    m = build(name)
    turns = [toks(20, 1), toks(9, 2), toks(13, 3)]
    ref = hf_turns(m, turns)
    got, cache = lynx_turns(m, turns, custom)
    assert [o.tolist() for o in got] == [r.tolist() for r in ref]
    assert cache.conversation.turns == 3
    assert cache.held_ids.tolist()[0] == got[-1][0, :-1].tolist()  # every token but the last reply's last one


def test_the_held_prefix_is_not_recomputed():
    """Turn 2 runs only the new positions through the model (Transformers' slicing, on the cache's own length)."""
    m = build()
    seen = []
    m.register_forward_pre_hook(lambda mod, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    ids = toks(20, 1)
    for custom in (SPEC, {}):
        c, _ = LynxCache.from_prefill(m, ids, quant_config=IDENT, residual_after_steps=0)
        o1 = m.generate(ids, cache=c, **SPEC, **KW)
        seen.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m.generate(torch.cat([o1, toks(9, 2)], 1), cache=c, **custom, **KW)
        assert seen[0] == 10  # the last reply token + 9 new ones
        assert max(seen) == 10


def test_a_contradicting_turn_is_refused_by_position_or_cropped():
    m = build()
    ids = toks(24, 6)
    cache, _ = LynxCache.from_prefill(m, ids, quant_config=IDENT, residual_after_steps=2)
    o1 = m.generate(ids, cache=cache, **SPEC, **KW)
    bad = torch.cat([o1, toks(10, 7)], 1)
    bad[0, 5] = 3 + (int(bad[0, 5]) - 2) % (V - 3)
    for custom in (SPEC, {}):
        with pytest.raises(ValueError, match=r"position 5 is token .* cache.on_mismatch = .crop."):
            m.generate(bad, cache=cache, **custom, **KW)
    assert cache.held_ids.shape[1] == o1.shape[1] - 1  # a refused turn leaves the cache as it was
    cache.on_mismatch = "crop"
    out = m.generate(bad, cache=cache, **SPEC, **KW)
    assert out.tolist() == m.generate(bad, **KW).tolist()  # recomputed from position 5 on: a fresh generate's output


def test_a_turn_without_a_new_token_re_runs_the_last_one():
    """Transformers re-feeds the whole prompt there and grows its cache; the LynxCache drops back to L - 1 and
    re-runs the last token: the output of a fresh generate on those ids."""
    m = build()
    ids = toks(24, 8)
    cache, _ = LynxCache.from_prefill(m, ids, quant_config=IDENT, residual_after_steps=2)
    o1 = m.generate(ids, cache=cache, **SPEC, **KW)
    for custom in (SPEC, {}):
        for again in (o1[:, :-1], o1[:, :30]):  # exactly what it holds; a prefix of it
            out = m.generate(again, cache=cache, **custom, **KW)
            assert out.tolist() == m.generate(again, **KW).tolist()


def test_deepcopy_branches_independently_and_a_fresh_prefix_serves_many():
    m = build()
    system, a, b = toks(24, 3), toks(9, 4), toks(12, 5)
    cache, _ = LynxCache.from_prefill(m, system, quant_config=IDENT, residual_after_steps=2)
    o1 = m.generate(system, cache=cache, **SPEC, **KW)
    fork = copy.deepcopy(cache)
    oa = m.generate(torch.cat([o1, a], 1), cache=cache, **SPEC, **KW)
    ob = m.generate(torch.cat([o1, b], 1), cache=fork, **KW)  # the plain path on the branch
    assert oa.tolist() == m.generate(torch.cat([o1, a], 1), **KW).tolist()
    assert ob.tolist() == m.generate(torch.cat([o1, b], 1), **KW).tolist()
    # a system prompt prefilled once (never generated on): each copy serves its own conversation
    base, _ = LynxCache.from_prefill(m, system, quant_config=IDENT)
    for user in (a, b):
        ids = torch.cat([system, user], 1)
        assert m.generate(ids, cache=copy.deepcopy(base), **SPEC, **KW).tolist() == m.generate(ids, **KW).tolist()


def test_deepcopy_and_continuation_are_refused_mid_generation_and_after_a_failure():
    m = build()
    ids = toks(20, 9)
    cache, _ = LynxCache.from_prefill(m, ids, quant_config=IDENT, residual_after_steps=0)

    class Boom(tf.StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            with pytest.raises(ValueError, match="in use by a generate call"):
                copy.deepcopy(cache)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        m.generate(ids, cache=cache, stopping_criteria=tf.StoppingCriteriaList([Boom()]), **SPEC, **KW)
    with pytest.raises(ValueError, match="failed part-way"):
        m.generate(ids, cache=cache, **SPEC, **KW)


def test_batch_continuation_is_refused_with_the_way_out():
    m = build()
    ids = torch.cat([toks(20, 10), toks(20, 11)])
    cache, _ = LynxCache.from_prefill(m, ids, quant_config=IDENT, residual_after_steps=0)
    out = m.generate(ids, cache=cache, **SPEC, **KW)
    nxt = torch.cat([out, toks(4, 12).expand(2, -1)], 1)
    for custom in (SPEC, {}):
        with pytest.raises(ValueError, match=r"one row: continue each row on its own cache"):
            m.generate(nxt, cache=cache, **custom, **KW)
    # the way out it names: one row per cache
    row = copy.deepcopy(cache)
    row.batch_select_indices(torch.tensor([1]))
    got = m.generate(nxt[1:], cache=row, **SPEC, **KW)
    assert got.tolist() == m.generate(nxt[1:], **KW).tolist()


@pytest.mark.parametrize("name", ["llama", "mistral-sliding-8"])
@pytest.mark.parametrize("after", [0, 3, 40])
def test_a_streamed_turn_with_drafts_equals_it_without(name, after):
    """add_turn ships only the new range (anchor first, the residual after `after` draft steps) behind the held
    prefix: drafting on prefix + noisy anchor, then verifying, gives the tokens of the same KV without drafts."""
    m = build(name)
    turns = [toks(30, 13), toks(25, 14), toks(17, 15)]
    outs = {}
    with noisy_anchor():
        for steps in (0, 64):
            spec = SpecConfig(max_draft_steps=steps)
            cache, _ = LynxCache.from_prefill(m, turns[0], quant_config=IDENT, residual_after_steps=after)
            o, res = m.generate(turns[0], cache=cache, **SPEC, spec_config=spec, max_new_tokens=10, do_sample=False), []
            for new in turns[1:]:
                ids = torch.cat([o, new], 1)
                cache.add_turn(m, ids, residual_after_steps=after)
                o = m.generate(ids, cache=cache, **SPEC, spec_config=spec, max_new_tokens=10, do_sample=False)
                res.append((o.tolist(), cache.stats.drafted, cache.stats.held_tokens))
            outs[steps] = res
    assert [r[0] for r in outs[0]] == [r[0] for r in outs[64]]
    assert all(r[1] == 0 for r in outs[0])
    if after:
        assert all(r[1] > 0 for r in outs[64])  # drafts really ran on the new range's anchor
    assert all(r[2] > 30 for r in outs[64])    # each turn held the conversation so far


def test_a_streamed_turn_ships_only_its_new_positions():
    m = build()
    ids1 = toks(40, 16)
    cache, _ = LynxCache.from_prefill(m, ids1, quant_config=Q(method="int8"), residual_after_steps=0)
    per_token = cache.nbytes() / 40
    o = m.generate(ids1, cache=cache, **SPEC, **KW)
    ids = torch.cat([o, toks(20, 17)], 1)
    cache.add_turn(m, ids)
    new = ids.shape[1] - cache.stats.held_tokens
    assert new == 21  # the last reply token (its KV was never computed) and 20 new ones
    assert cache.nbytes() == pytest.approx(per_token * new, rel=0.05)


def test_the_plain_path_checks_the_whole_prompt_not_its_last_token():
    """Before: plain generate compared only the prompt's last token and the mask; a prompt of the same length that
    shares that token reused the other prompt's KV silently."""
    m = build()
    ids = toks(24, 20)
    other = ids.clone()
    other[0, 3] = 3 + (int(other[0, 3]) - 2) % (V - 3)  # same length, same last token
    cache, _ = LynxCache.from_prefill(m, ids, quant_config=IDENT, residual_after_steps=0)
    with pytest.raises(ValueError, match="another prompt than the one this LynxCache was prefilled with"):
        m.generate(other, cache=cache, **KW)
    with pytest.raises(ValueError, match="holds a 24-token prompt"):
        m.generate(ids[:, :20], cache=cache, **KW)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert m.generate(ids, cache=cache, **KW).tolist() == m.generate(ids, **KW).tolist()  # still usable
