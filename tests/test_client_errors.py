"""What a newcomer on a busy machine hits first: a client that does its own work before it connects (the handshake's
deadline measures the peer, not this side), a refusal that says whether the secret or the deadline failed, one-line
errors with the command's prefix, errors that name only flags that exist, one cache root. In this process (fast);
the under-load connection run is in the slow tier."""
import socket
import subprocess
import sys
import time

import pytest

import lynx_hf
from lynx_hf.cli import main
from lynx_hf.transfer import server as S
from lynx_hf.transfer.decode import DecodeClient
from lynx_hf.transfer.auth import Channel, client_handshake
from lynx_hf.transfer.transport import TcpTransport
from lynx_hf.transfer.wire import WireError

SECRET = "newcomer-secret"


def test_a_client_computes_before_it_connects(tiny, monkeypatch):
    """Before: the fingerprint (3–25 s on a loaded machine) ran between connect and HELLO, past the server's
    deadline. Now a fingerprint that takes longer than the deadline does not matter: it runs before connecting."""
    from lynx_hf.transfer import decode

    srv = S.PrefillServer(tiny, secret=SECRET, handshake_timeout=0.5).start()
    real = decode.fingerprint
    monkeypatch.setattr(decode, "fingerprint", lambda m: (time.sleep(1.0), real(m))[1])  # a busy machine's
    try:
        cli = DecodeClient(tiny, *srv.address, secret=SECRET)
        assert cli.generate([5, 6, 7, 8], max_new_tokens=2)["tokens"]
        cli.close()
    finally:
        srv.close()


def test_a_refusal_says_whether_the_secret_or_the_deadline_failed(tiny):
    from lynx_hf.arch import fingerprint

    srv = S.PrefillServer(tiny, secret=SECRET, handshake_timeout=0.4).start()
    fp = fingerprint(tiny)
    try:
        with pytest.raises(WireError, match=r"refused our HELLO \(a different shared secret\)"):
            DecodeClient(tiny, *srv.address, secret="another-secret")
        ch = Channel(TcpTransport.connect(*srv.address))
        time.sleep(0.8)  # a client too slow for the deadline
        with pytest.raises(WireError, match="handshake deadline passed before our HELLO arrived"):
            client_handshake(ch, SECRET.encode(), fp)
        ch.close()
    finally:
        srv.close()


def test_serve_prefill_says_a_port_in_use_or_a_bad_listen_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(lynx_hf, "load_default_model", lambda *a, **k: pytest.fail("the model loaded first"))
    busy = socket.create_server(("127.0.0.1", 0))
    port = busy.getsockname()[1]
    for listen, says in ((f"127.0.0.1:{port}", f"cannot listen on 127.0.0.1:{port}"),
                         ("127.0.0.1", "expected HOST:PORT"), ("127.0.0.1:99999", "expected HOST:PORT")):
        with pytest.raises(SystemExit) as e:
            main(["serve-prefill", "--listen", listen, "--secret", "s"])
        msg = str(e.value.code)
        assert msg.startswith("lynx-hf serve-prefill: error: ") and says in msg and "\n" not in msg
    busy.close()


def test_missing_data_names_only_flags_the_command_has(tmp_path, monkeypatch):
    from lynx_hf.eval.lib import data

    monkeypatch.setattr(data, "shakespeare", lambda: tmp_path / "text" / "tinyshakespeare.txt")  # not there
    for cmd, flag, say in (("acceptance", None, None), ("bench transfer --prompts shakespeare",
                                                         "--prompts code (or a text file's path)", "--prompts code"),
                           ("codec-quality", "--text FILE", "--text FILE")):
        with pytest.raises(FileNotFoundError) as e:
            data.require(cmd, needs_text=True, text_flag=flag)
        assert ("--text" in str(e.value)) == (cmd == "codec-quality")
        assert say is None or say in str(e.value)


@pytest.mark.slow  # lm-eval's CLI in a subprocess
@pytest.mark.parametrize("margs, says", [("kv=int5", "kv must be one of"),
                                         ("pretrained=/nonexistent/model", "no such model folder")])
def test_eval_errors_are_one_line(margs, says):
    p = subprocess.run([sys.executable, "-m", "lynx_hf.cli", "eval", "run", "--model", "lynx", "--model_args", margs,
                        "--tasks", "niah_single_1", "--limit", "1"], capture_output=True, text=True, timeout=300)
    err = [l for l in p.stderr.splitlines() if l.strip() and "Warning" not in l and "warn" not in l]
    assert p.returncode != 0 and err[-1].startswith("lynx-hf eval: error: ") and says in err[-1], p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_one_cache_root_honours_xdg(tmp_path, monkeypatch):
    from lynx_hf.kernels import cpu
    from lynx_hf.model import cache_root

    monkeypatch.delenv("LYNX_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root().startswith(str(tmp_path / "lynx-hf")) and str(cpu._cache_dir()).startswith(
        str(tmp_path / "lynx-hf"))
    monkeypatch.setenv("LYNX_CACHE", str(tmp_path / "x"))
    assert cache_root().startswith(str(tmp_path / "x")) and str(cpu._cache_dir()).startswith(str(tmp_path / "x"))


@pytest.mark.slow  # two busy processes, the default model
def test_ten_connections_in_a_row_succeed_under_load(model_and_tok):
    """Two processes keep both cores busy (a shared decode node): 10 DecodeClients with the right secret in a row
    all connect and generate (before: "authentication failed" once the fingerprint outlasted the deadline); a wrong
    secret is named as such."""
    model, _ = model_and_tok
    burn = [subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<300: pass"])
            for _ in range(2)]
    srv = S.PrefillServer(model, secret=SECRET).start()
    try:
        ok = 0
        for _ in range(10):
            cli = DecodeClient(model, *srv.address, secret=SECRET)  # fingerprints the 135M model each time
            ok += cli.fp != ""
            cli.close()
        assert ok == 10
        with pytest.raises(WireError, match="a different shared secret"):
            DecodeClient(model, *srv.address, secret="wrong")
    finally:
        srv.close()
        for p in burn:
            p.kill()


def test_eval_help_names_the_flags_a_user_needs(capsys):
    from lynx_hf.eval.lmeval.lm_eval_model import cli

    with pytest.raises(SystemExit) as e:
        cli(["--help"])
    out = capsys.readouterr().out
    assert e.value.code in (0, None)
    for flag in ("lynx-hf eval run --help", "--model lynx", "--model_args", "--tasks", "--limit", "--output_path",
                 "--debug", "kv=MODE"):
        assert flag in out, flag
