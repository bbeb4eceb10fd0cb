"""The lm-eval model `lynx`: Hugging Face's `HFLM` with every request's context KV passed through a KV mode.

    lynx-hf eval --model lynx --model_args kv=lynx,residual_after=8 --tasks mmlu_pro_local --limit 50

Model args (besides HFLM's own: batch_size, max_length, ...):
    pretrained       Hub id or local folder (default: the embedded SmolLM2-135M-Instruct, named
                     "embedded/SmolLM2-135M-Instruct" in the results); gguf_file for GGUF
    kv               bf16 | int8 | int4 | kivi2 | cachegen | anchor | lynx | identity (eval/lib/kv_modes.py), default
    lynx
    lynx_config      folder, file or Hub repo with a lynx_config.json (LynxQuantConfig.from_pretrained)
    residual_after   "lynx": the residual lands after this many draft steps (default 8), or
    bandwidth_mbps   "lynx": anchor then residual stream over a simulated link of this speed

`generate_until` prefills each batch (left padded), moves its KV into a fresh LynxCache in the mode, and decodes:
"lynx" through `speculative_generate` (drafts on the anchor, verified: the output is the full tier's), every other
mode with plain `generate` on its tier. `_loglikelihood_tokens` (loglikelihood, loglikelihood_rolling) prefills each
distinct context once and scores its continuations against the context's KV in the mode
(`kv_modes.continuation_logprobs`); lm-eval's own path would score context and continuation in one cache-less pass,
where KV quantization has no effect. Rolling windows: only each window's context goes through the codec; its own
tokens are the decode side's. Importing this module registers the model."""
from __future__ import annotations

import os
from collections import defaultdict

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm
from transformers import StopStringCriteria, StoppingCriteriaList

import lynx_hf
from lynx_hf import LynxQuantConfig
# internal: one prefill's (KV, logits), reused by every KV mode (LynxCache.from_prefill runs its own)
from lynx_hf.local import prefill
from lynx_hf.model import EMBEDDED  # internal: the embedded model's name, what lm-eval records
from lynx_hf.errors import ConfigError
from lynx_hf.transfer.decode import DTYPES  # internal: dtype name → torch dtype, as on the wire

from lynx_hf.eval.lib.kv_modes import MODES, continuation_logprobs, mode_config, transferred_cache
from lynx_hf.eval.quality.ruler import OFFLINE



