#!/usr/bin/env bash
# Session 10's LayerNorm call (issue 2; carry [".ortgpu", ".ortinc"], start with `source .ortgpu/activate.sh &&`):
# the kernel alone in both layouts of the THIRDS sizes (three full blocks against one power-of-two block
# with the tail masked) over a small launch grid, then scripts/gpu_check.sh with the LayerNorm GPU tests
# and the ORT chains, ours (default table and LN_CANDIDATES) against ORT's kernels at the issue's shapes
# plus 1536 and 3072. Results: $OUT/layer_norm_sweep.json and $OUT/gpu_check.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ort_triton_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ "${SWEEP:-1}" = 1 ]; then
  timeout 200 python3 -m ort_triton.bench.layer_norm_sweep --rows "${SWEEP_ROWS:-4096}" --hidden "${SWEEP_HIDDEN:-768,1536,3072}" \
    --rows-per-program 1,2,4 --warps 1,2,4,8 --json "$OUT/layer_norm_sweep.json" 2>&1 | grep layout=
fi
PYTEST_PATHS=${PYTEST_PATHS:-"tests/gpu/test_layer_norm_ort.py tests/ops/test_layer_norm_kernel.py tests/native"} \
  ATTENTION_BENCH=0 BENCH_TIMEOUT=${BENCH_TIMEOUT:-240} BENCH_ARGS=${BENCH_ARGS:-"--hidden 768,1024,1536,3072,4096,8192"} \
  bash scripts/gpu_check.sh
