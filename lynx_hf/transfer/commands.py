"""`lynx-hf serve-prefill` and `lynx-hf serve-decode`: the two production processes (argument parsing and the loop
around PrefillServer / DecodeClient)."""
from __future__ import annotations

import argparse
import json
import logging
import socket
import sys

from ..flags import ANCHOR_BITS_HELP, DTYPE_HELP, DTYPES, MODEL_HELP, HelpFormatter  # noqa: F401 — (re-exported)

SECRET_HELP = ("shared secret; visible to every local user in the process list: prefer --secret-file or "
               "$LYNX_SECRET")
SECRET_FILE_HELP = "read the shared secret from this file's first line (or set $LYNX_SECRET); one of them is required"
EXACT_HELP = ("exact mode (Lynx codec only): a third stream makes the full tier the model's KV bit for bit, so the "
              "output equals plain generate in this dtype (default: equal to decoding the 8-bit full tier)")
NIXL_HELP = "pip install 'lynx-hf[nixl]'; UCX_TLS / UCX_NET_DEVICES choose its transports and interfaces"


class Renamed(argparse.Action):
    """A flag that has a new name: using it exits with one line naming the new one (argparse's status 2)."""

    def __init__(self, option_strings, dest, new: str, **kw):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"{parser.prog}: error: {option_string} is now {self.new}\n")


def _hostport(s: str, cmd: str):
    host, _, port = s.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise SystemExit(f"lynx-hf {cmd}: error: expected HOST:PORT (e.g. 127.0.0.1:7480), got {s!r}")
    return host.strip("[]"), int(port)


def _secret_or_exit(a, host: str) -> str | None:
    """The secret from --secret-file, --secret or $LYNX_SECRET; --insecure only alone and on loopback; said on
    stderr in one line."""
    from ..errors import ConfigError
    from .auth import read_secret_file, resolve_secret

    try:
        if a.secret and a.secret_file:
            raise ConfigError("--secret and --secret-file together: pass one")
        secret = read_secret_file(a.secret_file) if a.secret_file else a.secret
        resolve_secret(secret, a.insecure, host)
    except ConfigError as e:
        raise SystemExit(f"lynx-hf {a.cmd}: error: {e}")
    if a.insecure:
        print(f"lynx-hf {a.cmd}: WARNING: --insecure: a publicly known key, no authentication (loopback only)",
              file=sys.stderr)
    elif a.secret:
        print(f"lynx-hf {a.cmd}: note: --secret is visible to every local user in the process list; prefer "
              f"--secret-file or $LYNX_SECRET", file=sys.stderr)
    return secret


def plane_or_exit(a) -> None:
    """--data-plane, checked before the model loads: NIXL missing is one line naming the install command."""
    from ..errors import ConfigError
    from .nixl import check_plane

    try:
        check_plane(a.data_plane)
    except ConfigError as e:
        raise SystemExit(f"lynx-hf {a.cmd}: error: {e}")


