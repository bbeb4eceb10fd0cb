"""lynx-hf: progressive speculative quantization (Lynx) of the KV cache for Hugging Face Transformers.

The public names load on first use (PEP 562), so `import lynx_hf` and the `lynx-hf` command start without torch."""
import importlib

__version__ = "0.1.0"
_PUBLIC = {"LynxQuantConfig": ".config", "SpecConfig": ".config", "load_default_model": ".model", "quant": None,
           "LynxCache": ".local", "LoaderError": ".loader", "speculative_generate": ".engine", "warm_up": ".engine",
           "SpeculativeStreamer": ".streamer", "Session": ".session", "LocalLink": ".session"}
__all__ = list(_PUBLIC)


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'lynx_hf' has no attribute {name!r}")
    module = _PUBLIC[name]
    value = importlib.import_module(f".{name}", __name__) if module is None else \
        getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
