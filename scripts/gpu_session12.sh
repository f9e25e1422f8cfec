#!/usr/bin/env bash
# Session 12's GPU calls (carry [".ortgpu", ".ortinc"], start with `source .ortgpu/activate.sh &&`); STEPS picks
# them (default "tests sweep ln"), each bounded so a call ends inside 10 minutes:
#   tests  the LayerNorm kernel natively on CUDA (the eviction hints among the cases), the ORT-level
#          LayerNorm GPU tests;
#   sweep  issue 2: the kernel alone at the residual modes, each built-in (ROWS, warps) with and without the
#          eviction hints (EVICT, ops/layer_norm.py launch_evict), 4096 and 65536 rows;
#   ln     issue 2: the default library in the ORT chains against ORT's kernels, LN_INSTANCES sessions a
#          variant (default 3), beside the candidate tables of LN_CANDIDATES (default: `noevict`, the table
#          without the eviction hints at 4096 x 4096). The first call of the session ran the variant tables
#          of commit b2f68ba's scripts/ln_variant_tables.py (evict, loop, both) here.
source "$(dirname "$0")/gpu_env.sh"
for step in ${STEPS:-tests sweep ln}; do
  case $step in
  tests)
    gpu_tests ;;
  sweep)
    for h in ${SWEEP_HIDDEN:-768 1024 4096 8192}; do
      timeout "${SWEEP_TIMEOUT:-60}" python3 -m ort_triton.bench.layer_norm_sweep --rows 4096,65536 --hidden $h \
        --modes residual,residual+sum --current \
        --evict 0,1 --json "$OUT/sweep_variants_$h.json" 2>&1 | filter
    done ;;
  ln)
    noevict='noevict={"4096":{"few:residual":[2,16,0]}}'
    LN_CANDIDATES=${LN_CANDIDATES-$noevict}
    ln_chains 768,1024,4096,8192 || exit 1 ;;
  esac
done
