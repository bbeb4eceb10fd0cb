"""Lossless speculative generation inside model.generate, on the real default model (greedy and every deterministic
option, token for token) and on a tiny random MHA model (sampling, first token included, statistically)."""
import io
import os

import pytest
import torch
import transformers as tf
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig as Q, SpecConfig
from lynx_hf.local import prefill
from reference import full_tier_greedy

N_NEW = 24


def lynx_generate(model, ids, kv, logits, cfg, after, max_new_tokens=N_NEW, **kw):
    cache = LynxCache.from_kv(model, ids.shape[1], kv, logits, cfg, residual_after_steps=after)
    out = model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate,
                         max_new_tokens=max_new_tokens, **kw)
    return out[0, ids.shape[1]:].tolist(), cache.stats


def test_greedy_is_lossless_on_20_prompts(model_and_tok, eval_prompts):
    """Every prompt with the longest draft run (31 steps), and one of the other residual schedules in turn (none,
    1 and 5 draft steps: each on 6 or 7 of the 20 prompts)."""
    model, tok = model_and_tok
    cfg = Q()
    drafted = accepted = 0
    for i, ids in enumerate(eval_prompts):
        kv, logits = prefill(model, ids)
        ref = full_tier_greedy(model, ids.shape[1], kv, logits, cfg, N_NEW)[0]
        for after in ((0, 1, 5)[i % 3], 31):
            got, st = lynx_generate(model, ids, kv, logits, cfg, after, do_sample=False)
            assert got == ref[:len(got)] and (len(got) == N_NEW or got[-1] == tok.eos_token_id), (ids.shape, after)
            assert st["drafted"] == (0 if after == 0 else min(after, N_NEW - 1))
            drafted, accepted = drafted + st["drafted"], accepted + st["accepted"]
    assert drafted > 0 and 0 < accepted <= drafted


def test_every_option_equals_plain_generate_with_the_identity_codec(model_and_tok, shakespeare_ids):
    model, tok = model_and_tok
    ids = shakespeare_ids[:, :300]
    first = int(model.generate(ids, max_new_tokens=1, do_sample=False)[0, -1])
    options = {"greedy": {}, "suppress_tokens": {"suppress_tokens": [first]},
               "bad_words_ids": {"bad_words_ids": [[first]]},
               "repetition_penalty": {"repetition_penalty": 1.3}, "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
               "min_new_tokens": {"min_new_tokens": 3, "eos_token_id": first}}
    kv, logits = prefill(model, ids)
    for name, opt in options.items():
        plain = model.generate(ids, max_new_tokens=10, do_sample=False, **opt)[0, ids.shape[1]:].tolist()
        got, _ = lynx_generate(model, ids, kv, logits, Q(method="identity"), 0, 10, do_sample=False, **opt)
        assert got == plain, name
        drafted, st = lynx_generate(model, ids, kv, logits, Q(), 6, 10, do_sample=False, **opt)
        assert drafted == lynx_generate(model, ids, kv, logits, Q(), 0, 10, do_sample=False, **opt)[0], name
        assert st["drafted"] > 0
    assert got != lynx_generate(model, ids, kv, logits, Q(method="identity"), 0, 10, do_sample=False)[0]


def test_prompt_plus_first_token_form_still_works(model_and_tok, shakespeare_ids):
    model, _ = model_and_tok
    ids = shakespeare_ids[:, :300]
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    cache, first = LynxCache.from_prefill(model, ids, quant_config=Q(method="identity"), residual_after_steps=4)
    assert first.shape == (1, 1)
    out = model.generate(torch.cat([ids, first], -1), cache=cache, custom_generate=lynx_hf.speculative_generate,
                         max_new_tokens=11, do_sample=False)
    assert out.tolist() == plain.tolist()
    assert cache.stats["drafted"] == 0  # identity ships in one stream: nothing to draft on, plain decoding


def test_plain_generate_over_a_lynx_cache(model_and_tok, shakespeare_ids):
    model, _ = model_and_tok
    ids = shakespeare_ids[:, 100:400]
    plain = model.generate(ids, max_new_tokens=8, do_sample=False)
    cache, _ = LynxCache.from_prefill(model, ids, quant_config=Q(method="identity"), residual_after_steps=3)
    with pytest.warns(UserWarning, match="custom_generate=lynx_hf.speculative_generate"):
        out = model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False)
    assert out.tolist() == plain.tolist()


