"""`lynx-hf simulate`: an analytic model of disaggregated TTFT and TT32T, fitted to the paper and then extrapolated.

Inputs, each stated, none tuned per row:
  * the model's shape (layers, KV heads × head_dim or an MLA latent, parameters read per decoded token);
  * the codec's bits per value on the wire, measured by encoding a tensor of the model's head_dim with this
    project's codecs (metadata included): BF16, INT8, INT4 = KIVI-4, Lynx anchor / anchor + residual;
  * the decode accelerator: per-token decode time = (weights + KV read) / (HBM bandwidth × efficiency); a tree
    draft step and the verify pass are memory-bound like a decode step (a few dozen tokens against ~65 GB of
    weights), so each costs one step;
  * the codec's speed on the accelerator: encode and decode at `codec_fraction` of HBM bandwidth (a stated
    assumption until eval/gpu_check.sh has measured the Triton kernels); only the last layer's encode and decode are
    exposed (both pipeline per layer with the transfer);
  * the measured acceptance: the fraction of drafted steps that verification keeps (`lynx-hf acceptance`, tree);
  * the link: bandwidth and a fixed per-request overhead — the only two numbers fitted (least squares of the relative
    errors of the paper's eight figures).
Timeline: TTFT = overhead + first-stream bytes / link + exposed codec time (the first token is the prefill's, sent
with the KV; prefill compute is not modelled: the paper's figures behave as transfer-dominated, and a fixed
prefill cost would sit in the overhead). Baselines: TT32T = TTFT + 31 steps. Lynx: drafting runs from TTFT until the
residual lands (at the time INT8-sized bytes would), one step per draft; then one verify step emits the kept drafts
plus one; the rest are plain steps."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from lynx_hf.eval.lib.harness import final_line, printer

PAPER = {"bf16": (4.4, 5.9), "int8": (2.3, 3.8), "int4": (1.4, 2.9), "lynx": (1.6, 3.4)}  # Qwen-32B, 16K context
METHODS = ("bf16", "int8", "int4", "lynx")


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_per_token_layer: int   # values cached per token per layer (2 × KV heads × head_dim; MLA: latent + rope dims)
    head_dim: int             # the grouping width the codec sees
    decode_bytes: float       # weight bytes read per decoded token (bf16; MoE: the active experts)


QWEN32B = ModelShape("Qwen2.5-32B-like (64 layers, 8 KV heads × 128)", 64, 2 * 8 * 128, 128, 2 * 32.8e9)
MLA = ModelShape("DeepSeek-V3-like MLA (61 layers, 512 + 64 latent, 37B active)", 61, 512 + 64, 64, 2 * 37e9)


@dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_gbps: float
    efficiency: float     # achieved fraction of HBM bandwidth in decode
    codec_fraction: float  # codec throughput as a fraction of HBM bandwidth (stated, not measured here)


A100 = Accelerator("A100-80GB SXM (2039 GB/s HBM, 70 % achieved)", 2039.0, 0.70, 0.30)


def measured_bits(head_dim: int = 128) -> dict:
    """Bits per value on the wire of each method's streams, from this project's codecs on a [1, 8, 1024, D] tensor."""
    import torch

    from lynx_hf import LynxQuantConfig, quant

    torch.manual_seed(0)
    x = torch.randn(1, 8, 1024, head_dim)
    bits = {}
    for kind in ("key", "value"):
        lynx = quant.encode(x, LynxQuantConfig(), kind)
        got = {"bf16": quant.encode(x, LynxQuantConfig(method="bf16"), kind).bits_per_value(),
               "int8": quant.encode(x, LynxQuantConfig(method="int8"), kind).bits_per_value(),
               "int4": quant.encode(x, LynxQuantConfig(method="kivi4"), kind).bits_per_value(),
               "lynx_anchor": lynx.bits_per_value("anchor"), "lynx": lynx.bits_per_value("full")}
        for k, v in got.items():
            bits[k] = bits.get(k, 0.0) + v / 2
    return bits


def kv_bytes(model: ModelShape, context: int, bits: float) -> float:
    return model.layers * model.kv_per_token_layer * context * bits / 8


def step_s(model: ModelShape, acc: Accelerator, context: int) -> float:
    """One decode step: weights plus the bf16 KV read once, at the achieved HBM bandwidth."""
    return (model.decode_bytes + kv_bytes(model, context, 16)) / (acc.hbm_gbps * 1e9 * acc.efficiency)


def timeline(model: ModelShape, acc: Accelerator, context: int, link_gbps: float, overhead_s: float, bits: dict,
             acceptance: float, new_tokens: int = 32) -> dict:
    """{method: {ttft_s, tt32t_s, ...}} for one request. link_gbps: gigabits per second."""
    link = link_gbps * 1e9 / 8                                   # bytes/s
    t_step = step_s(model, acc, context)
    codec_bw = acc.hbm_gbps * 1e9 * acc.codec_fraction
    out = {}
    for m in METHODS:
        first = bits["lynx_anchor"] if m == "lynx" else bits[m]
        full = bits[m]
        exposed = 0.0 if m == "bf16" else 2 * kv_bytes(model, context, 16) / model.layers / codec_bw
        ttft = overhead_s + kv_bytes(model, context, first) / link + exposed
        if m != "lynx":
            out[m] = {"ttft_s": ttft, "tt32t_s": ttft + (new_tokens - 1) * t_step,
                      "wire_bytes": kv_bytes(model, context, full)}
            continue
        t_res = overhead_s + kv_bytes(model, context, full) / link + exposed
        drafted = min(new_tokens - 1, max(0, math.floor((t_res - ttft) / t_step)))
        kept = min(drafted, math.floor(acceptance * drafted + 1e-9))
        after_verify = 1 + kept + 1                          # first token, kept drafts, the verify pass's own token
        tt32 = t_res + t_step + max(0, new_tokens - after_verify) * t_step
        out[m] = {"ttft_s": ttft, "tt32t_s": tt32, "drafted": drafted, "kept": kept, "residual_at_s": t_res,
                  "wire_bytes": kv_bytes(model, context, full)}
    return out


def fit(bits: dict, acceptance: float, model: ModelShape = QWEN32B, acc: Accelerator = A100, context: int = 16384):
    """Least squares of the relative errors of the paper's eight figures over (link Gbit/s, overhead s)."""
    def loss(bw, o):
        t = timeline(model, acc, context, bw, o, bits, acceptance)
        return sum(((t[m][k] - PAPER[m][i]) / PAPER[m][i]) ** 2
                   for m in METHODS for i, k in enumerate(("ttft_s", "tt32t_s")))

    best = (float("inf"), None, None)
    for i in range(121):                      # coarse grid, then two refinements around the best
        bw = 10 ** (0 + 2 * i / 120)          # 1 .. 100 Gbit/s
        for j in range(61):
            o = 1.5 * j / 60
            best = min(best, (loss(bw, o), bw, o))
    for scale in (0.05, 0.005):
        _, bw0, o0 = best
        for i in range(-20, 21):
            for j in range(-20, 21):
                bw, o = bw0 * (1 + scale * i / 20), max(0.0, o0 + 1.5 * scale * j / 20)
                best = min(best, (loss(bw, o), bw, o))
    return best[1], best[2]


