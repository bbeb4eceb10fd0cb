"""Images and encoder-decoders: exact or refused at once by lynx_hf, in one line. A LLaVA prompt with an image is
prefilled with it (`from_prefill(model, ids, pixel_values=...)`) and then equals plain `generate` with the image on
both paths; an image a cache was not prefilled with is refused; Qwen2-VL with an image (M-RoPE rope deltas) is
refused at from_prefill, its text-only prompts work; BART, T5 and Whisper are refused at from_prefill, at generate's
start on both paths and in the Hub folder's generate. Tiny random configs."""
import warnings

import pytest
import torch
import transformers as tf

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig as Q
from lynx_hf.hub import hub_generate

V = 128
TEXT = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, eos_token_id=1, pad_token_id=0, bos_token_id=2)
KW = dict(max_new_tokens=6, do_sample=False)
SPEC = dict(custom_generate=lynx_hf.speculative_generate)


def scaled(m):
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0)
    return m.eval()


@pytest.fixture(scope="module")
def llava():
    torch.manual_seed(0)
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=28, patch_size=14)
    cfg = tf.LlavaConfig(text_config=tf.LlamaConfig(**TEXT), vision_config=vision, image_token_id=V - 1,
                         vision_feature_layer=-1, vision_feature_select_strategy="default")
    m = scaled(tf.LlavaForConditionalGeneration(cfg))
    ids = torch.randint(3, V - 2, (1, 20), generator=torch.Generator().manual_seed(1))
    ids[0, 3:7] = V - 1  # 4 image tokens: 28 / 14 squared patches
    pv = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(2))
    return m, ids, pv


@pytest.mark.parametrize("custom", [True, False], ids=["custom_generate", "plain"])
def test_llava_with_an_image_equals_plain_generate(llava, custom):
    m, ids, pv = llava
    want = m.generate(ids, pixel_values=pv, **KW)
    cache, _ = LynxCache.from_prefill(m, ids, pixel_values=pv, quant_config=Q(method="identity"),
                                      residual_after_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = m.generate(ids, pixel_values=pv, cache=cache, **(SPEC if custom else {}), **KW)
    assert got.tolist() == want.tolist()
    assert want.tolist() != m.generate(ids, pixel_values=pv * 0 + 1, **KW).tolist()  # the image matters here


@pytest.mark.parametrize("custom", [True, False], ids=["custom_generate", "plain"])
def test_an_image_the_cache_was_not_prefilled_with_is_refused(llava, custom):
    m, ids, pv = llava
    ids = ids.clone()
    ids[0, 3:7] = 5  # a text prompt
    cache, _ = LynxCache.from_prefill(m, ids, residual_after_steps=0)
    with pytest.raises(ValueError, match="prefilled without them: pass the same inputs to LynxCache.from_prefill"):
        m.generate(ids, pixel_values=pv, cache=cache, **(SPEC if custom else {}), **KW)
    _, img_ids, _ = llava
    cache, _ = LynxCache.from_prefill(m, img_ids, pixel_values=pv, residual_after_steps=0)
    with pytest.raises(ValueError, match="differ from the ones this LynxCache was prefilled with"):
        m.generate(img_ids, pixel_values=pv + 1, cache=cache, **(SPEC if custom else {}), **KW)
    with pytest.raises(ValueError, match="unexpected arguments .'pixels'."):
        LynxCache.from_prefill(m, img_ids, pixels=pv)


def test_qwen2_vl_with_an_image_is_refused_and_text_only_works():
    torch.manual_seed(0)
    cfg = tf.Qwen2VLConfig(text_config=dict(**TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                      "mrope_section": [2, 3, 3]}),
                           vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14,
                                              spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
                           image_token_id=V - 1, video_token_id=V - 2, vision_start_token_id=V - 3)
    m = scaled(tf.Qwen2VLForConditionalGeneration(cfg))
    ids = torch.randint(3, V - 4, (1, 20), generator=torch.Generator().manual_seed(3))
    pv, thw = torch.randn(4, 3 * 2 * 14 * 14), torch.tensor([[1, 2, 2]])
    with pytest.raises(ValueError, match="positions depend on the image .M-RoPE"):
        LynxCache.from_prefill(m, ids, pixel_values=pv, image_grid_thw=thw)
    cache, _ = LynxCache.from_prefill(m, ids, quant_config=Q(method="identity"), residual_after_steps=2)
    assert m.generate(ids, cache=cache, **SPEC, **KW).tolist() == m.generate(ids, **KW).tolist()


def _seq2seq():
    torch.manual_seed(0)
    yield "bart", tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, bos_token_id=0, pad_token_id=1,
        eos_token_id=2, decoder_start_token_id=2))
    yield "t5", tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                          num_heads=2, decoder_start_token_id=0, pad_token_id=0,
                                                          eos_token_id=1))
    yield "whisper", tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
        max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3))


@pytest.mark.parametrize("name, model", list(_seq2seq()), ids=lambda x: x if isinstance(x, str) else "")
def test_encoder_decoders_are_refused_in_one_line_everywhere(name, model):
    model.eval()
    ids = torch.randint(4, V, (1, 16), generator=torch.Generator().manual_seed(4))
    says = "LynxCache serves decoder-only models: this .* is an encoder-decoder"
    with pytest.raises(ValueError, match=says):
        LynxCache.from_prefill(model, ids)
    with pytest.raises(ValueError, match=says):
        hub_generate(model, Q().to_dict(), ids, max_new_tokens=2)  # the Hub folder's generate
    cache = LynxCache(1, 16)  # a cache built by hand for it: refused at generate's start, both paths (plain: a
    inputs = {"input_features": torch.randn(1, 8, 32)} if name == "whisper" else {"input_ids": ids}  # hand-built
    for custom in (SPEC, {}):  # cache names no model, and binding one to it refuses it)
        with pytest.raises(ValueError, match=says if custom else f"{says}|needs a LynxCache that knows its model"):
            model.generate(**inputs, cache=cache, max_new_tokens=2, **custom)
