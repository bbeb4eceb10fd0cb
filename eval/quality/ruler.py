"""RULER by KV mode: lm-eval's own synthetic long-context tasks (needle in a haystack), scored for every KV mode on
the same prompts. The accuracy column of `lynx-hf results`.

Per sample of a (task, length) cell: lm-eval builds the request (its prompt, gen_prefix and generation settings;
the haystack sized with the model's tokenizer); the prefill node runs the prompt once in full precision; each mode
carries that KV to the decode side (eval/lib/kv_modes.py) and decodes greedily (the task's `max_gen_toks`, 128, capped
at what its answer needs: 16 tokens for a 7-digit number, 40 for a UUID); lm-eval's `process_results` scores the
text. The baselines and the anchor tier decode as one batch, a row per mode over its own reconstructed KV (batch
rows may differ from a batch of one in float rounding, not in what they mean). "lynx" decodes with
`speculative_generate` (residual after `residual_after` draft steps); "full" (plain greedy decoding on Lynx's full
tier) is the reference Lynx must equal, token for token, on every sample: the run fails otherwise. One JSON line per
sample in a partial file: a rerun resumes."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig, quant
# internal: one prefill's (KV, logits), reused by every KV mode (LynxCache.from_prefill runs its own)
from lynx_hf.local import prefill

from lynx_hf.eval.lib.kv_modes import mode_config, transferred_cache

ROWS = ("bf16", "int8", "int4", "kivi2", "cachegen", "anchor", "lynx")
CELLS = (("niah_single_1", 1024), ("niah_multikey_2", 1024), ("niah_multikey_3", 1024),
         ("niah_single_1", 2048), ("niah_multikey_2", 2048), ("niah_multikey_3", 2048), ("niah_single_1", 4096))
# the RULER tasks that build their data here (the others download a haystack or questions)
OFFLINE = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")


def wilson(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson interval of a proportion k/n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def requests(task: str, length: int, limit: int, tokenizer: str) -> tuple:
    """(the lm-eval task, its Instances at `length` tokens for the first `limit` documents, as its CLI builds them)."""
    import random

    import numpy as np
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.tasks import TaskManager, get_task_dict

    # RULER draws its haystacks, keys and needles from the global generators, which lm-eval's CLI seeds before it
    # builds the tasks (simple_evaluate): the same seeds give the same documents as `lynx-hf eval --tasks TASK`
    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)
    tm = TaskManager(metadata={"max_seq_lengths": [length], "tokenizer": tokenizer})
    t = get_task_dict([task], tm)[task]
    t.build_all_requests(limit=limit)
    return t, sorted(t.instances, key=lambda i: i.doc_id)


BATCHED = tuple(m for m in ROWS if m != "lynx")  # decoded together: one row each, over its dequantized KV
GEN = {"niah_multikey_3": 40}  # tokens to generate: an answer is 7 digits (16 tokens suffice) or a UUID (40)


def _dequantized(kv, mode: str, lynx_config) -> list:
    """The prompt's KV as the decode side reconstructs it in `mode`: [(K, V)] per layer, each [1, H, S, D]."""
    cfg, tier = mode_config(mode, lynx_config)
    n = len(kv)
    return [tuple(quant.dequantize(quant.encode(x, cfg, kind, layer=(i, n)), tier)
                  for x, kind in ((k, "key"), (v, "value"))) for i, (k, v) in enumerate(kv)]


@torch.inference_mode()
def _sample(model, tok, task, inst, length: int, gen: int, residual_after: int, lynx_config=None) -> dict:
    """One sample: the prompt's prefill, then every mode's greedy tokens and lm-eval's score of their text."""
    context, gen_kwargs = inst.args
    ids = tok(context, add_special_tokens=False, return_tensors="pt").input_ids.to(model.device)   # [1, P]
    P, eos = ids.shape[1], tok.eos_token_id
    kv, logits = prefill(model, ids)
    n = min(int(gen_kwargs.get("max_gen_toks", gen)), GEN.get(task.config.task, gen))
    kw = dict(max_new_tokens=n, do_sample=False, pad_token_id=eos, eos_token_id=eos)
    # the baselines and the anchor tier: one batch row per mode, each over its own reconstructed KV
    rows = [_dequantized(kv, m, lynx_config) for m in BATCHED]
    batch = [tuple(torch.cat([r[i][j] for r in rows]) for j in (0, 1)) for i in range(len(kv))]  # [M, H, S, D]
    cache = LynxCache.from_kv(model, P, batch, logits.expand(len(BATCHED), -1),
                              LynxQuantConfig(method="identity")).pin_tier("full")
    seqs = model.generate(ids.expand(len(BATCHED), -1), cache=cache, **kw)[:, P:].tolist()
    out = dict(zip(BATCHED, seqs))
    # Lynx as a decode node runs it (drafts on the anchor, then verification), and its reference
    spec = transferred_cache(model, kv, logits, P, "lynx", lynx_config, residual_after=residual_after)
    out["lynx"] = model.generate(ids, cache=spec, custom_generate=lynx_hf.speculative_generate, **kw)[0, P:].tolist()
    full = LynxCache.from_kv(model, P, kv, logits, mode_config("lynx", lynx_config)[0]).pin_tier("full")
    out["full"] = model.generate(ids, cache=full, **kw)[0, P:].tolist()
    out = {m: t[:t.index(eos) + 1] if eos in t else t for m, t in out.items()}
    score = {m: float(task.process_results(inst.doc, [tok.decode(t, skip_special_tokens=True)])[str(length)])
             for m, t in out.items()}
    return {"tokens": P, "out": out, "score": score}


