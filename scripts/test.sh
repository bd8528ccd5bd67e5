#!/usr/bin/env bash
# Set up (if needed) and run what CI runs: lint, format check, the quick validation suite on
# every backend available here (cpu, cuda with its Triton kernels in the interpreter, and the
# out-of-tree ONNX Runtime plugin), then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pip install -q --no-deps --force-reinstall --no-build-isolation ./examples/onnxruntime_backend 2>&1 \
    | grep -v '^WARNING: Location' || true
DINFER_INTERPRET=1 .venv/bin/dinfer-rt validate --backends all --quick --markdown "${TMPDIR:-/tmp}/dinfer-validate.md"
.venv/bin/python -m pytest "$@"
