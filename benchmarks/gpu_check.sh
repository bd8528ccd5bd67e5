#!/usr/bin/env bash
# One command for a lent GPU machine (< 10 minutes on one H200). The device image already has
# torch, triton, pluggy, safetensors, tokenizers, jinja2 and pytest and cannot fetch packages,
# so dinfer-rt is installed without dependencies. Results go to ${OUT:-benchmarks/results}.
# The device checks run first (kernels, quantised GEMMs, the LLaDA-8B-shaped step, continuous
# batching, the engine with CUDA graphs per batch-size bucket: warm-up, captures per bucket,
# graphed vs eager tokens and tokens/s, cache policies), then the validation suite, then a
# CPU-side pytest subset on the device's torch build (one section alone: python3
# benchmarks/gpu_check.py --sections engine_graph_buckets --out DIR). Each stage has its own time
# limit and a failing stage does not stop the next: the verdicts are printed at the end and the
# exit status is non-zero if any stage failed.
# Needs pluggy >= 1.5 in the image (hooks are called through pluggy's relay).
# Run on one H200 in session 16 (about two minutes; results in benchmarks/results/h200/).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . || { echo "gpu_check: install failed"; exit 1; }
python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, torch.cuda.get_device_name())'
verdicts=()
stage() {  # stage NAME SECONDS CMD...: run CMD under a time limit, record its verdict, go on
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS rc=0
    timeout "$limit" "$@" || rc=$?
    verdicts+=("$name: rc=$rc in $((SECONDS - t0)) s")
}
stage generate 60 python3 -m dinfer_rt generate --backend cuda qwertyuiop
stage gpu_check "${GPU_CHECK_S:-360}" python3 benchmarks/gpu_check.py --backend cuda --out "$out"
# the cross-hardware validation suite on the device (op conformance incl. padded attention
# variants, fused vs unfused, model-level checks against the float64 `reference` backend)
stage validate "${VALIDATE_S:-100}" python3 -m dinfer_rt validate --backends cuda --quick \
    --markdown "$out/validate-cuda.md"
# the speed/accuracy sweep with dinfer-rt (device graphs) and the Fast-dLLM-style baseline both on
# the GPU (one repeat, 50 items at batch 1: about a minute); the issue-#19 targets computed from it
stage sweep "${SWEEP_S:-240}" python3 benchmarks/sweep.py --backend cuda --graphs --quick --repeats 1 \
    --limit-batch1 50 --out "$out/sweep"
stage pytest "${PYTEST_S:-45}" python3 -m pytest -q -x -p no:cacheprovider tests/test_ir.py tests/test_architecture.py
# Tensor parallelism over every visible GPU (NCCL) when there is more than one: TP=N greedy output
# must equal TP=1's (the embedded model has 6 heads: N in 2, 3, 6 splits it).
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
for n in 6 3 2; do
    if [ "$gpus" -ge "$n" ]; then
        one=$(python3 -m dinfer_rt generate --backend cuda qwertyuiop)
        many=$(python3 -m dinfer_rt generate --backend cuda --tensor-parallel-size "$n" qwertyuiop)
        [ "$one" = "$many" ] && verdicts+=("tp$n: equal") || verdicts+=("tp$n: differs: '$many' vs '$one'")
        break
    fi
done
printf 'gpu_check verdicts:\n'; printf '  %s\n' "${verdicts[@]}"
! printf '%s\n' "${verdicts[@]}" | grep -qv 'rc=0\|equal$'