def crossover(model, acc, context, overhead, bits, acceptance, key="tt32t_s", lo=0.01, hi=1e4, margin=0.05):
    """The range of link speeds (Gbit/s, [from, to] on a log grid of 400 points) where Lynx's `key` is at least
    `margin` (5 %) better than INT8's: below it the residual's wait dominates (TT32T) , above it the link no longer
    matters; None when Lynx never gains that much."""
    grid = [lo * (hi / lo) ** (i / 399) for i in range(400)]
    good = []
    for bw in grid:
        t = timeline(model, acc, context, bw, overhead, bits, acceptance)
        if (t["int8"][key] - t["lynx"][key]) / t["int8"][key] >= margin:
            good.append(bw)
    return [round(good[0], 3), round(good[-1], 3)] if good else None


def run(acceptance: float = 24.3 / 31, as_json: bool = False) -> dict:
    say = printer(as_json)
    bits = measured_bits(QWEN32B.head_dim)
    bw, o = fit(bits, acceptance)
    t = timeline(QWEN32B, A100, 16384, bw, o, bits, acceptance)
    paper_fit = {m: {"ttft_s": round(t[m]["ttft_s"], 3), "tt32t_s": round(t[m]["tt32t_s"], 3)} for m in METHODS}
    err = max(abs(t[m][k] - PAPER[m][i]) / PAPER[m][i] for m in METHODS for i, k in enumerate(("ttft_s", "tt32t_s")))
    say("bits/value (this project's codecs, D=128): " + ", ".join(f"{k} {v:.2f}" for k, v in bits.items()))
    say(f"accelerator: {A100.name}; decode step at 16K: {1e3 * step_s(QWEN32B, A100, 16384):.1f} ms; "
        f"acceptance {acceptance:.2f}")
    say(f"fitted: link {bw:.2f} Gbit/s, per-request overhead {o:.3f} s; worst error {100 * err:.1f} %\n")
    say("| method | TTFT s (paper) | TT32T s (paper) |\n|---|---|---|")
    for m in METHODS:
        say(f"| {m} | {t[m]['ttft_s']:.2f} ({PAPER[m][0]}) | {t[m]['tt32t_s']:.2f} ({PAPER[m][1]}) |")
    predictions = []
    for model in (QWEN32B, MLA):
        for ctx in (16384, 32768, 65536, 131072):
            for link in (10.0, 25.0, 100.0, 400.0):
                r = timeline(model, A100, ctx, link, o, bits, acceptance)
                predictions.append({"model": model.name, "context": ctx, "link_gbps": link,
                                    **{f"{m}_{k}": round(r[m][k], 3) for m in METHODS for k in ("ttft_s", "tt32t_s")}})
    say("\n| model | context | link Gbit/s | TTFT BF16 / INT8 / INT4 / Lynx s | TT32T BF16 / INT8 / INT4 / Lynx s |")
    say("|---|---|---|---|---|")
    for p in predictions:
        say(f"| {p['model'].split(' ')[0]} | {p['context'] // 1024}K | {p['link_gbps']:g} | "
            + " / ".join(f"{p[m + '_ttft_s']:.2f}" for m in METHODS) + " | "
            + " / ".join(f"{p[m + '_tt32t_s']:.2f}" for m in METHODS) + " |")
    cross = {f"{model.name.split(' ')[0]}@{ctx // 1024}K": {
        "tt32t_gain_5pct_gbps": crossover(model, A100, ctx, o, bits, acceptance),
        "ttft_gain_5pct_gbps": crossover(model, A100, ctx, o, bits, acceptance, "ttft_s")}
        for model in (QWEN32B, MLA) for ctx in (16384, 131072)}
    say("\nlink speeds (Gbit/s) where Lynx is at least 5 % faster than INT8: " + json.dumps(cross))
    res = {"paper_fit": paper_fit, "fitted": {"link_gbps": bw, "overhead_s": o}, "worst_error": err,
           "bits_per_value": bits, "acceptance": acceptance, "accelerator": A100.name, "predictions": predictions,
           "crossovers": cross}
    return final_line(res)
