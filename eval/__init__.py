"""Evaluation and benchmarks for lynx-hf. Installed as `lynx_hf.eval`; nothing in the core imports it.

    lib/      the library the rest shares, no command of its own: data (where the shared data lives; the 20
              evaluation prompts), harness (--json output, plots, free ports, the `serve-prefill` child process),
              kv_modes (the KV modes under evaluation and how a prompt's KV reaches the model in each), kvprobe
              (the teacher-forced KV quality probe)
    benches/  speed and memory: the `lynx-hf bench ...` subcommands (bench_*: each registers its own, `register`),
              `lynx-hf demo` (demo), `lynx-hf simulate`, roofline, dist_pair; vLLM's (vllm_bench: `bash bootstrap.sh
              vllm-bench`; vllm_arms: the load generator; vllm_replay and mooncake: a trace's replay; vllm_timeline;
              vllm_servers; vllm_demo: `bash bootstrap.sh vllm-demo`)
    quality/  what the codec does to answers: acceptance, anchor_widths, codec_quality, segment_quality,
              half_precision, ruler, results (the paper's table)
    lmeval/   lm-eval's glue: the `lynx` model of lm-eval and `lynx-hf eval` (lm_eval_model); tasks/, metrics/
    tools/    what a user publishes with: card (`lynx-hf card`, a Hub-ready folder), calibrate (`lynx-hf calibrate`)

Uses lynx_hf's public API — the names in `lynx_hf.__all__` (the `quant` module among them), the exceptions of
`lynx_hf.errors` and `lynx_hf.transfer.decode.DecodeClient` (README) — and, where a measurement needs what the API
hides, internals: each such import says which and why (`# internal: ...`). They are: `lynx_hf.local.prefill`,
`lynx_hf.model` (the embedded model's name and tokenizer), `lynx_hf.hub_folder`, `lynx_hf.quant`'s and
`lynx_hf.kernels`' implementation modules, `lynx_hf.config.AXES`, `lynx_hf.arch`, `lynx_hf.floors`,
`lynx_hf.transfer`'s wire, auth, transport, prefill and server modules and `decode.DTYPES`, the command line's parts
(`lynx_hf.flags`, `lynx_hf.transfer.commands`) and lynx_hf.vllm's."""
