#!/usr/bin/env bash
# One command for a lent GPU machine (< 10 minutes on one H200). The device image already has
# torch, triton, pluggy, safetensors, tokenizers, jinja2 and pytest and cannot fetch packages,
# so dinfer-rt is installed without dependencies. Results go to ${OUT:-benchmarks/results}.
# Status: prepared without a GPU (none was lent to the session that wrote it); not yet run.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-deps --no-build-isolation -e .
python3 -m pytest -q -p no:cacheprovider tests/test_reference_models.py tests/test_ir.py
python3 benchmarks/gpu_check.py --backend cuda --out "${OUT:-benchmarks/results}"
