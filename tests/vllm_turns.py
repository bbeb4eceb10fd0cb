"""Run inside .venv-vllm by tests/test_vllm.py: agents' continued turns on one prefill + decode engine pair
(prefix caching on, as `vllm serve` has it). Prints one JSON line (the test asserts). Usage: python
tests/vllm_turns.py MODEL_DIR PORT.

Per method (lynx, int8, kivi4), greedy, fp32: turn 1 sends a prompt A; turn 2 sends A + B (a tool result appended,
the agent's loop). Turn 2's real request hits the decode instance's cached full-tier blocks of A and loads only
from the first block it lacks; then the decode instance's prefix cache is dropped and the same A + B is sent fresh.
The two must be equal token for token, and the continued turn must ship fewer bytes. A sampled continued turn
(Lynx) is served too; and a turn whose prompt carries turn 1's answer (the hit covers tokens the decode engine
computed itself) is served, its agreement with a fresh send reported."""
import inspect
import json
import sys


def main():
    from transformers import AutoTokenizer

    from lynx_hf.vllm.serve.pd import LynxPD

    model, port = sys.argv[1], int(sys.argv[2])
    tok = AutoTokenizer.from_pretrained(model)
    ids = tok("".join(inspect.getsource(m) for m in (json.decoder, json.encoder, inspect))).input_ids
    a, b = ids[:600], ids[600:900]
    out = {}
    with LynxPD(model, bandwidth_mbps=50, port=port, num_speculative_tokens=8, timeout_s=60) as pd:
        for method in ("lynx", "int8", "kivi4"):
            t1 = pd.generate(a, 48, method=method)
            t2 = pd.generate(a + b, 16, method=method)
            cont = pd.generate(a + t1.tokens + b, 16, method=method)  # the answer sent back: blocks R computed
            pd.decode.reset_prefix_cache()
            fresh = pd.generate(a + b, 16, method=method)
            pd.decode.reset_prefix_cache()
            fresh_cont = pd.generate(a + t1.tokens + b, 16, method=method)
            out[method] = {"equal": t2.tokens == fresh.tokens, "continued_bytes": t2.bytes, "fresh_bytes": fresh.bytes,
                           "turn1_bytes": t1.bytes, "accepted": t2.accepted, "n": len(t2.tokens),
                           "answer_hit_bytes": cont.bytes, "answer_hit_fresh_bytes": fresh_cont.bytes,
                           "answer_hit_agree": sum(x == y for x, y in zip(cont.tokens, fresh_cont.tokens))}
            pd.decode.reset_prefix_cache()
        pd.generate(a, 8, method="lynx")
        s = pd.generate(a + b, 16, method="lynx", temperature=0.8, seed=7)
        out["sampled"] = {"n": len(s.tokens), "bytes": s.bytes, "finish": s.finish_reason}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
