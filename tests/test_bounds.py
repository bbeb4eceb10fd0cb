"""What the prefill server may hold, and the input it refuses before holding anything: a connection's in-flight
frames under `bound_inflight` (a client that does not read stalls its own request, never the compute and never a
growing queue), working sets under `--max-concurrent-prefills`, every numeric flag of every subcommand through one
validator (refused at parse time, before a model loads), client timeouts, and TLS spoken to a plain peer (or the
reverse) said at once. The tiny model; loopback servers in this process. The RSS bound itself: test_server_memory.py
(slow tier, the default model)."""
import argparse
import math
import threading
import time

import pytest
import torch

from conftest import wait_until
from lynx_hf import LynxQuantConfig as Q
from lynx_hf.errors import ConfigError
from lynx_hf.flags import number
from lynx_hf.transfer import prefill as P
from lynx_hf.transfer import server as S
from lynx_hf.transfer.decode import DecodeClient
from lynx_hf.transfer.transport import Transport
from lynx_hf.transfer.wire import WireError

SECRET = "bounds-secret"


def ids(n, seed):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- the transport's in-flight bound -----------------------------------------------------------------------------------
class Held(Transport):
    """Writes nothing until `go` is set: a peer that does not read."""

    def __init__(self):
        self.go = threading.Event()
        super().__init__()

    def _write(self, frame, priority):
        self.go.wait(10)


def test_in_flight_bytes_are_counted_until_written_and_wait_room_waits_for_the_peer():
    t = Held()
    t.bound_inflight(100)
    futs = [t.start_send(b"x" * 60) for _ in range(2)]
    assert t.inflight == 120 and not t.has_room()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="read nothing for 0.2 s"):
        t.wait_room(0.2)
    assert time.monotonic() - t0 < 2
    t.go.set()
    t.wait_room(5)  # returns once the frames are written
    assert all(f.result(5) is None for f in futs) and t.inflight == 0 and t.has_room()
    t.close()


def test_dropped_and_failed_frames_leave_the_count_and_a_failed_transport_wakes_its_waiters():
    t = Held()
    t.bound_inflight(10)
    first = t.start_send(b"a" * 50, tag=1)  # taken by the sender, which blocks in _write
    assert wait_until(lambda: first.running())
    t.start_send(b"b" * 50, tag=2)
    assert t.drop(2) == 1 and t.inflight == 50
    t.close()
    with pytest.raises(ConnectionError, match="failed while its frames waited"):
        t.wait_room(5)
    t.go.set()


# -- through the server ------------------------------------------------------------------------------------------------
def test_a_slow_reader_is_held_to_its_in_flight_bound_and_the_compute_never_waits_for_it(tiny, monkeypatch):
    """A 0.2 Mbit/s link drains a 900-token prompt's frames for seconds: the connection's queue never holds more
    than its 4 KiB bound plus one layer's frames of one forward pass (the pass queues what it can and never waits),
    and meanwhile another client's short request is prefilled and answered; both outputs are those of an unbounded
    server."""
    seen = []
    start_send = Transport.start_send

    def watch(self, frame, *a, **k):
        fut = start_send(self, frame, *a, **k)
        if self.max_inflight is not None:
            seen.append(self.inflight)
        return fut

    monkeypatch.setattr(Transport, "start_send", watch)
    bound = 4096
    srv = S.PrefillServer(tiny, secret=SECRET, bandwidth_bps=0.2e6, prefill_step=128, max_inflight_mb=bound / 2**20)
    srv.start()
    ref_srv = S.PrefillServer(tiny, secret=SECRET).start()
    try:
        slow, quick = (DecodeClient(tiny, *srv.address, secret=SECRET) for _ in range(2))
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("long", slow.generate(ids(900, 1), Q(), max_new_tokens=2)))
        th.start()
        assert wait_until(lambda: len(seen) > 20)
        short = quick.generate(ids(12, 2), Q(), max_new_tokens=2)
        assert th.is_alive()  # the long transfer is still draining: the short one did not wait for it
        th.join(120)
        g = P.kv_geometry(tiny)
        per_layer_pass = 128 * 2 * g["kv_heads"] * g["head_dim"] * 4  # raw bytes: frames of one layer, one pass
        assert max(seen) <= bound + per_layer_pass + 1024, (max(seen), bound)
        ref = DecodeClient(tiny, *ref_srv.address, secret=SECRET)
        assert out["long"]["tokens"] == ref.generate(ids(900, 1), Q(), max_new_tokens=2)["tokens"]
        assert short["tokens"] == ref.generate(ids(12, 2), Q(), max_new_tokens=2)["tokens"]
        for c in (slow, quick, ref):
            c.close()
    finally:
        srv.close()
        ref_srv.close()


