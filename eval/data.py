"""Where the shared, read-only data lives (never copied into the project): $LYNX_DATA, else ../shared/data next to
the checkout or the working directory."""
from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    cands = [os.environ.get("LYNX_DATA")] if os.environ.get("LYNX_DATA") else []
    here = Path(__file__).resolve().parent.parent
    cands += [here.parent / "shared" / "data", Path.cwd().parent / "shared" / "data", Path.cwd() / "shared" / "data"]
    for c in cands:
        if c and Path(c, "text").is_dir():
            return Path(c)
    raise FileNotFoundError("shared data not found: set LYNX_DATA to the folder holding text/ and mmlu_pro/")


def shakespeare() -> Path:
    return data_dir() / "text" / "tinyshakespeare.txt"


def mmlu_pro() -> Path:
    return data_dir() / "mmlu_pro" / "test.jsonl"


LENGTHS = (256, 400, 600, 800, 1000, 1200, 1400, 1600, 1800, 2048)


def eval_prompts(tok, shakespeare_ids=None):
    """20 prompts of 256–2048 tokens from the shared data: 10 many-shot MMLU-Pro, 10 Shakespeare stretches."""
    import json

    import torch

    if shakespeare_ids is None:
        shakespeare_ids = tok(shakespeare().read_text()[:8 * 4096 + 1000], return_tensors="pt").input_ids
    with open(mmlu_pro()) as f:
        qs = [json.loads(line) for _, line in zip(range(400), f)]
    out = []
    for i, n in enumerate(LENGTHS):
        text = "".join(f"Question: {q['question']}\nAnswer: ({q['answer']})\n\n" for q in qs[i * 40:(i + 1) * 40])
        ids = tok(text, return_tensors="pt").input_ids
        ids = ids if ids.shape[1] >= n else torch.cat([ids] * (n // ids.shape[1] + 1), 1)
        out.append(ids[:, :n])
        out.append(shakespeare_ids[:, 400 * i: 400 * i + n])
    return out
