"""A request's prompt KV in and out of vLLM's paged cache, as pure torch (no vLLM import; tests build the same
tensors by hand).

vLLM's CPU attention backend (the `vec`/`vec16` kernels) keeps one tensor per layer, [num_blocks, H_kv, block_size,
2 * D], whose memory per (block, head) is the block's keys stored transposed, [D, block_size], then its values,
[block_size, D] (v1/attention/backends/cpu_attn.py reads it as [NB, H, 2 * bs, D] chunked in two; the key half is
what `cpu_attn_reshape_and_cache` writes as D rows of bs positions — tests/test_vllm.py checks it against that op).
Position p of a request lives in block `block_ids[p // block_size]` at offset `p % block_size`."""
from __future__ import annotations

import torch


def kv_views(layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """layer_cache: [NB, H, bs, 2D] → views of the same memory: keys [NB, H, D, bs], values [NB, H, bs, D]."""
    if layer_cache.dim() != 4 or layer_cache.shape[-1] % 2 or not layer_cache.is_contiguous():
        raise ValueError(f"expected a contiguous CPU paged KV layer [num_blocks, H_kv, block_size, 2*D], got "
                         f"{tuple(layer_cache.shape)}")
    nb, h, bs, d2 = layer_cache.shape
    halves = layer_cache.view(nb, h, 2, bs * (d2 // 2))
    return halves[:, :, 0].view(nb, h, d2 // 2, bs), halves[:, :, 1].view(nb, h, bs, d2 // 2)


def _slots(block_ids, start: int, count: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(start, start + count)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)
    if (start + count + block_size - 1) // block_size > len(blocks):
        raise ValueError(f"positions [{start}, {start + count}) need more than the request's {len(blocks)} blocks")
    return blocks[pos // block_size], pos % block_size


def gather(layer_cache: torch.Tensor, block_ids, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's first `count` positions → (k, v), each [1, H_kv, count, D] (copies)."""
    keys, values = kv_views(layer_cache)
    b, o = _slots(block_ids, 0, count, values.shape[2])
    k, v = keys[b, :, :, o], values[b, :, o]  # [count, H, D] each
    return k.transpose(0, 1).unsqueeze(0).contiguous(), v.transpose(0, 1).unsqueeze(0).contiguous()


def scatter(layer_cache: torch.Tensor, block_ids, start: int, kind: str, x: torch.Tensor) -> None:
    """x: [1, H_kv, count, D] → the request's positions [start, start + count) of K (kind "key") or V ("value")."""
    keys, values = kv_views(layer_cache)
    if x.dim() != 4 or x.shape[0] != 1 or x.shape[1] != values.shape[1] or x.shape[3] != values.shape[3]:
        raise ValueError(f"a segment of shape {tuple(x.shape)} does not fit this cache {tuple(layer_cache.shape)}")
    b, o = _slots(block_ids, start, x.shape[2], values.shape[2])
    rows = x[0].transpose(0, 1).to(values.dtype)  # [count, H, D]
    if kind == "key":
        keys[b, :, :, o] = rows
    else:
        values[b, :, o] = rows
