"""A roofline prediction of the decode node's codec time on an NVIDIA H200, from the bytes each Triton launch moves
(eval/benches/bench_kernels.py measures them from the dispatch's own launches), and the check of it against what
`eval/gpu_check.sh` measures there.

`python -m lynx_hf.eval.benches.roofline [--codec runs/gpu_check/bench_codec.txt] [--json]`: per context length
(Llama-3.1-8B
geometry: 32 layers, 8 KV heads, head dim 128, bf16), the time per layer to dequantize the anchor tier and the
full tier at HBM speed, what PCIe carries per request (the codes and their statistics: the decode side dequantizes
on the GPU), and — given `lynx-hf bench codec --device cuda`'s JSON — the measured GB/s next to the predicted ones.
Ends with one JSON line."""
from __future__ import annotations

import argparse
import json
import sys

from lynx_hf.eval.lib.harness import final_line, printer

H200 = {"hbm_bps": 4.8e12, "pcie_bps": 55e9}  # HBM3e peak; PCIe Gen5 x16, measured typical (host → device)
LLAMA_8B = {"layers": 32, "kv_heads": 8, "head_dim": 128}
CONTEXTS = (8192, 32768, 131072)


def launch_bytes(dtype: str = "bfloat16", head_dim: int = 128) -> dict:
    """Bytes per K/V value moved by each launch kind ("encode", "decode anchor", "decode full") for keys (channel
    axis) and values (token axis), the codec's defaults for a Llama model."""
    from lynx_hf.eval.benches.bench_kernels import launches

    out = {}
    for l in launches():
        method, axis, D, dt, *what = l.what.split()
        if method == "lynx" and D == f"D={head_dim}" and dt == dtype:
            out[(" ".join(what), axis)] = l.bytes_per_value
    if not out:
        raise RuntimeError(f"no launch for head dim {head_dim} and {dtype}")
    return out


def predict(contexts=CONTEXTS, geometry: dict = LLAMA_8B, peak: dict = H200) -> dict:
    b = launch_bytes("bfloat16", geometry["head_dim"])
    per_layer_values = geometry["kv_heads"] * geometry["head_dim"]  # per token, for K and for V each
    kv_bf16 = 2 * 2 * per_layer_values                              # bytes per token and layer, K and V in bf16
    rows = []
    for T in contexts:
        def layer_bytes(kind):  # keys on the channel axis, values on the token axis
            return T * per_layer_values * (b[(kind, "channel")] + b[(kind, "token")])
        anchor, full = layer_bytes("decode anchor"), layer_bytes("decode full")
        # over PCIe: the codes and their statistics only (what the decode side stages); dequantized on the GPU
        codes_anchor = T * per_layer_values * 2 * (0.5 + _stats(b, "anchor"))
        codes_full = T * per_layer_values * 2 * (1.0 + _stats(b, "full"))
        rows.append({"tokens": T, "layer_bytes_anchor": anchor, "layer_bytes_full": full,
                     "layer_us_anchor": 1e6 * anchor / peak["hbm_bps"], "layer_us_full": 1e6 * full / peak["hbm_bps"],
                     "model_ms_full": 1e3 * full * geometry["layers"] / peak["hbm_bps"],
                     "pcie_mb_anchor": codes_anchor * geometry["layers"] / 1e6,
                     "pcie_mb_full": codes_full * geometry["layers"] / 1e6,
                     "pcie_ms_full": 1e3 * codes_full * geometry["layers"] / peak["pcie_bps"],
                     "pcie_ms_bf16_kv": 1e3 * T * kv_bf16 * geometry["layers"] / peak["pcie_bps"]})
    return {"peak": peak, "geometry": geometry, "bytes_per_value": {f"{k} {a}": v for (k, a), v in b.items()},
            "rows": rows}


def _stats(b: dict, tier: str) -> float:
    """Bytes of statistics per value that travel with the codes (a decode launch reads codes + stats, writes bf16)."""
    codes = 0.5 if tier == "anchor" else 1.0
    return ((b[(f"decode {tier}", "channel")] + b[(f"decode {tier}", "token")]) / 2) - codes - 2.0


def check(codec: dict, peak: dict = H200) -> dict:
    """`lynx-hf bench codec --device cuda`'s JSON (fp32 KV, head dim 64; GB/s of fp32 input) next to the roofline
    of the same launches: predicted GB/s = 4 bytes per value × HBM / bytes the launch moves per value."""
    b = launch_bytes("float32", 64)
    triton = codec["paths"].get("triton") or {}
    out = {"copy_gbps": codec["copy_gbps"]}
    for key, kind in (("decode_anchor_gbps", "decode anchor"), ("decode_full_gbps", "decode full"),
                      ("encode_gbps", "encode")):
        moved = b[(kind, "channel")]  # bench codec encodes keys (channel axis)
        pred = 4 * peak["hbm_bps"] / moved / 1e9
        got = triton.get(key)
        out[key] = {"predicted": round(pred, 1), "measured": got, "fraction": None if got is None else
                    round(got / pred, 3)}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codec", help="bench codec --device cuda output (its last line is JSON)")
    p.add_argument("--json", action="store_true", help="print only the final JSON line")
    a = p.parse_args(argv)
    say = printer(a.json)
    res = predict()
    say(f"H200 roofline (HBM {H200['hbm_bps'] / 1e12:g} TB/s, PCIe {H200['pcie_bps'] / 1e9:g} GB/s), Llama-3.1-8B "
        f"geometry, bf16:")
    say(f"{'tokens':>7s} {'anchor/layer':>12s} {'full/layer':>11s} {'full, 32 layers':>15s} {'PCIe codes':>11s} "
        f"{'PCIe time':>10s} {'bf16 KV over PCIe':>18s}")
    for r in res["rows"]:
        say(f"{r['tokens']:7d} {r['layer_us_anchor']:10.1f}µs {r['layer_us_full']:9.1f}µs "
            f"{r['model_ms_full']:13.2f}ms {r['pcie_mb_full']:9.0f}MB {r['pcie_ms_full']:8.1f}ms "
            f"{r['pcie_ms_bf16_kv']:16.1f}ms")
    if a.codec:
        lines = [l for l in open(a.codec).read().splitlines() if l.startswith("{")]
        res["check"] = check(json.loads(lines[-1]))
        for k, v in res["check"].items():
            if isinstance(v, dict):
                say(f"{k}: predicted {v['predicted']} GB/s, measured {v['measured']} ({v['fraction']} of the roofline)")
    return final_line(res)


if __name__ == "__main__":
    sys.exit(main() and 0)
