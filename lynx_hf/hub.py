"""Lynx as a Hub `custom_generate` repository: what its `custom_generate/generate.py` runs.

`model.generate(ids, custom_generate="org/repo" or a local folder, trust_remote_code=True, ...)` loads that file,
which `lynx-hf card` writes as a shim around `hub_generate` with the repo's codec settings inlined, beside a flat copy
of this runtime (hub_folder.py; Transformers copies the files into its module cache, so they cannot find a sibling
lynx_config.json by path). A string
`custom_generate` receives every `generate()` argument unprepared — None for what the caller left unset — unlike a
callable, which gets only its extra parameters. `hub_generate` keeps what carries a value, refuses what Lynx cannot
honour, prefills locally into a LynxCache unless the caller passed one, and hands over to `speculative_generate`.
A conversation goes on as with any cache: pass the previous turn's cache (`return_dict_in_generate=True` returns it
as `.cache`) with the whole conversation's ids; only the new positions run."""
from __future__ import annotations

from .arch import media_inputs
from .local import LynxCache  # (the prefill side: it registers LynxCache.from_prefill, which a local prefill uses)
from .config import LynxQuantConfig
from .engine import speculative_generate


def hub_generate(model, lynx_config: dict, inputs=None, residual_after_steps: int | None = None,
                 residual_after_tokens: int | None = None, **kwargs):
    """Run Lynx for a string `custom_generate`. inputs / input_ids: the prompt [B, P]; cache: a LynxCache to decode
    (default: a local full-precision prefill encoded with `lynx_config`, its residual landing after
    `residual_after_steps` draft steps; `residual_after_tokens`, as older shims pass it, is its alias); every other
    argument as in `generate`. A `streamer=` gets its end() exactly once however this ends (a refusal here, an
    error in the prefill or in Transformers' checks before speculative_generate took it), so a chat UI's loop ends."""
    given, lynx = kwargs.pop("streamer", None), kwargs.pop("lynx_streamer", None)
    if given is not None and lynx is not None:
        given.end(), lynx.end()
        raise ValueError("pass the streamer once: streamer= or lynx_streamer= (the same thing here)")
    streamer = given if given is not None else lynx
    once = None if streamer is None else _EndsOnce(streamer)
    try:
        return _hub_generate(model, lynx_config, inputs, residual_after_steps, residual_after_tokens, once, kwargs)
    finally:
        if once is not None:
            once.end()  # a no-op where speculative_generate ended it


class _EndsOnce:
    """A streamer's stand-in whose end() reaches the streamer once; everything else is the streamer's own."""

    def __init__(self, streamer):
        self._streamer, self._ended = streamer, False

    def __getattr__(self, name):
        return getattr(self._streamer, name)

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._streamer.end()


def _hub_generate(model, lynx_config, inputs, residual_after_steps, residual_after_tokens, streamer, kwargs):
    ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    kwargs.pop("input_ids", None)
    if ids is None:
        raise ValueError("Lynx custom_generate needs the prompt's input_ids")
    kw = {k: v for k, v in kwargs.items() if v is not None}
    # whatever speculative_generate cannot honour it refuses itself (beams, ...), as on the callable path; two
    # arguments Transformers would keep from a callable custom_generate are handled here: the streamer becomes its
    # lynx_streamer (the prompt, the verified tokens, end(); the drafts too if it takes them), an assistant refused
    if kw.get("assistant_model") is not None:
        raise ValueError("speculative_generate drafts on the anchor tier itself: assistant_model (assisted decoding) "
                         "cannot be combined with it; pass one or the other")
    if streamer is not None:
        kw["lynx_streamer"] = streamer
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
                                          residual_after_tokens=residual_after_tokens, **media_inputs(kw))
    elif not isinstance(cache, LynxCache):
        raise ValueError(f"Lynx custom_generate needs cache=LynxCache(...) or none, got {type(cache).__name__}")
    return model.generate(ids, cache=cache, custom_generate=speculative_generate, **kw)
