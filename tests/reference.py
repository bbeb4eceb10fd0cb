"""Reference decoders the tests compare Lynx against, written without LynxCache or speculative_generate."""
import torch
from transformers import DynamicCache

from lynx_hf.quant import dequantize as decode, encode


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


# -- a test-only codec whose drafts really happen and are verified, yet whose output must equal plain generate -----
def _noisy_encode(x, config, kind, reference, layer=None):
    from lynx_hf.quant import SplitKV

    payload = x.contiguous().view(torch.uint8)
    residual = torch.zeros(*x.shape[:3], x.shape[3] // 2, dtype=torch.uint8, device=x.device)
    return SplitKV(config, kind, tuple(x.shape), x.dtype, payload, residual, {})


def _noisy_decode(split, tier, reference, out=None):
    x = split.anchor.view(split.dtype).view(split.shape)
    if tier == "anchor":  # the KV plus 30 % of its spread in fixed Gaussian noise
        g = torch.Generator().manual_seed(sum(split.shape))
        x = x + 0.3 * x.float().std() * torch.randn(split.shape, generator=g).to(x)
    return x.clone() if out is None else out.copy_(x)


class noisy_anchor:
    """Within `with noisy_anchor():`, the "identity" method has a residual stream: its anchor tier is the KV plus
    noise, its full tier the exact KV. Drafts then run on a perturbed KV and are verified against the exact one."""

    def __enter__(self):
        from lynx_hf import quant

        self.saved = quant.CODECS["identity"]
        quant.CODECS["identity"] = quant.Codec(_noisy_encode, _noisy_decode, split=True)
        return self

    def __exit__(self, *exc):
        from lynx_hf import quant

        quant.CODECS["identity"] = self.saved
