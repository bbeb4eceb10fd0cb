"""The codec's exact invariants (tolerance 0) and its error handling; quality on synthetic data."""
import pytest
import torch

from lynx_hf import LynxQuantConfig as Q
from lynx_hf import quant
from lynx_hf.errors import ConfigError
from lynx_hf.quant import lynx as L
from lynx_hf.quant.pack import join_codes, pack2, pack4, pack_bits, split_codes, unpack2, unpack4, unpack_bits
from lynx_hf.quant.tables import tables

ALL = [Q(), Q(key_axis="token"), Q(alpha=0.0), Q.paper(), Q.paper(key_axis="token"), Q(method="bf16"),
       Q(method="int8"), Q(method="kivi4"), Q(method="kivi3"), Q(method="kivi2"), Q(method="identity"),
       Q(anchor_bits=3), Q(anchor_bits=2, key_axis="token"), Q.paper(anchor_bits=3)]


def kv(S=300, B=2, H=3, D=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, S, D, generator=g) * torch.linspace(0.2, 4, D)  # channel-scaled
    x[:, :, 0] *= 25  # an attention-sink-like token
    return x.to(dtype)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_bits_lossless_at_every_width(bits):
    """Packing is exact (tolerance 0) at every width an anchor or residual takes, and at 4 and 2 bits it is
    the nibble / quarter-byte layout the baselines use."""
    D = 64 if bits % 2 else 20 if bits != 8 else 7
    c = torch.randint(0, 1 << bits, (3, 5, 7, D), dtype=torch.uint8)
    p = pack_bits(c, bits)
    assert p.shape[-1] * 8 == D * bits and torch.equal(unpack_bits(p, bits), c)
    if bits in (2, 4):
        assert torch.equal(p, pack4(c) if bits == 4 else pack2(c))
    if bits == 3:  # code i of a group of 8 at bits [3i, 3i + 3) of the group's little-endian 24-bit word
        w = sum(int(p[0, 0, 0, k]) << (8 * k) for k in range(3))
        assert [(w >> (3 * i)) & 7 for i in range(8)] == c[0, 0, 0, :8].tolist()
    if bits != 8:
        with pytest.raises(ValueError, match="must be (even|a multiple of [48]) to pack"):
            pack_bits(torch.zeros(1, 3, dtype=torch.uint8), bits)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_narrow_lynx_anchor_is_a_rounded_code_and_rebuilds_the_8bit_code(bits):
    """At every width the "lynx" anchor is round((2^b − 1)·t) of the companded value t (a plain rounded b-bit
    code with both ends), and anchor · 2^(8−b) + residual is the 8-bit code the thresholds give."""
    cfg = Q(anchor_bits=bits)
    x = kv()
    s = quant.encode(x, cfg, "key")
    u = L.normalise(x, None, None, s.meta["mu"], s.meta["sigma"], axis=s.axis, page=cfg.page_size,
                    chunk=cfg.chunk_size)
    thr = tables(cfg.method, cfg.alpha, cfg.anchor, bits)[0]
    codes = L.codes_from_u(u, thr, False)
    a, r = unpack_bits(s.anchor, bits), unpack_bits(s.residual, 8 - bits)
    assert torch.equal(join_codes(a, r, bits), codes) and torch.equal(split_codes(codes, bits)[0], a)
    y = torch.sign(u) * torch.log1p(cfg.alpha * u.abs()) / torch.log1p(torch.tensor(cfg.alpha))
    t = (y.double() + 1) / 2
    near_edge = ((t * ((1 << bits) - 1)) % 1 - 0.5).abs() < 1e-4  # float rounding at a cell's edge
    want = (t * ((1 << bits) - 1)).round().clamp(0, (1 << bits) - 1)
    assert torch.equal(a.double()[~near_edge], want[~near_edge])
    assert s.anchor.shape[-1] == 64 * bits // 8 and s.residual.shape[-1] == 64 * (8 - bits) // 8


def test_anchor_bits_config_rules():
    assert "anchor_bits" not in Q().to_dict() and Q.from_dict(Q(anchor_bits=3).to_dict()) == Q(anchor_bits=3)
    assert Q(anchor_bits=3) != Q() and Q.paper(anchor_bits=2).anchor_bits == 2
    for bad, msg in ((dict(anchor_bits=5), "anchor_bits must be one of"), (dict(anchor_bits=True), "one of"),
                     (dict(method="int8", anchor_bits=3), "applies to method")):
        with pytest.raises(ConfigError, match=msg):
            Q(**bad)
    with pytest.raises(ValueError, match="multiple of 8 to pack 3-bit"):
        quant.encode(kv(D=20), Q(anchor_bits=3), "key")
    with pytest.raises(ValueError, match="multiple of 8 to pack 3-bit"):
        quant.stream_shapes(Q(anchor_bits=3), "key", (1, 3, 10, 20), torch.float32, axis="channel")


