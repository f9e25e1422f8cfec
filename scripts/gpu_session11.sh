#!/usr/bin/env bash
# Session 11's first call (carry [".ortgpu", ".ortinc"], start with `source .ortgpu/activate.sh &&`), each step
# bounded so the call ends inside 10 minutes:
# 1. every GPU test and every kernel test natively on CUDA (EmbedLayerNorm's first GPU run among them);
# 2. what EmbedLayerNorm buys end to end: BERT-base fp16 with CUDA graphs, the embeddings fused against
#    unfused (the ablation runtime), in alternating rounds (bench.ab).
source "$(dirname "$0")/gpu_env.sh"
timeout "${TEST_TIMEOUT:-280}" python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short -x \
  ${PYTEST_PATHS:-tests/gpu tests/ops} > "$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -8
grep -m1 -B2 -A40 "^_____" "$OUT/gpu_tests.log"
[ "${AB:-1}" = 1 ] || exit 0
timeout "${AB_TIMEOUT:-220}" python3 -m ort_triton.bench.ab --hf-config bert-base \
  --a ort_triton_unfused_embeddings_cuda_graph --b ort_triton_cuda_graph --shapes "${SHAPES:-1x128,8x128,8x512,32x512}" \
  --rounds "${ROUNDS:-6}" --json "$OUT/ab_embed_layer_norm.json" 2>&1 | filter | tail -20
