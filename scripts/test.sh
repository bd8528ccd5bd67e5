#!/usr/bin/env bash
# Set up (if needed) and run lint, format check and the whole test suite: what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
