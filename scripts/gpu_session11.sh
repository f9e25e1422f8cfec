#!/usr/bin/env bash
# Session 11's GPU calls (carry [".ortgpu", ".ortinc"], start with `source .ortgpu/activate.sh &&`); STEPS picks
# them (default "tests ab"), each bounded so a call ends inside 10 minutes:
#   tests     every GPU test and every kernel test natively on CUDA (EmbedLayerNorm's first GPU run, and
#             tests/ops/test_numerics.py's NaN/inf cases among them);
#   ab        what EmbedLayerNorm buys end to end: BERT-base fp16 with CUDA graphs, the embeddings fused
#             against unfused (the ablation runtime), in alternating rounds (bench.ab);
#   sanitize  compute-sanitizer memcheck and racecheck over the ORT-level GPU tests, our kernels only;
#   ln        issue 2: candidate launch tables (LN_CANDIDATES, scripts/gpu_env.sh) beside the default in the ORT
#             chains at the cells still behind ORT's kernel, three sessions a variant.
source "$(dirname "$0")/gpu_env.sh"
for step in ${STEPS:-tests ab}; do
  case $step in
  tests)
    timeout "${TEST_TIMEOUT:-280}" python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short \
      ${PYTEST_PATHS:-tests/gpu tests/ops} > "$OUT/gpu_tests.log" 2>&1
    echo "pytest exit $?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
    grep -m1 -B2 -A40 "^_____" "$OUT/gpu_tests.log" ;;
  ab)
    timeout "${AB_TIMEOUT:-220}" python3 -m ort_triton.bench.ab --hf-config bert-base \
      --a ort_triton_unfused_embeddings_cuda_graph --b ort_triton_cuda_graph --shapes "${SHAPES:-1x128,8x128,8x512,32x512}" \
      --rounds "${ROUNDS:-6}" --json "$OUT/ab_embed_layer_norm.json" 2>&1 | filter | tail -20 ;;
  sanitize) SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-270} sanitize "$OUT" ;;
  ln)
    ln_libraries || exit 1
    for rows in 4096 65536; do
      timeout "${LN_TIMEOUT:-150}" python3 -m ort_triton.bench.layer_norm "${LN_LIBS[@]}" --instances 3 --rows $rows \
        --hidden "${LN_HIDDEN:-1024,4096,8192}" --json "$OUT/ln_candidates_$rows.json" 2>&1 |
        grep -v CleanUnusedInitializers | tail -30
    done ;;
  esac
done
