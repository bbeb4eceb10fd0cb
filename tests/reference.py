"""Reference decoders the tests compare Lynx against, written without LynxCache or speculative_generate."""
import torch
from transformers import DynamicCache

from lynx_hf.quant import decode, encode


@torch.no_grad()
def full_tier_greedy(model, prompt_len: int, kv, logits: torch.Tensor, cfg, n: int) -> list:
    """Greedy decoding, one step at a time, over the full tier of the streamed KV (`loader.prefill`'s kv and logits):
    a DynamicCache of full layers holding each layer's held positions decoded, earlier positions zero (a sliding
    layer's mask never reaches them). Returns the n generated tokens of each row (the first from the logits)."""
    c = DynamicCache()
    for i, (k, v) in enumerate(kv):
        lead = lambda t: torch.cat([t.new_zeros(*t.shape[:2], prompt_len - t.shape[2], t.shape[3]), t], 2)
        c.update(lead(decode(encode(k, cfg, "key"), "full")), lead(decode(encode(v, cfg, "value"), "full")), i)
    nxt = logits.argmax(-1, keepdim=True)
    toks = [nxt]
    for _ in range(n - 1):
        nxt = model(input_ids=nxt, cache=c, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        toks.append(nxt)
    return torch.cat(toks, 1).tolist()