def _serve_prefill(a):
    import torch

    import lynx_hf
    from ..errors import ConfigError

    from .server import PrefillServer
    from .settings import ServerSettings

    host, port = _hostport(a.listen, a.cmd)
    secret = _secret_or_exit(a, host)
    plane_or_exit(a)
    bw = a.bandwidth_mbps  # (every numeric flag was checked by argparse: lynx_hf.flags)
    try:  # every setting checked before the model loads
        settings = ServerSettings(
            host=host, port=port, insecure=a.insecure, max_connections=a.max_connections, tls_cert=a.tls_cert,
            tls_key=a.tls_key, bandwidth_bps=None if bw is None else bw * 1e6, latency_s=a.latency_ms / 1e3,
            handshake_timeout=a.handshake_timeout, max_preauth=a.max_preauth,
            max_preauth_per_host=a.max_preauth_per_host, idle_timeout_s=a.idle_timeout,
            send_timeout_s=a.send_timeout, prefill_step=a.prefill_step, prefix_cache_mb=a.prefix_cache_mb,
            data_plane=a.data_plane, max_inflight_mb=a.max_inflight_mb,
            max_concurrent_prefills=a.max_concurrent_prefills)
    except ConfigError as e:
        raise SystemExit(f"lynx-hf serve-prefill: error: {e}")
    try:  # the port first, bound but not yet listening: a port in use is said before the model loads, and a
        # client that connects while the model loads is refused (it retries) rather than left waiting for a HELLO
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise SystemExit(f"lynx-hf serve-prefill: error: cannot listen on {host}:{port}: {e.strerror or e}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model, _ = lynx_hf.load_default_model(a.model, dtype=getattr(torch, a.dtype))
    try:
        srv = PrefillServer(model, settings, listen_socket=sock, secret=secret)
    except ConfigError as e:
        raise SystemExit(f"lynx-hf serve-prefill: error: {e}")
    logging.getLogger("lynx_hf.prefill").info("serving on %s:%s", *srv.address)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        srv.close()


def _prompts(a):
    """(label, text or an error) for every prompt: --prompt, --prompt-file, or each line of stdin (bytes decoded
    here, so a line that is not UTF-8 is one error, not the end of the process)."""
    if a.prompt:
        yield "--prompt", a.prompt
        return
    if a.prompt_file:
        try:
            with open(a.prompt_file, "rb") as f:
                raw = f.read()
            yield a.prompt_file, raw.decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            yield a.prompt_file, ValueError(f"cannot read {a.prompt_file}: {e}")
        return
    for n, raw in enumerate(sys.stdin.buffer, 1):
        try:
            text = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            yield f"line {n}", ValueError(f"line {n} is not UTF-8 ({e.reason} at byte {e.start})")
            continue
        if text:
            yield f"line {n}", text


def _serve_decode(a):
    import dataclasses

    import torch

    import lynx_hf
    from lynx_hf import LynxQuantConfig

    from ..arch import fingerprint
    from ..errors import ConfigError, LynxError
    from .decode import DecodeClient

    host, port = _hostport(a.prefill, a.cmd)
    if a.link_mbps is not None and a.anchor_bits != "auto":
        raise SystemExit("lynx-hf serve-decode: error: --link-mbps is the rate --anchor-bits auto plans with; it "
                         "emulates nothing (serve-prefill --bandwidth-mbps does)")
    secret = _secret_or_exit(a, host)
    plane_or_exit(a)
    model, tok = lynx_hf.load_default_model(a.model, dtype=getattr(torch, a.dtype))
    fp = fingerprint(model)  # once per process, before any connection (a reconnect needs no second pass)
    connect = lambda: DecodeClient(model, host, port, secret=secret, insecure=a.insecure, tls=a.tls, tls_ca=a.tls_ca,
                                   timeout_s=a.timeout, model_fingerprint=fp, data_plane=a.data_plane,
                                   prefill_on=a.prefill_on, link_bps=None if a.link_mbps is None else a.link_mbps * 1e6)
    cli = sess = None
    cfg = LynxQuantConfig.from_pretrained(a.lynx_config) if a.lynx_config else LynxQuantConfig(method=a.method)
    for flag, change in (("--exact", {"exact": True} if a.exact else None),
                         ("--anchor-bits", None if a.anchor_bits is None else {"anchor_bits": a.anchor_bits})):
        try:
            cfg = dataclasses.replace(cfg, **change) if change else cfg
        except ConfigError as e:
            raise SystemExit(f"lynx-hf serve-decode: error: {flag}: {e}")
    failed = False
    messages: list[dict] = []  # --session: the conversation so far (the chat template renders it each turn)
    tools = None  # --session: the tools the last turn that named them gave the template

    def fail(msg: str) -> None:  # one JSON line for the caller's parser, one line on stderr for a person
        nonlocal failed
        failed = True
        print(json.dumps({"error": msg}), flush=True)
        print(f"lynx-hf serve-decode: error: {msg}", file=sys.stderr, flush=True)

    for label, text in _prompts(a):
        if isinstance(text, Exception):
            fail(str(text))
            continue
        try:
            if cli is None:
                cli = connect()
                if sess is not None:
                    sess.reconnect(cli)  # the conversation goes on: a failed turn left its cache as it was
            kw = dict(max_new_tokens=a.max_new_tokens, speculative=not a.no_drafts)
            if a.session:  # the conversation's next turn: only its new positions cross the link
                sess = sess or cli.session(tokenizer=tok)
                new, tools = turn_messages(text, tools)
                r = sess.generate(messages + new, tools=tools, quant_config=cfg, **kw)
                messages += new + [{"role": "assistant", "content": tok.decode(r["tokens"], skip_special_tokens=True)}]
            else:
                r = cli.generate(tok(text).input_ids, cfg, **kw)
        except (LynxError, ConnectionError, TimeoutError, OSError, ValueError) as e:
            fail(f"{label}: {e}")
            if cli is not None and cli.broken:
                cli.close()
                # the next prompt opens a new connection; a session resumes there, shipping only its new part
                cli = None
            continue
        text = tok.decode(r["tokens"], skip_special_tokens=True) if a.session else tok.decode(r["tokens"])
        print(json.dumps({"text": text, "tokens": r["tokens"],
                          "bytes": r["bytes"], "held_tokens": r["held_tokens"],
                          **{k: r[k] for k in ("ttft_s", "ttft_verified_s", "tt32t_s")},
                          "drafted": r["stats"]["drafted"], "accepted": r["stats"]["accepted"],
                          "finish_reason": r["finish_reason"], "prefilled_on": r["prefilled_on"],
                          **({"width": r["width"]} if r["width"] else {})}), flush=True)
    if cli is not None:
        cli.close()
    if failed:
        sys.exit(1)


ROLES = ("system", "user", "assistant", "tool")


def turn_messages(line: str, tools):
    """What one --session input line adds to the conversation, and the tools from then on: a plain line is a user
    message; a JSON line is a message {"role", "content"}, a list of them, or {"messages": [...], "tools": [...]}
    (an agent's system prompt, tool results, its own turns)."""
    if not line.lstrip().startswith(("{", "[")):
        return [{"role": "user", "content": line}], tools
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise ValueError(f"a --session line that starts like JSON must be JSON: {e}") from None
    if isinstance(obj, dict) and "messages" in obj:
        tools, obj = obj.get("tools", tools), obj["messages"]
        if tools is not None and not isinstance(tools, list):
            raise ValueError("\"tools\" must be a list (of tool descriptions, as the chat template takes them)")
    msgs = [obj] if isinstance(obj, dict) else obj
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in msgs):
        raise ValueError(f"a --session JSON line takes messages {{\"role\": one of {', '.join(ROLES)}, "
                         f"\"content\": text}} (one, a list, or {{\"messages\": [...], \"tools\": [...]}})")
    return [{"role": m["role"], "content": m["content"]} for m in msgs], tools


