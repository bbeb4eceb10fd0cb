"""Every architecture and option either equals plain `generate` on the full-tier KV, token for token, or is refused
at once with one clear error. Drafting really happens and is verified: the test-only `noisy_anchor` codec gives an
anchor tier of KV plus noise and an exact full tier, so any difference from plain `generate` is Lynx's. Tiny random
models with weights ×3 (greedy has no near-ties)."""
import warnings

import pytest
import torch
import transformers as tf
from transformers import PreTrainedTokenizerFast, StoppingCriteria, SynthIDTextWatermarkingConfig

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig as Q, SpecConfig
from lynx_hf.engine.support import honours_tree_inputs
from reference import noisy_anchor

V, N, P = 128, 12, 40
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=1, pad_token_id=0,
            bos_token_id=2, tie_word_embeddings=False)
NO_HEAD_DIM = {"head_dim": None}
ARCHS = {
    "llama": (tf.LlamaConfig, {}),
    "deepseek-v3-mla": (tf.DeepseekV3Config, dict(head_dim=8, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16,
                                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                                                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  first_k_dense_replace=1, n_group=1, topk_group=1)),
    "mimo-v2-flash": (tf.MiMoV2FlashConfig, {}),
    "qwen3-moe": (tf.Qwen3MoeConfig, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "mixtral": (tf.MixtralConfig, dict(num_local_experts=4)),
    "gemma": (tf.GemmaConfig, {}),
    "gpt-neox": (tf.GPTNeoXConfig, {}),
    "falcon": (tf.FalconConfig, dict(new_decoder_architecture=True, num_kv_heads=2, **NO_HEAD_DIM)),
    "falcon-alibi": (tf.FalconConfig, dict(alibi=True, **NO_HEAD_DIM)),
    "bloom": (tf.BloomConfig, dict(n_head=4, n_layer=2)),
    "phi3-longrope": (tf.Phi3Config, dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                           "long_factor": [2.0] * 8, "rope_theta": 10000.0,
                                                           "original_max_position_embeddings": 64},
                                          max_position_embeddings=256, original_max_position_embeddings=64)),
    "llama-dynamic-rope": (tf.LlamaConfig, dict(max_position_embeddings=48, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
    "gpt-neo-local": (tf.GPTNeoConfig, dict(num_layers=2, num_heads=4, attention_types=[[["local"], 2]],
                                            window_size=4)),
    "mpt-alibi": (tf.MptConfig, dict(d_model=64, n_heads=4, n_layers=2)),
    "roformer": (tf.RoFormerConfig, dict(is_decoder=True)),
    "trocr": (tf.TrOCRConfig, dict(d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128)),
    "llama4-nope-temperature": (tf.Llama4TextConfig, dict(attention_chunk_size=None, no_rope_layer_interval=2,
                                                          num_local_experts=2, intermediate_size_mlp=128,
                                                          floor_scale=2, attn_scale=4.0,
                                                          layer_types=["full_attention"] * 2)),
    "roberta": (tf.RobertaConfig, dict(is_decoder=True, pad_token_id=1, eos_token_id=2)),
    "xlm-roberta": (tf.XLMRobertaConfig, dict(is_decoder=True, pad_token_id=1, eos_token_id=2)),
    "camembert": (tf.CamembertConfig, dict(is_decoder=True, pad_token_id=1, eos_token_id=2)),
    "data2vec-text": (tf.Data2VecTextConfig, dict(is_decoder=True, pad_token_id=1, eos_token_id=2)),
}
CHAIN = SpecConfig(tree_width=1, tree_branch=1)


def build(cls, scale=3.0, **kw):
    cfg = {k: v for k, v in {**BASE, **kw}.items() if v is not None}
    torch.manual_seed(0)
    m = tf.AutoModelForCausalLM.from_config(cls(**cfg)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    return m


def arch(name):
    cls, kw = ARCHS[name]
    return build(cls, **kw)


def prompt(seed=1, n=P, lo=3):
    return torch.randint(lo, V, (1, n), generator=torch.Generator().manual_seed(seed))


def lynx(model, ids, spec=None, after=6, mask=None, prefill_mask=None, **kw):
    """Lynx with drafts on a noisy anchor (residual after `after` draft steps), verified on the exact KV."""
    with noisy_anchor():
        cache, _ = LynxCache.from_prefill(model, ids, Q(method="identity"), residual_after_steps=after,
                                          attention_mask=prefill_mask)
        out = model.generate(ids, attention_mask=mask, cache=cache, custom_generate=lynx_hf.speculative_generate,
                             spec_config=spec, **{"max_new_tokens": N, "do_sample": False, **kw})
    return out, cache


def plain(model, ids, **kw):
    return model.generate(ids, **{"max_new_tokens": N, "do_sample": False, **kw})


@pytest.mark.parametrize("name", ARCHS)
def test_every_architecture_equals_plain_generate_with_tree_and_chain_drafts(name):
    model = arch(name)
    drafted = 0
    for seed in (1, 3):
        ids = prompt(seed)
        want = plain(model, ids, max_new_tokens=24).tolist()
        for spec in (None, CHAIN):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got, cache = lynx(model, ids, spec, max_new_tokens=24)
            assert got.tolist() == want, (name, seed, spec)
            drafted += cache.stats["drafted"]
    if name != "llama-dynamic-rope":  # past its original range: one-token passes only (below)
        assert drafted > 0


def test_the_probe_finds_the_models_that_ignore_positions_or_masks():
    verdict = {n: honours_tree_inputs(arch(n))[0] for n in ("llama", "deepseek-v3-mla", "falcon-alibi", "bloom",
                                                            "mpt-alibi", "roformer", "trocr", "gpt-neo-local",
                                                            "llama4-nope-temperature")}
    assert verdict == {"llama": True, "deepseek-v3-mla": True, "falcon-alibi": False, "bloom": False,
                       "mpt-alibi": False, "roformer": False, "trocr": False, "gpt-neo-local": False,
                       "llama4-nope-temperature": False}


def test_dynamic_rope_drafts_only_inside_its_original_range():
    model = arch("llama-dynamic-rope")                       # original range 48 positions
    inside, across = prompt(n=24), prompt(n=P)
    got, cache = lynx(model, inside, max_new_tokens=16)
    assert got.tolist() == plain(model, inside, max_new_tokens=16).tolist() and cache.stats["drafted"] > 0
    with pytest.warns(UserWarning, match="dynamic RoPE"):
        got, cache = lynx(model, across)
    assert got.tolist() == plain(model, across).tolist() and cache.stats["drafted"] == 0


def test_longrope_past_its_original_range_is_refused_at_once():
    model = arch("phi3-longrope")                            # generate recomputes the cache past 64 positions
    ids = prompt(n=60)
    with pytest.raises(ValueError, match="LongRoPE"):
        lynx(model, ids)


@pytest.mark.parametrize("opt", [{"guidance_scale": 1.5},
                                 {"watermarking_config": SynthIDTextWatermarkingConfig(keys=[7, 11, 13, 17],
                                                                                       ngram_len=3)}],
                         ids=["guidance", "synthid"])
def test_stateful_logits_processors_never_see_drafts(opt):
    model = arch("llama")
    ids = prompt()
    for spec in (None, CHAIN):
        with pytest.warns(UserWarning, match="must not see drafts"):
            got, cache = lynx(model, ids, spec, **opt)
        assert got.tolist() == plain(model, ids, **opt).tolist() and cache.stats["drafted"] == 0


class StopAtCall(StoppingCriteria):
    """Stops every row at its 6th call: state that unverified drafts must never advance."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores, **kw):
        self.calls += 1
        return torch.full((input_ids.shape[0],), self.calls >= 6, dtype=torch.bool)


@pytest.mark.parametrize("spec", [None, CHAIN], ids=["tree", "chain"])
def test_a_stateful_stopping_criterion_sees_verified_tokens_only(spec):
    model = arch("llama")
    ids = prompt()
    want = plain(model, ids, stopping_criteria=[StopAtCall()])
    got, cache = lynx(model, ids, spec, stopping_criteria=[StopAtCall()])
    assert got.tolist() == want.tolist() and want.shape[1] == P + 6 and cache.stats["drafted"] > 0


def test_pad_tokens_in_the_prompt_are_masked_as_generate_masks_them():
    model = arch("llama")                                    # pad 0, eos 1
    ids = prompt()
    ids[0, [5, 6, 17]] = 0
    got, _ = lynx(model, ids)                                # no mask anywhere: both infer it from the pad id
    assert got.tolist() == plain(model, ids).tolist()


def test_a_left_padded_batch_built_the_readme_way_equals_plain_generate():
    model = arch("llama")
    ids = torch.cat([prompt(2), torch.cat([torch.zeros(1, 7, dtype=torch.long), prompt(3, P - 7)], 1)])
    mask = (ids != 0).long()
    got, _ = lynx(model, ids, mask=mask)                     # from_prefill(model, input_ids): the mask is inferred
    assert got.tolist() == plain(model, ids, attention_mask=mask).tolist()


def test_another_prompt_or_mask_than_the_prefill_is_refused():
    model = arch("llama")
    ids, other = prompt(1), prompt(2)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    for custom in ({"custom_generate": lynx_hf.speculative_generate}, {}):
        for kw in ({"inputs": other}, {"inputs": ids, "attention_mask": mask}):
            cache, _ = LynxCache.from_prefill(model, ids, residual_after_steps=0)
            with pytest.raises(ValueError, match="another prompt than the one this LynxCache was prefilled with"):
                model.generate(cache=cache, max_new_tokens=4, do_sample=False, **custom, **kw)


def test_a_second_generate_on_the_same_prompt_re_runs_its_last_token():
    """A turn with no new token (the prompt again, after a generation): the cache drops what it holds past the
    prompt's last position and re-runs that one — plain generate's output again, never a grown cache."""
    model = arch("llama")
    ids = prompt()
    for custom in ({"custom_generate": lynx_hf.speculative_generate}, {}):
        cache, _ = LynxCache.from_prefill(model, ids, residual_after_steps=0)
        with pytest.raises(ValueError, match="another prompt"):   # refused before it ran: the cache stays usable
            model.generate(prompt(2), cache=cache, max_new_tokens=4, do_sample=False, **custom)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            first = model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False, **custom)
            again = model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False, **custom)
        assert again.tolist() == first.tolist() == model.generate(ids, max_new_tokens=4, do_sample=False).tolist()
        assert cache.held_ids.shape[1] == ids.shape[1] + 3


@pytest.mark.parametrize("opt", [{"penalty_alpha": 0.6, "top_k": 4}, {"dola_layers": "high"}],
                         ids=["contrastive", "dola"])
def test_modes_lynx_cannot_reproduce_are_refused(opt):
    model = arch("llama")
    ids = prompt()
    cache, _ = LynxCache.from_prefill(model, ids, residual_after_steps=0)
    with pytest.raises(ValueError, match="cannot reproduce"):
        model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=4,
                       do_sample=False, **opt)


def test_first_step_logits_are_the_prefills_on_both_paths():
    model = arch("qwen3-moe")
    ids = prompt()
    kw = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want = plain(model, ids, **kw).logits[0]
    for custom in ({"custom_generate": lynx_hf.speculative_generate}, {}):
        with noisy_anchor(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cache, _ = LynxCache.from_prefill(model, ids, Q(method="identity"), residual_after_steps=0)
            got = model.generate(ids, cache=cache, **custom, **kw).logits[0]
        assert torch.equal(got, want), custom


@pytest.mark.parametrize("cls, kw", [(tf.RwkvConfig, {}), (tf.OpenAIGPTConfig, {"n_head": 4}),
                                     (tf.CpmAntConfig, dict(dim_head=16, dim_model=64, dim_ff=128, num_layers=2)),
                                     (tf.DoryConfig, dict(n_input_layers=1, n_recurrent_layers=2, n_output_layers=1,
                                                          n_recurrent_loops=2, num_hidden_layers=4,
                                                          sliding_window=16))],
                         ids=["rwkv", "openai-gpt", "cpmant", "dory"])
def test_models_whose_kv_a_cache_cannot_hold_are_refused_at_once(cls, kw):
    model = build(cls, **kw)
    with pytest.raises(ValueError, match="LynxCache cannot hold"):
        LynxCache.from_prefill(model, prompt())


def word_tokenizer(vocab_size: int = V):
    """Token i is the word "w{i}" (3 is "abcdef", which StopStringCriteria tokenizes to clean the vocabulary);
    decoding concatenates."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    vocab["abcdef"] = vocab.pop("w3")
    t = Tokenizer(models.WordLevel(vocab, unk_token="w4"))
    t.pre_tokenizer, t.decoder = pre_tokenizers.Whitespace(), decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="w0", eos_token="w1", bos_token="w2")


def test_stop_strings_take_the_criterion_and_token_healing_is_refused_with_the_way_out():
    """Transformers hands a callable custom_generate neither `tokenizer=` nor (so) stop strings: refused with the
    way out, which stops exactly where plain generate's stop_strings do; the Hub folder builds it itself."""
    model, tok = arch("llama"), word_tokenizer()
    ids = prompt()
    stop = tok.convert_ids_to_tokens(int(plain(model, ids)[0, P + 3]))
    want = plain(model, ids, stop_strings=[stop], tokenizer=tok)
    assert want.shape[1] <= P + 4
    with pytest.raises(ValueError, match=r"stopping_criteria=\[transformers.StopStringCriteria"):
        lynx(model, ids, stop_strings=[stop], tokenizer=tok)
    got, cache = lynx(model, ids, stopping_criteria=[tf.StopStringCriteria(tok, [stop])])
    assert got.tolist() == want.tolist()
    from lynx_hf.hub import hub_generate
    with noisy_anchor():
        got = hub_generate(model, Q(method="identity").to_dict(), ids, residual_after_steps=2, stop_strings=[stop],
                           tokenizer=tok, max_new_tokens=N, do_sample=False)
    assert got.tolist() == want.tolist()
    with pytest.raises(ValueError, match="token_healing rewrites the prompt"):
        lynx(model, ids, token_healing=True, tokenizer=tok)


def test_plain_generate_on_a_cache_built_by_hand_needs_its_model():
    """A cache built by hand knows no model, and nothing Transformers hands a cache names the model that runs it
    (lynx_hf reads no stack frames): plain generate on it is refused with the way out (bind, from_kv); bound, it
    equals plain generate."""
    from lynx_hf.local import InProcessLoader, prefill

    model = arch("llama")
    ids = prompt()
    kv, logits = prefill(model, ids)
    cache = LynxCache(2, P)
    cache.put_logits(logits)
    InProcessLoader(kv, Q(method="identity")).attach(cache)
    with warnings.catch_warnings(), pytest.raises(ValueError, match="needs a LynxCache that knows its model"):
        warnings.simplefilter("ignore")
        model.generate(ids, cache=cache, max_new_tokens=N, do_sample=False)
    cache = LynxCache(2, P)
    cache.put_logits(logits)
    InProcessLoader(kv, Q()).attach(cache)
    cache._is_user_defined = True  # what Transformers' generate does to a cache it is given
    with warnings.catch_warnings(), pytest.raises(ValueError, match="needs a LynxCache that knows its model"):
        warnings.simplefilter("ignore")
        model(ids[:, -1:], cache=cache)
    cache = LynxCache(2, P).bind(model)
    cache.put_logits(logits)
    InProcessLoader(kv, Q(method="identity")).attach(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert model.generate(ids, cache=cache, **{"max_new_tokens": N, "do_sample": False}).tolist() == \
            plain(model, ids).tolist()
