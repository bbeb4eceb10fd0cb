"""Lynx as a Hub `custom_generate` repository: what its `custom_generate/generate.py` runs.

`model.generate(ids, custom_generate="org/repo" or a local folder, trust_remote_code=True, ...)` loads that file,
which `lynx-hf card` writes as a shim around `hub_generate` with the repo's codec settings inlined (Transformers
copies the file into its module cache, so it cannot find a sibling lynx_config.json by path). A string
`custom_generate` receives every `generate()` argument unprepared — None for what the caller left unset — unlike a
callable, which gets only its extra parameters. `hub_generate` keeps what carries a value, refuses what Lynx cannot
honour, prefills locally into a LynxCache unless the caller passed one, and hands over to `speculative_generate`."""
from __future__ import annotations

from .cache import LynxCache
from .config import LynxQuantConfig
from .engine import speculative_generate

# generate() arguments that Lynx's decoding loop cannot honour
_UNSUPPORTED = ("assistant_model", "prefix_allowed_tokens_fn", "negative_prompt_ids", "negative_prompt_attention_mask")

SHIM = '''"""Lynx: progressive speculative KV quantization, as a Transformers custom_generate (written by `lynx-hf card`).

    model.generate(input_ids, custom_generate=THIS_REPO, trust_remote_code=True, max_new_tokens=64)

decodes exactly as plain `generate` on the Lynx full tier: drafts on the 4-bit anchor of the prompt's KV while the
residual is pending (here: after {residual_after} draft steps, a local stand-in for the transfer), then verifies.
Pass cache=LynxCache(...) to decode a KV transferred from a prefill node instead."""
from lynx_hf.hub import hub_generate

LYNX_CONFIG = {config}
RESIDUAL_AFTER_STEPS = {residual_after}


def generate(model, *args, **kwargs):
    kwargs.setdefault("residual_after_steps", RESIDUAL_AFTER_STEPS)
    return hub_generate(model, LYNX_CONFIG, *args, **kwargs)
'''


def hub_generate(model, lynx_config: dict, inputs=None, residual_after_steps: int | None = None,
                 residual_after_tokens: int | None = None, **kwargs):
    """Run Lynx for a string `custom_generate`. inputs / input_ids: the prompt [B, P]; cache: a LynxCache to decode
    (default: a local full-precision prefill encoded with `lynx_config`, its residual landing after
    `residual_after_steps` draft steps; `residual_after_tokens`, as older shims pass it, is its alias); every other
    argument as in `generate`."""
    ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    kwargs.pop("input_ids", None)
    if ids is None:
        raise ValueError("Lynx custom_generate needs the prompt's input_ids")
    kw = {k: v for k, v in kwargs.items() if v is not None}
    bad = [k for k in _UNSUPPORTED if k in kw]
    if bad:
        raise ValueError(f"Lynx custom_generate does not support {bad}")
    if "streamer" in kw:  # speculative_generate takes its streamer as lynx_streamer (see its docstring)
        kw["lynx_streamer"] = kw.pop("streamer")
    kw.pop("synced_gpus", None)
    if kw.get("stop_strings"):  # a callable custom_generate never gets the tokenizer: build the criterion here
        from transformers import StopStringCriteria, StoppingCriteriaList

        tok = kw.pop("tokenizer", None)
        if tok is None:
            raise ValueError("stop_strings need tokenizer= (the model's tokenizer)")
        stops = kw.pop("stop_strings")
        kw["stopping_criteria"] = StoppingCriteriaList([*(kw.get("stopping_criteria") or []),
                                                        StopStringCriteria(tok, [stops] if isinstance(stops, str)
                                                                           else list(stops))])
    cache = kw.pop("cache", None)
    if cache is None:
        cfg = LynxQuantConfig.from_dict(dict(lynx_config))
        cache, _ = LynxCache.from_prefill(model, ids, quant_config=cfg, attention_mask=kw.get("attention_mask"),
                                          residual_after_steps=residual_after_steps,
                                          residual_after_tokens=residual_after_tokens)
    elif not isinstance(cache, LynxCache):
        raise ValueError(f"Lynx custom_generate needs cache=LynxCache(...) or none, got {type(cache).__name__}")
    return model.generate(ids, cache=cache, custom_generate=speculative_generate, **kw)


def write_custom_generate(folder, lynx_config: LynxQuantConfig, residual_after_steps: int = 8) -> None:
    """Write `custom_generate/generate.py` and `custom_generate/requirements.txt` into a repo folder."""
    import os

    from . import __version__

    d = os.path.join(folder, "custom_generate")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "generate.py"), "w") as f:
        f.write(SHIM.format(config=repr(lynx_config.to_dict()), residual_after=int(residual_after_steps)))
    with open(os.path.join(d, "requirements.txt"), "w") as f:
        f.write(f"lynx-hf>={__version__}\n")
