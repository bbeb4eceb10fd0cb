"""The prefill server facing a real network, on loopback with a tiny model: no client stalls another, bounded
handshakes and connections, authentication before anything is revealed, peer input checked before allocation,
and an 8-client load test whose server returns to its baseline afterwards."""
import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest
import torch
import transformers as tf

from conftest import wait_until

from lynx_hf import LynxQuantConfig as Q
from lynx_hf.transfer import prefill as P
from lynx_hf.transfer import server as S
from lynx_hf.transfer.decode import DecodeClient
from lynx_hf.arch import fingerprint
from lynx_hf.transfer.auth import Channel, client_handshake, resolve_secret, server_handshake
from lynx_hf.transfer.transport import TcpTransport, Transport
from lynx_hf.transfer.wire import HEADER, FrameType, Stream, WireError, encode_frame, parse_frame

SECRET = "test-secret"


def ids(n, seed):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def read_frames(sock, timeout):
    """Every frame the server sends until it closes (or the timeout); returns (frames, seconds until EOF)."""
    sock.settimeout(timeout)
    buf, t0 = b"", time.monotonic()
    try:
        while chunk := sock.recv(65536):
            buf += chunk
    except socket.timeout:
        return None, None
    frames = []
    while buf:
        n = HEADER.size + int.from_bytes(buf[16:20], "little")
        frames.append(parse_frame(buf[:n]))
        buf = buf[n:]
    return frames, time.monotonic() - t0


