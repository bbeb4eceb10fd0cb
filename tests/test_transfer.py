"""Prefill and decode over real loopback sockets: lossless output, handshake refusals, a server that survives bad
clients, and peers that vanish or go silent mid-stream (a clear error, never an unverified token as final)."""
import os
import socket
import time

import pytest
import torch

import lynx_hf
from lynx_hf import LoaderError, LynxCache, LynxQuantConfig as Q
from lynx_hf.transfer import server as S
from lynx_hf.transfer.decode import DecodeClient, NetworkLoader
from lynx_hf.transfer.auth import Channel
from lynx_hf.transfer.transport import InProcTransport, TcpTransport
from lynx_hf.transfer.wire import FrameType, Stream, WireError, encode_frame


@pytest.fixture(scope="module")
def server(model_and_tok):
    model, _ = model_and_tok
    srv = S.PrefillServer(model, secret="s3cret", bandwidth_bps=200e6).start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def prompt(shakespeare_ids):
    return shakespeare_ids[0, :300].tolist()


def test_lossless_over_tcp_and_same_as_in_process(server, model_and_tok, prompt):
    model, _ = model_and_tok
    cli = DecodeClient(model, *server.address, secret="s3cret")
    spec = cli.generate(prompt, Q(), max_new_tokens=12)
    ref = cli.generate(prompt, Q(), max_new_tokens=12, speculative=False)
    cli.close()
    assert spec["tokens"] == ref["tokens"] and len(spec["tokens"]) == 12  # the first token counts
    cache, _ = LynxCache.from_prefill(model, torch.tensor([prompt]), residual_after_steps=0)
    local = model.generate(torch.tensor([prompt]), cache=cache, custom_generate=lynx_hf.speculative_generate,
                           max_new_tokens=12, do_sample=False)
    assert spec["tokens"] == local[0, len(prompt):].tolist()
    kinds = [e[1] for e in spec["events"]]
    assert kinds.count("anchor") == kinds.count("residual") == 30 * 2 * 2  # 30 layers × K/V × 2 segments


def test_generation_options_apply_to_the_first_token_over_the_wire(server, model_and_tok, prompt):
    """The prefill ships its logits, so the decode side's options decide the first token too."""
    model, _ = model_and_tok
    ids = prompt[:80]
    first = int(model.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False)[0, -1])
    opt = {"suppress_tokens": [first], "repetition_penalty": 1.3}
    plain = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, **opt)[0, len(ids):].tolist()
    cli = DecodeClient(model, *server.address, secret="s3cret")
    assert cli.generate(ids, Q(method="identity"), max_new_tokens=5, **opt)["tokens"] == plain
    firsts = {cli.generate(ids, Q(), max_new_tokens=1, do_sample=True, temperature=3.0, top_k=0)["tokens"][0]
              for _ in range(8)}
    cli.close()
    assert len(firsts) >= 3  # sampled, not the prefill's argmax


def test_sliding_window_model_over_tcp():
    """A sliding layer ships only its window's positions; the output is plain generate's (identity codec) and
    drafting changes nothing (default codec)."""
    import transformers as tf

    torch.manual_seed(0)
    m = tf.MistralForCausalLM(tf.MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                               sliding_window=8)).eval()
    ids = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = m.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, 40:].tolist()
    srv = S.PrefillServer(m, secret="w").start()
    try:
        cli = DecodeClient(m, *srv.address, secret="w")
        got = cli.generate(ids, Q(method="identity"), max_new_tokens=8)
        assert got["tokens"] == plain and {e[2] for e in got["events"]} == {0, 1, 2}
        # layers × K/V × batch × heads × window × head_dim × fp32
        assert got["bytes"] == 3 * 2 * 1 * 2 * 8 * 16 * 4
        assert cli.generate(ids, Q(), max_new_tokens=8)["tokens"] == cli.generate(ids, Q(), max_new_tokens=8,
                                                                                 speculative=False)["tokens"]
        cli.close()
    finally:
        srv.close()