def test_streamers_see_every_generated_token(model_and_tok, shakespeare_ids):
    model, tok = model_and_tok
    ids = shakespeare_ids[:, :256]
    s = lynx_hf.SpeculativeStreamer()
    cache, _ = LynxCache.from_prefill(model, ids, residual_after_steps=5)
    out = model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=10,
                         do_sample=False, lynx_streamer=s)
    assert s.final == out[0, ids.shape[1]:].tolist() and len(s.final) == 10  # the first token included
    kinds = [e[0] for e in s.events]
    assert kinds.count("provisional") == 5 and "retract" in kinds and kinds[-1] == "end"
    # a standard Transformers streamer gets the prompt, then exactly the generated tokens

    c = Collect()
    cache, _ = LynxCache.from_prefill(model, ids, residual_after_steps=3)
    out = model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=6,
                         do_sample=False, lynx_streamer=c)
    assert c.puts[0] == ids[0].tolist() and c.puts[-1] == "end"
    assert sum(c.puts[1:-1], []) == out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("after", [0, 20])
def test_stop_strings_and_processors_apply_in_both_phases(model_and_tok, shakespeare_ids, after):
    from transformers import StopStringCriteria, StoppingCriteriaList

    model, tok = model_and_tok
    ids = shakespeare_ids[:, :256]
    kw = dict(max_new_tokens=20, do_sample=False, repetition_penalty=1.3)
    cache, _ = LynxCache.from_prefill(model, ids, residual_after_steps=None)  # full tier from the start
    ref = model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, **kw)[0, ids.shape[1]:]
    stop = tok.decode(ref).strip().split()[2]  # a word a few tokens in
    cache, _ = LynxCache.from_prefill(model, ids, residual_after_steps=after)
    out = model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate,
                         stopping_criteria=StoppingCriteriaList([StopStringCriteria(tok, [stop])]), **kw)
    got = out[0, ids.shape[1]:]
    assert got.tolist() == ref[:len(got)].tolist()  # same tokens: processors ran
    assert stop in tok.decode(got) and len(got) < 20  # stopped at the stop string, in either phase


def test_batch_with_left_padding(model_and_tok, shakespeare_ids):
    model, tok = model_and_tok
    a, b = shakespeare_ids[:, :200], shakespeare_ids[:, 500:640]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.full((2, 200), pad)
    ids[0], ids[1, 60:] = a[0], b[0]
    mask = torch.ones(2, 200, dtype=torch.long)
    mask[1, :60] = 0
    cache, _ = LynxCache.from_prefill(model, ids, attention_mask=mask, residual_after_steps=3)
    out = model.generate(ids, attention_mask=mask, cache=cache, custom_generate=lynx_hf.speculative_generate,
                         max_new_tokens=8, do_sample=False)
    for row, single in ((0, a), (1, b)):
        c1, _ = LynxCache.from_prefill(model, single, residual_after_steps=0)
        o1 = model.generate(single, cache=c1, custom_generate=lynx_hf.speculative_generate, max_new_tokens=8,
                            do_sample=False)
        assert out[row, 200:].tolist() == o1[0, single.shape[1]:].tolist()


def test_bad_calls_are_refused(model_and_tok, shakespeare_ids):
    model, _ = model_and_tok
    ids = shakespeare_ids[:, :64]
    cache, _ = LynxCache.from_prefill(model, ids)
    with pytest.raises(ValueError, match="prompt tokens"):
        model.generate(ids[:, :10], cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=2)
    with pytest.raises(ValueError, match="LynxCache"):
        model.generate(ids, custom_generate=lynx_hf.speculative_generate, max_new_tokens=2)
    model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=2)
    wrong = ids.clone()
    wrong[0, 7] = (int(wrong[0, 7]) + 1) % 1000
    with pytest.raises(ValueError, match="position 7 is token"):  # a turn that contradicts the held conversation
        model.generate(wrong, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=2)


def tiny_mha():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                      eos_token_id=None)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8)  # sharper, prompt-dependent distributions
    return m


