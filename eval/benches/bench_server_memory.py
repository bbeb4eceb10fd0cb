"""`lynx-hf bench server-memory`: what a `serve-prefill` process holds, measured against the bounds it declares.

A serve-prefill child (the embedded model) with a small prefix cache, a per-connection in-flight bound and
`slots` working-set slots; its VmRSS is read from /proc (sampled every 0.1 s for the peak):
  1. after warm-up (one short request): the baseline;
  2. one `tokens`-token miss from a well-behaved client;
  3. `stalled` raw clients that authenticate, send the same prompt and never read a frame, while another
     well-behaved client sends it too (its tokens must equal the miss's);
  4. idle, once the raw clients have gone.
The bound it checks: baseline + prefix cache + stalled x (in-flight bound + one layer's frames of a forward pass) +
slots x 2 x context x KV bytes a token + one forward pass's activations (lynx_hf.transfer.server.memory_bounds),
plus a stated slack for the allocator and the per-connection threads; idle after, within the slack of baseline +
prefix cache. Prints the numbers and a final JSON line."""
from __future__ import annotations

import secrets
import sys
import threading
import time
from pathlib import Path

from lynx_hf.eval.lib.harness import (default_prompt_text, final_line, free_port, printer, start_prefill_server,
                                      stop_server)

SLACK_MB = 200.0  # allocator fragmentation, thread stacks, socket buffers: what no flag bounds


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class Peak:
    """The highest VmRSS of `pid` since the last `reset()`, sampled every 0.1 s by a thread."""

    def __init__(self, pid: int):
        self.pid, self.value, self._stop = pid, 0.0, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self._stop.wait(0.1):
            try:
                self.value = max(self.value, rss_mb(self.pid))
            except (OSError, RuntimeError):
                return

    def reset(self) -> float:
        v, self.value = self.value, 0.0
        return v

    def close(self):
        self._stop.set()


def stalled_client(port: int, secret: str, fp: str, ids: list[int], cfg: dict):
    """An authenticated connection that sends one REQUEST and never reads (its frames fill the socket buffers,
    then wait in the server's queue up to its in-flight bound)."""
    from lynx_hf.transfer.auth import Channel, client_handshake, resolve_secret
    from lynx_hf.transfer.transport import TcpTransport
    from lynx_hf.transfer.wire import FrameType

    ch = Channel(TcpTransport.connect("127.0.0.1", port, 30))
    client_handshake(ch, resolve_secret(secret), fp)
    ch.send_json(FrameType.REQUEST, {"input_ids": ids, "quant_config": cfg}, 1)
    return ch