@pytest.mark.slow  # subprocess / spawned processes
def test_no_server_without_a_secret(tiny, monkeypatch):
    monkeypatch.delenv("LYNX_SECRET", raising=False)
    with pytest.raises(ValueError, match="no shared secret"):
        S.PrefillServer(tiny)
    assert resolve_secret(None, insecure=True) != resolve_secret("x")
    env = {k: v for k, v in os.environ.items() if k != "LYNX_SECRET"}
    for args, says in ((["--listen", "127.0.0.1:0"], "no shared secret"),
                       (["--listen", "0.0.0.0:0", "--insecure"], "loopback only")):
        p = subprocess.run([sys.executable, "-m", "lynx_hf.cli", "serve-prefill", *args], env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and says in p.stderr and "Traceback" not in p.stderr


def test_hello_reveals_nothing_and_a_wrong_mac_gets_one_generic_refusal(tiny):
    srv = S.PrefillServer(tiny, secret=SECRET).start()
    try:
        s = socket.create_connection(srv.address, timeout=5)
        ch = Channel(TcpTransport(s))
        hello = ch.recv(5, FrameType.HELLO).json()
        assert set(hello) == {"role", "nonce"}  # no fingerprint, no model, before the client proves the secret
        ch.send_json(FrameType.HELLO, {"role": "decode", "nonce": "a" * 32, "mac": "0" * 64})
        with pytest.raises(WireError, match="refused"):
            ch.recv(5)
        ch.close()
        with pytest.raises(WireError, match="authentication failed"):
            DecodeClient(tiny, *srv.address, secret="wrong")
        DecodeClient(tiny, *srv.address, secret=SECRET).close()  # and it serves on
    finally:
        srv.close()


def test_handshake_has_one_deadline_and_a_size_bound(tiny):
    srv = S.PrefillServer(tiny, secret=SECRET, handshake_timeout=1.5).start()
    try:
        s = socket.create_connection(srv.address, timeout=5)  # trickles a byte every 0.3 s
        stop = threading.Event()

        def trickle():
            while not stop.wait(0.3):
                try:
                    s.send(b"L")
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        frames, eof_after = read_frames(s, 10)
        stop.set()
        assert eof_after is not None and eof_after < 4.0, eof_after  # closed at the deadline, not kept alive
        assert [f.type for f in frames] == [FrameType.HELLO, FrameType.ERROR]
        s = socket.create_connection(srv.address, timeout=5)  # a HELLO declaring 1 MiB is refused from its header
        s.sendall(encode_frame(FrameType.HELLO, Stream.CONTROL, 0, 0, bytes(1 << 20))[:HEADER.size])
        frames, eof_after = read_frames(s, 10)
        assert eof_after < 1.0 and frames[-1].json() == {"error": "refused"}  # the one generic refusal
    finally:
        srv.close()


def test_connection_limit_refuses_clearly(tiny):
    """The cap counts authenticated connections; the next authenticated client hears "server busy" inside its
    channel (MAC'd), and a freed slot serves again. Idle unauthenticated sockets take none of these slots."""
    srv = S.PrefillServer(tiny, secret=SECRET, max_connections=2).start()
    try:
        idle = [socket.create_connection(srv.address, timeout=5) for _ in range(3)]
        held = [DecodeClient(tiny, *srv.address, secret=SECRET) for _ in range(2)]
        assert wait_until(lambda: srv.connections == 2 and srv.preauth == 3)
        third = DecodeClient(tiny, *srv.address, secret=SECRET)  # authenticates, then is told
        with pytest.raises(WireError, match="too many connections"):
            third.ch.recv(5)
        third.close()
        for c in held:
            c.close()
        assert wait_until(lambda: srv.connections == 0)
        DecodeClient(tiny, *srv.address, secret=SECRET).close()  # a slot is free again
        for s in idle:
            s.close()
        assert wait_until(lambda: srv.preauth == 0)
    finally:
        srv.close()


def test_a_long_transfer_does_not_stall_a_short_request(tiny, monkeypatch):
    """Two clients sharing the server's one emulated NIC (0.4 Mbit/s): a 10-token request gets its share of the wire
    at once (deficit round-robin over 16 KiB packets), not the time left on another client's 100 KB transfer."""
    queued = threading.Event()  # the long request's prefill is done and its KV queued behind the emulated link
    serve, await_sent, long_rq = P.serve_request, P._await_sent, threading.local()

    def serve_request(model, ch, req, rid, *args):
        long_rq.on = len(req["input_ids"]) == 200
        return serve(model, ch, req, rid, *args)

    def _await_sent(ch, rid, futs, **kw):
        if getattr(long_rq, "on", False):
            queued.set()
        return await_sent(ch, rid, futs, **kw)

    monkeypatch.setattr(P, "serve_request", serve_request)
    monkeypatch.setattr(P, "_await_sent", _await_sent)
    srv = S.PrefillServer(tiny, secret=SECRET, bandwidth_bps=0.4e6).start()
    try:
        short, long_ = DecodeClient(tiny, *srv.address, secret=SECRET), DecodeClient(tiny, *srv.address, secret=SECRET)
        alone = min(short.generate(ids(10, 1), Q(), max_new_tokens=2)["ttft_s"] for _ in range(2))
        th = threading.Thread(target=lambda: long_.generate(ids(200, 2), Q(method="identity"), max_new_tokens=2))
        th.start()
        assert queued.wait(60)  # its KV is on the emulated link for seconds more
        busy = short.generate(ids(10, 1), Q(), max_new_tokens=2)["ttft_s"]
        th.join(60)
        assert busy < alone + 1.0, (alone, busy)
        short.close()
        long_.close()
    finally:
        srv.close()


def test_a_failed_send_fails_every_frame_queued_after_it():
    all_queued = threading.Event()

    class Breaks(Transport):
        def _write(self, frame, priority):
            all_queued.wait(5)
            raise ConnectionError("link down")

    t = Breaks()
    futs = [t.start_send(b"x" * 10) for _ in range(5)]
    all_queued.set()
    for f in futs:
        with pytest.raises(ConnectionError):
            f.result(5)
    with pytest.raises(ConnectionError, match="earlier send failed"):
        t.start_send(b"late").result(1)


def _fake_prefill(model, prompt_patch: dict):
    """A server that authenticates properly, then lies in its PROMPT frame."""
    sock = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = sock.accept()
        ch = Channel(TcpTransport(conn))
        server_handshake(ch, SECRET.encode(), fingerprint(model))
        f = ch.recv(10, FrameType.REQUEST)
        p = P.kv_handshake(model, f.request_id, len(f.json()["input_ids"]), Q())
        ch.send_json(FrameType.PROMPT, {**p, **prompt_patch}, f.request_id)
        try:  # until the client, having refused the PROMPT, hangs up
            ch.recv(10)
        except (WireError, TimeoutError, ConnectionError):
            pass
        ch.close()

    threading.Thread(target=run, daemon=True).start()
    return sock


@pytest.mark.parametrize("patch", [{"num_layers": 1, "windows": [None]}, {"kv_heads": 64}, {"head_dim": 4096},
                                   {"dtype": "float16"}, {"batch": 8}, {"vocab": 10}])
def test_prompt_geometry_is_checked_before_anything_is_allocated(tiny, patch):
    sock = _fake_prefill(tiny, patch)
    cli = DecodeClient(tiny, *sock.getsockname()[:2], secret=SECRET)
    with pytest.raises(WireError, match="does not match this model"):
        cli.generate(ids(12, 3), Q(), max_new_tokens=2)
    cli.close()
    sock.close()


def test_eos_first_and_a_loader_failure_after_completion(tiny, monkeypatch):
    prompt = ids(30, 4)
    first = int(tiny.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False)[0, -1])

    class VanishAtEnd(TcpTransport):
        def _write(self, frame, priority):
            if frame[5] == FrameType.END:
                self.sock.shutdown(socket.SHUT_RDWR)
                raise ConnectionError("test: peer vanished")
            super()._write(frame, priority)

    srv = S.PrefillServer(tiny, secret=SECRET).start()
    try:
        cli = DecodeClient(tiny, *srv.address, secret=SECRET)
        r = cli.generate(prompt, Q(), max_new_tokens=5, eos_token_id=first)
        assert r["tokens"] == [first] and r["ttft_s"] == r["tt32t_s"]  # a first token that is EOS ends it cleanly
        cli.close()
    finally:
        srv.close()
    monkeypatch.setattr(S, "TcpTransport", VanishAtEnd)
    srv = S.PrefillServer(tiny, secret=SECRET).start()
    try:
        cli = DecodeClient(tiny, *srv.address, secret=SECRET, timeout_s=5)
        r = cli.generate(prompt, Q(), max_new_tokens=1)  # complete (from the logits) before the stream fails
        assert r["tokens"] == [first] and r["loader_error"]
        with pytest.raises(ConnectionError, match="failed earlier"):
            cli.generate(prompt, Q(), max_new_tokens=1)
        cli.close()
    finally:
        srv.close()