def test_anchor_frames_overtake_queued_residual_frames():
    """While the (emulated) link is busy, every queued anchor frame leaves before any queued residual frame."""
    from lynx_hf.link import LinkEmulator
    from lynx_hf.transfer.transport import PRIO_ANCHOR, PRIO_RESIDUAL

    a, b = InProcTransport.pair(LinkEmulator(bandwidth_bps=8 * 20_000))  # 20 kB/s: 50 ms per 1 kB frame
    fr = lambda s, i: encode_frame(FrameType.SEGMENT, s, 1, i, bytes(1000))
    futs = [a.start_send(fr(Stream.RESIDUAL, i), PRIO_RESIDUAL) for i in range(4)]
    futs += [a.start_send(fr(Stream.ANCHOR, i), PRIO_ANCHOR) for i in range(4)]
    for f in futs:
        a.wait_send(f, 10)
    order = [b.recv(5).stream for _ in range(8)]
    # at most one residual frame (already on the wire when the anchors were queued) precedes the anchors
    assert order in ([Stream.ANCHOR] * 4 + [Stream.RESIDUAL] * 4,
                     [Stream.RESIDUAL] + [Stream.ANCHOR] * 4 + [Stream.RESIDUAL] * 3)


def test_handshake_refuses_wrong_secret_and_other_model(server, model_and_tok, monkeypatch):
    model, _ = model_and_tok
    with pytest.raises(WireError, match="authentication"):
        DecodeClient(model, *server.address, secret="wrong")
    from lynx_hf.transfer import decode as D

    monkeypatch.setattr(D, "fingerprint", lambda m: "0" * 32)
    with pytest.raises(WireError, match="model mismatch"):
        DecodeClient(model, *server.address, secret="s3cret")


def test_server_survives_garbage_and_serves_the_next_client(server, model_and_tok, prompt):
    model, _ = model_and_tok
    for junk in (b"\x00" * 64, os.urandom(4096), b"GET / HTTP/1.1\r\n\r\n", b"\xff\xff\xff\xff" * 8, b""):
        s = socket.create_connection(server.address, timeout=5)
        s.sendall(junk)
        s.close()
    # a client that speaks the protocol but sends a bad request
    cli = DecodeClient(model, *server.address, secret="s3cret")
    with pytest.raises(WireError):
        cli.ch.send_json(FrameType.REQUEST, {"input_ids": [10 ** 9]}, 1)
        cli.ch.recv(10, FrameType.PROMPT)
    cli.close()
    cli = DecodeClient(model, *server.address, secret="s3cret")
    assert len(cli.generate(prompt[:50], Q(), max_new_tokens=3)["tokens"]) == 3
    cli.close()


class _Vanishing(TcpTransport):
    """Server-side transport that drops the connection after `n` frames of one stream."""
    stream, n = Stream.ANCHOR, 5

    def _write(self, frame, priority):
        if frame[6] == self.stream and frame[5] == FrameType.SEGMENT:
            self.count = getattr(self, "count", 0) + 1
            if self.count > self.n:
                self.sock.shutdown(socket.SHUT_RDWR)
                raise ConnectionError("test: peer vanished")
        super()._write(frame, priority)


@pytest.mark.parametrize("stream,n", [(Stream.ANCHOR, 5), (Stream.RESIDUAL, 20)], ids=["mid-anchor", "mid-residual"])
def test_peer_vanishing_mid_stream_is_a_clear_error(model_and_tok, prompt, monkeypatch, stream, n):
    model, _ = model_and_tok
    cls = type("V", (_Vanishing,), {"stream": stream, "n": n})
    monkeypatch.setattr(S, "TcpTransport", cls)
    srv = S.PrefillServer(model, secret="x", bandwidth_bps=20e6).start()
    try:
        cli = DecodeClient(model, *srv.address, secret="x", timeout_s=10)
        streamer = lynx_hf.SpeculativeStreamer()
        t = time.monotonic()
        with pytest.raises((LoaderError, WireError, ConnectionError)) as e:
            cli.generate(prompt, Q(), max_new_tokens=30, lynx_streamer=streamer)
        assert time.monotonic() - t < 30
        assert "closed" in str(e.value) or "lost" in str(e.value) or "truncated" in str(e.value)
        # no unverified token ever became final: none, or only the first token (the prefill's exact logits), when
        # FIRST won the race against the frame at which the peer vanished
        first = model.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False)[0, -1].item()
        assert streamer.final in ([], [first]), streamer.final
        cli.close()
    finally:
        srv.close()


def _loader_over_inproc(frames):
    """Feed hand-made frames to a NetworkLoader; return the cache after the loader stopped."""
    a, b = InProcTransport.pair()
    prompt = {"num_layers": 1, "windows": [None], "batch": 1, "kv_heads": 3, "head_dim": 64, "dtype": "float32",
              "vocab": 10, "prompt_len": 64}
    cache = LynxCache(1, 64, Q(), timeout_s=5)
    NetworkLoader(Channel(b), prompt, rid=1, timeout_s=2).attach(cache)
    for f in frames:
        a.send(f)
    return cache


