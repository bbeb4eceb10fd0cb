"""Lynx inside vLLM, as plugins vLLM imports: `LynxConnector` (connector.py, a v1 KV connector: the prefill instance
publishes each prompt's KV through lynx-hf's codec and wire, anchor first; the decode instance fills a shadow
request's blocks with the anchor tier and the real request's with the full tier) and `LynxProposer` (proposer.py, a
`custom_class` proposer: the shadow's tokens as the real request's drafts, verified by vLLM's rejection sampler).
docs/vllm.md has the flow.

The connector's two halves, as vLLM splits them: scheduler.py (the scheduler side: admission under KV pressure,
preemption, which shadows run, priced by pricing.py) and worker.py (the worker side: loads, saves, placement into
the paged layouts of paged.py), both plain data tested without vLLM; stream.py carries the KV between instances.
Only connector.py and fixes.py (the self-detecting fix of vLLM's CPU expand kernel, upstream #55005) import vLLM;
nothing here imports Transformers.

What a user runs beside vLLM lives in serve/ (the OpenAI-compatible proxy, `LynxPD`: two engines, one request at a
time); the benchmarks that drive it live in lynx_hf.eval.benches (vllm_*)."""
