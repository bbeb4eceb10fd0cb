"""Lynx inside vLLM, as plugins: `LynxConnector` (a v1 KV connector: the prefill instance publishes each prompt's KV
through lynx-hf's codec and wire, anchor first; the decode instance fills a shadow request's blocks with the anchor
tier and the real request's with the full tier), `LynxProposer` (a `custom_class` proposer: the shadow's tokens
as the real request's drafts, verified by vLLM's rejection sampler), `LynxPD` (two engines, one request at a time)
and the OpenAI-compatible proxy in front of two `vllm serve` instances (proxy.py). docs/vllm.md has the flow.

Only connector.py and fixes.py (the self-detecting fix of vLLM's CPU expand kernel, upstream #55005) import vLLM;
the rest imports lynx-hf's codec, wire and transfer layers (no Transformers). hooks.py (scheduler side) and
worker.py (worker side) hold the connector's logic as plain data, tested without vLLM."""
