"""A request's prompt KV in and out of one layer of vLLM's paged cache, as pure torch (no vLLM import; the fast tier
builds the same tensors by hand, the slow tier with vLLM's own allocator).

vLLM 0.32 hands a KV connector one tensor per layer: the logical view [num_blocks, H_kv, block_size, C] of one shared
allocation (v1/worker/utils.py `allocate_kv_cache`, v1/kv_cache_interface.py `create_kv_cache_views`). Its strides
follow the engine-wide `KVCacheLayout` (v1/kv_cache_layout.py), a permutation of [L, B, H, N, C] — L the layers
sharing the allocation, B blocks, H heads, N a block's slots, C a slot's content — into memory order: LBNHC ("NHD",
the default), LBHNC ("HND"), or one that interleaves layers per block (BL..). A `Layout` names the attention backend
that reads the view and that permutation; the backend fixes what C holds:
- packing "split" (FLASH_ATTN, FLASHINFER, TRITON_ATTN): per (block, head, slot) the key's D values, then the value's
  D (C = 2D; the backends read `kv.transpose(1, 2).split(D, dim=-1)`, FlashInfer after permuting to memory order);
- packing "cpu" (CPU_ATTN, LBHNC only; the vec/vec16 kernels): per (block, head) the block's keys stored transposed
  [D, block_size], then its values [block_size, D] (cpu_attn.py reads the view as [NB, H, 2 * bs, D] chunked in two;
  the key half is what `cpu_attn_reshape_and_cache` writes as D rows of bs positions — tests/vllm_pair.py checks it
  against that op).
A `PagedLayer` binds a layer's tensor to its layout, refusing (ValueError) a tensor whose shape or strides are not
that layout's. `kv_views` turns either packing into (keys, values) views [NB, H_kv, bs, D] of the same memory, which
`gather` and `scatter` index; a bare tensor is read in the CPU layout. Position p of a request lives in block
`block_ids[p // block_size]` at offset `p % block_size`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

ORDERS = {  # KVCacheLayout member → its stride order over the logical [L, B, H, N, C] (vLLM's enum values)
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
BACKENDS = {  # vLLM attention backend name → (packing, the KV cache layouts its kernels read)
    "CPU_ATTN": ("cpu", ("LBHNC",)),  # CPUAttentionBackend.supported_kv_cache_layouts
    "FLASH_ATTN": ("split", tuple(ORDERS)),  # no declared set: any layout
    "TRITON_ATTN": ("split", tuple(ORDERS)),
    "FLASHINFER": ("split", ("LBNHC", "LBHNC", "BLHNC", "BLNHC", "BHLNC")),  # those with a FlashInfer NHD/HND name
}


def supported() -> str:
    return "; ".join(f"{b}: {', '.join(layouts)}" for b, (_, layouts) in BACKENDS.items())


@dataclass(frozen=True)
class Layout:
    """How one attention backend's paged KV lies in memory: `backend` (vLLM's `get_name()`) and `kv_cache_layout`
    (vLLM's resolved `KVCacheLayout` name)."""
    backend: str
    kv_cache_layout: str

    def __post_init__(self):
        entry = BACKENDS.get(self.backend)
        if entry is None or self.kv_cache_layout not in entry[1]:
            raise ValueError(f"no paged KV reader for attention backend {self.backend!r} with KV cache layout "
                             f"{self.kv_cache_layout!r}; supported: {supported()}")

    @property
    def name(self) -> str:
        return f"{self.backend}/{self.kv_cache_layout}"

    @property
    def packing(self) -> str:
        return BACKENDS[self.backend][0]

    @property
    def view_order(self) -> tuple[int, ...]:
        """Memory order of the layer view's axes [B, H, N, C], outermost first (vLLM's `layer_view_order`)."""
        return tuple(i - 1 for i in ORDERS[self.kv_cache_layout] if i != 0)


CPU = Layout("CPU_ATTN", "LBHNC")
_AXES = "BHNC"


def _check(cache: torch.Tensor, layout: Layout) -> None:
    what = f"a {layout.name} paged KV layer [num_blocks, H_kv, block_size, 2*D]"
    if cache.dim() != 4 or cache.shape[-1] % 2 or 0 in cache.shape:
        raise ValueError(f"expected {what}, got shape {tuple(cache.shape)}")
    if layout.packing == "cpu":
        if not cache.is_contiguous():  # the kernels reinterpret each (block, head)'s memory
            raise ValueError(f"expected {what}, contiguous; got strides {cache.stride()}")
        return
    order = [a for a in layout.view_order if cache.shape[a] > 1 or a == 3]  # a size-1 axis has no memory order
    ok = cache.stride(3) == 1 and all(cache.stride(outer) >= cache.stride(inner) * cache.shape[inner]
                                      for outer, inner in zip(order, order[1:]))
    if not ok:
        raise ValueError(f"expected {what} laid out {''.join(_AXES[a] for a in layout.view_order)} in memory, got "
                         f"shape {tuple(cache.shape)} with strides {cache.stride()}")


@dataclass(frozen=True)
class PagedLayer:
    """One layer's paged KV as vLLM registered it, [NB, H_kv, bs, 2D] with the strides of `layout`."""
    cache: torch.Tensor
    layout: Layout = CPU

    def __post_init__(self):
        _check(self.cache, self.layout)

    @property
    def kv_heads(self) -> int:
        return self.cache.shape[1]

    @property
    def block_size(self) -> int:
        return self.cache.shape[2]

    @property
    def head_dim(self) -> int:
        return self.cache.shape[3] // 2


def kv_views(layer: PagedLayer | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """layer (a PagedLayer, or a bare tensor in the CPU layout) → views of its memory: keys, values [NB, H, bs, D]."""
    if not isinstance(layer, PagedLayer):
        layer = PagedLayer(layer, CPU)
    c = layer.cache
    nb, h, bs, d = c.shape[0], c.shape[1], c.shape[2], c.shape[3] // 2
    if layer.layout.packing == "split":
        return c[..., :d], c[..., d:]
    halves = c.view(nb, h, 2, bs * d)
    return halves[:, :, 0].view(nb, h, d, bs).transpose(2, 3), halves[:, :, 1].view(nb, h, bs, d)


def _slots(block_ids, start: int, count: int, block_size: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(start, start + count)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)
    if (start + count + block_size - 1) // block_size > len(blocks):
        raise ValueError(f"positions [{start}, {start + count}) need more than the request's {len(blocks)} blocks")
    b = blocks[pos // block_size]
    if count and (int(b.min()) < 0 or int(b.max()) >= num_blocks):
        raise ValueError(f"block ids {sorted(set(b.tolist()))} are not all among this layer's {num_blocks} blocks")
    return b, pos % block_size


def gather(layer: PagedLayer | torch.Tensor, block_ids, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's first `count` positions → (k, v), each [1, H_kv, count, D] (copies, on the cache's device)."""
    keys, values = kv_views(layer)  # [NB, H, bs, D] each
    b, o = _slots(block_ids, 0, count, keys.shape[2], keys.shape[0])
    k, v = keys[b, :, o], values[b, :, o]  # [count, H, D] each
    return k.transpose(0, 1).unsqueeze(0).contiguous(), v.transpose(0, 1).unsqueeze(0).contiguous()


def scatter(layer: PagedLayer | torch.Tensor, block_ids, start: int, kind: str, x: torch.Tensor) -> None:
    """x: [1, H_kv, count, D] → the request's positions [start, start + count) of K (kind "key") or V ("value")."""
    keys, values = kv_views(layer)  # [NB, H, bs, D] each
    if x.dim() != 4 or x.shape[0] != 1 or x.shape[1] != values.shape[1] or x.shape[3] != values.shape[3]:
        raise ValueError(f"a segment of shape {tuple(x.shape)} does not fit this layer's {values.shape[1]} KV heads "
                         f"of {values.shape[3]} dims [1, H_kv, count, D]")
    if kind not in ("key", "value"):
        raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")
    b, o = _slots(block_ids, start, x.shape[2], values.shape[2], values.shape[0])
    rows = x[0].transpose(0, 1).to(device=values.device, dtype=values.dtype)  # [count, H, D]
    (keys if kind == "key" else values)[b, :, o] = rows


def copy_blocks(layer: PagedLayer | torch.Tensor, src, dst) -> None:
    """Copy whole blocks src[i] → dst[i] of one layer (K and V: a block's memory, whatever the layout)."""
    c = layer.cache if isinstance(layer, PagedLayer) else layer
    src, dst = torch.as_tensor(list(src), dtype=torch.long), torch.as_tensor(list(dst), dtype=torch.long)
    if len(src) != len(dst) or (len(src) and (int(torch.cat([src, dst]).min()) < 0
                                              or int(torch.cat([src, dst]).max()) >= c.shape[0])):
        raise ValueError(f"block copy {src.tolist()} -> {dst.tolist()}: not all among this layer's {c.shape[0]} "
                         f"blocks, or not one for one")
    c[dst] = c[src]