def test_requests_beyond_the_working_set_slots_wait_hearing_progress(tiny, monkeypatch):
    """One slot per pool: while a short prompt holds the short one, a second short one waits — its prompt not yet
    looked up or prefilled, its client kept alive by PROGRESS frames past its own 1 s silence limit — and is served
    once the slot frees; a long prompt holding the other pool's slot (a transfer to a slow client) delays no short
    one."""
    monkeypatch.setattr(P, "PROGRESS_S", 0.2)
    srv = S.PrefillServer(tiny, secret=SECRET, max_concurrent_prefills=1).start()
    try:
        cli = DecodeClient(tiny, *srv.address, secret=SECRET, timeout_s=1.0)
        taken, release = threading.Event(), threading.Event()

        def hold(tokens, taken, release):
            with srv.slots.hold(tokens):
                taken.set()
                release.wait(10)

        long_taken, long_release = threading.Event(), threading.Event()
        threading.Thread(target=hold, args=(5000, long_taken, long_release)).start()
        assert long_taken.wait(5)
        assert len(cli.generate(ids(20, 4), Q(), max_new_tokens=2)["tokens"]) == 2  # not behind the long one
        th = threading.Thread(target=hold, args=(20, taken, release))
        th.start()
        assert taken.wait(5)
        looked = []
        monkeypatch.setattr(srv.prefix, "lookup", lambda *a, f=srv.prefix.lookup: looked.append(1) or f(*a))
        out = {}
        g = threading.Thread(target=lambda: out.setdefault("r", cli.generate(ids(20, 3), Q(), max_new_tokens=2)))
        g.start()
        time.sleep(2.0)
        assert not looked and g.is_alive()
        release.set()
        g.join(30)
        assert looked and len(out["r"]["tokens"]) == 2
        cli.close()
        th.join(5)
        long_release.set()
    finally:
        srv.close()


