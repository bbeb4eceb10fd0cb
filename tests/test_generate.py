"""Lossless speculative generation inside model.generate, on the real default model (greedy, token for token) and
on a tiny random MHA model (sampling, statistically)."""
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig as Q
from lynx_hf.loader import InProcessLoader, prefill
from lynx_hf.quant import decode, encode

N_NEW = 24


def prompts(tok, shakespeare_ids):
    from lynx_hf.eval.data import eval_prompts

    return eval_prompts(tok, shakespeare_ids)


@torch.no_grad()
def full_tier_greedy(model, kv, first, n, cfg):
    c = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(kv):
        c.update(decode(encode(k, cfg, "key"), "full"), decode(encode(v, cfg, "value"), "full"), i)
    toks, nxt = [first], first
    for _ in range(n - 1):
        nxt = model(input_ids=nxt, cache=c, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        toks.append(nxt)
    return torch.cat(toks, 1)[0].tolist()


def lynx_generate(model, ids, kv, first, cfg, after, **kw):
    cache = LynxCache(len(kv), ids.shape[1], cfg, dtype=kv[0][0].dtype)
    InProcessLoader(kv, cfg, residual_after_tokens=after).attach(cache)
    out = model.generate(torch.cat([ids, first], -1), cache=cache, custom_generate=lynx_hf.speculative_generate,
                         max_new_tokens=N_NEW - 1, **kw)
    return out[0, ids.shape[1]:].tolist(), cache.stats


def test_greedy_is_lossless_on_20_prompts(model_and_tok, shakespeare_ids):
    model, tok = model_and_tok
    cfg = Q()
    drafted = accepted = 0
    for ids in prompts(tok, shakespeare_ids):
        kv, first = prefill(model, ids)
        ref = full_tier_greedy(model, kv, first, N_NEW, cfg)
        for after in (0, 1, 5, 31):
            got, st = lynx_generate(model, ids, kv, first, cfg, after, do_sample=False)
            assert got == ref[:len(got)] and (len(got) == N_NEW or got[-1] == tok.eos_token_id), (ids.shape, after)
            assert st["drafted"] == (0 if after == 0 else min(after, N_NEW - 1))
            drafted, accepted = drafted + st["drafted"], accepted + st["accepted"]
    assert drafted > 0 and 0 < accepted <= drafted


def test_from_prefill_api_and_identity_codec_equals_dynamic_cache(model_and_tok, shakespeare_ids):
    model, tok = model_and_tok
    ids = shakespeare_ids[:, :300]
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    cache, first = LynxCache.from_prefill(model, ids, quant_config=Q(method="identity"), residual_after_tokens=4)
    assert first.shape == (1, 1)
    out = model.generate(torch.cat([ids, first], -1), cache=cache, custom_generate=lynx_hf.speculative_generate,
                         max_new_tokens=11, do_sample=False)
    assert out.tolist() == plain.tolist()
    assert cache.stats["drafted"] == 0  # identity ships in one stream: nothing to draft on, plain decoding


def test_streamers_see_verified_and_provisional_tokens(model_and_tok, shakespeare_ids):
    model, tok = model_and_tok
    ids = shakespeare_ids[:, :256]
    s = lynx_hf.SpeculativeStreamer()
    cache, first = LynxCache.from_prefill(model, ids, residual_after_tokens=5)
    out = model.generate(torch.cat([ids, first], -1), cache=cache, custom_generate=lynx_hf.speculative_generate,
                         max_new_tokens=10, do_sample=False, lynx_streamer=s)
    assert s.final == out[0, ids.shape[1] + 1:].tolist()
    kinds = [e[0] for e in s.events]
    assert kinds.count("provisional") == 5 and "retract" in kinds and kinds[-1] == "end"
    # a standard Transformers streamer gets exactly the verified tokens
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.puts = []

        def put(self, v):
            self.puts.append(v.reshape(-1).tolist())

        def end(self):
            self.puts.append("end")

    c = Collect()
    cache, first = LynxCache.from_prefill(model, ids, residual_after_tokens=3)
    out = model.generate(torch.cat([ids, first], -1), cache=cache, custom_generate=lynx_hf.speculative_generate,
                         max_new_tokens=6, do_sample=False, lynx_streamer=c)
    assert c.puts[0] == out[0, :ids.shape[1] + 1].tolist() and c.puts[-1] == "end"
    assert sum(c.puts[1:-1], []) == out[0, ids.shape[1] + 1:].tolist()


@pytest.mark.parametrize("after", [0, 20])
def test_stop_strings_and_processors_apply_in_both_phases(model_and_tok, shakespeare_ids, after):
    model, tok = model_and_tok
    ids = shakespeare_ids[:, :256]
    kw = dict(max_new_tokens=20, do_sample=False, repetition_penalty=1.3)
    cache, first = LynxCache.from_prefill(model, ids, residual_after_tokens=None)  # full tier from the start
    ref = model.generate(torch.cat([ids, first], -1), cache=cache, custom_generate=lynx_hf.speculative_generate, **kw)
    text = tok.decode(ref[0, ids.shape[1] + 1:])
    stop = text.strip().split()[2]  # a word a few tokens in
    cache, first = LynxCache.from_prefill(model, ids, residual_after_tokens=after)
    from transformers import StopStringCriteria, StoppingCriteriaList

    out = model.generate(torch.cat([ids, first], -1), cache=cache, custom_generate=lynx_hf.speculative_generate,
                         stopping_criteria=StoppingCriteriaList([StopStringCriteria(tok, [stop])]), **kw)
    got = out[0, ids.shape[1] + 1:]
    assert got.tolist() == ref[0, ids.shape[1] + 1: ids.shape[1] + 1 + len(got)].tolist()  # same tokens: processors ran
    assert stop in tok.decode(got) and len(got) < 20  # stopped at the stop string, in either phase


def test_batch_with_left_padding(model_and_tok, shakespeare_ids):
    model, tok = model_and_tok
    a, b = shakespeare_ids[:, :200], shakespeare_ids[:, 500:640]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.full((2, 200), pad)
    ids[0], ids[1, 60:] = a[0], b[0]
    mask = torch.ones(2, 200, dtype=torch.long)
    mask[1, :60] = 0
    cache, first = LynxCache.from_prefill(model, ids, attention_mask=mask, residual_after_tokens=3)
    out = model.generate(torch.cat([ids, first], -1), attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], -1),
                         cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=8, do_sample=False)
    for row, single in ((0, a), (1, b)):
        c1, f1 = LynxCache.from_prefill(model, single, residual_after_tokens=0)
        o1 = model.generate(torch.cat([single, f1], -1), cache=c1, custom_generate=lynx_hf.speculative_generate,
                            max_new_tokens=8, do_sample=False)
        assert out[row, 200:].tolist() == o1[0, single.shape[1]:].tolist()


