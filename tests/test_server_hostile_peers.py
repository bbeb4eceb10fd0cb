"""The prefill server against hostile peers and bad configuration (issue 21), on loopback with a tiny model: what an
unauthenticated peer can cost, one generic refusal for every malformed handshake, peer text quoted, configuration
refused at start, and a queue in which a short request waits for one prefill step of a long prompt, not all of it."""
import errno
import io
import json
import logging
import math
import os
import select
import socket
import ssl
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import make_tiny, wait_until
from lynx_hf import LynxQuantConfig as Q
from lynx_hf.errors import ConfigError
from lynx_hf.transfer import prefill as P
from lynx_hf.transfer import server as S
from lynx_hf.transfer.decode import DecodeClient
from lynx_hf.transfer.auth import Channel, PeerError, client_handshake, server_handshake
from lynx_hf.transfer.transport import InProcTransport
from lynx_hf.transfer.wire import FLAG_MAC, HEADER, FrameType, Stream, WireError, encode_frame, json_frame

SECRET = "hostile-secret"


def ids(n, seed):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def frames_until_eof(sock, timeout=10.0):
    """Every frame the server sends until it closes the connection."""
    sock.settimeout(timeout)
    buf = b""
    try:
        while chunk := sock.recv(65536):
            buf += chunk
    except ConnectionResetError:
        pass
    out = []
    while len(buf) >= HEADER.size:
        n = HEADER.size + int.from_bytes(buf[16:20], "little")
        out.append((FrameType(buf[5]), json.loads(buf[HEADER.size:n]) if buf[5] != FrameType.SEGMENT else None))
        buf = buf[n:]
    return out


def baseline():
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def back_to(base, timeout=20.0) -> bool:
    return wait_until(lambda: baseline()[0] <= base[0] and baseline()[1] <= base[1], timeout)


class Flood:
    """`n` unauthenticated connections that never say a word; any the server closes is opened again (each sweep
    every `sweep_s`), like a peer trying to keep the door shut."""

    def __init__(self, address, n, sweep_s=0.05, source="127.0.0.1"):
        self.address, self.sweep_s, self.reopened, self.source = address, sweep_s, 0, (source, 0)
        self.socks = [self._open() for _ in range(n)]
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.wait(self.sweep_s):
            for i, s in enumerate(self.socks):
                r, _, _ = select.select([s], [], [], 0)
                if r:  # the server's HELLO, or the end of the stream
                    try:
                        gone = s.recv(65536) == b""
                    except OSError:
                        gone = True
                    if gone:
                        s.close()
                        try:
                            self.socks[i] = self._open()
                            self.reopened += 1
                        except OSError:
                            pass

    def _open(self):
        return socket.create_connection(self.address, timeout=5, source_address=self.source)

    def close(self):
        self._stop.set()
        self._t.join(5)
        for s in self.socks:
            s.close()


def test_64_idle_unauthenticated_connections_shut_no_one_out(tiny):
    """The done-when of issue 21: a client is served while 64 unauthenticated connections are held open (before:
    32 idle ones took every slot and each client heard "server busy")."""
    srv = S.PrefillServer(tiny, secret=SECRET).start()
    try:
        cli = DecodeClient(tiny, *srv.address, secret=SECRET)
        alone = min(cli.generate(ids(10, 1), Q(), max_new_tokens=2)["ttft_s"] for _ in range(2))
        cli.close()
        flood = Flood(srv.address, 64)
        assert wait_until(lambda: srv.preauth >= 64)
        cli = DecodeClient(tiny, *srv.address, secret=SECRET)
        busy = cli.generate(ids(10, 1), Q(), max_new_tokens=2)["ttft_s"]
        cli.close()
        flood.close()
        assert busy < alone + 1.0, (alone, busy)
        assert wait_until(lambda: srv.preauth == 0 and srv.connections == 0)
    finally:
        srv.close()


def test_a_flooding_host_is_held_to_its_own_budget(tiny):
    """32 idle connections from 127.0.0.2, re-opened as fast as they are dropped, against a budget of 3 per host:
    the flood never holds more than 3, and each of 5 clients from 127.0.0.1 in a row is served. (Before, 32 idle
    connections from anywhere took every slot.)"""
    srv = S.PrefillServer(tiny, secret=SECRET, max_preauth=16, max_preauth_per_host=3, handshake_timeout=2).start()
    flood = Flood(srv.address, 32, source="127.0.0.2")
    try:
        assert wait_until(lambda: flood.reopened > 10)
        for k in range(5):
            cli = DecodeClient(tiny, *srv.address, secret=SECRET)
            assert len(cli.generate(ids(8, k), Q(), max_new_tokens=2)["tokens"]) == 2
            cli.close()
            assert srv.preauth <= 3
    finally:
        flood.close()
        srv.close()


