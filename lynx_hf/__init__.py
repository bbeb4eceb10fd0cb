"""lynx-hf: progressive speculative quantization (Lynx) of the KV cache for Hugging Face Transformers."""
from .config import LynxQuantConfig, SpecConfig
from .model import load_default_model
from . import quant

__all__ = ["LynxQuantConfig", "SpecConfig", "load_default_model", "quant"]
__version__ = "0.1.0"