def register(sub) -> None:
    from ..flags import (MAX_CONCURRENT_PREFILLS, MAX_INFLIGHT_MB, PREFIX_CACHE_MB, count, mbps, megabytes, number,
                         seconds, tokens)

    p = sub.add_parser("serve-prefill", help="the prefill process: computes KV and streams anchor, then residual",
                       formatter_class=HelpFormatter,
                       description="Serve decode peers: authenticate each (shared secret), prefill its prompts and "
                                   "stream their KV, anchor first. Memory: every byte held is under a bound below — "
                                   "the model, --prefix-cache-mb, --max-concurrent-prefills working sets (each a "
                                   "prompt's KV at most twice, at the model's context), --max-connections x "
                                   "--max-inflight-mb of queued frames; the startup log line gives the sums "
                                   "(docs/wire-format.md, 'Memory' and 'Threat model').")
    p.add_argument("--listen", default="127.0.0.1:7480", help="HOST:PORT (binds loopback unless told otherwise)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help=DTYPE_HELP)
    p.add_argument("--bandwidth-mbps", type=mbps(), default=None, help="emulate a link of this bandwidth")
    p.add_argument("--latency-ms", type=number(0, 60000), default=0.0, help="emulated one-way latency")
    p.add_argument("--max-connections", type=count(65536), default=32, help="authenticated connections served at once")
    p.add_argument("--max-preauth", type=count(65536), default=128,
                   help="connections still in their handshake (over it, the oldest idle one is dropped)")
    p.add_argument("--max-preauth-per-host", type=count(65536), default=96, help="the same, per source address")
    p.add_argument("--handshake-timeout", type=seconds(), default=5.0, help="seconds to complete TLS + Lynx handshake")
    p.add_argument("--idle-timeout", type=seconds(), default=300.0,
                   help="seconds an authenticated connection may stay without a request")
    p.add_argument("--send-timeout", type=seconds(), default=30.0,
                   help="seconds a client may leave a frame unread before its connection is dropped")
    p.add_argument("--prefill-step", type=tokens(), default=1024,
                   help="tokens per forward pass of a long prompt (a short request waits for at most one)")
    p.add_argument("--prefill-chunk", action=Renamed, new="--prefill-step")
    p.add_argument("--prefix-cache-mb", type=megabytes("off"), default=PREFIX_CACHE_MB,
                   help="full-precision KV of prefilled prompts kept for later turns and other clients (LRU, by "
                        "256-token blocks; 0: off)")
    p.add_argument("--max-inflight-mb", type=megabytes(), default=MAX_INFLIGHT_MB,
                   help="a connection's frames queued and not yet read by its client: one that stops reading stalls "
                        "its own request at this bound (in the anchor-first order within it)")
    p.add_argument("--max-concurrent-prefills", type=count(1024), default=MAX_CONCURRENT_PREFILLS,
                   help="requests holding a prompt's working set (its KV, once) at a time; more wait, hearing "
                        "PROGRESS")
    p.add_argument("--data-plane", choices=["tcp", "nixl"], default="tcp",
                   help=f"nixl: also let clients have the segments' bytes written into their memory by NIXL (UCX; "
                        f"{NIXL_HELP}); the control frames stay on the authenticated channel")
    p.add_argument("--secret", help=SECRET_HELP)
    p.add_argument("--secret-file", help=SECRET_FILE_HELP)
    p.add_argument("--insecure", action="store_true", help="no secret: a publicly known key (loopback only)")
    p.add_argument("--tls-cert", help="PEM certificate chain: speak TLS (for links that leave the rack)")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert (if not inside it)")
    p.add_argument("--model", help=MODEL_HELP)
    p.set_defaults(fn=_serve_prefill)
    _register_decode(sub)


def _register_decode(sub) -> None:
    from ..config import METHODS
    from ..flags import anchor_width, mbps, seconds, tokens

    q = sub.add_parser("serve-decode", help="the decode process: sends prompts, drafts, verifies, prints JSON lines",
                       formatter_class=HelpFormatter,
                       description="Send each prompt (--prompt, --prompt-file, or one per line of stdin) to a "
                                   "serve-prefill and print one JSON line per prompt: the result or {\"error\": ...}.")
    q.add_argument("--prefill", required=True, help="HOST:PORT of serve-prefill")
    q.add_argument("--prompt", help="one prompt (else --prompt-file, else one prompt per line of stdin)")
    q.add_argument("--prompt-file", help="one prompt: this file's whole text")
    codec = q.add_mutually_exclusive_group()
    codec.add_argument("--method", default="lynx", choices=list(METHODS), help="the KV codec")
    codec.add_argument("--lynx-config", help="the codec from a lynx_config.json (folder, file or Hub repo), e.g. "
                                             "written by `lynx-hf calibrate`")
    q.add_argument("--exact", action="store_true", help=EXACT_HELP)
    q.add_argument("--anchor-bits", type=anchor_width(), help=ANCHOR_BITS_HELP)
    q.add_argument("--link-mbps", type=mbps(), default=None,
                   help="--anchor-bits auto: the link's rate to plan with (else the largest rate its requests measure; "
                        "4 bits until one has); each line's JSON says the width taken and why (width)")
    q.add_argument("--dtype", choices=DTYPES, default="float32", help=DTYPE_HELP)
    q.add_argument("--session", action="store_true",
                   help="one conversation: each input line is the next turn — plain text: a user message; a JSON "
                        "line: messages with roles ({\"role\": \"system\"|\"user\"|\"assistant\"|\"tool\", "
                        "\"content\": ...}, a list of them, or {\"messages\": [...], \"tools\": [...]}). The chat "
                        "template renders the whole conversation; the decode side keeps its KV, so only each turn's "
                        "new tokens cross the link")
    q.add_argument("--max-new-tokens", type=tokens(), default=32, help="tokens to generate per prompt")
    q.add_argument("--prefill-on", choices=["prefill", "decode", "auto"], default="prefill",
                   help="--session: where a turn's new tokens are computed — the prefill server, this process (in "
                        "full precision: nothing crosses the link), or auto (whichever the rates measured on this "
                        "connection say answers sooner); each line's JSON says where (prefilled_on)")
    q.add_argument("--timeout", type=seconds(), default=30.0,
                   help="seconds of silence from the server before a request fails (a queued request hears "
                        "PROGRESS frames meanwhile)")
    q.add_argument("--no-drafts", action="store_true", help="wait for the full tier (reference decoding)")
    q.add_argument("--data-plane", choices=["tcp", "nixl"], default="tcp",
                   help=f"the segments' bytes over the channel, or written into this process's memory by NIXL "
                        f"({NIXL_HELP}; the server needs --data-plane nixl too)")
    q.add_argument("--secret", help=SECRET_HELP)
    q.add_argument("--secret-file", help=SECRET_FILE_HELP)
    q.add_argument("--insecure", action="store_true", help="no secret: a publicly known key (loopback only)")
    q.add_argument("--tls", action="store_true", help="speak TLS, trusting the system's CAs")
    q.add_argument("--tls-ca", help="speak TLS, trusting this PEM file (a private CA or the server's own certificate)")
    q.add_argument("--model", help=MODEL_HELP)
    q.set_defaults(fn=_serve_decode)