def test_pack_unpack_lossless():
    c = torch.randint(0, 16, (3, 5, 7, 64), dtype=torch.uint8)
    assert torch.equal(unpack4(pack4(c)), c)
    c2 = torch.randint(0, 4, (3, 5, 7, 64), dtype=torch.uint8)
    assert torch.equal(unpack2(pack2(c2)), c2)
    full = torch.arange(256, dtype=torch.uint8)
    a, r = split_codes(full)
    assert torch.equal(join_codes(a, r), full) and int(a.max()) == 15 and int(r.max()) == 15


@pytest.mark.parametrize("method", ["lynx", "paper"])
def test_tables_monotone_and_idempotent(method):
    cfg = Q() if method == "lynx" else Q.paper()
    thr, full, anc = tables(cfg.method, cfg.alpha, cfg.anchor)
    assert (thr[1:] >= thr[:-1]).all()
    # encoding a full-tier reconstruction gives back its own code (every reachable code is a fixed point)
    codes = torch.arange(256)
    u = full[codes]
    back = L.codes_from_u(u, thr, method == "paper").long()
    reach = (u.abs() <= 1.0 + 1e-6)
    if method == "paper":
        reach[128] = False  # "-0" re-encodes as "+0": the sign-magnitude code wastes a level
    assert torch.equal(back[reach], codes[reach])


@pytest.mark.parametrize("cfg", [Q(), Q(key_axis="token"), Q.paper()], ids=["lynx-ch", "lynx-tok", "paper"])
def test_anchor_and_residual_rebuild_the_8bit_code(cfg):
    x = kv()
    s = quant.encode(x, cfg)
    m = s.meta
    u = L.normalise(x, m.get("gamma_min"), m.get("gamma_scale"), m["mu"], m["sigma"], axis=s.axis,
                    page=cfg.page_size, chunk=cfg.chunk_size)
    codes = L.codes_from_u(u, tables(cfg.method, cfg.alpha, cfg.anchor)[0], cfg.method == "paper")
    assert torch.equal(join_codes(unpack4(s.anchor), unpack4(s.residual)), codes)


