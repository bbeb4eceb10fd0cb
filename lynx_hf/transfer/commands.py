"""`lynx-hf serve-prefill` and `lynx-hf serve-decode`: the two production processes (argument parsing and the loop
around PrefillServer / DecodeClient)."""
from __future__ import annotations

import ipaddress
import json
import logging
import sys

SECRET_HELP = "shared secret (or $LYNX_SECRET); required unless --insecure"
MODEL_HELP = "Hub id or local path (default: embedded SmolLM2-135M-Instruct)"


def _hostport(s: str):
    host, _, port = s.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"expected HOST:PORT, got {s!r}")
    return host.strip("[]"), int(port)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _secret_or_exit(a, host: str):
    """The --secret / $LYNX_SECRET check, and --insecure only on loopback, said on stderr."""
    from .session import resolve_secret

    if a.insecure:
        if not _loopback(host):
            raise SystemExit(f"lynx-hf {a.cmd}: --insecure is allowed on loopback only, not {host}")
        print(f"lynx-hf {a.cmd}: WARNING: --insecure: a publicly known key, no authentication (loopback only)",
              file=sys.stderr)
    try:
        resolve_secret(a.secret, a.insecure)
    except ValueError as e:
        raise SystemExit(f"lynx-hf {a.cmd}: error: {e}")


def _serve_prefill(a):
    import lynx_hf

    from .prefill import PrefillServer

    host, port = _hostport(a.listen)
    _secret_or_exit(a, host)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model, _ = lynx_hf.load_default_model(a.model)
    srv = PrefillServer(model, host, port, secret=a.secret, insecure=a.insecure, max_connections=a.max_connections,
                        tls_cert=a.tls_cert, tls_key=a.tls_key,
                        bandwidth_bps=a.bandwidth_mbps * 1e6 if a.bandwidth_mbps else None, latency_s=a.latency_ms / 1e3)
    logging.getLogger("lynx_hf.prefill").info("serving on %s:%s", *srv.address)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        srv.close()


def _serve_decode(a):
    import lynx_hf
    from lynx_hf import LynxQuantConfig

    from .decode import DecodeClient

    host, port = _hostport(a.prefill)
    _secret_or_exit(a, host)
    model, tok = lynx_hf.load_default_model(a.model)
    cli = DecodeClient(model, host, port, secret=a.secret, insecure=a.insecure, tls=a.tls, tls_ca=a.tls_ca)
    cfg = LynxQuantConfig.from_pretrained(a.lynx_config) if a.lynx_config else LynxQuantConfig(method=a.method)
    prompts = [a.prompt] if a.prompt else ([open(a.prompt_file).read()] if a.prompt_file else (l.rstrip("\n") for l in sys.stdin))
    for text in prompts:
        if not text:
            continue
        r = cli.generate(tok(text).input_ids, cfg, max_new_tokens=a.max_new_tokens, speculative=not a.no_drafts)
        print(json.dumps({"text": tok.decode(r["tokens"]), "tokens": r["tokens"], "bytes": r["bytes"],
                          **{k: r[k] for k in ("ttft_s", "ttft_verified_s", "tt32t_s")},
                          "drafted": r["stats"]["drafted"], "accepted": r["stats"]["accepted"]}), flush=True)
    cli.close()


def register(sub) -> None:
    from ..config import METHODS

    p = sub.add_parser("serve-prefill", help="the prefill process: computes KV and streams anchor, then residual")
    p.add_argument("--listen", default="127.0.0.1:7480", help="HOST:PORT (binds loopback unless told otherwise)")
    p.add_argument("--bandwidth-mbps", type=float, default=None, help="emulate a link of this bandwidth")
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--max-connections", type=int, default=32)
    p.add_argument("--secret", help=SECRET_HELP)
    p.add_argument("--insecure", action="store_true", help="no secret: a publicly known key (loopback only)")
    p.add_argument("--tls-cert", help="PEM certificate chain: speak TLS (for links that leave the rack)")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert (if not inside it)")
    p.add_argument("--model", help=MODEL_HELP)
    p.set_defaults(fn=_serve_prefill)

    q = sub.add_parser("serve-decode", help="the decode process: sends prompts, drafts, verifies, prints JSON lines")
    q.add_argument("--prefill", required=True, help="HOST:PORT of serve-prefill")
    q.add_argument("--prompt")
    q.add_argument("--prompt-file")
    codec = q.add_mutually_exclusive_group()
    codec.add_argument("--method", default="lynx", choices=list(METHODS))
    codec.add_argument("--lynx-config", help="the codec from a lynx_config.json (folder, file or Hub repo), e.g. "
                                             "written by `lynx-hf calibrate`")
    q.add_argument("--max-new-tokens", type=int, default=32)
    q.add_argument("--no-drafts", action="store_true", help="wait for the full tier (reference decoding)")
    q.add_argument("--secret", help=SECRET_HELP)
    q.add_argument("--insecure", action="store_true", help="no secret: a publicly known key (loopback only)")
    q.add_argument("--tls", action="store_true", help="speak TLS, trusting the system's CAs")
    q.add_argument("--tls-ca", help="speak TLS, trusting this PEM file (a private CA or the server's own certificate)")
    q.add_argument("--model", help=MODEL_HELP)
    q.set_defaults(fn=_serve_decode)