def test_idle_connections_over_the_budget_are_dropped_oldest_first(tiny):
    srv = S.PrefillServer(tiny, secret=SECRET, max_preauth=4, max_preauth_per_host=4).start()
    try:
        idle = []
        for _ in range(6):
            idle.append(socket.create_connection(srv.address, timeout=5))
            assert wait_until(lambda: srv.preauth == min(len(idle), 4))
        cli = DecodeClient(tiny, *srv.address, secret=SECRET)  # evicts the oldest idle one, then authenticates
        assert len(cli.generate(ids(8, 0), Q(), max_new_tokens=2)["tokens"]) == 2
        cli.close()
        gone = [frames_until_eof(s, 5) is not None and s.recv(1) == b"" for s in idle[:3]]
        assert all(gone)  # the three oldest were closed: by the 5th, the 6th connection and the client
        for s in idle:
            s.close()
    finally:
        srv.close()


def _client_hello() -> bytes:
    """The first flight of a real TLS client (its ClientHello), made in memory."""
    ctx = ssl.create_default_context()
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(inc, out, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return out.read()


def test_tls_handshake_has_a_deadline_and_refusals_are_never_plaintext(tiny, certificate):
    """A peer sending its ClientHello one byte every 0.3 s is cut off at the handshake deadline (before: each byte
    renewed a per-read timeout, and the only slot stayed taken), never hears a plaintext frame on the TLS port, and
    a TLS client is served meanwhile."""
    cert, key = certificate
    srv = S.PrefillServer(tiny, secret=SECRET, tls_cert=cert, tls_key=key, handshake_timeout=1.5).start()
    try:
        hello = _client_hello()
        slow = socket.create_connection(srv.address, timeout=10)
        got, t0, closed_after = b"", time.monotonic(), None
        stop = threading.Event()

        def trickle():
            for b in hello:
                if stop.wait(0.3):
                    return
                try:
                    slow.send(bytes([b]))
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        cli = DecodeClient(tiny, *srv.address, secret=SECRET, tls_ca=cert)
        assert len(cli.generate(ids(12, 3), Q(), max_new_tokens=2)["tokens"]) == 2
        cli.close()
        try:
            while chunk := slow.recv(65536):
                got += chunk
        except (ConnectionResetError, socket.timeout):
            pass
        closed_after = time.monotonic() - t0
        stop.set()
        assert closed_after < 4.0, closed_after
        assert b"LYNX" not in got  # no plaintext frame on a TLS port
        assert wait_until(lambda: srv.preauth == 0)
    finally:
        srv.close()


class _FailingAccept:
    """A listening socket whose accept() fails `n` times with EMFILE (as under a low `ulimit -n`) first."""

    def __init__(self, sock, n):
        self._sock, self.n = sock, n

    def accept(self):
        if self.n > 0:
            self.n -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self._sock.accept()

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_accept_failing_is_logged_and_the_server_keeps_serving(tiny, caplog):
    """Before: the first failing accept() ended the serve loop silently (exit status 0)."""
    srv = S.PrefillServer(tiny, secret=SECRET)
    srv.sock = _FailingAccept(srv.sock, 3)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    with caplog.at_level(logging.ERROR, "lynx_hf.prefill"):
        t.start()
        try:
            cli = DecodeClient(tiny, *srv.address, secret=SECRET)
            assert len(cli.generate(ids(8, 2), Q(), max_new_tokens=2)["tokens"]) == 2
            cli.close()
            assert t.is_alive()
        finally:
            srv.close()
    assert sum("accept failed" in r.getMessage() for r in caplog.records) == 3
    t.join(5)
    assert not t.is_alive()  # close() ends the loop


def _raw_handshake_answer(address, frame: bytes):
    """Connect, read the server's HELLO, send `frame`, and return every frame the server sends until it closes."""
    s = socket.create_connection(address, timeout=10)
    head = s.recv(HEADER.size, socket.MSG_WAITALL)
    s.recv(int.from_bytes(head[16:20], "little"), socket.MSG_WAITALL)
    s.sendall(frame)
    out = frames_until_eof(s)
    s.close()
    return out


HELLO = lambda obj: json_frame(FrameType.HELLO, 0, 0, obj)
MALFORMED = {
    "wrong MAC": HELLO({"role": "decode", "nonce": "a" * 32, "mac": "0" * 64}),
    "non-ASCII MAC": HELLO({"role": "decode", "nonce": "a" * 32, "mac": "é" * 64}),
    "MAC not a string": HELLO({"role": "decode", "nonce": "a" * 32, "mac": 5}),
    "no nonce": HELLO({"role": "decode", "mac": "0" * 64}),
    "nonce not hex": HELLO({"role": "decode", "nonce": "z" * 32, "mac": "0" * 64}),
    "a JSON list": encode_frame(FrameType.HELLO, Stream.CONTROL, 0, 0, b"[1, 2]"),
    "not JSON": encode_frame(FrameType.HELLO, Stream.CONTROL, 0, 0, b"\xff\xfe{"),
    "OK instead of HELLO": json_frame(FrameType.OK, 0, 0, {"fingerprint": "x"}),
    "a MAC-tagged frame": encode_frame(FrameType.HELLO, Stream.CONTROL, 0, 0, b"{}" + bytes(16), FLAG_MAC),
    "an ERROR forging log lines": json_frame(FrameType.ERROR, 0, 0, {"error": "x\n2026-01-01 lynx_hf.prefill "
                                                                              "request 1 served" + "y" * 5000}),
    "a header declaring 1 MiB": encode_frame(FrameType.HELLO, Stream.CONTROL, 0, 0, bytes(1 << 20))[:HEADER.size],
}


def test_every_malformed_handshake_gets_one_generic_refusal_and_no_traceback(tiny, caplog):
    """Before: a wrong MAC got two ERROR frames, a non-ASCII MAC made compare_digest raise TypeError (no answer, a
    traceback in the log), and an unauthenticated ERROR frame's text was logged verbatim and echoed back."""
    srv = S.PrefillServer(tiny, secret=SECRET).start()
    srv._preauth_log.every = 0.0  # log every refusal here, so each can be checked
    try:
        with caplog.at_level(logging.INFO, "lynx_hf"):
            for name, frame in MALFORMED.items():
                assert _raw_handshake_answer(srv.address, frame) == [(FrameType.ERROR, {"error": "refused"})], name
            assert wait_until(lambda: srv.preauth == 0)
        for r in caplog.records:
            assert r.exc_info is None and r.levelno < logging.ERROR, r.getMessage()
            assert "\n" not in r.getMessage() and len(r.getMessage()) < 1000, r.getMessage()
        DecodeClient(tiny, *srv.address, secret=SECRET).close()  # and it serves on
    finally:
        srv.close()


def authenticated_pair():
    """Two in-process transport ends (client a, server b) and their channels after a completed handshake."""
    a, b = InProcTransport.pair()
    srv, cli = Channel(b), Channel(a)
    t = threading.Thread(target=server_handshake, args=(srv, b"k", "f" * 32, 5))
    t.start()
    client_handshake(cli, b"k", "f" * 32, 5)
    t.join(5)
    return a, b, srv, cli


def test_an_untagged_error_after_the_handshake_is_rejected_not_shown():
    """After both sides proved the secret every frame carries a MAC, ERROR included (before: an untagged ERROR's
    text was raised as the peer's word)."""
    a, b, srv, cli = authenticated_pair()
    b.start_send(json_frame(FrameType.ERROR, 0, srv.out_seq[Stream.CONTROL], {"error": "forged"}))
    with pytest.raises(WireError, match="without a MAC") as e:
        cli.recv(5)
    assert not isinstance(e.value, PeerError)
    a.close()
    b.close()


@pytest.mark.parametrize("kw, says", [
    ({"tls_key": "key.pem"}, "TLS key without a certificate"),
    ({"bandwidth_bps": -1.0}, "bandwidth_bps"), ({"bandwidth_bps": 0.0}, "bandwidth_bps"),
    ({"bandwidth_bps": math.nan}, "bandwidth_bps"), ({"latency_s": -0.1}, "latency_s"),
    ({"max_connections": 0}, "max_connections"), ({"handshake_timeout": math.inf}, "handshake_timeout"),
    ({"host": "0.0.0.0", "insecure": True, "secret": None}, "loopback only"),
    ({"insecure": True}, "together"),
])
def test_bad_configuration_is_refused_at_start(tiny, kw, says):
    with pytest.raises(ConfigError, match=says):
        S.PrefillServer(tiny, **{"secret": SECRET, **kw})


def test_a_certificate_without_its_key_is_refused_clearly(tiny, certificate):
    cert, _ = certificate
    with pytest.raises(ConfigError, match="the key must be inside it"):
        S.PrefillServer(tiny, secret=SECRET, tls_cert=cert)


def test_the_python_api_allows_insecure_on_loopback_only(tiny):
    with pytest.raises(ConfigError, match="loopback only"):
        DecodeClient(tiny, "192.0.2.1", 7480, insecure=True)  # refused before any connection is tried


def test_a_handler_that_fails_releases_its_slot(tiny, monkeypatch):
    """Before: a handler failing before its try (e.g. the link emulator refusing its bandwidth) never gave its
    slot back; after max_connections connections every client was refused for good."""
    srv = S.PrefillServer(tiny, secret=SECRET, max_preauth=2, max_preauth_per_host=2).start()
    try:
        def broken(*a, **k):
            raise RuntimeError("test: broken link")

        monkeypatch.setattr(srv.nic, "port", broken)
        for _ in range(4):
            socket.create_connection(srv.address, timeout=5).close()
        assert wait_until(lambda: srv.preauth == 0 and srv.connections == 0)
        monkeypatch.undo()
        DecodeClient(tiny, *srv.address, secret=SECRET).close()
    finally:
        srv.close()


def test_a_prompt_past_the_models_context_is_refused(tiny):
    small = make_tiny(max_position_embeddings=64)
    srv = S.PrefillServer(small, secret=SECRET).start()
    try:
        cli = DecodeClient(small, *srv.address, secret=SECRET)
        with pytest.raises(ValueError, match="65 tokens exceeds this model's context of 64"):
            cli.generate(ids(65, 0), Q(), max_new_tokens=2)  # refused here, before a byte is sent
        assert not cli.broken and cli._rid == 0
        cli._rid += 1  # and by the server, for a client that sends it anyway
        cli.ch.send_json(FrameType.REQUEST, {"input_ids": ids(65, 0), "quant_config": Q().to_dict()}, cli._rid)
        with pytest.raises(WireError, match="65 tokens exceeds this model's context of 64"):
            cli.ch.recv(10)
        cli.close()
    finally:
        srv.close()


def test_an_idle_authenticated_connection_is_closed(tiny):
    srv = S.PrefillServer(tiny, secret=SECRET, idle_timeout_s=0.5).start()
    try:
        cli = DecodeClient(tiny, *srv.address, secret=SECRET)
        assert wait_until(lambda: srv.connections == 1)
        assert wait_until(lambda: srv.connections == 0, 5)
        cli.close()
    finally:
        srv.close()


@pytest.mark.parametrize("tls", [False, True])
def test_a_client_that_stops_reading_is_dropped_after_the_send_timeout(certificate, tls):
    """A client that authenticates, sends a prompt whose KV exceeds every socket buffer, and never reads: its sends
    fail after send_timeout_s and the slot, threads and descriptors are freed (before: ~600 s, under TLS twice the
    socket timeout)."""
    cert, key = certificate
    big = make_tiny(hidden_size=256, num_attention_heads=4, num_key_value_heads=4)
    tls_kw = {"tls_cert": cert, "tls_key": key} if tls else {}
    srv = S.PrefillServer(big, secret=SECRET, send_timeout_s=1.0, **tls_kw).start()
    try:
        cli = DecodeClient(big, *srv.address, secret=SECRET, **({"tls_ca": cert} if tls else {}))
        assert wait_until(lambda: srv.connections == 1)
        cli.ch.t.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        cli.ch.send_json(FrameType.REQUEST, {"input_ids": ids(2000, 5), "quant_config": Q(method="identity").to_dict()},
                         1)
        t0 = time.monotonic()
        assert wait_until(lambda: srv.connections == 0, 20), "the stalled client kept its slot"
        assert time.monotonic() - t0 < 12
        cli.close()
    finally:
        srv.close()


def test_compute_queue_serves_the_shortest_remaining_prompt_first():
    q, order, holding = P.ComputeQueue(), [], threading.Event()
    release = threading.Event()

    def hold():
        with q.turn(0):
            holding.set()
            release.wait(10)

    threading.Thread(target=hold).start()
    assert holding.wait(5)
    def waiter(name, tokens):
        with q.turn(tokens):
            order.append(name)

    ths = []
    for name, tokens in (("long", 500), ("short", 10), ("long2", 500), ("short2", 10)):
        th = threading.Thread(target=waiter, args=(name, tokens))
        th.start()
        ths.append(th)
        assert wait_until(lambda n=len(ths): q.waiting == n)
    release.set()
    for th in ths:
        th.join(5)
    assert order == ["short", "short2", "long", "long2"]


def test_compute_queue_gives_up_a_place_when_poll_raises():
    q, release = P.ComputeQueue(), threading.Event()
    polls = []

    def poll():
        polls.append(1)
        if len(polls) == 3:
            raise ConnectionError("test: the client went away")

    def hold():
        with q.turn(0):
            release.wait(10)

    th = threading.Thread(target=hold)
    th.start()
    assert wait_until(lambda: q._busy)
    with pytest.raises(ConnectionError):
        with q.turn(5, poll, every=0.02):
            pass
    assert q.waiting == 0 and len(polls) == 3
    release.set()
    th.join(5)
    with q.turn(1):  # the queue is free again
        pass


def _slow_server_model(per_token_s):
    """The tiny model (same weights, so the same fingerprint) whose forward pass takes `per_token_s` per input
    token: a CPU that a long prompt keeps busy."""
    m = make_tiny()
    calls = []

    def hook(_, args, kwargs):
        n = kwargs["input_ids"].shape[1]
        calls.append(n)
        time.sleep(per_token_s * n)

    m.register_forward_pre_hook(hook, with_kwargs=True)
    return m, calls


def test_a_short_request_waits_for_one_prefill_step_not_a_whole_long_prefill(tiny):
    """A 10-token request arriving while a 400-token prompt prefills (10 ms a token: 4 s in one pass) waits for
    one 16-token prefill step of it. Before: behind one compute lock, for the whole prefill."""
    model, calls = _slow_server_model(0.01)
    srv = S.PrefillServer(model, secret=SECRET, prefill_step=16).start()
    try:
        short, long_ = DecodeClient(tiny, *srv.address, secret=SECRET), DecodeClient(tiny, *srv.address, secret=SECRET)
        alone = min(short.generate(ids(10, 1), Q(), max_new_tokens=2)["ttft_s"] for _ in range(2))
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("r", long_.generate(ids(400, 2), Q(), max_new_tokens=2)))
        n0 = len(calls)
        th.start()
        assert wait_until(lambda: len(calls) >= n0 + 3)  # the long prompt is being prefilled
        busy = short.generate(ids(10, 1), Q(), max_new_tokens=2)["ttft_s"]
        th.join(60)
        assert busy < alone + 0.6, (alone, busy)
        ref = DecodeClient(tiny, *S.PrefillServer(tiny, secret=SECRET).start().address, secret=SECRET)
        assert out["r"]["tokens"] == ref.generate(ids(400, 2), Q(), max_new_tokens=2)["tokens"]  # in steps = whole
        for c in (short, long_, ref):
            c.close()
    finally:
        srv.close()