def _segments():
    from lynx_hf.quant import encode
    from lynx_hf.transfer.serde import pack_segment

    s = encode(torch.randn(1, 3, 64, 64), Q(), "key")
    return (encode_frame(FrameType.SEGMENT, Stream.ANCHOR, 1, 0, pack_segment(0, "key", 0, s, "anchor")),
            encode_frame(FrameType.SEGMENT, Stream.ANCHOR, 1, 1, pack_segment(0, "value", 0, s, "anchor")),
            encode_frame(FrameType.SEGMENT, Stream.ANCHOR, 1, 0, pack_segment(0, "value", 0, s, "anchor")))


@pytest.mark.parametrize("order,msg", [((0, 0), "duplicated"), ((1,), "out-of-order"), ((0, 2), "duplicated")])
def test_duplicated_and_reordered_frames_fail_the_cache(order, msg):
    fr = _segments()
    cache = _loader_over_inproc([fr[i] for i in order])
    with pytest.raises(LoaderError, match=msg):
        cache.wait_anchors(timeout=5)


def test_silent_peer_times_out():
    cache = _loader_over_inproc([_segments()[0]])
    t = time.monotonic()
    with pytest.raises(LoaderError, match="no frame"):
        cache.wait_anchors(timeout=10)
    assert time.monotonic() - t < 8


def _dist_worker(rank, port, q):
    import torch.distributed as dist

    from lynx_hf.transfer.transport import PRIO_ANCHOR, PRIO_RESIDUAL, DistTransport

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = DistTransport(peer=1 - rank)
    if rank == 0:
        futs = [t.start_send(encode_frame(FrameType.SEGMENT, Stream.RESIDUAL, 1, i, b"r" * 100), PRIO_RESIDUAL)
                for i in range(3)]
        futs += [t.start_send(encode_frame(FrameType.SEGMENT, Stream.ANCHOR, 1, i, b"a" * 10), PRIO_ANCHOR)
                 for i in range(3)]
        for f in futs:
            t.wait_send(f, 30)
        got = [(f.stream.name, f.seq, len(f.payload)) for f in (t.recv(30) for _ in range(2))]  # while it sends too
    else:
        t.start_send(encode_frame(FrameType.OK, Stream.CONTROL, 1, 0, b"{}"))
        t.start_send(encode_frame(FrameType.OK, Stream.CONTROL, 1, 1, b"{}"))
        got = [(f.stream.name, f.seq, len(f.payload)) for f in (t.recv(30) for _ in range(6))]
        t0 = time.monotonic()
        try:
            t.recv(timeout=0.5)  # nothing comes: a timeout, not a hang
        except TimeoutError:
            got.append(("timeout", time.monotonic() - t0 < 5))
    dist.barrier()
    t2 = DistTransport(peer=1 - rank)  # a fresh pair: the peer closing is noticed
    if rank == 0:
        t2.close()
    else:
        try:
            t2.recv(timeout=30)
        except Exception as e:  # noqa: BLE001
            got.append(type(e).__name__)
    q.put((rank, got))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # subprocess / spawned processes
def test_torch_distributed_transport_gloo():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_dist_worker, args=(r, port, q)) for r in (0, 1)]
    for p in ps:
        p.start()
    got = dict(q.get(timeout=120) for _ in ps)
    for p in ps:
        p.join(60)
    assert got[0] == [("CONTROL", 0, 2), ("CONTROL", 1, 2)]
    assert sorted(got[1][:6]) == sorted([("RESIDUAL", i, 100) for i in range(3)]
                                        + [("ANCHOR", i, 10) for i in range(3)])
    assert got[1][6:] == [("timeout", True), "PeerClosed"]
    assert all(p.exitcode == 0 for p in ps)


@pytest.mark.slow  # subprocess / spawned processes
def test_end_to_end_over_torch_distributed():
    """The GPU check's third part on the CPU: a prefill rank and a decode rank, each with the default model, the
    whole session (handshake, KV streams, logits) over DistTransport (gloo); Lynx's tokens = the full tier's."""
    from lynx_hf.eval.benches import dist_pair

    r = dist_pair.run("gloo", "cpu", tokens=96, new_tokens=6)
    assert r["identical_to_full"] is True and r["tokens"] == 96
    assert r["Lynx"]["bytes"] == r["Lynx, full tier only"]["bytes"] > 0
    assert r["Lynx"]["ttft_s"] > 0 and r["INT8"]["tt32t_s"] >= r["INT8"]["ttft_s"]