def test_bad_calls_are_refused(model_and_tok, shakespeare_ids):
    model, _ = model_and_tok
    ids = shakespeare_ids[:, :64]
    cache, first = LynxCache.from_prefill(model, ids)
    with pytest.raises(ValueError, match="prompt tokens plus"):
        model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=2)
    with pytest.raises(ValueError, match="LynxCache"):
        model.generate(ids, custom_generate=lynx_hf.speculative_generate, max_new_tokens=2)


def tiny_mha():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                      eos_token_id=None)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8)  # sharper, prompt-dependent distributions
    return m


def test_sampling_follows_the_full_tier_distribution_on_an_mha_model():
    """Distribution of (token 2, token 3) — both decided by verification — vs plain sampling with full-tier KV.
    Chi-square homogeneity with a 1e-3 critical value: fails spuriously once in a thousand runs at most."""
    from scipy.stats import chi2_contingency

    m = tiny_mha()
    ids = torch.randint(2, 12, (1, 40), generator=torch.Generator().manual_seed(1))
    cfg = Q(alpha=8.0)  # a coarse anchor: many drafts get rejected, so the rule is exercised
    kv, first = prefill(m, ids)
    N = 1500
    gen = dict(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=3)
    spec, ref = [], []
    for i in range(N):
        cache = LynxCache(2, 40, cfg)
        InProcessLoader(kv, cfg, residual_after_tokens=2).attach(cache)
        torch.manual_seed(10_000 + i)
        out = m.generate(torch.cat([ids, first], -1), cache=cache, custom_generate=lynx_hf.speculative_generate, **gen)
        spec.append(tuple(out[0, 41:43].tolist()))
        c = DynamicCache(config=m.config)
        for li, (k, v) in enumerate(kv):
            c.update(decode(encode(k, cfg, "key"), "full"), decode(encode(v, cfg, "value"), "full"), li)
        torch.manual_seed(20_000 + i)
        out = m.generate(torch.cat([ids, first], -1), cache=c, **gen)
        ref.append(tuple(out[0, 41:43].tolist()))
    keys = sorted(set(spec) | set(ref))
    table = [[spec.count(k) for k in keys], [ref.count(k) for k in keys]]
    cols = [j for j in range(len(keys)) if table[0][j] + table[1][j] >= 10]  # pool sparse cells
    rest = [j for j in range(len(keys)) if j not in cols]
    t = [[row[j] for j in cols] + [sum(row[j] for j in rest)] for row in table]
    t = [[a for a, b in zip(t[0], t[1]) if a + b > 0], [b for a, b in zip(t[0], t[1]) if a + b > 0]]
    p = chi2_contingency(t)[1]
    assert p > 1e-3, (p, t)


def test_greedy_lossless_on_a_tiny_mha_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    m = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)).eval()
    ids = torch.randint(0, 64, (1, 120), generator=torch.Generator().manual_seed(3))
    kv, first = prefill(m, ids)
    ref = full_tier_greedy(m, kv, first, 16, Q())
    for after in (0, 2, 9):
        cache = LynxCache(len(kv), ids.shape[1], Q())
        InProcessLoader(kv, Q(), residual_after_tokens=after).attach(cache)
        out = m.generate(torch.cat([ids, first], -1), cache=cache, custom_generate=lynx_hf.speculative_generate,
                         max_new_tokens=15, do_sample=False)
        assert out[0, ids.shape[1]:].tolist() == ref
        assert cache.stats["drafted"] == after