def test_a_queued_request_hears_progress_and_a_departed_one_is_dropped(tiny, monkeypatch):
    """While the compute is taken for 2.5 s, a client with a 1 s silence limit is kept waiting by PROGRESS frames
    and then served (before: "no whole frame from the peer within" its timeout); a client that sends a prompt and
    leaves is dropped while it waits, its prompt never prefilled."""
    monkeypatch.setattr(P, "PROGRESS_S", 0.2)
    model, calls = _slow_server_model(0.0)
    srv = S.PrefillServer(model, secret=SECRET).start()
    try:
        cli = DecodeClient(tiny, *srv.address, secret=SECRET, timeout_s=1.0)
        gone = DecodeClient(tiny, *srv.address, secret=SECRET)
        taken, release = threading.Event(), threading.Event()

        def hold():
            with srv.compute.turn(0):
                taken.set()
                release.wait(10)

        threading.Thread(target=hold, daemon=True).start()
        assert taken.wait(5)
        n0 = len(calls)
        gone.ch.send_json(FrameType.REQUEST, {"input_ids": ids(30, 9), "quant_config": Q().to_dict()}, 1)
        assert wait_until(lambda: srv.compute.waiting == 1)
        gone.close()
        assert wait_until(lambda: srv.compute.waiting == 0 and srv.connections == 1, 5)  # dropped while waiting
        threading.Timer(2.5, release.set).start()
        t0 = time.monotonic()
        r = cli.generate(ids(12, 4), Q(), max_new_tokens=2)
        assert time.monotonic() - t0 > 2.0 and len(r["tokens"]) == 2
        assert calls[n0:] == [12]  # the departed client's 30 tokens were never prefilled
        cli.close()
    finally:
        srv.close()


