"""`warm_up(model)`: pay at start what a first request would otherwise pay — the codec's kernels (the C library's
build, once per machine), the probe of whether the model takes tree inputs (two short forward passes, once per
model), and one short drafted generation through every path a request takes (prefill capture, encode, anchor tier,
tree draft step, layer-by-layer verify, full tier). `load_default_model`, `PrefillServer` and `DecodeClient` call it,
so a process's first request is as fast as its second (docs/performance.md, "First request")."""
from __future__ import annotations

import time
import warnings
import weakref

import torch

from ..cache import LynxCache
from ..config import LynxQuantConfig, SpecConfig
from ..quant.dispatch import prepare
from .generate import speculative_generate
from .support import honours_tree_inputs


_WARM: "weakref.WeakSet" = weakref.WeakSet()


@torch.no_grad()
def warm_up(model, tokens: int = 16) -> float:
    """Warm `model` for Lynx requests, once per model and process; returns the seconds it took (0 when it was warm).
    A model Lynx cannot serve is left as it is (its first request says why)."""
    if model in _WARM:
        return 0.0
    _WARM.add(model)
    t0 = time.perf_counter()
    prepare(next(model.parameters()).device)
    try:
        honours_tree_inputs(model)
        V = int(model.config.get_text_config().vocab_size)
        ids = torch.arange(tokens, device=next(model.parameters()).device)[None] % max(1, V - 3) + 3
        cache, _ = LynxCache.from_prefill(model, ids, quant_config=LynxQuantConfig(), residual_after_steps=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.generate(ids, cache=cache, custom_generate=speculative_generate,
                           spec_config=SpecConfig(max_draft_steps=4), max_new_tokens=6, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    except (ValueError, RuntimeError):  # an architecture or option Lynx refuses: nothing to warm
        pass
    return time.perf_counter() - t0
