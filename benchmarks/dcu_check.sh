#!/usr/bin/env bash
# One command for a Hygon DCU (or AMD Instinct) owner: validate, then bench. Run it in the vendor's
# DTK image (torch, triton from Hygon's channel: upstream ROCm wheels do not work on DCU), e.g.
#   HIP_VISIBLE_DEVICES=0 bash benchmarks/dcu_check.sh            # flavour/arch detected
#   BACKEND=rocm_dcu:hygon:gfx936 bash benchmarks/dcu_check.sh    # or named
# Writes validation.{json,md} and dcu_check.{json,md} to ${OUT:-benchmarks/results/dcu}.
# Status: prepared without a DCU; never run on one.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/dcu}"
BACKEND="${BACKEND:-rocm_dcu}"
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e .
python3 -m dinfer_rt backends
python3 -m dinfer_rt validate --backends "$BACKEND" --json "$OUT/validation.json" --markdown "$OUT/validation.md"
python3 benchmarks/gpu_check.py --backend "$BACKEND" --out "$OUT"
