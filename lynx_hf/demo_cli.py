"""Subcommands that need the cache, generation and transfer layers (registered into `lynx-hf`)."""


def _demo(a):
    from lynx_hf.eval import demo

    demo.run(a.prompt_file, a.tokens, a.bandwidth_mbps * 1e6, a.new_tokens, a.json)


def register(sub):
    d = sub.add_parser("demo", help="prefill → simulated link → speculative decode, all methods side by side")
    d.add_argument("--prompt-file", help="any text file (default: Python standard-library source)")
    d.add_argument("--tokens", type=int, default=1024, help="prompt length in tokens")
    d.add_argument("--bandwidth-mbps", type=float, default=50.0, help="simulated link, Mbit/s")
    d.add_argument("--new-tokens", type=int, default=32)
    d.add_argument("--json", action="store_true", help="print only the final JSON line")
    d.set_defaults(fn=_demo)
