"""The fault suite (issue 21): loopback only, each scenario bounded and stopping by itself. A tampering proxy between
client and server (flip, drop, duplicate, reorder, replay, truncate frames), kill -9 of the server mid-anchor,
mid-residual and after the anchors before the logits, and a client killed mid-stream. For each: no token computed
from unverified KV is ever final, the error is one clear line, and whoever survives returns to its baseline of
threads and descriptors (the pre-authentication flood and the slow TLS handshake are in
test_server_hostile_peers.py)."""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch

from conftest import wait_until
from lynx_hf import LynxQuantConfig as Q
from lynx_hf.errors import LynxError
from lynx_hf.streamer import SpeculativeStreamer
from lynx_hf.transfer import server as S
from lynx_hf.transfer.decode import DecodeClient
from lynx_hf.transfer.wire import HEADER, FrameType, Stream

SECRET = "fault-secret"
TESTS = os.path.dirname(os.path.abspath(__file__))
PROMPT = torch.randint(3, 96, (300,), generator=torch.Generator().manual_seed(11)).tolist()


def counts():
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def settle(base, timeout=20.0) -> bool:
    t0 = time.monotonic()
    while counts()[0] > base[0] or counts()[1] > base[1]:
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.02)
    return True


def recv_exact(s, n) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            return buf
        buf += chunk
    return buf


class Proxy:
    """One connection's man in the middle: client → server bytes pass unchanged; server → client frames pass one by
    one through `act(kind, index, frame) -> list[bytes] | None` (None: stop and close both sides), where kind is
    "anchor", "residual", "first" or "other" and index counts the frames of that kind."""

    def __init__(self, target, act):
        self.target, self.act = target, act
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.address = self.lsock.getsockname()[:2]
        self.threads = [threading.Thread(target=self._run, daemon=True)]
        self.threads[0].start()

    def _run(self):
        c, _ = self.lsock.accept()
        s = socket.create_connection(self.target)
        up = threading.Thread(target=self._pipe, args=(c, s), daemon=True)
        up.start()
        seen = {}
        try:
            while True:
                head = recv_exact(s, HEADER.size)
                if len(head) < HEADER.size:
                    break
                frame = head + recv_exact(s, int.from_bytes(head[16:20], "little"))
                ftype, stream = head[5], head[6]
                kind = ({Stream.ANCHOR: "anchor", Stream.RESIDUAL: "residual"}.get(stream)
                        if ftype == FrameType.SEGMENT else "first" if ftype == FrameType.FIRST else "other")
                i = seen[kind] = seen.get(kind, -1) + 1
                out = self.act(kind, i, frame)
                if out is None or None in out:
                    for b in (out or [])[:(out or [None]).index(None)]:
                        c.sendall(b)
                    break
                for b in out:
                    c.sendall(b)
        except OSError:
            pass
        finally:
            for x in (c, s):
                try:
                    x.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                x.close()
            up.join(5)
            self.lsock.close()

    @staticmethod
    def _pipe(a, b):
        try:
            while chunk := a.recv(65536):
                b.sendall(chunk)
            b.shutdown(socket.SHUT_WR)  # the client closed: pass its end of stream on, as a TCP proxy does
        except OSError:
            pass


def reseal(frame: bytes, pos: int) -> bytes:
    """Flip one payload byte and recompute the CRC (what an attacker can do): only the frame MAC can catch it."""
    head, body = bytearray(frame[:HEADER.size]), bytearray(frame[HEADER.size:])
    body[pos] ^= 0x40
    head[-4:] = b"\0\0\0\0"
    crc = zlib.crc32(bytes(body), zlib.crc32(bytes(head)))
    head[-4:] = crc.to_bytes(4, "little")
    return bytes(head + body)


