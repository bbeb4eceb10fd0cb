"""lynx-hf: progressive speculative quantization (Lynx) of the KV cache for Hugging Face Transformers."""
from .config import LynxQuantConfig, SpecConfig
from .model import load_default_model
from . import quant
from .cache import LynxCache
from .loader import LoaderError
from .engine import speculative_generate
from .streamer import SpeculativeStreamer

__all__ = ["LynxQuantConfig", "SpecConfig", "load_default_model", "quant", "LynxCache", "LoaderError",
           "speculative_generate", "SpeculativeStreamer"]
__version__ = "0.1.0"
