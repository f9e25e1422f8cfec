#!/usr/bin/env bash
# Session 26's GPU calls (carry [".ortgpu", ".ortinc"]; start with `source .ortgpu/activate.sh &&`). STEPS picks
# them (default "tests qwen3 gemma"), each bounded so a call ends inside 10 minutes:
#   tests   session 25's kernels (PDL chain, Linear, AddRMSNorm(+Linear/SwiGLU)), QKVRotaryCache with
#           QKVNormRotaryCache, and BiasGelu[Tanh]Mul, through ORT's CUDA EP (PYTEST_PATHS).
#   qwen3   Qwen3-0.6B's shape (decoders.CONFIGS "qwen3-0.6b"): the default rules against the same with
#           qkv_norm_rotary_cache (each layer's Split, head norms, rotaries, V's Transpose and cache Concats as one
#           QKVNormRotaryCache), alternating rounds (bench.ab); B/A > 1 is what the fusion buys.
#           JSON in $OUT/ab_qwen3-0.6b_qkv_norm_rotary_cache.json.
#   gemma   Gemma-2B's shape ("gemma-2b"): the default rules against the same with gelu_mul (GeGLU's product in the
#           activation's pass). JSON in $OUT/ab_gemma-2b_gelu_mul.json.
#   decoder, ab, profile: scripts/gpu_session25.sh's steps, run with the same environment.
source "$(dirname "$0")/gpu_env.sh"
for step in ${STEPS:-tests qwen3 gemma}; do
  echo "== $step"
  case $step in
  tests)
    TEST_LOG=tests PYTEST_PATHS=${PYTEST_PATHS:-"tests/gpu/test_pdl_chain.py tests/ops/test_linear_op.py \
tests/ops/test_norm_linear_op.py tests/ops/test_qkv_rotary_cache_kernel.py tests/ops/test_bias_gelu_kernel.py"} \
      TEST_TIMEOUT=${TEST_TIMEOUT:-300} gpu_tests ;;
  qwen3 | gemma)
    if [ $step = qwen3 ]; then model=qwen3-0.6b rule=qkv_norm_rotary_cache; else model=gemma-2b rule=gelu_mul; fi
    timeout "${AB_TIMEOUT:-280}" python3 -m ort_triton.bench.ab --decoder $model --a ort_triton_cuda_graph \
      --b ort_triton_cuda_graph+$rule --prefill "${PREFILL-1x512}" --decode "${DECODE:-1x1024,16x1024}" \
      --rounds "${ROUNDS:-3}" --iters "${ITERS:-20}" --work build/decoder_work --json "$OUT/ab_${model}_$rule.json" \
      2>&1 | filter | tail -12 ;;
  decoder | ab | profile) STEPS=$step bash "$(dirname "$0")/gpu_session25.sh" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
