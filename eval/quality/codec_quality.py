"""`lynx-hf codec-quality`: every method on real KV of a model over long real text, at several context lengths.

Per method: bits/value (metadata included), relative K/V error, next-token KL against full-precision KV, greedy
agreement and accepted prefix over 32 teacher-forced tokens; what CacheGen's arithmetic coder (per-channel tables
over 256-token chunks) would save on Lynx's anchor and residual streams, and at what coding time; then an α × C
ablation of the Lynx anchor. Ends with one JSON line {"methods": {...}, "default": NAME, "lynx_coded": {...}, ...}."""
from __future__ import annotations

import time

import torch
from tqdm import tqdm

from lynx_hf import LynxQuantConfig, load_default_model
from lynx_hf.errors import ConfigError

from lynx_hf.eval.lib.kvprobe import make_probe, score

METHODS = {
    "bf16": (LynxQuantConfig(method="bf16"), "full"),
    "int8": (LynxQuantConfig(method="int8"), "full"),
    "kivi4": (LynxQuantConfig(method="kivi4"), "full"),
    "kivi2": (LynxQuantConfig(method="kivi2"), "full"),
    "cachegen": (LynxQuantConfig(method="cachegen"), "full"),
    "paper-anchor": (LynxQuantConfig.paper(), "anchor"),
    "paper-full": (LynxQuantConfig.paper(), "full"),
    "lynx-anchor": (LynxQuantConfig(), "anchor"),
    "lynx-full": (LynxQuantConfig(), "full"),
}
DEFAULT = "lynx-anchor"
LINK_BPS = 15e6  # the demo's link
KEYS = ("bits_per_value", "kl", "agreement", "accepted_prefix", "rel_err_k", "rel_err_v")


def run(text_path, contexts=(512, 1024, 2048, 4096), gen=32, ablation=True, model_name=None, out=print):
    model, tok = load_default_model(model_name)
    text = open(text_path, encoding="utf-8", errors="replace").read()
    ids_all = tok(text[: 8 * max(contexts) + 1000], return_tensors="pt").input_ids
    if ids_all.shape[1] < max(contexts):
        raise ConfigError(f"{text_path} has only {ids_all.shape[1]} tokens; need {max(contexts)}")
    per = {m: [] for m in METHODS}
    probes = {}
    for n in tqdm(contexts, desc="contexts"):
        # a different stretch of text for each length
        start = min(ids_all.shape[1] - n, n)
        probes[n] = make_probe(model, ids_all[:, start:start + n], gen)
        for m, (cfg, tier) in METHODS.items():
            per[m].append(score(model, probes[n], cfg, tier))
    summary = {m: {k: sum(r[k] for r in rows) / len(rows) for k in KEYS} for m, rows in per.items()}
    out(f"\n## Methods (mean over contexts {list(contexts)}, {gen} teacher-forced tokens)\n")
    out("| method | bits/value | KL | greedy agreement | accepted prefix | rel err K | rel err V |")
    out("|---|---|---|---|---|---|---|")
    for m, s in summary.items():
        out(f"| {m} | {s['bits_per_value']:.3f} | {s['kl']:.2e} | {s['agreement']:.3f} | {s['accepted_prefix']:.1f} "
            f"| {s['rel_err_k']:.4f} | {s['rel_err_v']:.4f} |")
    out("\n## Per context length: KL\n")
    out("| method | " + " | ".join(str(n) for n in contexts) + " |")
    out("|---|" + "---|" * len(contexts))
    for m, rows in per.items():
        out(f"| {m} | " + " | ".join(f"{r['kl']:.2e}" for r in rows) + " |")
    n = 1024 if 1024 in probes else contexts[0]
    coded = lynx_coded(probes[n])
    a = coded["anchor"]
    out(f"\n## CacheGen's coder on Lynx's streams (context {n}; per-channel tables, {coded['chunk']}-token chunks)\n")
    out("| stream | bits/value as sent | arithmetic-coded | (its tables left out) | saved at 15 Mbit/s | "
        "coding time (encode + decode) |")
    out("|---|---|---|---|---|---|")
    for t in ("anchor", "residual"):
        c = coded[t]
        out(f"| {t} | {c['bits_per_value']:.3f} | {c['coded_bits_per_value']:.3f} | "
            f"{c['coded_bits_without_tables']:.3f} | {c['saved_link_s'] * 1e3:.1f} ms | {c['coding_s'] * 1e3:.1f} ms |")
    out(f"\nAnchor: the coder saves {a['net_s'] * 1e3:.1f} ms net of its coding time (negative: it costs), at most "
        f"{100 * a['ttft_cut_bound']:.1f} % of Lynx's TTFT (bounded by the anchor's own time on the link, "
        f"{a['link_s'] * 1e3:.0f} ms); adopted only at >= 5 %: {'adopt' if coded['adopt'] else 'not adopted'}. "
        "The residual is not on the TTFT path.")
    abl = {}
    if ablation:
        n = 1024 if 1024 in probes else contexts[0]
        out(f"\n## Ablation: Lynx anchor KL over α × C (context {n}; KIVI-4 {summary['kivi4']['kl']:.2e} "
            f"averaged over contexts, {per['kivi4'][list(contexts).index(n)]['kl']:.2e} here)\n")
        alphas, chunks = (0.0, 0.25, 0.5, 1.0, 2.0, 8.0), (32, 64, 128)
        out("| α \\ C | " + " | ".join(f"{c} ({4 + 32 / c:.2f} b)" for c in chunks) + " |")
        out("|---|" + "---|" * len(chunks))
        for a in tqdm(alphas, desc="ablation"):
            row = []
            for c in chunks:
                r = score(model, probes[n], LynxQuantConfig(alpha=a, chunk_size=c, page_size=max(256, c)), "anchor")
                abl[f"alpha={a},C={c}"] = r["kl"]
                row.append(f"{r['kl']:.2e}")
            out(f"| {a} | " + " | ".join(row) + " |")
    result = {"methods": {m: {k: summary[m][k] for k in ("bits_per_value", "kl", "accepted_prefix", "agreement")}
                          for m in METHODS},
              "default": DEFAULT, "contexts": list(contexts), "ablation": abl, "lynx_coded": coded,
              "config": LynxQuantConfig().to_dict()}
    return result


