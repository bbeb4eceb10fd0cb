"""`lynx-hf bench codec`: CPU encode/decode throughput of each implementation next to `copy_` bandwidth, measured
in one run on the same tensor (the KV of one layer of a long prompt, fp32). Prints a table and one JSON line."""
from __future__ import annotations

import json
import time

import torch

from lynx_hf import LynxQuantConfig, quant
from lynx_hf.quant import dispatch, lynx


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run(tokens: int = 4096, heads: int = 3, head_dim: int = 64, layers: int = 30, reps: int = 3, as_json=False):
    torch.manual_seed(0)
    # the whole KV of a `tokens`-token prompt of the default model (K and V of 30 layers, 3 KV heads, D = 64):
    # 189 MB in fp32 at 4096 tokens — larger than any cache, so copy_ measures memory bandwidth
    x = torch.randn(1, 2 * heads * layers, tokens, head_dim)
    x[:, :, 0] *= 30  # an attention-sink-like outlier token
    nbytes = x.numel() * x.element_size()
    cfg = LynxQuantConfig()
    dst = torch.empty_like(x)
    copy_s = _best(lambda: dst.copy_(x), reps)
    paths = {}
    split = quant.encode(x, cfg, reference=True)
    for name in ("eager", "compiled"):
        dispatch.enable_compile(name == "compiled")
        try:
            enc = _best(lambda: quant.encode(x, cfg), reps)
            dec_a = _best(lambda: quant.decode(split, "anchor"), reps)
            dec_f = _best(lambda: quant.decode(split, "full"), reps)
        finally:
            dispatch.enable_compile(None)
        paths[name] = {"encode_gbps": nbytes / enc / 1e9, "decode_anchor_gbps": nbytes / dec_a / 1e9,
                       "decode_full_gbps": nbytes / dec_f / 1e9}
    copy_gbps = nbytes / copy_s / 1e9
    say = (lambda *a: None) if as_json else print
    say(f"tensor {tuple(x.shape)} fp32 = {nbytes / 1e6:.1f} MB; copy_ {copy_gbps:.2f} GB/s; threads {torch.get_num_threads()}")
    say(f"{'path':10s} {'encode':>10s} {'dec anchor':>11s} {'dec full':>10s}   (GB/s of fp32 input; % of copy_)")
    for k, v in paths.items():
        say(f"{k:10s} {v['encode_gbps']:10.2f} {v['decode_anchor_gbps']:11.2f} {v['decode_full_gbps']:10.2f}"
              f"   enc {100 * v['encode_gbps'] / copy_gbps:.0f}% dec {100 * v['decode_full_gbps'] / copy_gbps:.0f}%")
    out = {"copy_gbps": copy_gbps, "paths": paths, "bytes": nbytes}
    print(json.dumps(out))
    return out
