"""Evaluation and benchmarks for lynx-hf. Installed as `lynx_hf.eval`; uses only lynx_hf's public API."""