def run(tokens: int = 6000, stalled: int = 4, prefix_cache_mb: float = 64, max_inflight_mb: float = 8,
        slots: int = 2, send_timeout_s: float = 10, new_tokens: int = 8, model_name: str | None = None,
        as_json: bool = False) -> dict:
    import lynx_hf
    from lynx_hf import LynxQuantConfig
    from lynx_hf.arch import fingerprint  # internal: the model fingerprint the raw clients' handshake sends
    from lynx_hf.transfer.decode import DecodeClient
    from lynx_hf.transfer.server import memory_bounds  # internal: the bounds the server declares, to check

    say = printer(as_json)
    model, tok = lynx_hf.load_default_model(model_name)
    ids = tok(default_prompt_text()).input_ids[:tokens]
    secret, port = secrets.token_hex(16), free_port()
    args = ("--prefix-cache-mb", str(prefix_cache_mb), "--max-inflight-mb", str(max_inflight_mb),
            "--max-concurrent-prefills", str(slots), "--send-timeout", str(send_timeout_s))
    proc = start_prefill_server(port, None, secret, model_name, args)
    b = memory_bounds(model, prefix_cache_mb, max_inflight_mb, stalled, slots, 1024)  # `stalled` connections
    mb = lambda x: x / (1 << 20)
    out = {"tokens": len(ids), "stalled": stalled, "prefix_cache_mb": prefix_cache_mb,
           "max_inflight_mb": max_inflight_mb, "slots": slots, "slack_mb": SLACK_MB,
           "bound_prefix_cache_mb": mb(b["prefix_cache"]), "bound_inflight_mb": mb(b["inflight"]),
           "bound_working_sets_mb": mb(b["working_sets"])}
    peak = Peak(proc.pid)
    try:
        connect = lambda: DecodeClient(model, "127.0.0.1", port, secret=secret, timeout_s=600)
        cli = connect()
        cli.generate(ids[:64], LynxQuantConfig(), max_new_tokens=2)
        time.sleep(1.0)
        out["rss_baseline_mb"] = base = rss_mb(proc.pid)
        peak.reset()
        say(f"after warm-up: {base:,.0f} MB; one {len(ids)}-token miss ...")
        ref = cli.generate(ids, LynxQuantConfig(), max_new_tokens=new_tokens)["tokens"]
        time.sleep(1.0)
        out["rss_after_miss_mb"], out["peak_miss_mb"] = rss_mb(proc.pid), peak.reset()
        say(f"after the miss: {out['rss_after_miss_mb']:,.0f} MB (peak {out['peak_miss_mb']:,.0f}); "
            f"{stalled} clients that never read, and a well-behaved one ...")
        fp = fingerprint(model)
        raw = [stalled_client(port, secret, fp, ids, LynxQuantConfig().to_dict()) for _ in range(stalled)]
        t0 = time.monotonic()
        good = connect().generate(ids, LynxQuantConfig(), max_new_tokens=new_tokens)
        out["served_meanwhile_s"], out["served_meanwhile_identical"] = time.monotonic() - t0, good["tokens"] == ref
        out["rss_stalled_mb"] = rss_mb(proc.pid)
        for ch in raw:
            ch.close()
        time.sleep(send_timeout_s + 5)  # every stalled request ends (its client gone) and the heap is trimmed
        out["peak_stalled_mb"], out["rss_idle_mb"] = peak.reset(), rss_mb(proc.pid)
    except BaseException:
        proc.log.seek(0)
        print(f"serve-prefill's log:\n{proc.log.read()[-3000:]}", file=sys.stderr)
        raise
    finally:
        peak.close()
        stop_server(proc)
    out["bound_compute_mb"] = mb(b["compute"])
    out["bound_mb"] = base + mb(b["prefix_cache"] + b["inflight"] + b["working_sets"] + b["compute"]) + SLACK_MB
    out["idle_bound_mb"] = base + mb(b["prefix_cache"]) + SLACK_MB
    out["within_bound"] = max(out["peak_miss_mb"], out["peak_stalled_mb"]) <= out["bound_mb"]
    out["idle_within_slack"] = out["rss_idle_mb"] <= out["idle_bound_mb"]
    say(f"with {stalled} stalled clients: peak {out['peak_stalled_mb']:,.0f} MB (bound {out['bound_mb']:,.0f} = "
        f"baseline + prefix cache {prefix_cache_mb:g} + in-flight {mb(b['inflight']):,.0f} + working sets "
        f"{mb(b['working_sets']):,.0f} + one forward pass {mb(b['compute']):,.0f} + slack {SLACK_MB:g}); a "
        f"well-behaved client served in "
        f"{out['served_meanwhile_s']:.1f} s, identical: {out['served_meanwhile_identical']}")
    say(f"idle after: {out['rss_idle_mb']:,.0f} MB (bound {out['idle_bound_mb']:,.0f} = baseline + prefix cache + "
        f"slack)")
    return final_line(out)


def register(bench) -> None:
    """`lynx-hf bench server-memory` and its flags (`bench`: the subcommands of `lynx-hf bench`). The defaults are a
    small server's, whose bounds a 6K-token miss and 4 stalled clients reach; the server's own defaults with an 8K
    prompt: --tokens 8000 --prefix-cache-mb 512 --max-inflight-mb 128 --slots 4."""
    # internal: the command line's own parts (its subcommand helper and help texts, the numeric validators)
    from lynx_hf.flags import JSON_HELP, MODEL_HELP, subcommand
    from lynx_hf.flags import count, megabytes, seconds, tokens

    p = subcommand(bench, "server-memory", "a serve-prefill's VmRSS after a 6K-token miss, with 4 clients that "
                                           "never read, and idle, against the bounds it declares")
    p.add_argument("--tokens", type=tokens(), default=6000, help="prompt tokens")
    p.add_argument("--stalled", type=count(64), default=4, help="clients that never read")
    p.add_argument("--prefix-cache-mb", type=megabytes("off"), default=64, help="the server's prefix cache")
    p.add_argument("--max-inflight-mb", type=megabytes(), default=8, help="the server's per-connection bound")
    p.add_argument("--slots", type=count(1024), default=2, help="the server's --max-concurrent-prefills")
    p.add_argument("--send-timeout", type=seconds(), default=10, help="the server's --send-timeout")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(fn=_command)


def _command(a) -> None:
    run(a.tokens, a.stalled, a.prefix_cache_mb, a.max_inflight_mb, a.slots, a.send_timeout, model_name=a.model,
        as_json=a.json)


def main(argv=None):
    """`python -m lynx_hf.eval.benches.bench_server_memory [--tokens 6000 ...]`: `lynx-hf bench server-memory`
    itself."""
    import argparse

    sub = argparse.ArgumentParser(prog="python -m lynx_hf.eval.benches.bench_server_memory").add_subparsers()
    register(sub)
    a = sub.choices["server-memory"].parse_args(sys.argv[1:] if argv is None else argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