def _raw_request(addr, prompt, fp):
    """An authenticated client that sends one REQUEST and then does whatever the test makes it do."""
    ch = Channel(TcpTransport.connect(*addr))
    client_handshake(ch, SECRET.encode(), fp)
    ch.send_json(FrameType.REQUEST, {"input_ids": prompt, "quant_config": Q().to_dict()}, 1)
    return ch


def test_eight_clients_one_stalled_one_vanishing(tiny):
    """Six clients finish with their solo output; one never reads, one closes mid-residual; then the server's
    connections, threads and traced memory return to their baseline."""
    fp = fingerprint(tiny)
    prompts = [ids(20 + 15 * i, 10 + i) for i in range(6)]
    srv = S.PrefillServer(tiny, secret=SECRET, bandwidth_bps=4e6).start()
    try:
        solo = []
        for p in prompts:
            c = DecodeClient(tiny, *srv.address, secret=SECRET)
            solo.append(c.generate(p, Q(), max_new_tokens=6)["tokens"])
            c.close()
        # the baseline: the threads alive now (the codec's pool was started by the server at its start)
        assert wait_until(lambda: srv.connections == 0)
        threads0 = set(threading.enumerate())
        tracemalloc.start()
        mem0 = tracemalloc.get_traced_memory()[0]
        stalled = _raw_request(srv.address, ids(300, 20), fp)  # never reads a byte of its answer
        vanishing = _raw_request(srv.address, ids(300, 21), fp)
        out = [None] * 6

        def run(i):
            c = DecodeClient(tiny, *srv.address, secret=SECRET)
            out[i] = c.generate(prompts[i], Q(), max_new_tokens=6)["tokens"]
            c.close()

        ths = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in ths:
            t.start()
        while vanishing.recv(10).stream != Stream.RESIDUAL:
            pass
        vanishing.t.sock.shutdown(socket.SHUT_RDWR)  # gone mid-residual
        vanishing.close()
        for t in ths:
            t.join(120)
        assert out == solo
        stalled.close()
        wait_until(lambda: srv.connections == 0 and not set(threading.enumerate()) - threads0)
        assert srv.connections == 0 and not set(threading.enumerate()) - threads0, set(threading.enumerate()) - threads0
        grown = tracemalloc.get_traced_memory()[0] - mem0
        tracemalloc.stop()
        assert grown < 4 << 20, grown
    finally:
        srv.close()


