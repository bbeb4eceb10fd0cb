"""The NIXL data plane (lynx_hf.transfer.nixl): the segments' bytes written by NIXL into the decode side's arena, the
control frames on the MAC'd channel. UCX is pinned to loopback TCP here. Without NIXL installed these tests skip
(but the missing-extra error is tested either way)."""
import os

os.environ.setdefault("UCX_TLS", "tcp")          # before any NIXL agent starts: loopback only, no other interface
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import builtins  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from lynx_hf import LynxQuantConfig as Q  # noqa: E402
from lynx_hf.errors import ConfigError, LynxError  # noqa: E402
from lynx_hf.transfer import nixl  # noqa: E402
from lynx_hf.transfer import server as S  # noqa: E402
from lynx_hf.transfer.decode import DecodeClient  # noqa: E402
from lynx_hf.transfer.wire import WireError  # noqa: E402

SECRET = "nixl-test-secret"
needs_nixl = pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed (pip install 'lynx-hf[nixl]')")


def ids(n, seed):
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def nixl_server(tiny):
    srv = S.PrefillServer(tiny, secret=SECRET, data_plane="nixl").start()
    yield srv
    srv.close()


@needs_nixl
@pytest.mark.parametrize("method", ["lynx", "cachegen", "identity"])
def test_segments_by_nixl_give_the_tcp_paths_tokens(tiny, nixl_server, method):
    """Fixed-size codes, an entropy-coded stream (CacheGen: sizes known only after encoding) and raw KV; 600 tokens
    make three segments per layer and kind. A second turn ships only its delta, by NIXL too."""
    by_nixl = DecodeClient(tiny, *nixl_server.address, secret=SECRET, data_plane="nixl")
    by_tcp = DecodeClient(tiny, *nixl_server.address, secret=SECRET)
    try:
        prompt = ids(600, 0)
        a = by_nixl.generate(prompt, Q(method=method), max_new_tokens=6)
        b = by_tcp.generate(prompt, Q(method=method), max_new_tokens=6)
        assert a["tokens"] == b["tokens"] and a["bytes"] == b["bytes"]
        streams = 2 if method == "lynx" else 1
        assert a["placed_segments"] == 2 * 2 * 3 * streams and b["placed_segments"] == 0  # layers × kinds × segments
        sess = by_nixl.session()
        first = sess.generate(prompt[:300], max_new_tokens=4)
        second = sess.generate(prompt[:300] + first["tokens"] + prompt[300:340], max_new_tokens=4)
        assert second["held_tokens"] == 303 and second["loader_error"] is None
        assert second["placed_segments"] == 2 * 2 * 2  # Lynx: one segment of 40 + 1 tokens per layer, kind, stream
    finally:
        by_nixl.close()
        by_tcp.close()


@needs_nixl
def test_flipped_bytes_in_the_receive_arena_fail_the_request_in_one_line(tiny, nixl_server, monkeypatch):
    """NIXL's bytes are not MAC'd: the SHA-256 in the MAC'd PLACED frame is. A byte flipped after NIXL delivered it
    fails the request; the server serves the next client."""
    arenas = []
    init, wait = nixl.Arena.__init__, nixl.Agent.wait_notif

    def record(self, *a, **k):
        init(self, *a, **k)
        arenas.append(self)

    def corrupt(self, tag, timeout_s):
        wait(self, tag, timeout_s)
        off = int(tag.split()[-1])
        if len(arenas) and off > 0:  # the first segment intact, every later one flipped
            arenas[-1].buf[off] ^= 0x40

    monkeypatch.setattr(nixl.Arena, "__init__", record)
    monkeypatch.setattr(nixl.Agent, "wait_notif", corrupt)
    cli = DecodeClient(tiny, *nixl_server.address, secret=SECRET, data_plane="nixl")
    with pytest.raises(LynxError, match=r"fail their SHA-256 digest \(corrupted or forged on the fabric\)"):
        cli.generate(ids(300, 1), Q(), max_new_tokens=4)
    assert cli.broken
    cli.close()
    monkeypatch.undo()
    again = DecodeClient(tiny, *nixl_server.address, secret=SECRET, data_plane="nixl")
    assert again.generate(ids(30, 2), Q(), max_new_tokens=2)["loader_error"] is None
    again.close()


