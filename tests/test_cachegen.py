"""CacheGen baseline (lynx_hf/quant/cachegen.py): its symbols survive the arithmetic coder exactly (tolerance 0), its
bits/value are the bytes it produced, a damaged stream is refused with a clear error, and it travels every path a KV
mode goes (cache, batch maps, the wire)."""
import struct

import pytest
import torch

from lynx_hf import LynxCache, LynxQuantConfig as Q, quant
from lynx_hf.local import prefill
from lynx_hf.quant import cachegen as cg
from lynx_hf.transfer import serde
from lynx_hf.transfer.wire import WireError

CG = Q(method="cachegen")


def kv_like(B=1, H=3, S=300, D=64, seed=0):
    """Keys-like data: a few outlier channels, heavy tails."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, S, D, generator=g) * torch.linspace(0.2, 3.0, D)
    x[..., 5] += 8.0
    return x


def reference_symbols(x, bins):
    """LMCache's torch_quant, written out: per token, absmax over the merged heads' channels."""
    B, H, S, D = x.shape
    t = x.float().permute(0, 2, 1, 3).reshape(B, S, H * D)
    M = bins // 2 - 1
    m = t.abs().amax(-1, keepdim=True)
    return (torch.round(t * (M / m)).clamp(-M, M) + M).to(torch.uint8), m.squeeze(-1)


@pytest.mark.parametrize("layer,kind,bins", [((0, 30), "key", 32), ((8, 30), "key", 32), ((9, 30), "key", 16),
                                             ((1, 30), "value", 32), ((2, 30), "value", 16), ((0, 1), "key", 32)])
def test_symbols_round_trip_exactly(layer, kind, bins):
    x = kv_like(B=2, S=300)
    s = quant.encode(x, CG, kind, layer=layer)
    want, m = reference_symbols(x, bins)
    got, levels = cg.symbols(s)
    assert levels == bins - 1 and torch.equal(got, want)              # tolerance 0 after quantization
    assert torch.equal(s.meta["scale"], m)
    M = bins // 2 - 1
    deq = ((want.float() - M) * (m / M).unsqueeze(-1)).view(2, 300, 3, 64).permute(0, 2, 1, 3)
    assert torch.equal(quant.dequantize(s), deq) and torch.equal(quant.dequantize(s, "anchor"), deq)


def test_bits_per_value_are_the_bytes_produced():
    x = kv_like(S=600)
    s = quant.encode(x, CG, "value", layer=(5, 30))
    raw = s.anchor.numpy().tobytes()
    magic, version, levels, chunk, _ = cg.HEAD.unpack_from(raw)
    n_chunks = -(-600 // chunk)
    words = struct.unpack_from(f"<{n_chunks}I", raw, cg.HEAD.size)
    assert (magic, levels, chunk) == (b"CG", 15, 256)
    assert len(raw) == cg.HEAD.size + 4 * n_chunks + n_chunks * 192 * levels + 4 * sum(words)
    assert s.nbytes() == len(raw) + 600 * 4                            # + the float32 scale of each token
    assert s.bits_per_value() == 8 * s.nbytes() / x.numel()
    assert s.bits_per_value() < 4.0                                    # entropy coding beats log2(15) raw bits


def test_damaged_streams_are_refused_clearly():
    s = quant.encode(kv_like(), CG, "key", layer=(0, 2))
    a = s.anchor.clone()
    for i in (3, cg.HEAD.size + 2, len(a) // 2, len(a) - 1):
        bad = a.clone()
        bad[i] ^= 0x21
        with pytest.raises(ValueError, match="cachegen: corrupted stream"):
            quant.dequantize(quant.SplitKV(s.config, s.kind, s.shape, s.dtype, bad, None, s.meta, s.axis))
    for cut in (0, 5, cg.HEAD.size + 1, len(a) - 4):
        with pytest.raises(ValueError, match="corrupted stream"):
            quant.dequantize(quant.SplitKV(s.config, s.kind, s.shape, s.dtype, a[:cut], None, s.meta, s.axis))
    wrong_shape = quant.SplitKV(s.config, s.kind, (1, 3, 299, 64), s.dtype, a, None, {"scale": s.meta["scale"][:, 1:]})
    with pytest.raises(ValueError, match="corrupted stream"):
        quant.dequantize(wrong_shape)
    nan = quant.SplitKV(s.config, s.kind, s.shape, s.dtype, a, None, {"scale": s.meta["scale"] * float("nan")})
    with pytest.raises(ValueError, match="NaN"):
        quant.dequantize(nan)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="needs layer"):
        quant.encode(kv_like(), CG, "key")
    with pytest.raises(ValueError, match="layer must be"):
        quant.encode(kv_like(), CG, "key", layer=(3, 2))
    x = kv_like()
    x[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quant.encode(x, CG, "key", layer=(0, 2))
    z = quant.encode(torch.zeros(1, 2, 10, 8), CG, "key", layer=(0, 2))   # all-zero tokens: no division by zero
    assert torch.equal(quant.dequantize(z), torch.zeros(1, 2, 10, 8))


def test_batch_maps_code_the_rows_again_exactly():
    s = quant.encode(kv_like(B=2), CG, "key", layer=(0, 2))
    full = quant.dequantize(s)
    rep = cg.select(s, lambda t: t.repeat_interleave(2, 0))
    assert rep.shape[0] == 4 and torch.equal(quant.dequantize(rep), full.repeat_interleave(2, 0))
    one = cg.select(s, lambda t: t[torch.tensor([1])])
    assert torch.equal(quant.dequantize(one), full[1:])


def test_wire_checks_a_coded_segment(tiny):
    s = quant.encode(kv_like(S=40, H=2, D=16), CG, "key", layer=(0, 2))
    payload = serde.pack_segment(0, "key", 0, s, "anchor")
    layer, kind, axis, start, count, tensors = serde.unpack_segment(payload)
    back = serde.to_split(tensors, CG, kind, axis, (1, 2, count, 16), torch.float32)
    assert torch.equal(quant.dequantize(back), quant.dequantize(s))
    huge = {**tensors, "codes": torch.zeros(cg.max_nbytes((1, 2, 40, 16)) + 1, dtype=torch.uint8)}
    with pytest.raises(WireError, match="exceeds the bound"):
        serde.to_split(huge, CG, kind, axis, (1, 2, 40, 16), torch.float32)
    with pytest.raises(WireError, match="do not match"):
        serde.to_split({**tensors, "scale": tensors["scale"][:, :-1]}, CG, kind, axis, (1, 2, 40, 16), torch.float32)


@torch.inference_mode()
def test_a_cachegen_cache_decodes_its_reconstruction(tiny):
    """In a LynxCache, CacheGen's prompt KV is exactly its dequantized KV: generation equals generation on an identity
    cache holding that reconstruction; its bytes are the coded streams'."""
    ids = torch.randint(3, 96, (1, 50), generator=torch.Generator().manual_seed(2))
    kv, logits = prefill(tiny, ids)
    n = len(kv)
    splits = [(quant.encode(k, CG, "key", layer=(i, n)), quant.encode(v, CG, "value", layer=(i, n)))
              for i, (k, v) in enumerate(kv)]
    rec = [(quant.dequantize(a), quant.dequantize(b)) for a, b in splits]
    c1 = LynxCache.from_kv(tiny, 50, kv, logits, CG).pin_tier("full")
    c2 = LynxCache.from_kv(tiny, 50, rec, logits, Q(method="identity")).pin_tier("full")
    g1 = tiny.generate(ids, cache=c1, max_new_tokens=8, do_sample=False)
    g2 = tiny.generate(ids, cache=c2, max_new_tokens=8, do_sample=False)
    assert torch.equal(g1, g2)
    assert c1.nbytes() == sum(a.nbytes() + b.nbytes() for a, b in splits)


