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
    here = Path(__file__).resolve().parents[2]  # the checkout (eval/lib/data.py)
    cands += [here.parent / "shared" / "data", Path.cwd().parent / "shared" / "data", Path.cwd() / "shared" / "data"]
    for c in cands:
        if c and Path(c, "text").is_dir():
            return Path(c)
    raise FileNotFoundError("shared data not found: set LYNX_DATA to the folder holding text/ and mmlu_pro/")


WAY_OUT = ("set LYNX_DATA to a folder holding text/tinyshakespeare.txt and mmlu_pro/test.jsonl (docs/cli.md, 'Data'); "
           "tests/fixtures/ has small stand-ins: shakespeare.txt, mmlu_pro.jsonl")


def require(command: str, text: str | None = None, needs_text: bool = False, needs_mmlu: bool = False,
            text_flag: str | None = "--text FILE") -> None:
    """Before any model is loaded: what `command` reads exists, else one FileNotFoundError line saying what is
    missing and the way out. `text`: the --text file given (None: the shared Shakespeare, where `needs_text`);
    `text_flag`: the command's own way to name another text (None where it has none)."""
    if text is not None and not Path(text).is_file():
        raise FileNotFoundError(f"lynx-hf {command}: --text {text}: no such file")
    if needs_text and text is None:
        try:
            path = shakespeare()
        except FileNotFoundError:
            path = None
        if path is None or not path.is_file():
            other = f"pass {text_flag}, or " if text_flag else ""
            raise FileNotFoundError(f"lynx-hf {command} reads the shared tinyshakespeare.txt, not found: {other}"
                                    f"{WAY_OUT}")
    if needs_mmlu:
        env = os.environ.get("LYNX_MMLU_PRO_PATH")
        if env:
            if not Path(env).is_file():
                raise FileNotFoundError(f"lynx-hf {command}: LYNX_MMLU_PRO_PATH={env}: no such file")
            return
        try:
            ok = mmlu_pro().is_file()
        except FileNotFoundError:
            ok = False
        if not ok:
            raise FileNotFoundError(f"lynx-hf {command} reads MMLU-Pro questions, not found: set LYNX_MMLU_PRO_PATH "
                                    f"to a JSONL file in the Hub dataset's schema, or {WAY_OUT}")


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