def test_the_server_states_its_memory_bounds(tiny, caplog):
    caplog.set_level("INFO", logger="lynx_hf.prefill")
    srv = S.PrefillServer(tiny, secret=SECRET, prefix_cache_mb=8, max_inflight_mb=2, max_connections=3,
                          max_concurrent_prefills=2)
    try:
        b, g = srv.bounds, P.kv_geometry(tiny)
        per_token = g["num_layers"] * 2 * g["kv_heads"] * g["head_dim"] * 4
        assert b["kv_bytes_per_token"] == per_token and b["prefix_cache"] == 8 << 20
        assert b["working_sets"] == 2 * 2 * (P.max_prompt_tokens(tiny) + 1024) * per_token
        assert b["inflight"] == 3 * ((2 << 20) + 1024 * per_token // g["num_layers"])
        assert b["total"] == b["model"] + b["prefix_cache"] + b["working_sets"] + b["compute"] + b["inflight"]
        assert "memory bounds: model" in caplog.text and "in-flight frames 3 connections x (2 MB" in caplog.text
    finally:
        srv.close()


# -- operator and client input -------------------------------------------------------------------------------------
ZERO_OK = {("bench transfer", "--links"), ("bench server-memory", "--prefix-cache-mb"), ("acceptance", "--drafts"),
           ("results", "--residual-after"), ("results", "--ruler-samples"), ("card", "--residual-after"),
           ("simulate", "--acceptance"), ("serve-prefill", "--latency-ms"), ("serve-prefill", "--prefix-cache-mb")}
REQUIRED = {"card": ["--out", "x"], "serve-decode": ["--prefill", "127.0.0.1:1"]}


def numeric_flags():
    """(command, action) of every numeric flag, `bench`'s benchmarks included ("bench codec", ...)."""
    from lynx_hf.cli import build_parser

    def walk(p, cmd):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, q in a.choices.items():
                    yield from walk(q, f"{cmd} {name}".strip())
            elif a.option_strings and a.type not in (None, str) and a.nargs != 0:
                yield cmd, a

    yield from walk(build_parser(), "")


def test_every_numeric_flag_goes_through_the_one_validator():
    flags = list(numeric_flags())
    assert len(flags) >= 35
    assert all(isinstance(a.type, number) for _, a in flags), [(c, a.dest) for c, a in flags
                                                               if not isinstance(a.type, number)]
    assert {(c, a.option_strings[-1]) for c, a in flags if a.type.zero or a.type.ok(0)} == ZERO_OK


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e308", "1e12", "many"])
def test_every_numeric_flag_refuses_bad_values_in_one_line_at_parse_time(value, capsys):
    from lynx_hf.cli import build_parser

    for cmd, a in numeric_flags():
        flag = a.option_strings[-1]
        argv = [*cmd.split(), *REQUIRED.get(cmd, []), flag, value]
        if value == "0" and (cmd, flag) in ZERO_OK:
            build_parser().parse_args(argv)  # 0 means something here ("off", "no emulation", ...)
            continue
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and err.startswith(f"lynx-hf {cmd}: error: argument {flag}"), (cmd, flag, err)
        assert repr(value) in err


@pytest.mark.parametrize("kw", [{"idle_timeout_s": 1e308}, {"send_timeout_s": math.inf}, {"handshake_timeout": 0},
                                {"prefix_cache_mb": 1e12}, {"prefix_cache_mb": -1}, {"max_inflight_mb": 0},
                                {"max_concurrent_prefills": 0}])
def test_the_server_refuses_unbounded_settings(tiny, kw):
    with pytest.raises(ConfigError, match=next(iter(kw)).split("_s")[0]):
        S.PrefillServer(tiny, secret=SECRET, **kw)


@pytest.mark.parametrize("timeout", [0, -1, math.nan, math.inf, 1e308, "5"])
def test_a_client_timeout_must_be_finite_and_positive_before_it_connects(tiny, timeout):
    with pytest.raises(ConfigError, match="timeout_s must be a finite number of seconds"):
        DecodeClient(tiny, "127.0.0.1", 1, secret=SECRET, timeout_s=timeout)


def test_tls_spoken_to_a_plain_server_and_plain_to_a_tls_server_are_said_at_once(tiny, certificate):
    cert, key = certificate
    tls = S.PrefillServer(tiny, secret=SECRET, tls_cert=cert, tls_key=key).start()
    plain = S.PrefillServer(tiny, secret=SECRET).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(WireError, match="the prefill server speaks TLS: connect with tls=True"):
            DecodeClient(tiny, *tls.address, secret=SECRET)
        with pytest.raises(WireError, match="speaks plain TCP, not TLS"):
            DecodeClient(tiny, *plain.address, secret=SECRET, tls_ca=cert)
        assert time.monotonic() - t0 < 2.0  # not the 5 s handshake deadline
        ok = DecodeClient(tiny, "127.0.0.1", tls.address[1], secret=SECRET, tls_ca=cert)
        assert len(ok.generate(ids(10, 4), Q(), max_new_tokens=2)["tokens"]) == 2
        ok.close()
    finally:
        tls.close()
        plain.close()


def test_no_numeric_flag_anywhere_bypasses_the_validator():
    """The vLLM demo and proxy and the eval scripts parse their own flags: none with a bare int or float type."""
    import re
    from pathlib import Path

    root = Path(__file__).parent.parent
    bare = [f"{p.relative_to(root)}:{n}" for d in ("lynx_hf", "eval") for p in (root / d).rglob("*.py")
            for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"type=(int|float)\b", line)]
    assert not bare, bare
