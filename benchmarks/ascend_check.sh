#!/usr/bin/env bash
# One command for an Ascend 910B owner: validate, then bench, on the real torch_npu + CANN. First
#   source /usr/local/Ascend/ascend-toolkit/set_env.sh   # CANN, so torch_npu can import
#   ASCEND_RT_VISIBLE_DEVICES=0 bash benchmarks/ascend_check.sh
# The validation compares every mapped torch_npu operator and the model-level results against
# the float64 cpu reference; its report names any operator whose argument conventions differ
# from the documentation the mapping was written from (docs/backends/ascend.md).
# Writes validation.{json,md} and ascend_check.{json,md} to ${OUT:-benchmarks/results/ascend}.
# Status: prepared without an NPU (tested here only against a simulated torch_npu); never run on one.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/ascend}"
mkdir -p "$OUT"
python3 -c "import torch_npu, torch; print('torch', torch.__version__, 'torch_npu', torch_npu.__version__)"
python3 -m pip install -q --no-deps --no-build-isolation -e .
python3 -m dinfer_rt backends
python3 -m dinfer_rt validate --backends ascend --json "$OUT/validation.json" --markdown "$OUT/validation.md"
python3 benchmarks/gpu_check.py --backend ascend --out "$OUT"