def test_cachegen_over_tcp_sends_its_coded_bytes(tiny):
    """Two endpoints on loopback: the bytes received are the coded streams of every segment, and the output is the
    in-process CacheGen cache's."""
    from lynx_hf.transfer import server as S
    from lynx_hf.transfer.decode import DecodeClient
    from lynx_hf.transfer.wire import SEGMENT_TOKENS

    ids = torch.randint(3, 96, (1, 300), generator=torch.Generator().manual_seed(3))
    kv, logits = prefill(tiny, ids)
    n = len(kv)
    want = sum(quant.encode(x[:, :, o:o + SEGMENT_TOKENS].contiguous(), CG, kind, layer=(i, n)).nbytes()
               for i, (k, v) in enumerate(kv) for kind, x in (("key", k), ("value", v))
               for o in range(0, 300, SEGMENT_TOKENS))
    local = tiny.generate(ids, cache=LynxCache.from_kv(tiny, 300, kv, logits, CG).pin_tier("full"),
                          max_new_tokens=6, do_sample=False)[0, 300:].tolist()
    srv = S.PrefillServer(tiny, secret="cg").start()
    try:
        cli = DecodeClient(tiny, *srv.address, secret="cg")
        got = cli.generate(ids[0].tolist(), CG, max_new_tokens=6)
        cli.close()
    finally:
        srv.close()
    assert got["bytes"] == want and got["tokens"] == local
