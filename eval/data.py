"""Where the shared, read-only evaluation data lives (never copied into the project): $LYNX_DATA, else ../shared/data
next to the checkout or the working directory. `eval_prompts` builds the 20 evaluation prompts from any text and
questions (tests pass their small fixtures)."""
from __future__ import annotations

import itertools
import json
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


def read_questions(path, limit: int | None = None) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in itertools.islice(f, limit)]


LENGTHS = (256, 400, 600, 800, 1000, 1200, 1400, 1600, 1800, 2048)
SHAKESPEARE_CHARS = 8 * 4096 + 1000  # enough text for every Shakespeare prompt


def eval_prompts(tok, shakespeare_ids=None, questions: list[dict] | None = None):
    """20 prompts of 256–2048 tokens: 10 many-shot MMLU-Pro (40 questions each, repeated to length), 10 Shakespeare
    stretches. Defaults: the shared data (its first 400 questions)."""
    import torch

    if shakespeare_ids is None:
        shakespeare_ids = tok(shakespeare().read_text()[:SHAKESPEARE_CHARS], return_tensors="pt").input_ids
    qs = questions if questions is not None else read_questions(mmlu_pro(), 400)
    step = max(1, len(qs) // len(LENGTHS))
    out = []
    for i, n in enumerate(LENGTHS):
        shots = [qs[(i * step + j) % len(qs)] for j in range(40)]
        text = "".join(f"Question: {q['question']}\nAnswer: ({q['answer']})\n\n" for q in shots)
        ids = tok(text, return_tensors="pt").input_ids
        ids = ids if ids.shape[1] >= n else torch.cat([ids] * (n // ids.shape[1] + 1), 1)
        out.append(ids[:, :n])
        out.append(shakespeare_ids[:, 400 * i: 400 * i + n])
    return out
