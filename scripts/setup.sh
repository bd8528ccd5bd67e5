#!/usr/bin/env bash
# Create .venv and install dinfer-rt (editable) with the `serve` extra. `--test` adds the test tools.
# torch is installed first, pinned to the CPU build on this machine's disk, so that no
# other requirement pulls a multi-GB CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
.venv/bin/python -c 'import torch' 2>/dev/null || pip install "torch==${DINFER_TORCH_VERSION:-2.13.0}"
extras="[serve]"
[ "${1:-}" = "--test" ] && extras="[serve,test]"
pip install -e ".${extras}"
.venv/bin/python -c 'import dinfer_rt' || { echo "setup: dinfer_rt failed to install" >&2; exit 1; }
