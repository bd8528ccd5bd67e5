#!/usr/bin/env bash
# One command for a lent GPU machine (< 10 minutes on one H200). The device image already has
# torch, triton, pluggy, safetensors, tokenizers, jinja2 and pytest and cannot fetch packages,
# so dinfer-rt is installed without dependencies. Results go to ${OUT:-benchmarks/results}.
# Status: prepared without a GPU (none was lent to the sessions that wrote it); not yet run.
# It also checks continuous batching on the device (per-row attention windows, engine vs offline).
# Needs pluggy >= 1.5 in the image (hooks are called through pluggy's relay).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-deps --no-build-isolation -e .
out="${OUT:-benchmarks/results}"
python3 -m pytest -q -p no:cacheprovider tests/test_reference_models.py tests/test_ir.py tests/test_architecture.py
# the cross-hardware validation suite on the device (op conformance incl. padded attention
# variants, fused vs unfused, model-level checks against the float64 cpu reference); a failed
# verdict is reported in the file and does not stop the timings below
python3 -m dinfer_rt validate --backends cuda --quick --json "$out/validate-cuda.json" \
    --markdown "$out/validate-cuda.md" || echo "gpu_check: validate verdict: fail (see $out/validate-cuda.md)"
python3 benchmarks/gpu_check.py --backend cuda --out "$out"