def _cell(model, tok, task_name, length, samples, tokenizer, gen, residual_after, lynx_config, done, path, quiet,
          setting):
    task, insts = requests(task_name, length, samples, tokenizer)
    recs = []
    for inst in tqdm(insts, desc=f"RULER {task_name}@{length}", disable=quiet):
        key = f"{task_name}/{length}/{inst.doc_id}"
        if key not in done:
            done[key] = {"key": key, "setting": setting,
                         **_sample(model, tok, task, inst, length, gen, residual_after, lynx_config)}
            with open(path, "a") as f:
                f.write(json.dumps(done[key]) + "\n")
        recs.append(done[key])
    return recs


def run(model=None, tok=None, cells=CELLS, samples: int = 50, gen: int = 16, residual_after: int = 2,
        partial: str = "docs/results.ruler.partial.jsonl", model_name: str | None = None, quiet: bool = False,
        lynx_config: LynxQuantConfig | None = None) -> dict:
    """{"cells": {"task@length": {"n", "tokens", "rows": {mode: {"accuracy", "ci"}}, "lynx_equals_full"}}, ...}.
    lynx_config: the codec of "anchor" and "lynx" (default LynxQuantConfig())."""
    from transformers.utils import logging

    # internal: the embedded model's tokenizer folder (its converted GGUF copy), which RULER sizes haystacks with
    from lynx_hf.model import DEFAULT_GGUF, converted_gguf, default_model_dir

    logging.set_verbosity_error()
    if model is None:
        model, tok = lynx_hf.load_default_model(model_name)
    tokenizer = model_name or converted_gguf(default_model_dir(), DEFAULT_GGUF)
    path = Path(partial)
    setting = [model_name, gen, residual_after, "lm-eval seeds"] + ([lynx_config.to_dict()] if lynx_config else [])
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("setting") == setting:
                done[r["key"]] = r
    report, t0, cpu0 = {"cells": {}, "samples": samples, "gen": gen}, time.time(), time.process_time()
    before, used = set(done), set()
    for task_name, length in cells:
        if task_name not in OFFLINE:
            raise ValueError(f"{task_name} downloads its haystack; offline RULER tasks: {OFFLINE}")
        keys = [f"{task_name}/{length}/{i}" for i in range(samples)]  # lm-eval's --limit: the first documents
        if all(k in done for k in keys):  # resumed whole: no need to build the task (500 haystacks)
            recs = [done[k] for k in keys]
        else:
            recs = _cell(model, tok, task_name, length, samples, tokenizer, gen, residual_after, lynx_config, done,
                         path, quiet, setting)
        used |= {r["key"] for r in recs}
        same = sum(r["out"]["lynx"] == r["out"]["full"] for r in recs)
        if same != len(recs):
            raise AssertionError(f"RULER {task_name}@{length}: Lynx differs from its full tier on "
                                 f"{len(recs) - same} of {len(recs)} samples")
        rows = {}
        for mode in (*ROWS, "full"):
            k = sum(r["score"][mode] for r in recs)
            rows[mode] = {"accuracy": k / len(recs), "ci": wilson(k, len(recs))}
        report["cells"][f"{task_name}@{length}"] = {
            "n": len(recs), "tokens": sum(r["tokens"] for r in recs) / len(recs), "rows": rows,
            "lynx_equals_full": same}
    report["seconds"], report["cpu_seconds"] = time.time() - t0, time.process_time() - cpu0
    report["computed"], report["resumed"] = len(used - before), len(used & before)
    return report
