#!/usr/bin/env bash
# Session 12's GPU calls (carry [".ortgpu", ".ortinc"], start with `source .ortgpu/activate.sh &&`); STEPS picks
# them (default "tests sweep ln"), each bounded so a call ends inside 10 minutes:
#   tests  the LayerNorm kernel natively on CUDA (the eviction hints and the looping grid among the cases),
#          the ORT-level LayerNorm GPU tests;
#   sweep  issue 2: the kernel alone at the residual modes, each built-in (ROWS, warps) against its variants
#          (EVICT:programs; ops/layer_norm.py launch_variant), 4096 and 65536 rows;
#   ln     issue 2: the variant tables of scripts/ln_variant_tables.py (or LN_CANDIDATES) beside the default
#          library in the ORT chains against ORT's kernels, three sessions a variant.
source "$(dirname "$0")/gpu_env.sh"
for step in ${STEPS:-tests sweep ln}; do
  case $step in
  tests)
    timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short \
      ${PYTEST_PATHS:-tests/ops/test_layer_norm_kernel.py tests/gpu -k "layer_norm or LayerNorm"} > "$OUT/gpu_tests.log" 2>&1
    echo "pytest exit $?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12 ;;
  sweep)
    for h in ${SWEEP_HIDDEN:-768 1024 4096 8192}; do
      timeout "${SWEEP_TIMEOUT:-60}" python3 -m ort_triton.bench.layer_norm_sweep --rows 4096,65536 --hidden $h \
        --modes residual,residual+sum --current \
        --variants "${VARIANTS:-0:0,1:0,0:1056,0:2112,0:4224,1:2112}" --json "$OUT/sweep_variants_$h.json" 2>&1 | filter
    done ;;
  ln)
    LN_CANDIDATES=${LN_CANDIDATES:-$(python3 scripts/ln_variant_tables.py)}
    ln_libraries || exit 1
    for rows in ${LN_ROWS:-4096 65536}; do
      timeout "${LN_TIMEOUT:-150}" python3 -m ort_triton.bench.layer_norm "${LN_LIBS[@]}" --instances 3 --rows $rows \
        --hidden "${LN_HIDDEN:-768,1024,4096,8192}" --json "$OUT/ln_variants_$rows.json" 2>&1 |
        grep -v CleanUnusedInitializers | tail -40
    done ;;
  esac
done
