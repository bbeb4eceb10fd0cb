"""`python -m lynx_hf.vllm.proxy`: the name the proxy was published under, kept for those who type it; the proxy
lives in lynx_hf.vllm.serve.proxy."""
from .serve.proxy import Proxy, app, main  # noqa: F401 — the names it had here

if __name__ == "__main__":
    main()
