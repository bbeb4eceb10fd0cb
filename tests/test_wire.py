"""Wire format and segment serde: exact round trips (tolerance 0), and every malformed input → WireError."""
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lynx_hf import LynxQuantConfig as Q
from lynx_hf.quant import encode
from lynx_hf.transfer.serde import (check_residual, pack_bundle, pack_segment, to_split, unpack_bundle,
                                   unpack_segment)
from lynx_hf.transfer.wire import (HEADER, MAX_PAYLOAD, VERSION, Frame, FrameType, SequenceChecker, Stream, WireError,
                                   parse_frame, encode_frame, json_frame)


def test_frame_roundtrip_exact():
    buf = encode_frame(FrameType.SEGMENT, Stream.RESIDUAL, 7, 3, b"\x00\x01payload")
    f = parse_frame(buf)
    assert ((f.type, f.stream, f.request_id, f.seq, f.payload)
            == (FrameType.SEGMENT, Stream.RESIDUAL, 7, 3, b"\x00\x01payload"))
    assert parse_frame(json_frame(FrameType.OK, 1, 0, {"mac": "5"})).json() == {"mac": "5"}
    with pytest.raises(WireError, match="limit of 4096"):  # e.g. before the handshake: refused from the header
        parse_frame(encode_frame(FrameType.HELLO, Stream.CONTROL, 0, 0, bytes(5000)), limit=4096)


@pytest.mark.parametrize("mutate,msg", [
    (lambda b: b[:10], "truncated header"),
    (lambda b: b[:-3], "truncated frame"),
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum"),
    (lambda b: b"XXXX" + b[4:], "magic"),
    (lambda b: b[:4] + bytes([VERSION + 1]) + b[5:], "version"),
    (lambda b: b[:5] + bytes([77]) + b[6:], "unknown frame type"),
    (lambda b: b[:16] + struct.pack("<I", MAX_PAYLOAD + 1) + b[20:], "exceeds the limit"),
    (lambda b: b + b"x", "trailing"),
])
def test_bad_frames(mutate, msg):
    good = encode_frame(FrameType.SEGMENT, Stream.ANCHOR, 1, 0, b"0123456789")
    with pytest.raises(WireError, match=msg):
        parse_frame(mutate(good))


def test_sequence_checker_catches_duplicates_and_gaps():
    c = SequenceChecker()
    f = lambda seq: Frame(FrameType.SEGMENT, Stream.ANCHOR, 1, seq, b"")
    c.check(f(0))
    with pytest.raises(WireError, match="duplicated"):
        c.check(f(0))
    with pytest.raises(WireError, match="out-of-order"):
        c.check(f(2))


def test_json_payload_must_be_an_object():
    with pytest.raises(WireError, match="JSON"):
        parse_frame(encode_frame(FrameType.FIRST, Stream.CONTROL, 0, 0, b"\xff\xfe")).json()
    with pytest.raises(WireError, match="object"):
        parse_frame(encode_frame(FrameType.FIRST, Stream.CONTROL, 0, 0, b"[1,2]")).json()


@pytest.mark.parametrize("cfg", [Q(), Q(key_axis="token"), Q.paper(), Q(method="kivi4"), Q(method="int8"),
                                 Q(method="bf16"), Q(method="identity")], ids=lambda c: c.method + c.key_axis)
def test_segment_serde_roundtrip_exact(cfg):
    x = torch.randn(1, 3, 100, 64)
    s = encode(x, cfg, "key")
    layer, kind, axis, start, count, t = unpack_segment(pack_segment(4, "key", 256, s, "anchor"))
    assert (layer, kind, start, count) == (4, "key", 256, 100)
    back = to_split(t, cfg, kind, axis, (1, 3, count, 64), torch.float32)
    assert torch.equal(back.anchor, s.anchor) and back.meta.keys() == s.meta.keys()
    assert all(torch.equal(back.meta[k], s.meta[k]) for k in s.meta)
    if s.residual is not None:
        *_, tr = unpack_segment(pack_segment(4, "key", 256, s, "residual"))
        assert torch.equal(check_residual(tr, cfg, "key", axis, (1, 3, 100, 64), torch.float32), s.residual)


