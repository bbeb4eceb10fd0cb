"""Content-determined blocks (issue 64 item 1): in method `lynx` nothing spans chunks, so a full chunk's 8-bit code
(its anchor, its residual) and its statistics are a function of that chunk's KV alone. Two prompts that share a
prefix therefore encode every full chunk of the shared part bit for bit alike (tolerance 0), for every anchor width
and both axes — whether the KV is encoded whole or in the transfer's SEGMENT_TOKENS segments (vLLM's publisher) —
and the padding of a partial last chunk never touches a full one. This is what lets a decode instance's cached
full-tier block of turn n stand for the block turn n + 1 would ship (block_size a multiple of chunk_size)."""
import pytest
import torch

from lynx_hf import LynxQuantConfig as Q
from lynx_hf.quant import encode
from lynx_hf.transfer.wire import SEGMENT_TOKENS

C = 64
SHARED = 448  # 7 full chunks; the tails differ in length and content (a partial last chunk in both)


def _kv(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 3, n, 64, generator=g)
    x[:, :, :, 5] *= 12  # an outlier channel (keys' rotary ones), which only widens its own chunks
    return x


def _pair() -> tuple[torch.Tensor, torch.Tensor]:
    shared = _kv(0, SHARED)
    a, b = _kv(1, 252), _kv(2, 300) * 40  # b's tail far wider: a chunk spanning both would show it
    return torch.cat([shared, a], 2), torch.cat([shared, b], 2)


def _chunks(x: torch.Tensor, cfg: Q, kind: str, segment: int | None) -> list[tuple]:
    """Per full chunk of the shared part: (anchor, residual, its statistics), encoded whole or segment by segment."""
    step = segment or x.shape[2]
    parts = [(off, encode(x[:, :, off:off + step].contiguous(), cfg, kind)) for off in range(0, x.shape[2], step)]
    out = []
    for c in range(SHARED // C):
        lo = c * C
        off, s = next((o, s) for o, s in parts if o <= lo < o + s.shape[2])
        i = lo - off
        if s.axis == "channel":
            stats = (s.meta["mu"][:, :, i // C], s.meta["sigma"][:, :, i // C])
        else:
            stats = (s.meta["mu"][:, :, i:i + C], s.meta["sigma"][:, :, i:i + C])
        out.append((s.axis, s.anchor[:, :, i:i + C], s.residual[:, :, i:i + C], *stats))
    return out


@pytest.mark.parametrize("segment", [None, SEGMENT_TOKENS], ids=["whole", "segments"])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("kind", ["key", "value"])
def test_a_full_chunk_of_a_shared_prefix_encodes_alike_whatever_follows(kind, bits, axis, segment):
    cfg = Q(anchor_bits=bits, chunk_size=C, key_axis=axis, value_axis=axis)
    x, y = _pair()
    for c, (p, q) in enumerate(zip(_chunks(x, cfg, kind, segment), _chunks(y, cfg, kind, segment))):
        assert p[0] == q[0] == axis
        for name, u, v in zip(("anchor", "residual", "mu", "sigma"), p[1:], q[1:]):
            assert torch.equal(u, v), f"chunk {c}: {name} differs"


@pytest.mark.parametrize("method", ["lynx", "int8", "kivi4", "bf16"])
def test_the_vllm_stream_carries_a_full_segment_of_a_shared_prefix_byte_for_byte_alike(method):
    """What vLLM's publisher sends (stream.encode_layer: segments of segment_tokens on an absolute grid, the
    default 'auto' axes chosen per segment) is a function of each segment's own KV: every full segment of a shared
    prefix is the same frame payload, whatever follows it, so a decode instance's cached block of turn n holds
    exactly what turn n + 1 would ship."""
    from lynx_hf.vllm.stream import encode_layer, segment_tokens

    cfg = Q(method=method)
    x, y = _pair()
    fx, fy = encode_layer(cfg, 1, 3, x, x * 0.5), encode_layer(cfg, 1, 3, y, y * 0.5)
    full = lambda frames: [(st, off, p) for st, off, p in frames if off + segment_tokens(cfg) <= SHARED]  # noqa: E731
    assert full(fx) == full(fy) and len(full(fx)) == (SHARED // segment_tokens(cfg)) * 2 * (1 + (method == "lynx"))
    assert {(st, off) for st, off, _ in fx} != {(st, off) for st, off, _ in fy}  # (the tails differ in length)
