"""The decode side's KV: `PromptStore` (the encoded prompt as it arrives), `LynxLayer` (its materialised KV and the
decode-side tail) and `LynxCache` (the `transformers.Cache` that orchestrates them). Imports only config, quant,
arch, trace and the loader interface."""
from .layer import LynxLayer
from .lynx_cache import PLAIN_GENERATE_HINT, LynxCache
from .store import KINDS, PromptStore

__all__ = ["LynxCache", "LynxLayer", "PromptStore", "KINDS", "PLAIN_GENERATE_HINT"]