def test_a_segment_with_wrong_shapes_is_refused():
    s = encode(torch.randn(1, 3, 100, 64), Q(), "key")
    *_, axis, _, _, t = unpack_segment(pack_segment(0, "key", 0, s, "anchor"))
    with pytest.raises(WireError, match="do not match"):
        to_split(t, Q(), "key", axis, (1, 3, 101, 64), torch.float32)  # a peer lying about the token count
    with pytest.raises(WireError, match="do not match"):
        check_residual(t, Q(), "key", axis, (1, 3, 100, 64), torch.float32)  # anchor tensors as a residual


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_random_bytes_only_raise_wire_error(data):
    try:
        f = parse_frame(data)
    except WireError:
        return
    assert isinstance(f, Frame)


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 255), st.binary(min_size=1, max_size=8))
def test_fuzz_every_mutated_frame_is_rejected(pos, flip, extra):
    """A changed byte anywhere (CRC32 catches every burst of up to 32 bits), a cut, or trailing bytes: WireError."""
    s = encode(torch.randn(1, 3, 8, 64), Q(), "key")
    good = encode_frame(FrameType.SEGMENT, Stream.ANCHOR, 1, 0, pack_segment(0, "key", 0, s, "anchor"))
    bad = bytearray(good)
    bad[pos % len(bad)] ^= flip
    for buf in (bytes(bad), good + extra, good[: pos % len(good)]):
        with pytest.raises(WireError):
            parse_frame(buf)


def _authenticated_pair():
    from lynx_hf.transfer.auth import Channel
    from lynx_hf.transfer.transport import InProcTransport

    a, b = InProcTransport.pair()
    server, client = Channel(a), Channel(b)
    server.authenticate(b"k", "n" * 32, "m" * 32, "prefill")
    client.authenticate(b"k", "n" * 32, "m" * 32, "decode")
    return server, client, a


def test_frame_macs_reject_forgery_reflection_and_untagged_frames():
    server, client, raw = _authenticated_pair()
    server.send_json(FrameType.PROMPT, {"prompt_len": 3}, 1)
    assert client.recv(5, FrameType.PROMPT).json() == {"prompt_len": 3}
    # an on-path host rewrites the payload and fixes the CRC: the tag no longer matches
    frame = server._frame(FrameType.PROMPT, Stream.CONTROL, 1, b'{"prompt_len":3}')
    f = parse_frame(frame)
    forged = encode_frame(f.type, f.stream, f.request_id, f.seq, b'{"prompt_len":9}' + f.payload[-16:], f.flags)
    raw.send(forged)
    with pytest.raises(WireError, match="fails its MAC"):
        client.recv(5)
    _, client, raw = _authenticated_pair()
    raw.send(client._frame(FrameType.PROMPT, Stream.CONTROL, 1, b"{}"))  # the client's own frame, reflected
    with pytest.raises(WireError, match="fails its MAC"):
        client.recv(5)
    _, client, raw = _authenticated_pair()
    raw.send(encode_frame(FrameType.PROMPT, Stream.CONTROL, 1, 0, b"{}"))  # injected without a tag
    with pytest.raises(WireError, match="without a MAC"):
        client.recv(5)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_segment_payloads(data):
    try:
        unpack_segment(data)
    except WireError:
        pass


def test_a_bundle_carries_its_segments_exactly_and_a_malformed_one_is_refused():
    parts = [b"a", b"bc" * 100, bytes(range(256))]
    assert [bytes(p) for p in unpack_bundle(pack_bundle(parts), 3, 512)] == parts
    good = pack_bundle(parts)
    bad = {"too short": b"\x01", "0 segments": pack_bundle([]), "4 segments": pack_bundle(parts + [b"d"]),
           "over its bound": pack_bundle([b"x" * 513]), "empty segment": pack_bundle([b""]),
           "truncated": good[:-1], "trailing": good + b"\x00", "lying length": good[:2] + struct.pack("<I", 9999)
           + good[6:]}
    for why, data in bad.items():
        with pytest.raises(WireError):
            unpack_bundle(data, 3, 512)
            pytest.fail(why)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_bundles(data):
    try:
        for p in unpack_bundle(data, 8, 64):
            assert 1 <= len(p) <= 64
    except WireError:
        pass


def test_header_is_24_bytes():
    assert HEADER.size == 24
