"""What the benchmarks and demos share, and nothing they do not: a library module (no command of its own).

    printer / final_line   what a script says for a person (silent, or on stderr, under --json) and the one JSON
                           line every command ends with on stdout
    pyplot / save_figure / save_plot
                           matplotlib on the Agg backend (an optional extra: without it a PNG is skipped, said in
                           one line, and the numbers are still written)
    free_port              a loopback port nobody listens on
    start_prefill_server / stop_server / prefill_child
                           a `lynx-hf serve-prefill` child process behind the link emulator, and a DecodeClient
                           connected to it and warmed up
    default_prompt_text / METHODS
                           the demo's prompt (text every Python has) and its codec rows

Imports nothing heavy at load: the benchmark modules that import it register their `lynx-hf bench` subcommands
while `lynx-hf --help` runs, which starts without torch (torch and the client load inside `prefill_child`)."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time

from lynx_hf import LynxQuantConfig

METHODS = {"BF16": LynxQuantConfig(method="bf16"), "INT8": LynxQuantConfig(method="int8"),
           "INT4 (KIVI-4)": LynxQuantConfig(method="kivi4"), "CacheGen": LynxQuantConfig(method="cachegen"),
           "Lynx": LynxQuantConfig()}


# -- output ---------------------------------------------------------------------------------------------------------
def printer(as_json: bool, stderr: bool = False):
    """`print`, or under --json a printer that drops its text (`stderr`: prints it on stderr instead), so that
    stdout holds the final JSON line alone."""
    if not as_json:
        return print
    return (lambda *a: print(*a, file=sys.stderr)) if stderr else (lambda *a: None)


def final_line(res: dict) -> dict:
    """Print `res` as the command's last line, one JSON object (what scripts and checks parse), and return it."""
    print(json.dumps(res))
    return res


# -- plots ----------------------------------------------------------------------------------------------------------
def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display); ImportError where matplotlib is not installed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, rect=None) -> None:
    """Lay out, write at 110 dpi and close (a figure left open keeps its memory)."""
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def save_plot(draw, path, say, beside=None, what: str = "the PNG") -> bool:
    """draw(path) writes a PNG; say what was written (`beside`: a file written before it, named too). Without
    matplotlib: say so in one line and return False (the numbers are written all the same)."""
    try:
        draw(path)
    except ImportError:
        say(f"wrote {beside} (install matplotlib for {what})" if beside else f"install matplotlib for {what}")
        return False
    say(f"wrote {beside} and {path}" if beside else f"wrote {path}")
    return True


# -- the prefill child process --------------------------------------------------------------------------------------
def default_prompt_text() -> str:
    """Text every Python installation has: the standard library's own source."""
    import inspect
    import json as _json
    import textwrap

    return "".join(inspect.getsource(m) for m in (textwrap, _json.decoder, _json.encoder, inspect))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_prefill_server(port: int, bandwidth_bps: float | None, secret: str, model: str | None,
                         extra: tuple = ()) -> subprocess.Popen:
    """`lynx-hf serve-prefill` on 127.0.0.1:`port` (`extra`: more of its flags), once it accepts connections; its
    log in `proc.log` (a file: a pipe nobody drains blocks the server once ~64 KiB accumulate)."""
    cmd = [sys.executable, "-m", "lynx_hf.cli", "serve-prefill", "--listen", f"127.0.0.1:{port}"] + \
        (["--bandwidth-mbps", str(bandwidth_bps / 1e6)] if bandwidth_bps else []) + \
        (["--model", model] if model else []) + list(extra)
    env = dict(os.environ, LYNX_SECRET=secret)
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log = log
    t = time.time()
    while time.time() - t < 300:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"prefill server exited: {log.read()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("prefill server did not start within 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    """Terminate (kill after 10 s) and close its log."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    proc.log.close()


@contextlib.contextmanager
def prefill_child(model, bandwidth_bps: float | None, warmup_ids: list[int], model_name: str | None = None,
                  timeout_s: float = 120, server_args: tuple = (), data_plane: str = "tcp", port: int | None = None,
                  link_bps: float | None = None):
    """A `serve-prefill` child process behind the link emulator (`bandwidth_bps` None or 0: no emulation;
    `server_args`: more of its flags), and a DecodeClient connected to it and warmed up (one short request through
    both processes); the child is stopped on exit. data_plane "nixl": the segments move by NIXL, which this loopback
    pair pins to loopback TCP unless $UCX_TLS / $UCX_NET_DEVICES say otherwise. port: the child's (None: a free
    one). link_bps: the client's hint of the link's rate (anchor_bits "auto")."""
    from lynx_hf.transfer.decode import DecodeClient

    if data_plane == "nixl":
        os.environ.setdefault("UCX_TLS", "tcp")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        server_args = (*server_args, "--data-plane", "nixl")
    secret, port = secrets.token_hex(16), port or free_port()
    proc = start_prefill_server(port, bandwidth_bps, secret, model_name, server_args)
    try:
        cli = DecodeClient(model, "127.0.0.1", port, secret=secret, timeout_s=timeout_s, data_plane=data_plane,
                           link_bps=link_bps or None)
        cli.generate(warmup_ids, LynxQuantConfig(), max_new_tokens=2)
        yield cli
        cli.close()
    finally:
        stop_server(proc)