def test_an_early_stop_cancels_the_rest_of_the_stream(model_and_tok, prompt):
    """max_new_tokens=1 needs only the prefill's logits, which leave ahead of the KV: the decode side cancels, the
    prefill side drops the segment frames still queued behind its slow link (anchor ones too), and the connection
    serves the next request exactly."""
    model, _ = model_and_tok
    srv = S.PrefillServer(model, secret="s3cret", bandwidth_bps=5e6).start()
    try:
        cli = DecodeClient(model, *srv.address, secret="s3cret")
        short = cli.generate(prompt, Q(), max_new_tokens=1)
        full = cli.generate(prompt, Q(), max_new_tokens=4)
        cli.close()
    finally:
        srv.close()
    anchor, residual = ([e for e in short["events"] if e[1] == kind] for kind in ("anchor", "residual"))
    assert short["cancelled"] and short["dropped_frames"] > 0 and short["loader_error"] is None
    assert len(anchor) + len(residual) + short["dropped_frames"] <= 30 * 2 * 2 * 2  # layers × K/V × 2 segments × 2
    assert len(anchor) < 30 * 2 * 2  # the first token waited for no anchor frame
    assert full["dropped_frames"] == 0 and full["loader_error"] is None
    cache, _ = LynxCache.from_prefill(model, torch.tensor([prompt]), residual_after_steps=0)
    local = model.generate(torch.tensor([prompt]), cache=cache, custom_generate=lynx_hf.speculative_generate,
                           max_new_tokens=4, do_sample=False)
    assert full["tokens"] == local[0, len(prompt):].tolist() and short["tokens"] == full["tokens"][:1]


VIEWS = {"aten::view", "aten::as_strided", "aten::reshape", "aten::_reshape_alias", "aten::detach", "detach",
         "aten::alias", "aten::unsqueeze", "aten::select", "aten::slice", "aten::lift_fresh", "aten::empty",
         "aten::_unsafe_view",
         "aten::to", "aten::resolve_conj", "aten::resolve_neg"}  # Tensor.numpy() on a CPU tensor: no copy (no copy_)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_receiver_runs_no_torch_compute_op(dtype):
    """A parallel torch op on the receiving thread starts a second OpenMP pool, which throttles every parallel region
    of the decoding thread (docs/drafting.md). Everything the receiver does per frame — parse, check against the
    codec's shapes (worked out beforehand by `serde.warm` on the decoding thread), store, and the logits' NaN check —
    runs only views there, whatever the tensor sizes (here well above torch's grain size)."""
    import threading
    from types import SimpleNamespace

    from torch.profiler import ProfilerActivity, profile

    from lynx_hf.quant import encode
    from lynx_hf.transfer.serde import pack_segment, warm

    B, H, S, D, cfg = 1, 3, 600, 64, Q()
    geometry = {"batch": B, "kv_heads": H, "head_dim": D, "windows": [None]}
    frames = []
    for kind in ("key", "value"):
        for off in range(0, S, 256):
            s = encode(torch.randn(B, H, min(256, S - off), D).to(dtype), cfg, kind)
            frames += [SimpleNamespace(stream=Stream.ANCHOR, payload=pack_segment(0, kind, off, s, "anchor")),
                       SimpleNamespace(stream=Stream.RESIDUAL, payload=pack_segment(0, kind, off, s, "residual"))]
    logits = torch.randn(B, 49152).to(dtype)
    cache = LynxCache(1, S, cfg, dtype=dtype)
    loader = NetworkLoader(None, {"prompt_len": S, "num_layers": 1}, rid=1)
    loader.cache = cache
    warm(cfg, geometry, S, dtype)                       # the decoding thread's part
    ops = {}

    def receive():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for f in frames:
                loader._segment(f.stream, f.payload, B, H, D, dtype)
            cache.put_logits(logits)
        ops["names"] = {e.name for e in prof.events()}

    t = threading.Thread(target=receive)
    t.start()
    t.join()
    assert cache.residual_ready() and cache.prefill_logits is not None
    assert ops["names"] <= VIEWS, ops["names"] - VIEWS
