"""`lynx-hf card`: a Hub-ready folder for a model served with Lynx.

    DIR/README.md                          model card (huggingface_hub ModelCard / ModelCardData; the measured
                                           results of docs/results.json as EvalResults, so the Hub shows them)
    DIR/lynx_config.json                   the codec (LynxQuantConfig.save_pretrained; calibrated or default)
    DIR/results.md                         the results table the card's numbers come from (when there is one)
    DIR/custom_generate/generate.py        Transformers' Hub layout: model.generate(..., custom_generate=DIR_OR_REPO,
    DIR/custom_generate/lynx_*.py          trust_remote_code=True) runs Lynx: the shim, a flat copy of the runtime
    DIR/custom_generate/requirements.txt   (lynx_hf/hub_folder.py) and what it needs from the index (torch,
                                           transformers)

`--push REPO` uploads the folder with huggingface_hub (needs a token and the network)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from lynx_hf import LynxQuantConfig
from lynx_hf.hub_folder import write_custom_generate  # internal: the custom_generate/ folder in the Hub's layout

from lynx_hf.eval.quality.results import LABELS

DEFAULT_BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


DEFAULT_RESULTS = "docs/results.md"


def resolve_results(results: str | None) -> str | None:
    """The results file: as given; the default also beside this checkout's docs/ when run from elsewhere, and none
    (a card without results) when there is no such file."""
    if results != DEFAULT_RESULTS:
        return results or None
    for p in (Path(results), Path(__file__).resolve().parents[2] / results):
        if p.exists():
            return str(p)
    print(f"lynx-hf card: no {DEFAULT_RESULTS} here or in this checkout: the card has no results section "
          "(write them with `lynx-hf results`, pass --results FILE)")
    return None


def _results_json(results: str | None) -> dict | None:
    if not results:
        return None
    p = Path(results)
    p = p.with_suffix(".json") if p.suffix == ".md" else p
    if not p.exists():
        raise FileNotFoundError(f"{p}: no results (write them with `lynx-hf results`)")
    return json.loads(p.read_text())


def eval_results(report: dict | None) -> list:
    from huggingface_hub import EvalResult

    out = []
    for n_ctx, c in (report or {}).get("contexts", {}).items():
        for mode, r in c["rows"].items():
            # huggingface_hub groups results into model-index tasks by (task type, dataset type, config, split,
            # revision): the context length goes into the config, so that each length is a task of its own
            out.append(EvalResult(task_type="multiple-choice", task_name=f"MMLU-Pro, many-shot {n_ctx}-token context",
                                  dataset_type="TIGER-Lab/MMLU-Pro", dataset_name="MMLU-Pro",
                                  dataset_config=f"default, many-shot {n_ctx}-token context", dataset_split="test",
                                  dataset_args={"config": "default", "context_tokens": int(n_ctx)},
                                  metric_type="accuracy", metric_name=f"accuracy, KV {LABELS.get(mode, mode)}",
                                  metric_value=round(r["accuracy"], 4)))
    return out


def _body(base: str, cfg: LynxQuantConfig, report: dict | None, results_md: str | None) -> str:
    lines = [f"# {base} with Lynx KV transfer", "",
             "Lynx quantizes the KV cache a prefill node ships to a decode node into an 8-bit code split into a 4-bit "
             "anchor (sent first) and a 4-bit residual. The decode node drafts on the anchor while the residual "
             "streams in; one verification pass on the full KV keeps the output exactly that of full-tier decoding. "
             "Over a link the prefill node's last logits leave ahead of the KV, so the first token is the prefill's "
             "for every KV method alike; what Lynx moves is when decoding starts (its first draft needs only the "
             "anchor) and the time to the tokens after it.",
             "", "## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
             f'model = AutoModelForCausalLM.from_pretrained("{base}")',
             f'tok = AutoTokenizer.from_pretrained("{base}")',
             'ids = tok("The capital of France is", return_tensors="pt").input_ids',
             'out = model.generate(ids, custom_generate="THIS_REPO", trust_remote_code=True, max_new_tokens=32)',
             "```", "", "`custom_generate/` carries the Lynx runtime (the `lynx_*.py` files beside `generate.py`); "
             "it needs only `torch` and `transformers` (`custom_generate/requirements.txt`). Without a `cache=`, "
             "`generate` prefills locally, quantizes the prompt's KV with the settings below, drafts on the 4-bit "
             "anchor and lets the residual land after `residual_after_steps` draft steps (a stand-in for the "
             "transfer), then verifies: the output equals plain greedy or sampled `generate` on the full tier.", "",
             "What this `generate` adds to Transformers' arguments:", "",
             "- `cache=`: a `LynxCache` holding a prompt's KV transferred from a prefill node (built with the "
             "lynx-hf package: `LynxCache.from_prefill` or a network loader), decoded instead of a local prefill; or "
             "the previous turn's cache (`return_dict_in_generate=True` returns it as `.cache`) with the whole "
             "conversation's ids: only the new tokens run, as with Transformers' own caches;",
             "- `residual_after_steps=N`: when the residual lands in the local stand-in (default "
             "`RESIDUAL_AFTER_STEPS` in `generate.py`);",
             "- `streamer=` / `lynx_streamer=`: any Transformers streamer gets the verified tokens; one with "
             "`put_provisional` / `resolve_provisional` also sees the drafts and their retraction.", "",
             "It takes what Transformers' `generate` takes (logits processors and `prefix_allowed_tokens_fn`, "
             "stopping criteria, `stop_strings` with `tokenizer=`, images as `pixel_values=` for models whose "
             "positions do not depend on them) and refuses, with a `ValueError` naming the way out, what it cannot "
             "equal: beam search (`num_beams` > 1), `assistant_model` / prompt lookup, contrastive search, DoLa, "
             "token healing, encoder-decoder models, M-RoPE models (Qwen2-VL) with an image.", "",
             "The codec settings are in `lynx_config.json`:", "", "```json",
             json.dumps(cfg.to_dict(), indent=1), "```", ""]
    if report:
        lines += ["## Results", "", "Accuracy by KV mode on MMLU-Pro many-shot prompts (`lynx-hf results`"
                  + (", full table in results.md" if results_md else "") + "):", "",
                  "| context | " + " | ".join(LABELS[m] for m in LABELS) + " | Lynx = full tier |",
                  "|---|" + "---:|" * (len(LABELS) + 1)]
        for n_ctx, c in report["contexts"].items():
            lines.append(f"| {n_ctx} | " + " | ".join(f"{100 * c['rows'][m]['accuracy']:.1f} %" for m in LABELS)
                         + f" | {c['lynx_equals_full']}/{c['n']} |")
        lines += ["", f"Model evaluated: {report['model']}."]
    return "\n".join(lines) + "\n"


def run(model_name: str | None = None, out: str = "card", results: str | None = None,
        lynx_config: str | None = None, residual_after: int = 8, push: str | None = None) -> str:
    from huggingface_hub import ModelCard, ModelCardData

    base = model_name or DEFAULT_BASE
    cfg = LynxQuantConfig.from_pretrained(lynx_config) if lynx_config else LynxQuantConfig()
    results = resolve_results(results)
    report = _results_json(results)
    data = ModelCardData(base_model=base, library_name="transformers", license="apache-2.0",
                         tags=["custom_generate", "lynx", "kv-cache-quantization", "speculative-decoding",
                               "disaggregated-serving"],
                         model_name=f"{base.split('/')[-1]}-lynx", eval_results=eval_results(report) or None)
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{_body(base, cfg, report, results)}")
    Path(out).mkdir(parents=True, exist_ok=True)
    card.save(str(Path(out) / "README.md"))
    local = _cfg_file(lynx_config) if lynx_config else None  # a calibration's measurements travel with it
    calibration = json.loads(local.read_text()).get("calibration") if local else None
    cfg.save_pretrained(out, calibration)
    if results:
        md = Path(results).with_suffix(".md")
        if md.exists():
            shutil.copyfile(md, Path(out) / "results.md")
    write_custom_generate(out, cfg, residual_after)
    if push:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(push, exist_ok=True)
        api.upload_folder(repo_id=push, folder_path=out, commit_message="Lynx model card and custom_generate")
    print(f"wrote {out}/README.md, lynx_config.json, {'results.md, ' if results else ''}custom_generate/"
          + (f"; pushed to {push}" if push else ""))
    return out


def _cfg_file(name: str) -> Path | None:
    p = Path(name)
    p = p / "lynx_config.json" if p.is_dir() else p
    return p if p.is_file() else None
