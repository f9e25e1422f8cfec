#!/usr/bin/env bash
# Session 29's GPU calls (carry [".ortgpu", ".ortinc"]; start with `source .ortgpu/activate.sh &&`). STEPS picks
# them (default "rotary_tests rotary_ab"), each bounded so a call ends inside 10 minutes:
#   rotary_tests  Rotary, TransposeRotary, QKVRotaryCache, QKVNormRotaryCache and QKVCache natively on CUDA and
#           through ORT's CUDA EP, after the half-split specs (kernels/rotary.py rope_halves) and the selected
#           (not branched) output rows of qkv_heads_cache. Log: $OUT/rotary_tests.log.
#   rotary_ab  The library before those kernel changes (A: OLD_SRC's, on the tuned-library slot) against this
#           tree's (B), both ort_triton with CUDA graphs in one process (gpu_decoders.sh's lib_ab),
#           alternating rounds: Llama-1B (QKVRotaryCache) and Qwen3-0.6B (QKVNormRotaryCache) at prefill 1x512 and
#           8x512 and decode 1x1024. OLD_SRC (default .old_src): a directory holding the old ort_triton package,
#           e.g. `mkdir -p .old_src && git archive 202af8a ort_triton | tar -x -C .old_src`, which travels to the
#           device as an untracked path. JSON in $OUT/ab_rotary_MODEL.json.
#   rotary_micro  scripts/rotary_micro.py: QKVRotaryCache and QKVNormRotaryCache compiled as the library's specs are,
#           rope_rows against rope_halves at three tiles, Llama-1B and Qwen3-0.6B shapes. $OUT/rotary_micro.jsonl.
#   swiglu  scripts/gpu_session27.sh's tests and ab of add_rms_norm_swiglu (its steps spec declares K % 16).
source "$(dirname "$0")/gpu_env.sh"
for step in ${STEPS:-rotary_tests rotary_ab}; do
  echo "== $step"
  case $step in
  rotary_tests)
    TEST_LOG=rotary_tests TEST_TIMEOUT=${TEST_TIMEOUT:-150} PYTEST_PATHS="tests/ops/test_rotary_kernel.py
      tests/ops/test_qkv_rotary_cache_kernel.py tests/ops/test_qkv_cache_kernel.py" gpu_tests ;;
  rotary_ab)  # gpu_decoders.sh's lib_ab (A: OLD_SRC's library on the tuned-library slot, B: this tree's), per model
    for model in ${MODELS:-llama-1b qwen3-0.6b}; do
      OLD_SRC=${OLD_SRC:-.old_src} AB_MODEL=$model AB_PREFILL=${PREFILL-1x512,8x512} AB_DECODE=${DECODE-1x1024} \
        AB_TIMEOUT=${AB_TIMEOUT:-240} AB_JSON=ab_rotary_$model STEPS=lib_ab bash "$(dirname "$0")/gpu_decoders.sh"
    done ;;
  rotary_micro)
    timeout "${MICRO_TIMEOUT:-150}" python3 scripts/rotary_micro.py --ceiling-gbs "${CEILING_GBS:-3000}" \
      --json "$OUT/rotary_micro.jsonl" 2>&1 | filter | tail -40 ;;
  swiglu)
    STEPS="tests ab" PYTEST_PATHS="tests/ops/test_norm_linear_op.py" TEST_TIMEOUT=${SWIGLU_TEST_TIMEOUT:-90} \
      DECODE=1x1024 bash "$(dirname "$0")/gpu_session27.sh" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
