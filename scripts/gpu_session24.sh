#!/usr/bin/env bash
# Session 24's GPU calls (carry [".ortgpu", ".ortinc"]; start with `source .ortgpu/activate.sh &&`). STEPS picks
# them (default "chain"), each bounded so a call ends inside 10 minutes:
#   chain  issue 5: decode-shaped products over chains of distinct weights (scripts/gemv_chain_sweep.py): cuBLAS as
#          ORT runs it, Linear's GEMV, the tl.dot "skinny" candidate, and AddRMSNorm (+ SwiGLU) fused into it
#          against the library's three launches; JSONL in $OUT/gemv_chain_sweep.jsonl.
#   tests  AddRMSNormLinear / AddRMSNormSwiGLU natively (Triton's JIT, the three modes) and through ORT's CUDA EP
#          from the AOT library (fused and steps, fp32/fp16/bf16, CUDA graphs): tests/ops/test_norm_linear_op.py;
#   ab     MODELS' (default llama-1b) prefill and decode through ORT with CUDA graphs: the default rules (A) against
#          the default rules and add_rms_norm_swiglu (B), alternating rounds; B/A > 1 is the rule's gain. JSON in
#          $OUT/ab_norm_swiglu_MODEL.json.
source "$(dirname "$0")/gpu_env.sh"
for step in ${STEPS:-chain}; do
  echo "== $step"
  case $step in
  chain)
    timeout "${CHAIN_TIMEOUT:-560}" python3 scripts/gemv_chain_sweep.py --rep "${REP:-10}" ${CHAIN_ARGS:-} \
      --json "$OUT/gemv_chain_sweep.jsonl" 2>&1 | grep -E '"kind": "(copy|cublas|best|fused_library)"|rror' | tail -70 ;;
  tests)
    TEST_LOG=tests PYTEST_PATHS="tests/ops/test_norm_linear_op.py" TEST_TIMEOUT=${TEST_TIMEOUT:-240} gpu_tests ;;
  ab)
    for model in ${MODELS:-llama-1b}; do
      timeout "${AB_TIMEOUT:-420}" python3 -m ort_triton.bench.ab --decoder "$model" --a ort_triton_cuda_graph \
        --b ort_triton_cuda_graph+add_rms_norm_swiglu --prefill "${PREFILL-1x512}" --decode "${DECODE:-1x1024,16x1024}" \
        --rounds "${ROUNDS:-3}" --iters "${ITERS:-20}" --work build/decoder_work \
        --json "$OUT/ab_norm_swiglu_$model.json" 2>&1 | filter | tail -20
    done ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
