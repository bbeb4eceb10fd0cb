"""`lynx-hf bench stream`: what one request's KV costs the prefill node's core on the vLLM stream, per method — the
codec (`encode_layer` over every layer, one thread, as an engine bound to one core runs it) and the send (the
publisher streaming it through the emulated link to a subscriber in another process, whose CPU is not counted).

The KV is seeded noise of the embedded model's geometry by default (30 layers, 3 KV heads of 64, fp32); the codec's
work does not depend on the values beyond the axis each Lynx segment picks. Methods run in a rotated order each
round (`--repeat`); figures are medians over rounds, with the range, and `ratios` the medians of the per-round
paired ratios Lynx/INT8. Prints a table and a final JSON line."""
from __future__ import annotations

import multiprocessing
import queue
import resource
import statistics
import time

from lynx_hf.eval.lib.harness import final_line, printer

METHODS = ("lynx", "int8", "kivi4")
SECRET, FP = b"bench-stream-secret", "bench"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _subscribe(port: int, method: str, spec: dict, xfer: str, out) -> None:
    """The decode side, in a child process: receive the whole transfer, then report (error or None)."""
    from lynx_hf import LynxQuantConfig
    from lynx_hf.vllm.stream import KVSpec, Subscription

    sub = Subscription("127.0.0.1", port, SECRET, FP, xfer, LynxQuantConfig(method=method), KVSpec(**spec), "d",
                       timeout_s=120)
    while not sub.full_done and sub.error is None:
        sub.drain()
        time.sleep(0.005)
    out.put(sub.error)
    sub.close()


def _report(q, child, timeout_s: float = 600.0):
    """The subscriber's report; RuntimeError, saying so, if its process died or ran past `timeout_s` first."""
    t0 = time.monotonic()
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            if not child.is_alive():  # (a report it sent just before ending may still be on its way)
                try:
                    return q.get(timeout=1.0)
                except queue.Empty:
                    raise RuntimeError(f"the subscriber process ended without a report (exit code "
                                       f"{child.exitcode})") from None
            if time.monotonic() - t0 > timeout_s:
                child.kill()
                raise RuntimeError(f"the subscriber received nothing whole in {timeout_s:g} s") from None


def one(method: str, kv: list, spec, bandwidth_bps: float | None, xfer: str) -> dict:
    """One request's KV (kv: per layer (k, v) [1, H, P, D]) through a fresh publisher (bandwidth_bps None: unpaced):
    {"encode_s", "send_s", "wall_s", "bytes"} (CPU seconds, but wall_s)."""
    from dataclasses import asdict

    from lynx_hf import LynxQuantConfig
    from lynx_hf.vllm.stream import KVPublisher, encode_layer

    cfg = LynxQuantConfig(method=method)
    pub = KVPublisher("127.0.0.1", 0, SECRET, FP, bandwidth_bps=bandwidth_bps)
    try:
        t0 = time.process_time()
        pub.begin(xfer, cfg, spec, "d")
        for i, (k, v) in enumerate(kv):
            pub.add(xfer, encode_layer(cfg, i, len(kv), k, v))
        pub.finish(xfer)
        encode_s, nbytes = time.process_time() - t0, pub.stored_bytes
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        child = ctx.Process(target=_subscribe, args=(pub.port, method, asdict(spec), xfer, q))
        c0, w0 = _cpu(), time.perf_counter()
        child.start()
        err = _report(q, child)
        child.join(60)
        if err is not None:
            raise RuntimeError(f"the subscriber failed: {err}")
        return {"encode_s": encode_s, "send_s": _cpu() - c0, "wall_s": time.perf_counter() - w0, "bytes": nbytes}
    finally:
        pub.close()


def run(prompt: int = 512, repeat: int = 3, bandwidth_mbps: float = 15.0, layers: int = 30, kv_heads: int = 3,
        head_dim: int = 64, as_json: bool = False) -> dict:
    import torch

    from lynx_hf.vllm.stream import KVSpec

    say = printer(as_json, stderr=True)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(1, kv_heads, prompt, head_dim, generator=g), torch.randn(1, kv_heads, prompt, head_dim,
                                                                                generator=g)) for _ in range(layers)]
    spec, bps = KVSpec(layers, kv_heads, head_dim, "float32", prompt), bandwidth_mbps * 1e6
    for m in METHODS:  # (each codec's first call loads its kernels and tables: outside the rounds)
        one(m, kv, spec, None, f"warm-{m}")
    rounds = []
    for r in range(repeat):
        order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
        rounds.append({m: one(m, kv, spec, bps, f"r{r}-{m}") for m in order})
        say(f"round {r + 1}/{repeat}: " + ", ".join(f"{m} encode {x['encode_s'] * 1e3:.0f} ms send "
                                                   f"{x['send_s'] * 1e3:.0f} ms" for m, x in rounds[-1].items()))
    spread = lambda xs: {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    methods = {m: {k: spread([rd[m][k] for rd in rounds]) for k in ("encode_s", "send_s", "wall_s", "bytes")}
               for m in METHODS}
    ratios = {f"{k}_lynx_int8": spread([rd["lynx"][k] / rd["int8"][k] for rd in rounds])
              for k in ("encode_s", "send_s")}
    say(f"{prompt}-token prompt, {layers} layers x {kv_heads} KV heads x {head_dim}, fp32, link "
        f"{bandwidth_mbps:g} Mbit/s; CPU seconds of the prefill side per request, median [min, max] of {repeat}:")
    for m, x in methods.items():
        say(f"  {m:6s} encode {x['encode_s']['median'] * 1e3:6.1f} ms [{x['encode_s']['min'] * 1e3:.1f}, "
            f"{x['encode_s']['max'] * 1e3:.1f}]  send {x['send_s']['median'] * 1e3:6.1f} ms "
            f"[{x['send_s']['min'] * 1e3:.1f}, {x['send_s']['max'] * 1e3:.1f}]  {x['bytes']['median']:,.0f} bytes")
    return final_line({"prompt": prompt, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                       "bandwidth_mbps": bandwidth_mbps, "rounds": repeat, "methods": methods, "ratios": ratios})


def register(bench) -> None:
    """`lynx-hf bench stream` and its flags (`bench`: the subcommands of `lynx-hf bench`)."""
    # internal: the command line's own parts (its subcommand helper and help texts, the numeric validators)
    from lynx_hf.flags import JSON_HELP, count, mbps, subcommand, tokens

    p = subcommand(bench, "stream", "the vLLM KV stream's prefill-side CPU per request and method: the codec and "
                                    "the send")
    p.add_argument("--prompt", type=tokens(lo=16), default=512, help="prompt tokens (default 512)")
    p.add_argument("--repeat", type=count(100), default=3, help="rounds, methods rotated (default 3)")
    p.add_argument("--bandwidth-mbps", type=mbps(), default=15.0, help="the emulated link (default 15)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(fn=_command)


def _command(a) -> None:
    run(a.prompt, a.repeat, a.bandwidth_mbps, as_json=a.json)
