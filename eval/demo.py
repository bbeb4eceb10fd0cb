"""`lynx-hf demo` (in-process edition): one prefill, then each method's KV crosses a simulated link of fixed
bandwidth (a loader thread that really waits bytes/bandwidth, anchor stream first) while the decoder waits,
drafts (Lynx) and verifies. Prints a table like the paper's and one JSON line. The two-process TCP version with
layer-wise overlap of transfer and prefill is not built yet (issue 4); here transfer starts after prefill."""
from __future__ import annotations

import json
import time

import torch

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig
from lynx_hf.loader import InProcessLoader, prefill

METHODS = {"BF16": LynxQuantConfig(method="bf16"), "INT8": LynxQuantConfig(method="int8"),
           "INT4 (KIVI-4)": LynxQuantConfig(method="kivi4"), "Lynx": LynxQuantConfig()}


def default_prompt(tok, n_tokens: int) -> torch.Tensor:
    """Text every Python installation has: the standard library's own source files."""
    import inspect
    import json as _json
    import textwrap

    text = "".join(inspect.getsource(m) for m in (textwrap, _json.decoder, _json.encoder, inspect))
    return tok(text, return_tensors="pt").input_ids[:, :n_tokens]


def run(prompt_file=None, tokens=1024, bandwidth_bps=50e6, new_tokens=32, as_json=False):
    model, tok = lynx_hf.load_default_model()
    if prompt_file:
        ids = tok(open(prompt_file, encoding="utf-8", errors="replace").read(), return_tensors="pt").input_ids[:, :tokens]
    else:
        ids = default_prompt(tok, tokens)
    say = (lambda *a: None) if as_json else print
    t = time.perf_counter()
    kv, first = prefill(model, ids)
    prefill_s = time.perf_counter() - t
    say(f"prompt {ids.shape[1]} tokens; prefill {prefill_s:.2f} s; link {bandwidth_bps / 1e6:.0f} Mbit/s")
    rows, full_ids, lynx_ids = {}, None, None
    for name, cfg in METHODS.items():
        cache = LynxCache(len(kv), ids.shape[1], cfg, dtype=kv[0][0].dtype)
        loader = InProcessLoader(kv, cfg, bandwidth_bps=bandwidth_bps / 8)
        nbytes = sum(s.nbytes("full") for pair in loader.splits for s in pair)
        t0 = time.perf_counter()
        loader.attach(cache)
        out = model.generate(torch.cat([ids, first], -1), cache=cache, custom_generate=lynx_hf.speculative_generate,
                             max_new_tokens=new_tokens, do_sample=False)
        st = cache.stats
        gen = out[0, ids.shape[1]:].tolist()
        ttft = st["ttft_draft_s"] if st["ttft_draft_s"] is not None else st["ttft_verified_s"]
        rows[name] = {"ttft_s": prefill_s + ttft, "ttft_verified_s": prefill_s + st["ttft_verified_s"],
                      "tt32t_s": prefill_s + time.perf_counter() - t0, "bytes": nbytes,
                      "drafted": st["drafted"], "accepted": st["accepted"]}
        if name == "Lynx":
            lynx_ids = gen
    # full-tier reference for Lynx: the same cache with the residual at once (plain full-tier decoding)
    cache, _ = LynxCache(len(kv), ids.shape[1], METHODS["Lynx"], dtype=kv[0][0].dtype), None
    InProcessLoader(kv, METHODS["Lynx"], residual_after_tokens=0).attach(cache)
    full_ids = model.generate(torch.cat([ids, first], -1), cache=cache, custom_generate=lynx_hf.speculative_generate,
                              max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
    say(f"{'method':15s} {'TTFT s':>8s} {'TTFT verified':>14s} {'TT32T s':>8s} {'MB on wire':>11s} {'drafted/accepted':>17s}")
    for n, r in rows.items():
        say(f"{n:15s} {r['ttft_s']:8.2f} {r['ttft_verified_s']:14.2f} {r['tt32t_s']:8.2f} {r['bytes'] / 1e6:11.2f} "
            f"{r['drafted']:>8d}/{r['accepted']:<8d}")
    same = lynx_ids == full_ids
    say(f"Lynx output identical to full-tier decoding: {same}")
    say("generated:", repr(tok.decode(lynx_ids)))
    res = {"methods": {n: {k: r[k] for k in ("ttft_s", "ttft_verified_s", "tt32t_s", "bytes")} for n, r in rows.items()},
           "lynx": {"drafted": rows["Lynx"]["drafted"], "accepted": rows["Lynx"]["accepted"], "identical_to_full": same},
           "bandwidth_bps": bandwidth_bps, "prefill_s": prefill_s, "mode": "in-process simulated link"}
    print(json.dumps(res))
    return res