def tamper(how):
    """act() for the proxy: `how` applied to the 3rd residual frame (the decode side is drafting on anchors then).
    A None in the returned list closes both sides after what precedes it."""
    held = {}

    def act(kind, i, frame):
        if kind == "anchor" and i == 0:
            held["anchor0"] = frame
        if kind != "residual" or i not in (2, 3):
            return [frame]
        if i == 3:
            return [frame, held.pop("r2")] if "r2" in held else [frame]
        return {"flip": lambda: [reseal(frame, 40)],
                "drop": lambda: [],
                "duplicate": lambda: [frame, frame],
                "reorder": lambda: held.update(r2=frame) or [],
                "replay": lambda: [frame, held["anchor0"]],
                "truncate": lambda: [frame[:len(frame) // 2], None]}[how]()

    return act


@pytest.fixture(scope="module")
def plain_server(tiny):
    srv = S.PrefillServer(tiny, secret=SECRET).start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def reference(tiny, plain_server):
    cli = DecodeClient(tiny, *plain_server.address, secret=SECRET)
    out = cli.generate(PROMPT, Q(), max_new_tokens=8)["tokens"]
    cli.close()
    return out


def generate_through(tiny, proxy, **kw):
    """(exception or None, the tokens the streamer saw as final)."""
    streamer = SpeculativeStreamer()
    cli = None
    try:
        cli = DecodeClient(tiny, *proxy.address, secret=SECRET, timeout_s=5, **kw)
        cli.generate(PROMPT, Q(), max_new_tokens=8, lynx_streamer=streamer)
        return None, streamer.final
    except (LynxError, ConnectionError, TimeoutError) as e:
        return e, streamer.final
    finally:
        if cli is not None:
            cli.close()


HOW = {"flip": "fails its MAC", "drop": "out-of-order", "duplicate": "duplicated", "reorder": "out-of-order",
       "replay": "duplicated frame on the anchor stream", "truncate": "truncated frame"}


@pytest.mark.parametrize("how", list(HOW))
def test_a_tampering_proxy_is_refused_and_no_unverified_token_is_final(tiny, plain_server, reference, how):
    base = counts()
    proxy = Proxy(plain_server.address, tamper(how))
    err, final = generate_through(tiny, proxy)
    assert err is not None, f"{how}: generation completed through a tampering proxy"
    msg = str(err)
    assert "\n" not in msg and re.search(HOW[how], msg), (how, msg)
    assert final == reference[:len(final)], (how, final, reference)  # nothing final that full KV would not give
    assert wait_until(lambda: plain_server.connections == 0 and plain_server.preauth == 0)
    assert settle(base), (base, counts())


SERVER = """
import sys
sys.path.insert(0, {tests!r})
from conftest import make_tiny
from lynx_hf.transfer.server import PrefillServer
srv = PrefillServer(make_tiny(), secret={secret!r}, bandwidth_bps=2e6)
print(srv.address[1], flush=True)
srv.serve_forever()
"""


def spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


@pytest.mark.slow  # a server process per phase
@pytest.mark.parametrize("phase", [("anchor", 3), ("residual", 2), ("first", 0)],
                         ids=["mid-anchor", "mid-residual", "after-anchors-before-logits"])
def test_kill_9_of_the_server_is_one_clear_error_and_no_unverified_token(tiny, reference, phase):
    proc = spawn(SERVER.format(tests=TESTS, secret=SECRET))
    try:
        port = int(proc.stdout.readline())
        base = counts()

        def act(kind, i, frame):
            if (kind, i) == phase:
                os.kill(proc.pid, signal.SIGKILL)  # the frame and everything after it never leave the server
                proc.wait(10)
                return None
            return [frame]

        err, final = generate_through(tiny, Proxy(("127.0.0.1", port), act))
        assert err is not None and "\n" not in str(err), err
        assert final == reference[:len(final)], (final, reference)
        assert settle(base), (base, counts())
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


CLIENT = """
import sys
sys.path.insert(0, {tests!r})
from conftest import make_tiny
from lynx_hf import LynxQuantConfig as Q
from lynx_hf.transfer.decode import DecodeClient
cli = DecodeClient(make_tiny(), "127.0.0.1", {port}, secret={secret!r})
print("connected", flush=True)
cli.generate(list(range(3, 93)) * 20, Q(method="identity"), max_new_tokens=4)
"""


@pytest.mark.slow  # a client process
def test_a_client_killed_mid_stream_frees_the_servers_thread_descriptors_and_memory(tiny):
    import gc
    import tracemalloc

    srv = S.PrefillServer(tiny, secret=SECRET, bandwidth_bps=0.5e6).start()  # 1,800 tokens: seconds on the link
    try:
        cli = DecodeClient(tiny, *srv.address, secret=SECRET)
        cli.generate(PROMPT, Q(), max_new_tokens=2)
        cli.close()
        assert wait_until(lambda: srv.connections == 0)
        tracemalloc.start()
        gc.collect()
        base, mem0 = counts(), tracemalloc.get_traced_memory()[0]
        proc = spawn(CLIENT.format(tests=TESTS, port=srv.address[1], secret=SECRET))
        assert proc.stdout.readline().strip() == "connected"
        assert wait_until(lambda: srv.connections == 1)
        time.sleep(1.5)  # its request is prefilled and its KV on the emulated link
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
        assert wait_until(lambda: srv.connections == 0 and srv.compute.waiting == 0, 20)
        assert settle(base), (base, counts())
        gc.collect()
        grew = tracemalloc.get_traced_memory()[0] - mem0
        tracemalloc.stop()
        assert grew < 2 << 20, grew  # the queued KV frames were freed
    finally:
        srv.close()
