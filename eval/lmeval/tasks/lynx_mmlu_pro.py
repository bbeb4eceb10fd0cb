"""Data and prompts of the project's MMLU-Pro tasks (lm-eval YAMLs in this folder refer to these functions).

mmlu_pro_local     lm-eval's `mmlu_pro` prompts, filter and metric on a local JSONL in the Hub dataset's schema
                   ($LYNX_MMLU_PRO_PATH, else the shared data). Such a file may have no validation split (the shared
                   test split has none): the first 5 questions of each category in file order are that category's
                   few-shot examples, answered "The answer is (X)." (the test split carries no chain of thought), and
                   are never scored. The scored questions are shuffled with a fixed seed, so `--limit N` spans
                   categories.
mmlu_pro_longctx   many-shot prompts: solved questions of the scored question's category, each ending "The answer is
                   (X).", fill the context to `context_tokens` tokens of the model's tokenizer, then the question and
                   "Answer: The answer is ("; the option letters are scored by log-likelihood against the context's
                   KV (the paper's long-context setting, with a model too small to reason at length).
The tokenizer comes from the task metadata (`--model_args pretrained=...` reaches it; `tokenizer=` overrides),
defaulting to the embedded model's."""
from __future__ import annotations

import functools
import os
import random

LETTERS = "ABCDEFGHIJ"
SHOTS = 5
SEED = 1234
DESCRIPTION = ("The following are multiple choice questions (with answers) about {}. Think step by step and then "
               "finish your answer with \"the answer is (X)\" where X is the correct letter choice.\n")


def data_path() -> str:
    path = os.environ.get("LYNX_MMLU_PRO_PATH")
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"LYNX_MMLU_PRO_PATH={path}: no such file")
        return path
    from lynx_hf.eval.lib import data

    try:
        return str(data.mmlu_pro())
    except FileNotFoundError:
        raise FileNotFoundError("set LYNX_MMLU_PRO_PATH to a JSONL file of MMLU-Pro questions (the Hub dataset's "
                                "schema: question, options, answer, answer_index, category)") from None


@functools.cache
def _questions(path: str) -> tuple:
    """The file's questions, read with `datasets`, as dicts; schema checked."""
    import datasets

    ds = datasets.load_dataset("json", data_files=path, split="train")
    missing = {"question", "options", "answer", "answer_index", "category"} - set(ds.column_names)
    if missing:
        raise ValueError(f"{path}: not in MMLU-Pro's schema, missing {sorted(missing)}")
    return tuple(ds.to_list())


def _split(path: str):
    """(shots per category: the first SHOTS in file order, scored question indices shuffled with SEED)."""
    qs = _questions(path)
    shots: dict = {}
    scored = []
    for i, q in enumerate(qs):
        got = shots.setdefault(q["category"], [])
        (got.append(i) if len(got) < SHOTS else scored.append(i))
    random.Random(SEED).shuffle(scored)
    return shots, scored


def question_block(q: dict) -> str:
    """lm-eval mmlu_pro's question format (utils.format_cot_example without the answer)."""
    opts = "".join(f"{LETTERS[i]}. {o.strip()}\n" for i, o in enumerate(q["options"][: len(LETTERS)]))
    return f"Question:\n{q['question']}\nOptions:\n{opts}"


def solved(q: dict, lead: str) -> str:
    return f"{question_block(q)}{lead} The answer is ({q['answer']}).\n\n"


# -- mmlu_pro_local ------------------------------------------------------------------------------------------------
def load_local(**metadata):
    import datasets

    path = data_path()
    _, scored = _split(path)
    qs = _questions(path)
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([qs[i] for i in scored])})


@functools.cache
def _local_shots(path: str, category: str) -> str:
    shots, _ = _split(path)
    qs = _questions(path)
    return "".join(solved(qs[i], "Answer: Let's think step by step.") for i in shots[category])


def local_prompt(doc: dict) -> str:
    return (DESCRIPTION.format(doc["category"]) + _local_shots(data_path(), doc["category"])
            + question_block(doc) + "Answer: Let's think step by step.")


# -- mmlu_pro_longctx ----------------------------------------------------------------------------------------------
ANSWER_LEAD = "Answer: The answer is ("


@functools.cache
def _tokenizer(name: str | None):
    """The tokenizer of a Hub id or folder; None or the embedded model's name: the embedded model's (cached)."""
    from lynx_hf.model import EMBEDDED, default_tokenizer  # internal: the embedded model's name and tokenizer

    if name in (None, EMBEDDED):
        return default_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


@functools.cache
def _lengths(path: str, tokenizer: str | None) -> tuple:
    """Tokens of each question as a solved shot, and as the scored question."""
    tok, qs = _tokenizer(tokenizer), _questions(path)
    shot = tok([solved(q, "Answer:") for q in qs], add_special_tokens=False).input_ids
    ask = tok([question_block(q) + ANSWER_LEAD for q in qs], add_special_tokens=False).input_ids
    return tuple(len(s) for s in shot), tuple(len(a) for a in ask)


def load_longctx(context_tokens: int = 1024, tokenizer: str | None = None, pretrained: str | None = None,
                 **metadata):
    """Every question, shuffled with SEED, each with `shot_ids`: questions of its category (cyclically after it,
    never itself) whose solved forms fill the prompt to at most `context_tokens` tokens."""
    import datasets

    path = data_path()
    qs = _questions(path)
    shot_len, ask_len = _lengths(path, tokenizer or pretrained)
    by_cat: dict = {}
    for i, q in enumerate(qs):
        by_cat.setdefault(q["category"], []).append(i)
    pos = {i: k for ids in by_cat.values() for k, i in enumerate(ids)}
    order = list(range(len(qs)))
    random.Random(SEED).shuffle(order)
    docs = []
    for i in order:
        ids, budget, picked = by_cat[qs[i]["category"]], int(context_tokens) - ask_len[i], []
        for step in range(1, len(ids)):
            j = ids[(pos[i] + step) % len(ids)]
            if shot_len[j] > budget:
                break
            picked.append(j)
            budget -= shot_len[j]
        docs.append({**qs[i], "shot_ids": picked, "context_tokens": int(context_tokens)})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def longctx_prompt(doc: dict) -> str:
    qs = _questions(data_path())
    return "".join(solved(qs[j], "Answer:") for j in doc["shot_ids"]) + question_block(doc) + ANSWER_LEAD


def longctx_choices(doc: dict) -> list[str]:
    return list(LETTERS[: len(doc["options"])])
