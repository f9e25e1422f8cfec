#!/usr/bin/env bash
# Session 23's GPU calls (carry [".ortgpu", ".ortinc"], start with `source .ortgpu/activate.sh &&`), for Linear
# (ops/linear.py: a MatMul by a constant weight, a Triton GEMV at one row, cuBLAS beyond). STEPS picks them
# (default "tests ab"), each bounded so a call ends inside 10 minutes:
#   tests  Linear through ORT's CUDA EP from the AOT library (both paths, fp32/fp16/bf16, a CUDA graph), and the
#          GEMV natively (Triton's JIT) against fp32;
#   sweep  the GEMV's configs and cuBLAS on the transposed weight against ORT's layout at Llama-1B's and GPT-2's
#          projection shapes (scripts/gemv_sweep.py; JSONL in $OUT/gemv_sweep.jsonl);
#   ab     MODELS' (default llama-1b) prefill and decode through ORT with CUDA graphs: the default rules (A) against
#          the default rules and `linear` (B), alternating rounds (ort_triton.bench.ab; a cold machine spends
#          ~3 min exporting and fusing first). B/A > 1 is the rule's gain. JSON in $OUT/ab_linear_MODEL.json.
source "$(dirname "$0")/gpu_env.sh"
for step in ${STEPS:-tests ab}; do
  case $step in
  tests)
    TEST_LOG=tests PYTEST_PATHS="tests/ops/test_linear_op.py" TEST_TIMEOUT=${TEST_TIMEOUT:-200} gpu_tests ;;
  sweep)
    timeout "${SWEEP_TIMEOUT:-400}" python3 scripts/gemv_sweep.py --rep 10 --json "$OUT/gemv_sweep.jsonl" 2>&1 |
      grep -E '"kind": "(gemv_best|cublas)"' ;;
  ab)
    for model in ${MODELS:-llama-1b}; do
      timeout "${AB_TIMEOUT:-500}" python3 -m ort_triton.bench.ab --decoder "$model" --a ort_triton_cuda_graph \
        --b ort_triton_linear_cuda_graph --prefill "${PREFILL-1x512}" --decode "${DECODE:-1x1024,16x1024}" \
        --rounds "${ROUNDS:-5}" --iters "${ITERS:-20}" --work build/decoder_work --json "$OUT/ab_linear_$model.json" \
        2>&1 | filter | tail -20
    done ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
