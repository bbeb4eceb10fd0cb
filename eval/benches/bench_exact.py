"""`lynx-hf bench exact`: what exact mode's correction stream costs — bits per value on each text kind and KV dtype,
next to the 8-bit code and the dtype's own bits, and the correction's encode / decode throughput here.

The embedded model (or --model) prefills a prompt of each kind (--tokens): prose (Shakespeare when the data folder
has it, else the standard library's docstrings), Python source (the standard library's), JSON (a document built
from the standard library's module index) and many-shot QA (MMLU-Pro questions when the data folder has them). For
each dtype the model runs in that dtype, and every layer's K and V are encoded with `LynxQuantConfig(exact=True)`;
every reconstruction is checked bit for bit. Prints a table and ends with one JSON line."""
from __future__ import annotations

import json
import sys
import time

from lynx_hf.eval.lib.harness import default_prompt_text, final_line, printer

DTYPES = ("bfloat16", "float16", "float32")
# (torch and the model load inside run: `lynx-hf --help` registers this subcommand without importing torch)


def texts() -> dict:
    """{kind: text} for the kinds this machine has data for."""
    import inspect
    import pkgutil

    from lynx_hf.eval.lib import data

    mods = sorted(m.name for m in pkgutil.iter_modules() if not m.name.startswith("_"))[:400]
    out = {"python": default_prompt_text(),
           "json": json.dumps([{"module": m, "index": i, "private": False} for i, m in enumerate(mods)], indent=1)}
    try:
        out["prose"] = data.shakespeare().read_text()[:40000]
    except (FileNotFoundError, OSError, SystemExit):
        out["prose"] = "\n".join(inspect.getdoc(m) or "" for m in (json, inspect, pkgutil))
    try:
        qs = data.read_questions(data.mmlu_pro(), 40)
        out["many-shot QA"] = "\n\n".join(f"Q: {q['question']}\nOptions: {'; '.join(q['options'])}\n"
                                          f"A: {q['answer']}" for q in qs)
    except (FileNotFoundError, OSError, SystemExit, KeyError):
        pass
    return out


def measure(model, ids) -> dict:
    """One prompt's KV: the correction's and the whole stream's bits per value, seconds to encode / correct."""
    import torch

    from lynx_hf import LynxQuantConfig
    from lynx_hf.local import prefill  # internal: the prefill node's KV, as it ships
    from lynx_hf.quant import dequantize, encode

    INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    kv, _ = prefill(model, ids)
    cfg = LynxQuantConfig(exact=True)
    values = corr = total = 0
    enc_s = dec_s = 0.0
    for k, v in kv:
        for kind, x in (("key", k), ("value", v)):
            t = time.perf_counter()
            s = encode(x, cfg, kind)
            enc_s += time.perf_counter() - t
            t = time.perf_counter()
            y = dequantize(s, "full")
            dec_s += time.perf_counter() - t
            if not torch.equal(y.view(INT[x.dtype]), x.view(INT[x.dtype])):
                raise AssertionError("exact mode gave back other bits")  # (a benchmark that checks what it times)
            values += x.numel()
            corr += s.correction.numel()
            total += s.nbytes("full")
    return {"correction_bits": 8 * corr / values, "total_bits": 8 * total / values, "values": values,
            "encode_s": enc_s, "full_tier_s": dec_s}


def run(tokens: int = 1024, model_name: str | None = None, dtypes=DTYPES, as_json: bool = False) -> dict:
    import torch
    from tqdm import tqdm

    import lynx_hf

    say = printer(as_json, stderr=True)
    kinds = texts()
    rows = {}
    for name in tqdm(dtypes, desc="dtypes", file=sys.stderr, disable=as_json):
        dt = getattr(torch, name)
        model, tok = lynx_hf.load_default_model(model_name, dtype=dt)  # (loaded in each dtype, never cast between)
        for kind, text in kinds.items():
            ids = tok(text, return_tensors="pt").input_ids[:, :tokens]
            rows[f"{kind}/{name}"] = {"kind": kind, "dtype": name, "tokens": ids.shape[1],
                                      "dtype_bits": 8 * dt.itemsize, **measure(model, ids)}
    say(f"{'text':14s} {'dtype':9s} {'tokens':>6s} {'correction':>10s} {'exact total':>11s} {'dtype':>6s} "
        f"{'vs dtype':>8s} {'encode':>9s} {'full tier':>9s}   (bits per value; seconds for the prompt's KV)")
    for r in rows.values():
        say(f"{r['kind']:14s} {r['dtype']:9s} {r['tokens']:6d} {r['correction_bits']:10.2f} {r['total_bits']:11.2f} "
            f"{r['dtype_bits']:6d} {r['total_bits'] / r['dtype_bits']:8.2f} {r['encode_s']:9.2f} "
            f"{r['full_tier_s']:9.2f}")
    return final_line({"rows": rows, "tokens": tokens})


def register(bench) -> None:
    """`lynx-hf bench exact` (`bench`: the subcommands of `lynx-hf bench`)."""
    # internal: the command line's own parts (its subcommand helper and help texts)
    from lynx_hf.flags import JSON_HELP, subcommand
    from lynx_hf.flags import tokens
    from lynx_hf.transfer.commands import MODEL_HELP

    p = subcommand(bench, "exact", "exact mode's correction stream: bits per value by text and dtype, speed")
    p.add_argument("--tokens", type=tokens(), default=1024, help="prompt length per text kind")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="the model's dtypes")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(fn=_command)


def _command(a) -> None:
    run(a.tokens, a.model, a.dtypes, a.json)