@register_model("lynx")
class LynxLM(HFLM):
    def __init__(self, pretrained: str | None = None, kv: str = "lynx", lynx_config: str | None = None,
                 residual_after: int = 8, bandwidth_mbps: float | None = None, gguf_file: str | None = None,
                 dtype: str = "float32", device: str | None = None, **kwargs):
        if kv not in MODES:
            raise ConfigError(f"lynx: kv must be one of {MODES}, got {kv!r}")
        if dtype not in DTYPES:
            raise ConfigError(f"lynx: dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        self.kv = kv
        self.lynx_config = LynxQuantConfig.from_pretrained(lynx_config) if lynx_config else None
        mode_config(kv, self.lynx_config)  # validates the pair
        self.residual_after = int(residual_after)
        self.bandwidth_bps = float(bandwidth_mbps) * 1e6 if bandwidth_mbps else None
        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            device = "cuda" if torch.cuda.is_available() else "cpu"  # lm-eval's CLI says cuda:0 unless told
        model, tok = lynx_hf.load_default_model(pretrained, dtype=DTYPES[dtype], gguf_file=gguf_file, device=device)
        super().__init__(pretrained=model, tokenizer=tok, **kwargs)
        self._stops: dict = {}

    # -- generate_until ---------------------------------------------------------------------------------------------
    def _stop_criteria(self, stop: list[str]) -> StoppingCriteriaList:
        """Per-row, stateless stop strings (lm-eval's own criterion keeps per-row state, which drafts would taint)."""
        key = tuple(stop)
        if key not in self._stops:
            self._stops[key] = StoppingCriteriaList([StopStringCriteria(self.tokenizer, list(stop))] if stop else [])
        return self._stops[key]

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        kw = dict(generation_kwargs)
        mask = kw.pop("attention_mask", None)
        kw["temperature"] = kw.get("temperature", 0.0)   # lm-eval's convention: 0.0 means greedy
        if kw["temperature"] == 0.0 and kw.get("do_sample") is None:
            kw["do_sample"] = False
        if kw.get("do_sample") is False and kw["temperature"] == 0.0:
            kw.pop("temperature")
        kv, logits = prefill(self.model, context, mask)
        cache = transferred_cache(self.model, kv, logits, context.shape[1], self.kv, self.lynx_config,
                                  residual_after=self.residual_after, bandwidth_bps=self.bandwidth_bps)
        if self.kv == "lynx":
            kw["custom_generate"] = lynx_hf.speculative_generate
        return self.model.generate(input_ids=context, attention_mask=mask, cache=cache, max_length=max_length,
                                   stopping_criteria=self._stop_criteria(stop),
                                   pad_token_id=self.tokenizer.pad_token_id, **kw)

    # -- loglikelihood ------------------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """requests: [((context, continuation) strings or None, context ids, continuation ids)] → [(logprob, greedy)].
        One prefill per distinct context; its continuations are scored together against its KV in the mode."""
        by_context = defaultdict(list)
        for i, (_, ctx, cont) in enumerate(requests):
            if not cont or len(cont) >= self.max_length:
                raise ValueError(f"lynx: a continuation of {len(cont)} tokens cannot be scored within max_length "
                                 f"{self.max_length}")
            ctx = list(ctx)[-(self.max_length - len(cont)):] if len(ctx) + len(cont) > self.max_length else list(ctx)
            by_context[tuple(ctx)].append(i)
        res: list = [None] * len(requests)
        pbar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc=f"loglikelihood (kv={self.kv})")
        for ctx, idx in by_context.items():
            conts = [list(requests[i][2]) for i in idx]
            prefilled = prefill(self.model, torch.tensor([ctx], device=self.device))
            for start in range(0, len(idx), 8):  # at most 8 continuations of one context per forward pass
                part = conts[start: start + 8]
                logps = continuation_logprobs(self.model, list(ctx), part, self.kv, self.lynx_config, prefilled)
                for i, cont, logp in zip(idx[start: start + 8], part, logps):
                    c = torch.tensor(cont, device=logp.device)
                    answer = (float(logp.gather(1, c[:, None]).sum()), bool((logp.argmax(-1) == c).all()))
                    res[i] = answer
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                    pbar.update(1)
        pbar.close()
        return res


TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


def task_manager(include_path=None, **kwargs):
    """An lm-eval TaskManager that also indexes this project's tasks (mmlu_pro_local, mmlu_pro_longctx_*)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=_with_ours(include_path), **kwargs)


def _with_ours(include_path):
    paths = list(include_path) if isinstance(include_path, (list, tuple)) else [include_path] if include_path else []
    return [*paths, TASKS_DIR]


PREFACE = """lynx-hf eval: lm-eval's own CLI, every flag unchanged (`lynx-hf eval run --help` lists them; the ones a
user needs: --model lynx --model_args ... --tasks T1,T2 --limit N --num_fewshot K --batch_size B --output_path DIR
--log_samples --metadata JSON --device cpu|cuda), plus --debug (a traceback instead of a one-line error), and
  --model lynx        the KV-mode model: --model_args kv=MODE[,pretrained=HUB_ID_OR_FOLDER][,lynx_config=DIR]
                      [,residual_after=N][,bandwidth_mbps=X]; MODE is one of {modes}
                      (default: lynx; pretrained defaults to the embedded SmolLM2-135M-Instruct)
  tasks               lm-eval's own (e.g. niah_single_1, mmlu_pro) and this project's: {ours}
                      (`lynx-hf eval ls tasks` lists them all)
"""


def _our_tasks() -> list[str]:
    d = os.path.join(os.path.dirname(__file__), "tasks")
    return sorted(f[:-5] for f in os.listdir(d) if f.endswith(".yaml"))


def _with_tokenizer(argv: list[str]) -> list[str]:
    """Tasks that build their prompts with a tokenizer named in the model args or --metadata (RULER's) get the
    embedded model's, as a folder (the converted GGUF copy), unless --metadata names one."""
    import json

    # internal: the embedded model's tokenizer folder (its converted GGUF copy)
    from lynx_hf.model import DEFAULT_GGUF, converted_gguf, default_model_dir

    i = argv.index("--metadata") + 1 if "--metadata" in argv[:-1] else None
    try:
        meta = json.loads(argv[i]) if i is not None else {}
    except json.JSONDecodeError:
        return argv  # lm-eval reports its own error on it
    if not isinstance(meta, dict) or "tokenizer" in meta:
        return argv
    try:
        meta["tokenizer"] = converted_gguf(default_model_dir(), DEFAULT_GGUF)
    except (OSError, RuntimeError):
        return argv
    meta = json.dumps(meta)
    return argv[:i] + [meta] + argv[i + 1:] if i is not None else argv + ["--metadata", meta]


def cli(argv: list[str]) -> None:
    """`lynx-hf eval ARGS`: lm-eval's own CLI (every flag unchanged) with the `lynx` model registered and this
    project's task folder indexed next to lm-eval's own tasks and any --include_path. Without --device, the device
    that runs (cuda if available, else cpu) is what lm-eval records; for `--model lynx` without `pretrained=`, the
    results carry the embedded model's name (lm-eval names its output folder after it) and tasks that need a
    tokenizer by name (RULER) get the embedded model's tokenizer folder through --metadata."""
    import sys

    if {"-h", "--help"} & set(argv):
        print(PREFACE.format(modes=" | ".join(MODES), ours=", ".join(_our_tasks())))
    tasks = argv[argv.index("--tasks") + 1].split(",") if "--tasks" in argv[:-1] else []
    if tasks == ["list"]:
        raise SystemExit("lynx-hf eval: `--tasks list` is not a task: `lynx-hf eval ls tasks` lists them")
    if any(t.startswith(("mmlu_pro_local", "mmlu_pro_longctx")) for t in tasks):
        from lynx_hf.eval.lib.data import require

        try:
            require("eval --tasks " + ",".join(tasks), needs_mmlu=True)
        except FileNotFoundError as e:
            raise SystemExit(f"error: {e}") from None
    argv = list(argv)
    if argv and argv[0] not in ("ls", "validate") and not {"-h", "--help"} & set(argv):
        if "--device" not in argv:
            argv += ["--device", "cuda" if torch.cuda.is_available() else "cpu"]
        if "--model" in argv and argv[argv.index("--model") + 1:argv.index("--model") + 2] == ["lynx"]:
            i = argv.index("--model_args") + 1 if "--model_args" in argv else None
            margs = argv[i] if i is not None and i < len(argv) else ""
            if not any(f"{k}=" in margs for k in ("pretrained", "model", "path")):
                margs = ",".join(x for x in (margs, f"pretrained={EMBEDDED}") if x)
                argv = argv[:i] + [margs] + argv[i + 1:] if i is not None else argv + ["--model_args", margs]
                argv = _with_tokenizer(argv)

    from lm_eval import __main__ as lm_main
    from lm_eval.tasks import TaskManager

    init = TaskManager.__init__
    if not getattr(init, "_lynx", False):
        def __init__(self, *args, include_path=None, **kwargs):
            init(self, *args, include_path=_with_ours(include_path), **kwargs)

        __init__._lynx = True
        TaskManager.__init__ = __init__
    debug = "--debug" in argv or bool(os.environ.get("LYNX_DEBUG"))
    argv = [a for a in argv if a != "--debug"]
    sys.argv = ["lynx-hf eval", *argv]
    online = [t for t in tasks if t in DOWNLOADS]
    try:
        return lm_main.cli_evaluate()
    except Exception as e:  # noqa: BLE001 — narrowed below: a user's mistake becomes one line, a bug a traceback
        if online and _is_download_error(e):
            raise SystemExit(f"lynx-hf eval: {', '.join(online)} fetch{'es' if len(online) == 1 else ''} data from "
                             f"the internet (RULER's Paul Graham essays, SQuAD or HotpotQA) and the download failed "
                             f"({type(e).__name__}: {str(e)[:160]}). Tasks that build their data offline: "
                             f"{', '.join(OFFLINE)}") from None
        if debug or not _users_mistake(e):
            raise
        raise SystemExit(f"lynx-hf eval: error: {str(e).splitlines()[0] if str(e) else type(e).__name__} "
                         f"(--debug shows the traceback)") from None


def _users_mistake(e: BaseException) -> bool:
    """A bad --model_args value (ConfigError), a model path or file that does not exist, a Hub id not found."""
    from lynx_hf.errors import LynxError

    mod = type(e).__module__ or ""
    return isinstance(e, (LynxError, FileNotFoundError, IsADirectoryError, NotADirectoryError)) or (
        isinstance(e, OSError) and ("does not appear to have" in str(e) or "is not a local folder" in str(e))) or \
        mod.startswith("huggingface_hub")


# RULER tasks whose haystack or questions come from the internet; the others build their data here
DOWNLOADS = {"ruler", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multiquery", "niah_multivalue",
             "ruler_qa_squad", "ruler_qa_hotpot"}


def _is_download_error(e: BaseException) -> bool:
    """Whether e (or what caused it) is a network failure: httpx's, requests', socket's, or the Hub's offline mode."""
    while e is not None:
        mod = type(e).__module__ or ""
        if mod.startswith(("httpx", "httpcore", "requests", "urllib3", "huggingface_hub", "aiohttp")) or \
                isinstance(e, (ConnectionError, TimeoutError)) or "offline" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False