class ByteTokenizer:
    """Token ids from the UTF-8 bytes of the text (what the CLI needs of a tokenizer: call and decode)."""

    def __call__(self, text):
        return SimpleNamespace(input_ids=[3 + b % 90 for b in text.encode()][:64])

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_serve_decode_answers_every_line_even_one_that_is_not_utf8(tiny, monkeypatch, capsys):
    """Before: a stdin line that was not UTF-8 ended the process with an uncaught error and the prompts after it were
    never sent. Now each line gets one JSON line, the result or {"error": ...}, and the exit status says one failed."""
    import lynx_hf
    from lynx_hf.cli import main

    srv = S.PrefillServer(tiny, secret=SECRET).start()
    try:
        monkeypatch.setattr(lynx_hf, "load_default_model", lambda name=None, dtype=None: (tiny, ByteTokenizer()))
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"first prompt\n\xff\xfe not text\nthird\n")))
        with pytest.raises(SystemExit) as e:
            main(["serve-decode", "--prefill", "%s:%d" % srv.address, "--secret", SECRET, "--max-new-tokens", "2"])
        assert e.value.code == 1
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [len(x.get("tokens", [])) for x in lines] == [2, 0, 2]
        assert "line 2 is not UTF-8" in lines[1]["error"]
    finally:
        srv.close()


