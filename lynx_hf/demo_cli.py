"""Subcommands that need the cache, generation and transfer layers (registered into `lynx-hf`)."""
import json
import logging
import sys


def _hostport(s: str):
    host, _, port = s.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"expected HOST:PORT, got {s!r}")
    return host, int(port)


def _demo(a):
    from lynx_hf.eval import demo

    demo.run(a.prompt_file, a.tokens, a.bandwidth_mbps * 1e6, a.new_tokens, a.json, a.out, a.model)


def _serve_prefill(a):
    import lynx_hf
    from lynx_hf.transfer.prefill import PrefillServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model, _ = lynx_hf.load_default_model(a.model)
    host, port = _hostport(a.listen)
    srv = PrefillServer(model, host, port, secret=a.secret,
                        bandwidth_bps=a.bandwidth_mbps * 1e6 if a.bandwidth_mbps else None, latency_s=a.latency_ms / 1e3)
    logging.getLogger("lynx_hf.prefill").info("serving on %s:%s", *srv.address)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        srv.close()


def _serve_decode(a):
    import lynx_hf
    from lynx_hf import LynxQuantConfig
    from lynx_hf.transfer.decode import DecodeClient

    model, tok = lynx_hf.load_default_model(a.model)
    host, port = _hostport(a.prefill)
    cli = DecodeClient(model, host, port, secret=a.secret)
    cfg = LynxQuantConfig() if a.method == "lynx" else LynxQuantConfig(method=a.method)
    prompts = [a.prompt] if a.prompt else ([open(a.prompt_file).read()] if a.prompt_file else (l.rstrip("\n") for l in sys.stdin))
    for text in prompts:
        if not text:
            continue
        r = cli.generate(tok(text).input_ids, cfg, max_new_tokens=a.max_new_tokens, speculative=not a.no_drafts)
        print(json.dumps({"text": tok.decode(r["tokens"]), "tokens": r["tokens"], "bytes": r["bytes"],
                          **{k: r[k] for k in ("ttft_s", "ttft_verified_s", "tt32t_s")},
                          "drafted": r["stats"]["drafted"], "accepted": r["stats"]["accepted"]}), flush=True)
    cli.close()


def register(sub):
    d = sub.add_parser("demo", help="prefill and decode processes over loopback TCP: BF16 / INT8 / INT4 / Lynx")
    d.add_argument("--prompt-file", help="any text file (default: Python standard-library source)")
    d.add_argument("--tokens", type=int, default=1024, help="prompt length in tokens")
    d.add_argument("--bandwidth-mbps", type=float, default=15.0, help="link emulator, Mbit/s")
    d.add_argument("--new-tokens", type=int, default=32)
    d.add_argument("--out", default="runs", help="folder for demo.json and demo_timeline.png")
    d.add_argument("--model", help="Hub id or local path (default: embedded SmolLM2-135M-Instruct)")
    d.add_argument("--json", action="store_true", help="print only the final JSON line")
    d.set_defaults(fn=_demo)

    common = dict(secret="shared secret (default: $LYNX_SECRET, else a development default)",
                  model="Hub id or local path (default: embedded SmolLM2-135M-Instruct)")
    p = sub.add_parser("serve-prefill", help="the prefill process: computes KV and streams anchor, then residual")
    p.add_argument("--listen", default="127.0.0.1:7480", help="HOST:PORT (binds loopback unless told otherwise)")
    p.add_argument("--bandwidth-mbps", type=float, default=None, help="emulate a link of this bandwidth")
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--secret", help=common["secret"])
    p.add_argument("--model", help=common["model"])
    p.set_defaults(fn=_serve_prefill)

    q = sub.add_parser("serve-decode", help="the decode process: sends prompts, drafts, verifies, prints JSON lines")
    q.add_argument("--prefill", required=True, help="HOST:PORT of serve-prefill")
    q.add_argument("--prompt")
    q.add_argument("--prompt-file")
    q.add_argument("--method", default="lynx", choices=["lynx", "paper", "bf16", "int8", "kivi4", "kivi2", "identity"])
    q.add_argument("--max-new-tokens", type=int, default=32)
    q.add_argument("--no-drafts", action="store_true", help="wait for the full tier (reference decoding)")
    q.add_argument("--secret", help=common["secret"])
    q.add_argument("--model", help=common["model"])
    q.set_defaults(fn=_serve_decode)
