#!/usr/bin/env bash
# The whole GPU check in one device call: build the library for sm_90, run the GPU tests (and the kernel
# tests, natively on CUDA), then the attention and LayerNorm benchmarks. Results under $OUT.
#
#   ../shared/device/ort-gpu-bundle                 # once, here: writes .ortgpu/
#   mkdir -p .ortinc && cp "$ORT_INCLUDE_DIR"/*.h .ortinc/   # or: ./dev build (fetches into .cache)
#   device run, carry [".ortgpu", ".ortinc"]:  source .ortgpu/activate.sh && bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ort_triton_out}
mkdir -p "$OUT" build
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export ORT_TRITON_CACHE=/tmp/ort_triton_cache ORT_INCLUDE_DIR=${ORT_INCLUDE_DIR:-$PWD/.ortinc}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -m ort_triton build --arch 90 -o build/lib 2>&1 | tail -3 | tee "$OUT/build.log" || exit 1
export ORT_TRITON_LIBRARY=$PWD/build/lib/libort_triton.so
python3 -m ort_triton doctor 2>&1 | tee "$OUT/doctor.txt"
python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short tests/gpu tests/ops ${PYTEST_ARGS:-} \
  > "$OUT/gpu_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -15
grep -m1 -B2 -A30 "^_____" "$OUT/gpu_tests.log"   # the first failure, whole
python3 -m ort_triton.bench.attention --json "$OUT/attention_bench.json" 2>&1 | tee "$OUT/attention_bench.txt"
python3 -m ort_triton.bench.layer_norm --library "$ORT_TRITON_LIBRARY" --json "$OUT/layer_norm_bench.json" \
  ${BENCH_ARGS:-} 2>&1 | tee "$OUT/layer_norm_bench.txt"