@pytest.mark.parametrize("cfg", ALL, ids=lambda c: f"{c.method}-{c.key_axis}")
@pytest.mark.parametrize("S", [1, 63, 65, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shape_dtype_determinism_any_length(cfg, S, dtype):
    x = kv(S=S, dtype=dtype)
    s1, s2 = quant.encode(x, cfg), quant.encode(x, cfg)
    assert torch.equal(s1.anchor, s2.anchor)
    for tier in ("anchor", "full"):
        a, b = quant.dequantize(s1, tier), quant.dequantize(s2, tier)
        assert a.shape == x.shape and a.dtype == x.dtype
        assert torch.equal(a, b)
    if cfg.method == "identity":
        assert torch.equal(quant.dequantize(s1), x)


def test_error_ordering_and_bits():
    x = kv(S=512)
    err = lambda y: float((y.float() - x).pow(2).sum() / x.pow(2).sum())
    s = quant.encode(x, Q())
    ea, ef = err(quant.dequantize(s, "anchor")), err(quant.dequantize(s, "full"))
    e2 = err(quant.dequantize(quant.encode(x, Q(method="kivi2"))))
    assert ef < ea / 50 < e2 / 50
    assert s.bits_per_value("anchor") <= 4.5 and s.bits_per_value("full") <= 8.5
    assert s.nbytes("full") - s.nbytes("anchor") == s.residual.numel() == x.numel() // 2


def test_auto_axis_picks_channel_for_outlier_channels():
    x = torch.randn(1, 2, 256, 64)
    x[..., 5] *= 30
    assert L.choose_axis(x) == "channel"
    y = torch.randn(1, 2, 256, 64) * torch.rand(1, 1, 256, 1) * 5
    assert L.choose_axis(y) == "token"


@pytest.mark.parametrize("cfg", [Q(), Q(anchor_bits=2), Q(key_axis="token"), Q(method="int8"), Q(method="kivi4"),
                                 Q(method="bf16"), Q(method="identity"), Q(method="paper"), Q(exact=True),
                                 Q(method="cachegen")],
                         ids=lambda c: f"{c.method}-{c.anchor_bits}-{c.key_axis}-{c.exact}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_rows_is_each_row_encoded_alone(cfg, dtype):
    """Tolerance 0: every tensor, the shape and the axis of each row's code equal its own encode, rows choosing
    different "auto" axes among them (rows 0 and 3 have outlier channels, the others token-scaled)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, 64, generator=g) * torch.rand(5, 1, 64, 1, generator=g) * 5
    x[[0, 3], ..., 7] *= 40
    x = x.to(dtype)
    for kind in ("key", "value"):
        rows = quant.encode_rows(x, cfg, kind, layer=(2, 30))
        assert len(rows) == 5
        for i, got in enumerate(rows):
            want = quant.encode(x[i:i + 1].contiguous(), cfg, kind, layer=(2, 30))
            assert (got.shape, got.dtype, got.axis, got.meta.keys()) == (want.shape, want.dtype, want.axis,
                                                                        want.meta.keys())
            for a, b in [(got.anchor, want.anchor), (got.residual, want.residual), (got.correction, want.correction),
                         *((got.meta[k], want.meta[k]) for k in want.meta)]:
                assert (a is None and b is None) or torch.equal(a, b)
    if cfg == Q():
        assert {r.axis for r in quant.encode_rows(x, cfg, "value")} == {"channel", "token"}
    x[2, 1, 5, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quant.encode_rows(x, cfg, "key", layer=(2, 30))


@pytest.mark.parametrize("bad,msg", [
    (lambda x: x.clone().index_put_((torch.tensor([0]),), torch.tensor(float("nan"))), "NaN"),
    (lambda x: x.clone().fill_(float("inf")), "NaN or Inf"),
    (lambda x: x[0], "rank 4"),
    (lambda x: x.to(torch.int32), "dtype"),
    (lambda x: x[:, :, :0], "empty"),
    (lambda x: x[..., :63], "even"),
    (lambda x: x * 1e6, "fp16"),
])
def test_bad_input_raises_value_error(bad, msg):
    with pytest.raises(ValueError, match=msg):
        quant.encode(bad(kv(S=16)), Q())


@pytest.mark.parametrize("kw,msg", [({"method": "int3"}, "method"), ({"alpha": -1.0}, "alpha"),
                                    ({"chunk_size": 0}, "chunk_size"), ({"page_size": 100}, "multiple"),
                                    ({"key_axis": "diag"}, "key_axis"), ({"anchor": "x"}, "anchor")])
def test_bad_config_raises(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Q(**kw)


def test_dequantize_errors():
    s = quant.encode(kv(S=8), Q())
    with pytest.raises(ValueError, match="tier"):
        quant.dequantize(s, "half")
    s.residual = None
    with pytest.raises(ValueError, match="residual"):
        quant.dequantize(s, "full")
    assert quant.dequantize(s, "anchor").shape == (2, 3, 8, 64)


def test_config_roundtrip():
    c = Q(alpha=1.0, chunk_size=32)
    assert Q.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="unknown"):
        Q.from_dict({"alpha": 1.0, "bogus": 1})


@pytest.mark.parametrize("cfg", [Q(), Q(alpha=0.0), Q(alpha=8.0), Q.paper(), Q.paper(alpha=3.0)],
                         ids=["lynx", "lynx-a0", "lynx-a8", "paper", "paper-a3"])
def test_arithmetic_codes_equal_threshold_search(cfg):
    thr, _, _ = tables(cfg.method, cfg.alpha, cfg.anchor)
    g = torch.Generator().manual_seed(0)
    u = torch.cat([torch.rand(200_000, generator=g) * 2.2 - 1.1,  # beyond ±1 too
                   thr, torch.nextafter(thr, torch.tensor(-2.0)), torch.nextafter(thr, torch.tensor(2.0)),
                   -thr, torch.tensor([0.0, -0.0, 1.0, -1.0])])
    sm = cfg.method == "paper"
    assert torch.equal(L.codes_from_u_fast(u, thr, sm, cfg.alpha), L.codes_from_u(u, thr, sm))


def test_fast_encode_equals_reference_encode():
    x = kv(S=300)
    for cfg in (Q(), Q.paper()):
        a, b = quant.encode(x, cfg), quant.encode(x, cfg, reference=True)
        assert torch.equal(a.anchor, b.anchor) and torch.equal(a.residual, b.residual)


GEOMETRIES = [(1, 3, 100, 64), (2, 2, 1, 16), (1, 1, 257, 128), (3, 4, 64, 8), (1, 2, 300, 24)]
SHAPE_CONFIGS = ALL + [Q(key_axis="auto", value_axis="auto"), Q(chunk_size=32), Q.paper(page_size=512),
                       Q.paper(chunk_size=16, page_size=48), Q(method="kivi4", group_size=32),
                       Q(method="kivi2", group_size=128), Q(method="int8", group_size=10), Q(method="cachegen")]


@pytest.mark.parametrize("cfg", SHAPE_CONFIGS, ids=lambda c: f"{c.method}-{c.key_axis}-{c.chunk_size}-{c.group_size}")
@pytest.mark.parametrize("geom", GEOMETRIES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_stream_shapes_equal_a_real_encode(cfg, geom, dtype):
    """`stream_shapes` (no encode) gives exactly the tensors an encode of that geometry produces: every shape, dtype
    and byte count, both tiers (tolerance 0); a coded anchor (CacheGen) within its bound."""
    if cfg.method == "kivi2" and geom[3] % 4:
        pytest.skip("KIVI-2 packs four codes a byte")
    x = kv(S=geom[2], B=geom[0], H=geom[1], D=geom[3], dtype=dtype)
    for kind in ("key", "value"):
        s = quant.encode(x, cfg, kind, layer=(0, 2))
        want = quant.stream_shapes(cfg, kind, geom, dtype, axis=s.axis if quant.codec(cfg).split else None)
        assert want.axis == s.axis
        sig = lambda t: (tuple(t.shape), t.dtype)
        assert {k: m.signature for k, m in want.meta.items()} == {k: sig(v) for k, v in s.meta.items()}
        assert (want.residual is None) == (s.residual is None)
        if s.residual is not None:
            assert want.residual.signature == sig(s.residual)
        if want.coded:
            assert s.anchor.dtype == want.anchor.dtype and s.anchor.dim() == 1
            assert s.anchor.numel() <= want.anchor.nbytes and s.nbytes("full") <= want.nbytes("full")
        else:
            assert want.anchor.signature == sig(s.anchor)
            assert all(want.nbytes(t) == s.nbytes(t) for t in quant.TIERS)


@pytest.mark.parametrize("cfg", [Q(), Q.paper(), Q(key_axis="token")], ids=lambda c: c.method + c.key_axis)
def test_stream_shapes_follow_the_declared_axis(cfg):
    for axis in ("channel", "token"):
        s = quant.encode(kv(S=90), Q(**{**cfg.to_dict(), "key_axis": axis}), "key")
        want = quant.stream_shapes(cfg, "key", (2, 3, 90, 64), torch.float32, axis=axis)
        assert ({k: m.signature for k, m in want.meta.items()}
                == {k: (tuple(v.shape), v.dtype) for k, v in s.meta.items()})


@pytest.mark.parametrize("call, msg", [
    (lambda: quant.stream_shapes(Q(), "key", (1, 3, 10), torch.float32), "rank 4"),
    (lambda: quant.stream_shapes(Q(), "key", (1, 3, 0, 64), torch.float32), "empty"),
    (lambda: quant.stream_shapes(Q(), "key", (1, 3, 10, 64), torch.int8), "dtype"),
    (lambda: quant.stream_shapes(Q(), "key", (1, 3, 10, 63), torch.float32), "even"),
    (lambda: quant.stream_shapes(Q(), "key", (1, 3, 10, 64), torch.float32, axis=""), "axis"),
    (lambda: quant.stream_shapes(Q(key_axis="auto"), "key", (1, 3, 10, 64), torch.float32), "axis"),
    (lambda: quant.stream_shapes(Q(), "keys", (1, 3, 10, 64), torch.float32), "kind"),
])
def test_stream_shapes_refuse_what_encode_refuses(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


def test_decode_is_dequantize_under_its_old_name_with_a_warning():
    s = quant.encode(kv(S=8), Q())
    with pytest.warns(DeprecationWarning, match="dequantize"):
        old = quant.decode(s, "anchor")
    assert torch.equal(old, quant.dequantize(s, "anchor"))
    with pytest.warns(DeprecationWarning, match="dequantize"):
        assert quant.codec(Q()).decode is quant.codec(Q()).dequantize
