"""Run inside .venv-vllm by tests/test_vllm.py: vLLM's own benchmark client (`vllm.benchmarks.serve`, as `vllm bench
serve` runs it) against the proxy in front of two `vllm serve` running LynxConnector, as an operator would try it.
Prints one JSON line: per arm (lynx with two shadows, int8) the client's completed requests, total output tokens and
each request's generated text's length in tokens. Usage: python tests/vllm_bench_client.py MODEL_DIR BASE_PORT
(LYNX_BC_N prompts, 4 by default, at LYNX_BC_RATE requests/s, 1 by default: issue 64 item 7 tried 16 at 0.2)."""
import json
import os
import secrets
import subprocess
import sys
import tempfile

from lynx_hf.eval.benches.vllm_servers import serve, speculative, stop, wait_up

N, OUT, RATE = int(os.environ.get("LYNX_BC_N", 4)), 32, os.environ.get("LYNX_BC_RATE", "1")


def run_client(model: str, port: int, result_dir: str) -> dict:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ap = FlexibleArgumentParser()
    add_cli_args(ap)
    args = ap.parse_args(["--backend", "openai", "--endpoint", "/v1/completions", "--base-url",
                          f"http://127.0.0.1:{port}", "--model", model, "--tokenizer", model, "--dataset-name",
                          "random", "--random-input-len", "512", "--random-output-len", str(OUT), "--num-prompts",
                          str(N), "--request-rate", RATE, "--ignore-eos", "--save-result", "--save-detailed",
                          "--result-dir", result_dir, "--result-filename", f"p{port}.json", "--seed", "3",
                          "--disable-tqdm"])
    main(args)
    with open(os.path.join(result_dir, f"p{port}.json")) as f:
        return json.load(f)


def main_():
    from transformers import AutoTokenizer

    model, base = sys.argv[1], int(sys.argv[2])
    tok = AutoTokenizer.from_pretrained(model)
    P, D, KV, A, B = (base + i for i in range(5))
    secret, log = secrets.token_hex(16), open(os.environ.get("LYNX_SERVE_LOG", os.devnull), "w")
    procs = [serve(model, P, KV, "kv_producer", secret, log),
             serve(model, D, KV, "kv_consumer", secret, log, speculative(8))]
    proxy = lambda port, method, shadows: subprocess.Popen(  # noqa: E731
        [sys.executable, "-m", "lynx_hf.vllm.serve.proxy", "--prefill", f"http://127.0.0.1:{P}", "--decode",
         f"http://127.0.0.1:{D}", "--kv-port", str(KV), "--port", str(port), "--method", method,
         "--shadows", str(shadows)], stdout=log, stderr=subprocess.STDOUT)
    proxies = [proxy(A, "lynx", 2), proxy(B, "int8", 0)]
    out = {}
    try:
        for port in (P, D, A, B):
            wait_up(f"http://127.0.0.1:{port}/health", procs + proxies)
        with tempfile.TemporaryDirectory() as d:
            for name, port in (("lynx", A), ("int8", B)):
                r = run_client(model, port, d)
                out[name] = {"completed": r["completed"], "total_output_tokens": r["total_output_tokens"],
                             "output_lens": r["output_lens"],
                             "text_tokens": [len(tok(t, add_special_tokens=False).input_ids)
                                             for t in r["generated_texts"]], "errors": [e for e in r["errors"] if e]}
    finally:
        stop(proxies + procs)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main_()
