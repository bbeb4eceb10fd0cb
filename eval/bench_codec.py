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


def run(tokens: int = 4096, heads: int = 3, head_dim: int = 64, layers: int = 4, reps: int = 5, as_json=False):
    torch.manual_seed(0)
    x = torch.randn(1, heads * layers, tokens, head_dim)  # a few layers' worth of one K tensor
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
            dispatch.enable_compile(False)
        paths[name] = {"encode_gbps": nbytes / enc / 1e9, "decode_anchor_gbps": nbytes / dec_a / 1e9,
                       "decode_full_gbps": nbytes / dec_f / 1e9}
    copy_gbps = nbytes / copy_s / 1e9
    print(f"tensor {tuple(x.shape)} fp32 = {nbytes / 1e6:.1f} MB; copy_ {copy_gbps:.2f} GB/s; threads {torch.get_num_threads()}")
    print(f"{'path':10s} {'encode':>10s} {'dec anchor':>11s} {'dec full':>10s}   (GB/s of fp32 input; % of copy_)")
    for k, v in paths.items():
        print(f"{k:10s} {v['encode_gbps']:10.2f} {v['decode_anchor_gbps']:11.2f} {v['decode_full_gbps']:10.2f}"
              f"   enc {100 * v['encode_gbps'] / copy_gbps:.0f}% dec {100 * v['decode_full_gbps'] / copy_gbps:.0f}%")
    out = {"copy_gbps": copy_gbps, "paths": paths, "bytes": nbytes}
    print(json.dumps(out))
    return out