@pytest.mark.slow  # a statistical test: thousands of samples
def test_sampling_follows_the_full_tier_distribution_on_an_mha_model():
    """Joint distribution of the first three tokens — the first sampled from the prefill's logits, the next two
    decided by verification — vs plain sampling with full-tier KV. Chi-square homogeneity with a 1e-3 critical
    value: fails spuriously once in a thousand runs at most."""
    from scipy.stats import chi2_contingency

    m = tiny_mha()
    ids = torch.randint(2, 12, (1, 40), generator=torch.Generator().manual_seed(1))
    cfg = Q(alpha=8.0)  # a coarse anchor: many drafts get rejected, so the rule is exercised
    kv, logits = prefill(m, ids)
    c = DynamicCache(config=m.config)
    for li, (k, v) in enumerate(kv):
        c.update(lynx_hf.quant.decode(lynx_hf.quant.encode(k, cfg, "key"), "full"),
                 lynx_hf.quant.decode(lynx_hf.quant.encode(v, cfg, "value"), "full"), li)
    N, gen = 1500, dict(do_sample=True, temperature=1.0, top_k=0)
    spec, ref = [], []
    for i in range(N):
        torch.manual_seed(10_000 + i)
        got, st = lynx_generate(m, ids, kv, logits, cfg, 2, 3, **gen)
        spec.append(tuple(got))
        torch.manual_seed(20_000 + i)  # reference: first token from the same logits, then full-tier KV
        probs = torch.softmax(logits.float(), -1)
        first = torch.multinomial(probs, 1)
        c.crop(ids.shape[1] - c.get_seq_length())
        out = m.generate(torch.cat([ids, first], -1), cache=c, max_new_tokens=2, **gen)
        ref.append(tuple(out[0, 40:43].tolist()))
    assert sum(1 for s in spec if s[0] != spec[0][0]) > 0  # the first token is sampled
    keys = sorted(set(spec) | set(ref))
    table = [[spec.count(k) for k in keys], [ref.count(k) for k in keys]]
    cols = [j for j in range(len(keys)) if table[0][j] + table[1][j] >= 10]  # pool sparse cells
    rest = [j for j in range(len(keys)) if j not in cols]
    t = [[row[j] for j in cols] + [sum(row[j] for j in rest)] for row in table]
    t = [[a for a, b in zip(t[0], t[1]) if a + b > 0], [b for a, b in zip(t[0], t[1]) if a + b > 0]]
    p = chi2_contingency(t)[1]
    assert p > 1e-3, (p, t)


def test_tree_drafts_are_kept_where_the_chain_loses_them(model_and_tok, eval_prompts):
    """Residual after 31 draft steps on the four longest many-shot MMLU-Pro prompts: same tokens either way; the
    tree (default) keeps most steps (measured 31, 12, 31, 31 against the chain's 3, 12, 25, 31), and at least what the
    chain keeps."""
    model, _ = model_and_tok
    runs = {"chain": SpecConfig(tree_width=1, tree_branch=1), "tree": SpecConfig()}
    accepted = {name: [] for name in runs}
    for ids in eval_prompts[::2][-4:]:
        kv, logits = prefill(model, ids)
        outs = {}
        for name, spec in runs.items():
            cache = LynxCache.from_kv(model, ids.shape[1], kv, logits, Q(), residual_after_steps=31)
            outs[name] = model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate,
                                        spec_config=spec, max_new_tokens=33, do_sample=False).tolist()
            accepted[name].append(cache.stats["accepted"])
            assert cache.stats["drafted"] == 31
        assert outs["chain"] == outs["tree"]
    print(accepted)
    assert sum(accepted["tree"]) >= max(sum(accepted["chain"]), 0.8 * 31 * 4), accepted


class Collect(BaseStreamer):
    """A plain Transformers streamer that records what it is given."""

    def __init__(self):
        self.puts = []

    def put(self, v):
        self.puts.append(v.reshape(-1).tolist())

    def end(self):
        self.puts.append("end")


