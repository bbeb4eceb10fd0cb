"""Evaluation and benchmarks for lynx-hf. Installed as `lynx_hf.eval`.

Library modules (no command of their own; the scripts and tests import them):
    harness        output (--json), plots, free ports, the `serve-prefill` child process and its client
    data           where the shared evaluation data lives; the 20 evaluation prompts
    kv_modes       the KV modes under evaluation and how a prompt's KV reaches the model in each
    kvprobe        teacher-forced KV quality probe
    lm_eval_model  the `lynx` model of lm-eval and `lynx-hf eval`; tasks/, metrics/: lm-eval's task and metric folders
Scripts (a `lynx-hf` subcommand or `python -m lynx_hf.eval.NAME`): bench_codec, bench_exact, bench_kernels,
bench_transfer, bench_session, bench_startup, bench_server_memory (each registers its `lynx-hf bench` subcommand:
`register`), acceptance, calibrate, card, codec_quality, demo, results, ruler, simulate, half_precision, roofline,
dist_pair.

Uses lynx_hf's public API — the names in `lynx_hf.__all__` (the `quant` module among them), the exceptions of
`lynx_hf.errors` and `lynx_hf.transfer.decode.DecodeClient` (README) — and, where a measurement needs what the API
hides, internals: each such import says which and why (`# internal: ...`). They are: `lynx_hf.local.prefill`,
`lynx_hf.model` (the embedded model's name and tokenizer), `lynx_hf.hub_folder`, `lynx_hf.quant`'s and
`lynx_hf.kernels`' implementation modules, `lynx_hf.config.AXES`, `lynx_hf.arch`, `lynx_hf.transfer`'s wire, auth,
transport, prefill and server modules and `decode.DTYPES`, and the command line's parts
(`lynx_hf.flags`, `lynx_hf.transfer.commands`)."""