def test_fingerprint_covers_every_parameter(tiny):
    fp = fingerprint(tiny)
    last_name, last = list(tiny.named_parameters())[-1]
    was = last.detach().view(-1)[-1].clone()
    with torch.no_grad():
        last.view(-1)[-1] += 1.0  # the last element of the last tensor
    try:
        assert fingerprint(tiny) != fp, last_name
    finally:
        with torch.no_grad():
            last.view(-1)[-1] = was  # exactly (x + 1 - 1 need not be x, and the fingerprint sees one ulp)
    assert fingerprint(tiny) == fp


def test_fingerprint_does_not_depend_on_the_thread_count():
    """Two nodes with the same weights agree whatever their thread counts (a float sum's rounding follows the
    reduction order: 1 and 2 threads gave different fingerprints for this model)."""
    torch.manual_seed(0)
    m = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=50000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = fingerprint(m)
        torch.set_num_threads(1)
        assert fingerprint(m) == two
    finally:
        torch.set_num_threads(threads)


def test_tls_end_to_end_and_plain_clients_are_refused(tiny, certificate):
    cert, key = certificate
    prompt = ids(120, 7)
    plain_srv = S.PrefillServer(tiny, secret=SECRET).start()
    srv = S.PrefillServer(tiny, secret=SECRET, tls_cert=cert, tls_key=key, handshake_timeout=2).start()
    try:
        ref = DecodeClient(tiny, *plain_srv.address, secret=SECRET)
        want = [ref.generate(prompt, Q(), max_new_tokens=6)["tokens"] for _ in range(2)]
        ref.close()
        cli = DecodeClient(tiny, *srv.address, secret=SECRET, tls_ca=cert)
        assert [cli.generate(prompt, Q(), max_new_tokens=6)["tokens"] for _ in range(2)] == want
        cli.close()
        t0 = time.monotonic()
        with pytest.raises((WireError, ConnectionError, TimeoutError)):
            DecodeClient(tiny, *srv.address, secret=SECRET, timeout_s=5)  # no TLS: never gets a frame
        assert time.monotonic() - t0 < 10
        with pytest.raises(ConnectionError, match="TLS handshake failed"):
            DecodeClient(tiny, *srv.address, secret=SECRET, tls=True)  # the system CAs do not vouch for it
    finally:
        srv.close()
        plain_srv.close()


def test_a_handshake_broken_otherwise_is_not_called_an_authentication_failure():
    """Only the server's refusal of our MAC is "authentication failed"; any other error frame during the handshake
    says what the peer reported."""
    from lynx_hf.transfer.transport import InProcTransport

    a, b = InProcTransport.pair()
    server = Channel(b)

    def serve():
        server.send_json(FrameType.HELLO, {"role": "prefill", "nonce": "b" * 32})
        server.recv(5, FrameType.PROBE)  # the client's first frame (a TLS port would fail on it at once)
        server.recv(5, FrameType.HELLO)
        server.send_json(FrameType.ERROR, {"error": "overloaded, try later"})

    t = threading.Thread(target=serve)
    t.start()
    with pytest.raises(WireError, match="handshake failed: .*overloaded") as e:
        client_handshake(Channel(a), b"secret", "0" * 32, timeout=5)
    assert "authentication" not in str(e.value)
    t.join(5)
    a.close()
    b.close()


def test_fingerprint_ignores_where_the_model_was_loaded_from(tiny, tmp_path):
    """The same weights saved to two folders (two install paths, or a GGUF file and its converted copy) have one
    fingerprint (before, the config's _name_or_path was part of it). A copy is saved: save_pretrained writes into
    the config it saves (dtype, architectures), and the session's `tiny` must stay what a fresh one is."""
    import copy

    saved = copy.deepcopy(tiny)
    for d in ("a", "b"):
        saved.save_pretrained(tmp_path / d)
    a, b = (tf.LlamaForCausalLM.from_pretrained(tmp_path / d) for d in ("a", "b"))
    assert a.config._name_or_path != b.config._name_or_path
    assert fingerprint(a) == fingerprint(b) == fingerprint(saved)
