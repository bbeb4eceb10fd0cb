"""What a user runs beside vLLM: proxy.py (`python -m lynx_hf.vllm.serve.proxy`, or the old name
`python -m lynx_hf.vllm.proxy`: an OpenAI-compatible front for a prefill and a decode `vllm serve`), pd.py (`LynxPD`:
two engines in two processes, one request at a time) and engine.py (one engine in a child process)."""
