"""paged.py's layouts against paged KV built as vLLM 0.32 lays it out (fast tier: pure torch, no vLLM). One backing
allocation holds L layers: a physical tensor whose axes are the logical [L, B, H, N, C] in the layout's memory order,
permuted back to the logical order, one [B, H, N, C] view per layer (vLLM's `allocate_kv_cache`). Known K/V are
written and read by direct indexing in the physical tensor — per (block, head, slot) K then V in C for FlashAttention,
FlashInfer and Triton, per (block, head) K transposed [D, N] then V [N, D] for the CPU kernels. Tolerance 0. The slow
test checks the same against vLLM's own allocator and backend classes in .venv-vllm (run as a script there)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lynx_hf.vllm import paged
from lynx_hf.vllm.stream import stream_tier

ROOT = Path(__file__).resolve().parent.parent
VPY = ROOT / ".venv-vllm" / "bin" / "python"
STRIDE_ORDER = {  # vllm/v1/kv_cache_layout.py, KVCacheLayout: logical [L, B, H, N, C] axes in memory order
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
LAYOUTS = [("FLASH_ATTN", o) for o in STRIDE_ORDER] + [("TRITON_ATTN", o) for o in STRIDE_ORDER] + \
          [("FLASHINFER", o) for o in ("LBNHC", "LBHNC", "BLHNC", "BLNHC", "BHLNC")] + [("CPU_ATTN", "LBHNC")]
IDS = [f"{b}/{o}" for b, o in LAYOUTS]
L, NB, H, BS, D = 3, 7, 2, 16, 8


def vllm_layers(order: str, layers=L, nb=NB, h=H, bs=BS, d=D, dtype=torch.float32, seed=0):
    """→ (physical tensor, per-layer logical views [NB, H, bs, 2D]), as vLLM allocates them (random content)."""
    perm = STRIDE_ORDER[order]
    logical = (layers, nb, h, bs, 2 * d)
    phys = torch.randn([logical[a] for a in perm], generator=torch.Generator().manual_seed(seed)).to(dtype)
    view = phys.permute([perm.index(a) for a in range(5)])  # [L, B, H, N, C]
    return phys, [view[i] for i in range(layers)]


def where(backend, order, kind, layer, block, head, slot, dim, bs=BS, d=D):
    """The physical index of K or V's element (block, slot, head, dim) of `layer`, from the backend's packing."""
    if backend == "CPU_ATTN":  # per (block, head): keys [D, bs], then values [bs, D]
        n, c = divmod(dim * bs + slot if kind == "key" else bs * d + slot * d + dim, 2 * d)
    else:
        n, c = slot, dim + (d if kind == "value" else 0)
    logical = (layer, block, head, n, c)
    return tuple(logical[a] for a in STRIDE_ORDER[order])


def expected(phys, backend, order, layer, ids, count, kind, h=H, bs=BS, d=D):
    """What the request's first `count` positions hold, read element by element from physical memory."""
    out = torch.empty(1, h, count, d, dtype=phys.dtype)
    for p in range(count):
        for hh in range(h):
            for dd in range(d):
                out[0, hh, p, dd] = phys[where(backend, order, kind, layer, ids[p // bs], hh, p % bs, dd, bs, d)]
    return out


def written_mask(phys, backend, order, layer, ids, start, count):
    mask = torch.zeros(phys.shape, dtype=torch.bool)
    for kind in ("key", "value"):
        for p in range(start, start + count):
            for hh in range(H):
                for dd in range(D):
                    mask[where(backend, order, kind, layer, ids[p // BS], hh, p % BS, dd)] = True
    return mask


@pytest.mark.parametrize("backend, order", LAYOUTS, ids=IDS)
def test_layout_gather_reads_what_vllm_positions_hold(backend, order):
    phys, views = vllm_layers(order)
    ids, count = [5, 1, 3], 2 * BS + 5  # non-contiguous, unsorted, a partial last block
    k, v = paged.gather(paged.PagedLayer(views[1], paged.Layout(backend, order)), ids, count)
    assert k.shape == v.shape == (1, H, count, D)
    assert torch.equal(k, expected(phys, backend, order, 1, ids, count, "key"))
    assert torch.equal(v, expected(phys, backend, order, 1, ids, count, "value"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend, order", LAYOUTS, ids=IDS)
def test_layout_scatter_writes_only_the_requests_slots_and_gather_reads_them_back(backend, order, dtype):
    phys, views = vllm_layers(order, dtype=dtype)
    before = phys.clone()
    layer = paged.PagedLayer(views[2], paged.Layout(backend, order))
    ids, start, count = [6, 0, 4], BS - 3, 2 * BS - 4  # from inside the first block to inside the third
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(1, H, count, D, generator=g).to(dtype) for _ in range(2))
    paged.scatter(layer, ids, start, "key", k[:, :, :7])  # in pieces, as segments arrive
    paged.scatter(layer, ids, start + 7, "key", k[:, :, 7:])
    paged.scatter(layer, ids, start, "value", v)
    got_k, got_v = paged.gather(layer, ids, start + count)
    assert torch.equal(got_k[:, :, start:], k) and torch.equal(got_v[:, :, start:], v)
    assert torch.equal(got_k[:, :, start:], expected(phys, backend, order, 2, ids, start + count, "key")[:, :, start:])
    mask = written_mask(phys, backend, order, 2, ids, start, count)
    assert int(mask.sum()) == 2 * H * count * D
    assert torch.equal(phys[~mask], before[~mask])  # every other byte: other layers, blocks, slots, positions < start


@pytest.mark.parametrize("backend, order", LAYOUTS, ids=IDS)
def test_layout_with_one_kv_head_and_a_request_of_one_position(backend, order):
    phys, views = vllm_layers(order, h=1)
    layer = paged.PagedLayer(views[0], paged.Layout(backend, order))
    x = torch.full((1, 1, 1, D), 3.0)
    paged.scatter(layer, [4], 0, "value", x)
    assert torch.equal(paged.gather(layer, [4], 1)[1], x)
    assert all(phys[where(backend, order, "value", 0, 4, 0, 0, dd)] == 3.0 for dd in range(D))


def test_layout_cpu_is_the_default_for_a_bare_tensor():
    _, views = vllm_layers("LBHNC")
    ids = [2, 6]
    bare, bound = paged.gather(views[0], ids, BS + 1), paged.gather(paged.PagedLayer(views[0]), ids, BS + 1)
    assert paged.PagedLayer(views[0]).layout == paged.CPU == paged.Layout("CPU_ATTN", "LBHNC")
    assert all(torch.equal(a, b) for a, b in zip(bare, bound))


def test_layout_refuses_a_tensor_of_another_shape_or_memory_order():
    _, nhd = vllm_layers("LBNHC")
    _, hnd = vllm_layers("LBHNC")
    with pytest.raises(ValueError, match=r"laid out BHNC.*strides"):
        paged.PagedLayer(nhd[0], paged.Layout("FLASHINFER", "LBHNC"))  # NHD memory read as HND
    with pytest.raises(ValueError, match=r"laid out BNHC.*strides"):
        paged.PagedLayer(hnd[0], paged.Layout("FLASH_ATTN", "LBNHC"))
    with pytest.raises(ValueError, match="contiguous"):
        paged.PagedLayer(nhd[0], paged.CPU)
    for bad in (torch.zeros(NB, H, BS, 2 * D + 1), torch.zeros(NB, H, 2 * D), torch.zeros(2, NB, BS, H, D)):
        with pytest.raises(ValueError, match=r"FLASH_ATTN/LBHNC paged KV layer.*got shape"):
            paged.PagedLayer(bad, paged.Layout("FLASH_ATTN", "LBHNC"))
    with pytest.raises(ValueError, match="paged KV layer"):
        paged.gather(torch.zeros(NB, H, BS, 2 * D + 1), [0], 1)  # a bare tensor: the CPU layout's check


@pytest.mark.parametrize("backend, order", [("FLASH_ATTN", "LBNHC"), ("FLASHINFER", "BLHNC"), ("CPU_ATTN", "LBHNC")])
def test_layout_refuses_too_few_blocks_foreign_blocks_and_segments_that_do_not_fit(backend, order):
    _, views = vllm_layers(order)
    layer = paged.PagedLayer(views[0], paged.Layout(backend, order))
    with pytest.raises(ValueError, match="need more than the request's 2 blocks"):
        paged.gather(layer, [0, 1], 2 * BS + 1)
    with pytest.raises(ValueError, match="need more than the request's 1 blocks"):
        paged.scatter(layer, [3], BS - 1, "key", torch.zeros(1, H, 2, D))
    for ids in ([0, NB], [-1]):
        with pytest.raises(ValueError, match=f"not all among this layer's {NB} blocks"):
            paged.gather(layer, ids, len(ids) * BS)
    with pytest.raises(ValueError, match=f"does not fit this layer's {H} KV heads of {D} dims"):
        paged.scatter(layer, [0], 0, "key", torch.zeros(1, H + 1, 4, D))
    with pytest.raises(ValueError, match="does not fit"):
        paged.scatter(layer, [0], 0, "value", torch.zeros(1, H, 4, D - 1))
    with pytest.raises(ValueError, match="kind must be"):
        paged.scatter(layer, [0], 0, "keys", torch.zeros(1, H, 4, D))


def test_layout_names_refused_in_one_line_with_what_is_supported():
    for backend, order in (("ROCM_ATTN", "LBNHC"), ("FLASHINFER", "LHBNC"), ("CPU_ATTN", "LBNHC"),
                           ("FLASH_ATTN", "NHD")):
        with pytest.raises(ValueError) as e:
            paged.Layout(backend, order)
        msg = str(e.value)
        assert (f"{backend!r}" in msg and f"{order!r}" in msg and "supported: CPU_ATTN: LBHNC;" in msg
                and "\n" not in msg)


def test_layout_choice_of_register_kv_caches_refuses_unknown_backends_in_one_line():
    from lynx_hf.vllm.worker import choose_layout

    assert choose_layout(["FLASH_ATTN", "FLASH_ATTN"], "LBNHC") == paged.Layout("FLASH_ATTN", "LBNHC")
    assert choose_layout(["CPU_ATTN"], "LBHNC") == paged.CPU
    for backends, layout, named in ((["ROCM_AITER_FA"], "LBNHC", "'ROCM_AITER_FA'"), (["CPU_ATTN"], "LBNHC", "'LBNHC'"),
                                    (["FLASH_ATTN", "FLASHINFER"], "LBNHC", "['FLASHINFER', 'FLASH_ATTN']"),
                                    ([], "LBNHC", "none")):
        with pytest.raises(RuntimeError) as e:
            choose_layout(backends, layout)
        assert named in str(e.value) and "supported" in str(e.value) and "\n" not in str(e.value)


def test_layout_worker_register_binds_each_layer_and_names_the_one_that_does_not_fit():
    from lynx_hf.vllm.worker import WorkerSide

    _, views = vllm_layers("BLNHC", dtype=torch.bfloat16)  # layers interleaved per block: no view is contiguous
    w = WorkerSide({}, b"s", "fp")
    layout = paged.Layout("TRITON_ATTN", "BLNHC")
    w.register({f"model.layers.{i}.attn": t for i, t in enumerate(views)}, layout)
    assert (w.spec(40).layers, w.spec(40).kv_heads, w.spec(40).head_dim, w.spec(40).dtype) == (L, H, D, "bfloat16")
    assert [p.layout for p in w.paged] == [layout] * L and all(p.cache is t for p, t in zip(w.paged, views))
    hnd = vllm_layers("LBHNC", dtype=torch.bfloat16)[1][0]  # layer 0 as TRITON_ATTN/LBHNC lays it out, layer 1 not
    with pytest.raises(ValueError, match=r"layer 'model.layers.1.attn': .*TRITON_ATTN/LBHNC.*laid out BHNC"):
        WorkerSide({}, b"s", "fp").register({"model.layers.0.attn": hnd, "model.layers.1.attn": views[1]},
                                            paged.Layout("TRITON_ATTN", "LBHNC"))


def test_layout_prefill_on_flashattention_nhd_streams_to_decode_on_flashinfer_hnd_exactly():
    """The stream carries [1, H_kv, P, D]: instances on different layouts interoperate (full tier, tolerance 0)."""
    from lynx_hf import LynxQuantConfig
    from lynx_hf.vllm.scheduler import LoadMeta, SaveMeta, StepMeta
    from lynx_hf.vllm.stream import KVPublisher
    from lynx_hf.vllm.worker import WorkerSide
    import time

    h, bs, d, P = 2, 32, 64, 70
    pub = KVPublisher("127.0.0.1", 0, b"s", "fp")
    try:
        pw, dw = WorkerSide({}, b"s", "fp", pub), WorkerSide({}, b"s", "fp", timeout_s=10)
        _, src = vllm_layers("LBNHC", nb=6, h=h, bs=bs, d=d)
        dst_phys, dst = vllm_layers("LBHNC", nb=8, h=h, bs=bs, d=d)
        dst_phys.zero_()
        pw.register({f"l.{i}": t for i, t in enumerate(src)}, paged.Layout("FLASH_ATTN", "LBNHC"))
        dw.register({f"l.{i}": t for i, t in enumerate(dst)}, paged.Layout("FLASHINFER", "LBHNC"))
        src_ids, dst_ids = [4, 0, 2], [7, 1, 5]
        save = StepMeta(saves=[SaveMeta("p", "x", "lynx", P, src_ids, "dg")])
        for name, t in zip(pw.index, src):
            pw.save_layer(save, name, t)
        pw.end_saves()
        dw.begin_step(StepMeta(loads=[LoadMeta("r", "x", "lynx", "full", True, "127.0.0.1", pub.port, P, 0, dst_ids,
                                               "dg")]))
        done, t_end = set(), time.time() + 20
        while "r" not in done:
            d_, f_ = dw.results(set())
            assert not f_ and time.time() < t_end, f_
            done |= d_
            time.sleep(0.005)
        cfg = LynxQuantConfig()
        for i in range(L):
            want = [stream_tier(x, cfg, kind, (i, L), "full")
                    for x, kind in zip(paged.gather(pw.paged[i], src_ids, P), ("key", "value"))]
            for kind, w in zip(("key", "value"), want):
                assert torch.equal(expected(dst_phys, "FLASHINFER", "LBHNC", i, dst_ids, P, kind, h, bs, d), w)
        untouched = [b for b in range(8) if b not in dst_ids]
        assert not dst_phys[:, untouched].any()
    finally:
        pub.close()


# -- against vLLM itself (slow tier; this file runs as a script in .venv-vllm) --------------------------------------
def _against_vllm() -> dict:
    """paged.py's tables and reads against vLLM's KVCacheLayout, allocator, backend classes and their own K/V split."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.attention.backends.utils import _FLASHINFER_LAYOUT_NAMES
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                            compute_layout_strides)
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    out = {"orders": {m.name: m.value for m in KVCacheLayout} == paged.ORDERS == STRIDE_ORDER,
           "view_orders": all(paged.Layout("FLASH_ATTN", m.name).view_order == m.layer_view_order
                              for m in KVCacheLayout),
           "names": [c.get_name() for c in (FlashAttentionBackend, TritonAttentionBackend, CPUAttentionBackend)]
           == ["FLASH_ATTN", "TRITON_ATTN", "CPU_ATTN"] and "FLASHINFER" in AttentionBackendEnum.__members__,
           "cpu_layouts": [m.name for m in CPUAttentionBackend.supported_kv_cache_layouts()]
           == list(paged.BACKENDS["CPU_ATTN"][1]),
           "any_layout": FlashAttentionBackend.supported_kv_cache_layouts() is None
           and TritonAttentionBackend.supported_kv_cache_layouts() is None,
           "flashinfer_layouts": set(_FLASHINFER_LAYOUT_NAMES) == set(paged.BACKENDS["FLASHINFER"][1])}
    names, nb, h, d = ["l0", "l1", "l2"], 5, 2, 32
    reads, checked = True, 0
    for dtype in (torch.float32, torch.bfloat16):
        spec = FullAttentionSpec(block_size=16, num_kv_heads=h, head_size=d, dtype=dtype)
        for m in KVCacheLayout:
            ls, bstride, *_ = compute_layout_strides(spec, nb, len(names), m)
            cfg = KVCacheConfig(num_blocks=nb, kv_cache_tensors=[KVCacheTensor(
                size=spec.page_size_bytes * nb * len(names), layers=names, layer_stride=ls, block_stride=bstride)],
                kv_cache_groups=[KVCacheGroupSpec(names, spec)])
            kv = allocate_kv_cache(cfg, torch.device("cpu"), m)["l1"]  # what register_kv_caches gets
            for backend, (packing, layouts) in paged.BACKENDS.items():
                if m.name not in layouts or packing != "split":
                    continue
                checked += 1
                reads &= _split_reads(kv, paged.Layout(backend, m.name), d, m.layer_view_order)
    out["reads"], out["checked"] = bool(reads), checked
    return out


def _split_reads(kv, layout, d, view_order) -> bool:
    """K/V written through the backend's own split (FlashInfer: of the view permuted to memory order) → paged reads
    them; paged writes → the backend's split reads them."""
    kv.zero_()
    nb, h, bs = kv.shape[:3]
    if layout.backend == "FLASHINFER":
        key_cache, value_cache = kv.permute(*view_order).split(d, dim=-1)
        axes = [("B", "H", "N")[a] for a in view_order[:3]]
    else:
        key_cache, value_cache = kv.transpose(1, 2).split(d, dim=-1)  # flash_attn.py, triton_attn.py
        axes = ["B", "N", "H"]
    g = torch.Generator().manual_seed(0)
    ids, count = [3, 0, 4], 2 * bs + 3
    k, v = (torch.randn(1, h, count, d, generator=g).to(kv.dtype) for _ in range(2))
    for p in range(count):
        for hh in range(h):
            at = {"B": ids[p // bs], "N": p % bs, "H": hh}
            key_cache[tuple(at[a] for a in axes)] = k[0, hh, p]
            value_cache[tuple(at[a] for a in axes)] = v[0, hh, p]
    layer = paged.PagedLayer(kv, layout)
    ok = all(torch.equal(a, b) for a, b in zip(paged.gather(layer, ids, count), (k, v)))
    kv.zero_()
    paged.scatter(layer, ids, 0, "key", k)
    paged.scatter(layer, ids, 0, "value", v)
    for p in range(count):
        for hh in range(h):
            at = {"B": ids[p // bs], "N": p % bs, "H": hh}
            ok &= torch.equal(key_cache[tuple(at[a] for a in axes)], k[0, hh, p])
            ok &= torch.equal(value_cache[tuple(at[a] for a in axes)], v[0, hh, p])
    return bool(ok) and int(kv.count_nonzero()) == 2 * count * h * d


@pytest.mark.slow
def test_layout_tables_and_reads_match_vllms_allocator_and_backends():
    if not VPY.exists():
        pytest.skip("no vLLM environment (.venv-vllm): run `bash bootstrap.sh vllm-env`")
    p = subprocess.run([str(VPY), str(Path(__file__))], capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    assert p.returncode == 0 and lines, (p.stdout + p.stderr)[-3000:]
    r = json.loads(lines[-1])
    assert r == {**r, "orders": True, "view_orders": True, "names": True, "cpu_layouts": True, "any_layout": True,
                 "flashinfer_layouts": True, "reads": True}, r
    assert r["checked"] == 2 * (6 + 6 + 5)  # two dtypes × the (split backend, layout) pairs


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(_against_vllm()))