class _Letters:
    """A tokenizer stand-in: token i is three letters a + i % 26, a space after every third token."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) * 3 + (" " if i % 3 == 0 else "") for i in ids)


class _Tty(io.StringIO):
    def isatty(self):
        return True


def _screen(raw: str, width: int) -> list[str]:
    """What a terminal `width` columns wide shows after `raw` (text, \\b, \\033[K, SGR codes; lines wrap)."""
    rows, r, c = [[]], 0, 0
    i = 0
    while i < len(raw):
        if raw.startswith("\033[K", i):
            del rows[r][c:]
            i += 3
            continue
        if raw.startswith("\033[", i):
            i = raw.index("m", i) + 1
            continue
        ch = raw[i]
        i += 1
        if ch == "\b":
            c = max(0, c - 1)
        elif ch == "\n":
            rows.append([])
            r, c = r + 1, 0
        else:
            if c == width:
                rows.append([])
                r, c = r + 1, 0
            rows[r][c:c + 1] = [ch]
            c += 1
    return ["".join(x) for x in rows]


@pytest.mark.parametrize("tty", [False, True])
def test_speculative_streamer_prints_each_verified_token_once(monkeypatch, tty):
    """48 tokens, drafts retracted and kept along the way, in an 80-column terminal: the screen holds the text once
    (before: a redraw with \\r cleared one screen line only, so a wrapped line left a copy per redraw); to a file or a
    pipe, the verified text and no escape sequence."""
    import shutil

    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback=None: os.terminal_size((80, 24)))
    out = _Tty() if tty else io.StringIO()
    s = lynx_hf.SpeculativeStreamer(_Letters(), file=out)
    s.put(torch.tensor([[1, 2, 3]]))  # the prompt: skipped
    toks = list(range(1, 300, 6))[:48]
    for k in range(0, 48, 4):
        s.put_provisional(torch.tensor(toks[k:k + 4] + [5, 5]))
        s.resolve_provisional(4)
        s.put(torch.tensor(toks[k:k + 4]))
    s.end()
    want = _Letters().decode(toks)
    if not tty:
        assert out.getvalue() == want + "\n"
        return
    assert "\r" not in out.getvalue()
    screen = _screen(out.getvalue(), 80)
    assert "".join(screen[:-1]) == want and screen[-1] == ""


def test_a_streamer_given_to_generate_gets_what_plain_generate_gives_it(tiny):
    """`lynx_streamer=` on the custom_generate path receives exactly the puts plain generate makes to its `streamer=`
    (the prompt, then one verified token per step, then end), drafts or not. (A `streamer=` given to generate stays
    with Transformers, which hands a callable custom_generate only its own parameters.)"""
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(0))
    plain_rec = Collect()
    tiny.generate(ids, max_new_tokens=6, do_sample=False, streamer=plain_rec)
    for after in (0, 2):
        cache, _ = LynxCache.from_prefill(tiny, ids, residual_after_steps=after)
        rec = Collect()
        tiny.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=6,
                      do_sample=False, lynx_streamer=rec)
        assert rec.puts == plain_rec.puts
    # a conversation's next turn: the streamer gets that turn's input (by Transformers), then its tokens
    out = tiny.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=6,
                        do_sample=False)
    nxt = torch.cat([out, ids[:, :5]], 1)
    want, got = Collect(), Collect()
    tiny.generate(nxt, max_new_tokens=4, do_sample=False, streamer=want)
    tiny.generate(nxt, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=4, do_sample=False,
                  lynx_streamer=got)
    assert got.puts == want.puts


def test_a_chat_uis_threaded_streamer_always_ends(tiny):
    """The usual chat UI: generate in a thread, a TextIteratorStreamer consumed in another. The consumer's loop ends
    after the verified text (before: it never ended), and also when generation fails (an error inside it)."""
    import threading

    from transformers import TextIteratorStreamer

    tok = _Letters()
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    want = tok.decode(tiny.generate(ids, max_new_tokens=8, do_sample=False)[0, 24:])

    def chat(fail: bool):
        cache, _ = LynxCache.from_prefill(tiny, ids, residual_after_steps=2)
        st = TextIteratorStreamer(tok, skip_prompt=True, timeout=30)
        kw = dict(cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=8, do_sample=False,
                  lynx_streamer=st)
        if fail:  # a stopping criterion that raises once three tokens are out: generation fails part-way
            class Boom(tf.StoppingCriteria):
                def __call__(self, input_ids, scores, **k):
                    if input_ids.shape[1] >= 27:
                        raise RuntimeError("boom")
                    return torch.zeros(input_ids.shape[0], dtype=torch.bool)

            kw["stopping_criteria"] = tf.StoppingCriteriaList([Boom()])
        errors = []
        th = threading.Thread(target=lambda: _catch(errors, lambda: tiny.generate(ids, **kw)), daemon=True)
        th.start()
        text = "".join(st)  # ends only when the streamer's end() is called
        th.join(30)
        return text, errors

    text, errors = chat(False)
    assert text == want and not errors
    text, errors = chat(True)
    assert want.startswith(text) and len(errors) == 1 and "boom" in str(errors[0])


def _catch(errors, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 — handed to the test
        errors.append(e)


def test_text_streamer_prints_the_verified_text(tiny, capsys):
    from transformers import TextStreamer

    tok = _Letters()
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(2))
    tiny.generate(ids, max_new_tokens=8, do_sample=False, streamer=TextStreamer(tok, skip_prompt=True))
    want = capsys.readouterr().out
    cache, _ = LynxCache.from_prefill(tiny, ids, residual_after_steps=3)
    tiny.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=8, do_sample=False,
                  lynx_streamer=TextStreamer(tok, skip_prompt=True))
    assert capsys.readouterr().out == want and want.strip()
