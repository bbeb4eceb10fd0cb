"""Attention masks the engine builds itself, for passes a 2D padding mask cannot describe: tree passes (each node
sees its ancestors) and rows with holes (ragged acceptance left invalid positions in a row's tail).

`layer_masks(model, layers, dtype, vis, q_pos, k_pos)`: layers (each with is_sliding, offset, sliding_window:
the cache's), the cache's dtype; vis [B, q, K] bool — which of the K cache positions (after the pass)
each of the q new tokens may see — and the logical positions of queries [B, q] and keys [B, K] → what the model's
forward takes as `attention_mask`: one 4D mask [B, 1, q, K_layer], or a dict per layer type (models mixing full and
sliding layers). A sliding layer holds keys from its offset on and sees only keys less than W positions back."""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch

CUSTOM_MASK_ATTENTION = ("sdpa", "eager")  # implementations that take a custom 4D mask as is


def attn_impl(model) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def takes_custom_masks(model) -> bool:
    return attn_impl(model) in CUSTOM_MASK_ATTENTION


def layer_masks(model, layers, dtype, vis: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
    impl = attn_impl(model)
    masks = {}
    for layer in layers:
        kind = "sliding_attention" if layer.is_sliding else "full_attention"
        if kind in masks:
            continue
        m = vis[:, :, layer.offset:]                                             # [B, q, K_layer]
        if layer.is_sliding:
            m = m & ((q_pos[:, :, None] - k_pos[:, None, layer.offset:]) < layer.sliding_window)
        m = m[:, None]                                                           # [B, 1, q, K_layer]
        if impl != "sdpa":  # additive float mask
            m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
        masks[kind] = m
    return masks if len(masks) > 1 else next(iter(masks.values()))


@contextmanager
def masked_gqa(model, device: torch.device):
    """Around a pass with the engine's masks: Transformers' sdpa copies K/V once per query head of a group whenever a
    mask is given (repeat_kv: ×3 for a 9/3-head model, ~145 MB a tree step on the default model), while PyTorch's
    CPU sdpa takes the mask with `enable_gqa` and gives the same values (tests/test_masks.py); Transformers reads
    TRANSFORMERS_SDPA_FORCE_GQA at every call. CPU only (elsewhere a masked GQA call may leave the fused kernels)."""
    if attn_impl(model) != "sdpa" or device.type != "cpu" or os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA") == "1":
        yield
        return
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TRANSFORMERS_SDPA_FORCE_GQA", None)
