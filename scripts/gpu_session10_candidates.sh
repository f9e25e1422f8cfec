#!/usr/bin/env bash
# Session 10's second LayerNorm call (issue 2; carry [".ortgpu", ".ortinc"], start with
# `source .ortgpu/activate.sh &&`): the cells the first call left under ORT's kernel. The kernel alone over
# a launch grid (H=8192 with a residual, 4096 and 65536 rows; H=768 in both layouts at 65536 rows), then
# candidate launch tables (LN_CANDIDATES) in the ORT chains, three sessions a variant: H=768 and 8192 at
# 4096 rows, H=768 at 65536 rows. Results: $OUT/*.json and *.txt.
source "$(dirname "$0")/gpu_env.sh"
sweep() { timeout 150 python3 -m ort_triton.bench.layer_norm_sweep "$@" 2>&1 | grep layout=; }
sweep --rows 4096,65536 --hidden 8192 --modes residual,residual+sum --rows-per-program 1,2,4 --warps 2,4,8,16 \
  --json "$OUT/sweep_8192.json"
sweep --rows 65536 --hidden 768 --rows-per-program 1,2,4 --warps 1,2,4 --json "$OUT/sweep_768.json"
ln_libraries || exit 1
chains() { timeout 200 python3 -m ort_triton.bench.layer_norm "${LN_LIBS[@]}" --instances 3 "$@" 2>&1 |
  grep -v CleanUnusedInitializers; }
chains --rows 4096 --hidden 768,8192 --json "$OUT/chains_4096.json" | tail -45 | tee "$OUT/chains_4096.txt"
chains --rows 65536 --hidden 768 --json "$OUT/chains_65536.json" | tail -25 | tee "$OUT/chains_65536.txt"