def lynx_coded(probe, config: LynxQuantConfig | None = None, link_bps: float = LINK_BPS) -> dict:
    """Lynx's anchor and residual codes arithmetic-coded the way CacheGen codes its symbols (quant/cachegen.py):
    per stream, bits/value as sent (metadata with the anchor) and coded, the link time saved at `link_bps`, and the
    measured coding time. `ttft_cut_bound`: the net saving over the anchor's own link time, an upper bound on the
    TTFT cut (TTFT includes at least the anchor's transfer); "adopt" when it reaches 5 %."""
    from lynx_hf import quant
    # internal: CacheGen's coder and the 4-bit unpacking, applied to Lynx's own streams
    from lynx_hf.quant import cachegen
    from lynx_hf.quant.pack import unpack4

    config = config or LynxQuantConfig()
    res = {t: {"bytes": 0, "coded_bytes": 0, "table_bytes": 0, "coding_s": 0.0} for t in ("anchor", "residual")}
    numel = 0
    for k, v in zip(probe.keys, probe.values):
        for x, kind in ((k, "key"), (v, "value")):
            s = quant.encode(x, config, kind)
            numel += x.numel()
            for t, packed, extra in (("anchor", s.anchor, s.meta_nbytes()), ("residual", s.residual, 0)):
                codes = unpack4(packed)                                      # [B, H, S, D] in 0..15
                sym = codes.permute(0, 2, 1, 3).reshape(codes.shape[0], codes.shape[2], -1)   # [B, S, H·D]
                t0 = time.perf_counter()
                stream = cachegen.symbols_to_stream(sym, 16)
                back, _ = cachegen.stream_to_symbols(stream, *sym.shape)
                res[t]["coding_s"] += time.perf_counter() - t0
                assert torch.equal(back, sym), "the coder must be lossless"
                res[t]["bytes"] += packed.numel() + extra
                res[t]["coded_bytes"] += stream.numel() + extra
                res[t]["table_bytes"] += sym.shape[0] * -(-sym.shape[1] // cachegen.CHUNK) * sym.shape[2] * 16
    for t, r in res.items():
        r["bits_per_value"] = 8 * r["bytes"] / numel
        r["coded_bits_per_value"] = 8 * r["coded_bytes"] / numel
        r["coded_bits_without_tables"] = 8 * (r["coded_bytes"] - r["table_bytes"]) / numel
        r["link_s"] = 8 * r["bytes"] / link_bps
        r["saved_link_s"] = 8 * (r["bytes"] - r["coded_bytes"]) / link_bps
        r["net_s"] = r["saved_link_s"] - r["coding_s"]
        r["ttft_cut_bound"] = r["net_s"] / r["link_s"]
    return {**res, "chunk": cachegen.CHUNK, "link_bps": link_bps, "adopt": res["anchor"]["ttft_cut_bound"] >= 0.05}
