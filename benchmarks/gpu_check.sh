#!/usr/bin/env bash
# One command for a lent GPU machine (< 10 minutes on one H200). The device image already has
# torch, triton, pluggy, safetensors, tokenizers, jinja2 and pytest and cannot fetch packages,
# so dinfer-rt is installed without dependencies. Results go to ${OUT:-benchmarks/results}.
# Status: prepared without a GPU (none was lent to the sessions that wrote it); not yet run.
# It also checks continuous batching on the device (per-row attention windows, engine vs offline)
# and weight-only quantisation (int8 / fp8 dequant GEMMs vs bf16, the precision schedule step cost).
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
# Tensor parallelism over every visible GPU (NCCL) when there is more than one: TP=N greedy output
# must equal TP=1's (the embedded model has 6 heads: N in 2, 3, 6 splits it).
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
for n in 6 3 2; do
    if [ "$gpus" -ge "$n" ]; then
        one=$(python3 -m dinfer_rt generate --backend cuda qwertyuiop)
        many=$(python3 -m dinfer_rt generate --backend cuda --tensor-parallel-size "$n" qwertyuiop)
        [ "$one" = "$many" ] && echo "gpu_check: TP=$n on $gpus GPUs equals TP=1" || echo "gpu_check: TP=$n differs: '$many' vs '$one'"
        break
    fi
done