@needs_nixl
def test_a_server_without_the_plane_refuses_a_nixl_client_clearly(tiny):
    srv = S.PrefillServer(tiny, secret=SECRET).start()
    try:
        cli = DecodeClient(tiny, *srv.address, secret=SECRET, data_plane="nixl")
        with pytest.raises(WireError, match="no NIXL data plane .start it with --data-plane nixl"):
            cli.generate(ids(20, 0), Q(), max_new_tokens=2)
        cli.close()
    finally:
        srv.close()


@needs_nixl
def test_an_arena_claim_is_bounded_before_anything_is_staged():
    plane = nixl.PrefillPlane()
    good = {"kind": "nixl", "agent": "x", "metadata": "", "arena": [4096, 1000]}
    for bad, why in (({**good, "arena": [4096, 10**12]}, "exceeds this request's bound of 1000 bytes"),
                     ({**good, "arena": [4096, -1]}, "non-negative ints"),
                     ({**good, "arena": "0x1000"}, r"\[address, length\]"),
                     ({**good, "metadata": "not base64!"}, "not base64"),
                     ({**good, "metadata": 7}, "must be base64"),
                     ({**good, "kind": "rdma"}, "kind")):
        with pytest.raises(WireError, match=why):
            plane.begin(bad, 1, bound=1000)
    assert plane.stage is None  # nothing was allocated for a refused claim
    plane.close()


def test_selecting_nixl_without_it_is_one_line_naming_the_extra(tiny, monkeypatch):
    real = builtins.__import__

    def no_nixl(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.split(".")[0] in ("nixl", "nixl_cu12"):
            raise ImportError(f"No module named {name!r}")
        return real(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_nixl)
    for make in (lambda: DecodeClient(tiny, "127.0.0.1", 1, secret=SECRET, data_plane="nixl"),
                 lambda: S.PrefillServer(tiny, secret=SECRET, data_plane="nixl")):
        with pytest.raises(ConfigError, match=r"needs NIXL: pip install 'lynx-hf\[nixl\]'"):
            make()
    with pytest.raises(ConfigError, match="data_plane must be one of"):
        nixl.check_plane("rdma")


def test_the_cli_says_so_before_loading_a_model():
    code = ("import builtins, sys; real = builtins.__import__\n"
            "def imp(name, globals=None, locals=None, fromlist=(), level=0):\n"
            "    if level == 0 and name.split('.')[0] in ('nixl', 'nixl_cu12'): raise ImportError(name)\n"
            "    return real(name, globals, locals, fromlist, level)\n"
            "builtins.__import__ = imp\n"
            "from lynx_hf.cli import main; sys.argv = ['lynx-hf', 'serve-prefill', '--insecure', '--data-plane', "
            "'nixl', '--listen', '127.0.0.1:0']; main()")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    lines = [l for l in p.stderr.strip().splitlines() if "WARNING" not in l]
    assert lines == ["lynx-hf serve-prefill: error: the NIXL data plane needs NIXL: pip install 'lynx-hf[nixl]'"]


@needs_nixl
@pytest.mark.slow  # a serve-prefill child process and the default model
def test_two_processes_by_nixl_equal_the_tcp_path(model_and_tok):
    from lynx_hf.eval.benches.demo import default_prompt_text, prefill_child

    model, tok = model_and_tok
    prompt = tok(default_prompt_text()).input_ids[:700]
    with prefill_child(model, 200e6, prompt[:32], data_plane="nixl") as cli:
        a = cli.generate(prompt, Q(), max_new_tokens=16)
        b = cli.generate(prompt, Q(), max_new_tokens=16, speculative=False)
    assert a["placed_segments"] > 0 and a["loader_error"] is None
    with prefill_child(model, 200e6, prompt[:32]) as cli:
        c = cli.generate(prompt, Q(), max_new_tokens=16)
    assert a["tokens"] == b["tokens"] == c["tokens"]
    assert c["placed_segments"] == 0 and a["bytes"] == c["bytes"]
