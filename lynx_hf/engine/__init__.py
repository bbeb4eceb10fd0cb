"""One draft → verify → decode loop (`generate.speculative_generate`, the `custom_generate` entry point) over one
decode state (`state.DecodeState`), with a chain drafter and a tree drafter behind one interface (`drafters`),
the draft policy (`policy`) and the engine's own attention masks (`masks`). The acceptance math itself is pure and
lives beside it, in `lynx_hf.spec` (chains) and `lynx_hf.tree` (trees)."""
from .generate import speculative_generate
from .state import DecodeState
from .warm import warm_up

__all__ = ["speculative_generate", "DecodeState", "warm_up"]
