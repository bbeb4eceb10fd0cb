"""How often drafted decoding equals plain `generate` in half precision, next to Transformers' own speculative
decoding (prompt lookup), on the embedded model: `python -m lynx_hf.eval.quality.half_precision [--prompts 6]
[--tokens 48]`.

Per dtype (fp32, bf16, fp16) and prompt (Python standard-library source, the demo's text, cut at different places):
greedy `generate` alone; Lynx with drafts (identity codec, residual after 8 draft steps, so the only difference from
plain decoding is that the verify pass scores several positions in one forward pass); Lynx without drafts; and
Transformers' prompt-lookup decoding (`prompt_lookup_num_tokens=10`, which also verifies several positions at once).
Counts the prompts whose tokens equal plain greedy's, and where the first difference is. Ends with one JSON line."""
from __future__ import annotations

import argparse
import sys
import warnings

import torch
from tqdm import tqdm

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig, SpecConfig

from lynx_hf.eval.lib.harness import default_prompt_text, final_line, printer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


QUESTIONS = ("Write a short poem about a lynx.", "What is the capital of France?", "Explain what a KV cache is.",
             "List three prime numbers.", "How do I reverse a list in Python?", "Tell me a fun fact about cats.",
             "What is 17 times 23?", "Summarise the plot of Hamlet.", "Why is the sky blue?",
             "Give me a recipe for pancakes.", "What does HTTP stand for?", "Describe a sunset in one sentence.")


def prompt_ids(tok, prompts: int, prompt_tokens: int, chat: bool) -> list[list[int]]:
    """Chat-template questions, or cuts of Python standard-library source of `prompt_tokens` tokens."""
    if chat:
        return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False) for q in QUESTIONS[:prompts]]
    text = tok(default_prompt_text()).input_ids
    return [text[s:s + prompt_tokens] for s in (i * (len(text) - prompt_tokens) // max(1, prompts)
                                                  for i in range(prompts))]


def run(prompts: int = 6, tokens: int = 48, prompt_tokens: int = 256, as_json: bool = False,
        chat: bool = False) -> dict:
    say = printer(as_json, stderr=True)
    _, tok = lynx_hf.load_default_model(warm=False)
    cuts = prompt_ids(tok, prompts, prompt_tokens, chat)
    res = {"prompts": len(cuts), "tokens": tokens, "prompt_tokens": None if chat else prompt_tokens, "chat": chat,
           "dtypes": {}}
    for name, dtype in DTYPES.items():
        model, _ = lynx_hf.load_default_model(dtype=dtype, warm=False)
        row = {"lynx_drafts": 0, "lynx_no_drafts": 0, "prompt_lookup": 0, "first_diff": []}
        for cut in tqdm(cuts, desc=name, file=sys.stderr, disable=as_json):
            ids, P = torch.tensor([cut]), len(cut)
            kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            plain = model.generate(ids, **kw)[0, P:].tolist()
            got = {}
            for arm, steps in (("lynx_drafts", 64), ("lynx_no_drafts", 0)):
                cache, _ = LynxCache.from_prefill(model, ids, quant_config=LynxQuantConfig(method="identity"),
                                                  residual_after_steps=8)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got[arm] = model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate,
                                              spec_config=SpecConfig(max_draft_steps=steps), **kw)[0, P:].tolist()
            got["prompt_lookup"] = model.generate(ids, prompt_lookup_num_tokens=10, **kw)[0, P:].tolist()
            for arm, out in got.items():
                row[arm] += out == plain
            row["first_diff"].append(first_difference(got["lynx_drafts"], plain))
        res["dtypes"][name] = row
        n = len(cuts)
        say(f"{name}: equal to plain greedy on {row['lynx_drafts']}/{n} prompts with drafts, "
            f"{row['lynx_no_drafts']}/{n} without, prompt lookup {row['prompt_lookup']}/{n}; "
            f"Lynx's first differing token: {row['first_diff']}")
    return final_line(res)


def main(argv=None):
    from lynx_hf.flags import count, tokens  # internal: the one validator of every numeric flag

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=count(1000), default=6)
    p.add_argument("--tokens", type=tokens(hi=4096), default=48, help="tokens generated per prompt")
    p.add_argument("--prompt-tokens", type=tokens(), default=256, help="prompt length")
    p.add_argument("--chat", action="store_true", help="chat-template questions instead of source-code cuts")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    run(a.prompts, a.tokens, a.prompt_tokens, as_json=a.json, chat=a.chat)


if __name__ == "__main__":
    main()
