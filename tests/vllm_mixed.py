"""Run inside .venv-vllm by tests/test_vllm_fixes.py: the mixed-batch repro of vLLM issue #55005. One in-process engine
(speculative decoding through tests/vllm_echo_proposer.py) on the embedded model; 4 greedy prompts alone, then the
same 4 in one batch with 4 sampled requests (temperature 1.0, seeded). Prints one JSON line: whether the installed
expand kernel is broken after the engine started (LYNX_VLLM_EXPAND_FIX=0 leaves it so), each greedy output's
equality with itself alone, the alone run's top-2 logprob gap at a first difference, the draft tokens proposed.
Usage: python tests/vllm_mixed.py MODEL_DIR."""
import json
import os
import sys

os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                  TOKENIZERS_PARALLELISM="false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    from vllm import LLM, SamplingParams

    from lynx_hf.vllm.fixes import expand_kernel_broken

    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=2048, block_size=128,
              disable_log_stats=False,
              speculative_config={"method": "custom_class", "model": "vllm_echo_proposer.EchoProposer",
                                  "num_speculative_tokens": 4})
    base = ("The quick brown fox jumps over the lazy dog. " * 6, "def add(a, b):\n    return a + b\n" * 5,
            "Monday, Tuesday, Wednesday, Thursday, Friday, " * 5, "1, 2, 3, 5, 8, 13, 21, 34, " * 6)
    greedy = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    alone = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0] for p in base]
    sampled = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=24) for i in range(4)]
    outs = llm.generate(list(base) + [f"Story {i}: once upon a time" for i in range(4)], [greedy] * 4 + sampled,
                        use_tqdm=False)
    equal, first, gaps = [], [], []
    for ref, got in zip(alone, outs[:4]):
        a, b = list(ref.token_ids), list(got.outputs[0].token_ids)
        tail = None if len(a) == len(b) else min(len(a), len(b))  # equal up to where one stopped
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), tail)
        equal.append(k is None)
        first.append(k)  # the first differing position (None: equal)
        top = sorted((lp.logprob for lp in ref.logprobs[k].values()), reverse=True) if k is not None and k < len(a) \
            else []
        gaps.append(top[0] - top[1] if len(top) > 1 else (0.0 if k is None else float("inf")))  # the alone run's top-2
    drafted = sum(int(getattr(m, "value", 0)) for m in llm.get_metrics()
                  if m.name == "vllm:spec_decode_num_draft_tokens")
    print(json.dumps({"broken": expand_kernel_broken(), "equal": equal, "first": first, "gap": gaps,
                      "drafted": drafted}), flush=True)


if __name__ == "__main__":
    main()
