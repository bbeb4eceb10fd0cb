"""Lynx in a few lines: prefill, ship the KV as anchor + residual, draft on the anchor, verify, keep decoding."""
import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig

model, tok = lynx_hf.load_default_model()  # or lynx_hf.load_default_model("HuggingFaceTB/SmolLM2-135M-Instruct")
messages = [{"role": "user", "content": "Write a short poem about a lynx crossing a snowy network link."}]
input_ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                   return_dict=True)["input_ids"]

# Prefill node: full-precision prefill; KV encoded as anchor (4 bit + metadata) and residual (4 bit), plus the
# prompt's last-position logits. Here both nodes are this process; the residual "lands" after 8 draft steps.
cache, _ = LynxCache.from_prefill(model, input_ids, quant_config=LynxQuantConfig(), residual_after_steps=8)

# Decode node: ordinary `generate` on the bare prompt, with Lynx's draft -> verify loop plugged in.
streamer = lynx_hf.SpeculativeStreamer(tok)  # verified text plain, drafts dimmed until verified
out = model.generate(input_ids, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=48,
                     do_sample=False, repetition_penalty=1.1,
                     lynx_streamer=streamer)  # transformers 5.x drops `streamer=` for custom_generate callables
print()  # the streamer printed the verified text (`tok.decode(out[0, input_ids.shape[1]:])` is the same)
print({k: cache.stats[k] for k in ("drafted", "accepted", "ttft_draft_s", "ttft_verified_s", "verify_s")})
