"""Speed and memory benchmarks, the HF path's and vLLM's (eval/__init__.py has the map; docs/performance.md,
docs/vllm.md)."""