@pytest.mark.parametrize("args, says", [
    (["--secret", "s", "--tls-key", "k.pem"], "--tls-key without --tls-cert"),
    (["--secret", "s", "--bandwidth-mbps", "-1"], "argument --bandwidth-mbps: must be a finite number in (0,"),
    (["--secret", "s", "--bandwidth-mbps", "0"], "argument --bandwidth-mbps: must be a finite number in (0,"),
    (["--secret", "s", "--bandwidth-mbps", "nan"], "argument --bandwidth-mbps: must be a finite number in (0,"),
    (["--secret", "s", "--insecure"], "together"),
    (["--secret", "s", "--secret-file", "f"], "--secret and --secret-file together"),
    (["--secret-file", "/nonexistent/secret"], "cannot read the secret file"),
])
def test_serve_prefill_refuses_bad_flags_before_loading_the_model(monkeypatch, capsys, args, says):
    """Before: --tls-key alone started in plaintext without a word, and --bandwidth-mbps -1 started a server whose
    every connection died holding its slot."""
    import lynx_hf
    from lynx_hf.cli import main

    monkeypatch.setattr(lynx_hf, "load_default_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.delenv("LYNX_SECRET", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["serve-prefill", "--listen", "127.0.0.1:0", *args])
    assert says in str(e.value.code) + capsys.readouterr().err


def test_a_secret_file_is_read_and_used(tiny, tmp_path):
    from lynx_hf.transfer.auth import read_secret_file

    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    assert read_secret_file(str(f)) == SECRET
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_secret_file(str(tmp_path / "empty"))


def test_a_reflected_frame_fails_its_mac():
    """Per-direction keys: a frame the server sent, played back to the server, is refused."""
    a, b, srv, cli = authenticated_pair()
    seq = srv.out_seq[Stream.CONTROL]
    srv.send_json(FrameType.PROGRESS, {"prefilled": 0, "of": 1, "queued": 0}, 1)
    echoed = a.inbox.get(timeout=5)  # the server's frame, as the client would have received it
    a.start_send(echoed)  # ... sent back to the server
    assert echoed[12:16] == seq.to_bytes(4, "little")
    with pytest.raises(WireError, match="fails its MAC"):
        srv.recv(5)
    a.close()
    b.close()


@pytest.mark.slow  # ~1,000 requests
def test_a_thousand_requests_leave_threads_and_descriptors_at_baseline(tiny):
    srv = S.PrefillServer(tiny, secret=SECRET).start()
    try:
        DecodeClient(tiny, *srv.address, secret=SECRET).close()
        assert wait_until(lambda: srv.connections == 0)
        base = baseline()
        for c in range(10):
            cli = DecodeClient(tiny, *srv.address, secret=SECRET)
            for r in range(100):
                assert len(cli.generate(ids(6 + r % 7, r), Q(), max_new_tokens=1)["tokens"]) == 1
            cli.close()
        assert wait_until(lambda: srv.connections == 0 and srv.preauth == 0)
        assert back_to(base), (base, baseline())
    finally:
        srv.close()
