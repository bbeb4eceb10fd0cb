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
