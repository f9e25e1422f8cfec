#!/usr/bin/env bash
# Session 25's GPU calls (carry [".ortgpu", ".ortinc"]; start with `source .ortgpu/activate.sh &&`). STEPS picks
# them (default "tests ab"), each bounded so a call ends inside 10 minutes:
#   tests    AddRMSNormLinear / AddRMSNormSwiGLU natively (the three modes) and through ORT's CUDA EP from the AOT
#            library (fused and steps, fp32/fp16/bf16, CUDA graphs), Linear, and a chain of PDL kernels:
#            tests/gpu/test_pdl_chain.py, tests/ops/test_linear_op.py, tests/ops/test_norm_linear_op.py (PYTEST_PATHS).
#   ab       MODELS' (default llama-1b) prefill and decode through ORT with CUDA graphs, A (default
#            ort_triton_cuda_graph) against B (default A+add_rms_norm_swiglu: rules off by default put in as +RULE),
#            alternating rounds; B/A > 1 is B's gain. JSON in $OUT/ab_${TAG:-b}_MODEL.json.
#   decoder  bench.decoder over RUNTIMES (default A, A+add_rms_norm_swiglu, that +linear) side by side, PREFILL /
#            DECODE shapes, once per ORT_TRITON_PDL in PDLS (default "1 0": programmatic dependent launch opted into, not):
#            $OUT/decoder_MODEL_pdlP.json.
#   profile  where a Llama-1B decode step's GPU time goes, kernel by kernel (CUPTI), for PROFILE_RUNTIMES (default
#            A and B above): $OUT/profile_llama-1b_decode.json and the top kernels printed.
source "$(dirname "$0")/gpu_env.sh"
A=${A:-ort_triton_cuda_graph}
B=${B:-$A+add_rms_norm_swiglu}
for step in ${STEPS:-tests ab}; do
  echo "== $step"
  case $step in
  tests)
    TEST_LOG=tests PYTEST_PATHS=${PYTEST_PATHS:-"tests/gpu/test_pdl_chain.py tests/ops/test_linear_op.py tests/ops/test_norm_linear_op.py"} \
      TEST_TIMEOUT=${TEST_TIMEOUT:-240} gpu_tests ;;
  ab)
    for model in ${MODELS:-llama-1b}; do
      timeout "${AB_TIMEOUT:-420}" python3 -m ort_triton.bench.ab --decoder "$model" --a "$A" --b "$B" \
        --prefill "${PREFILL-1x512}" --decode "${DECODE:-1x1024,16x1024}" --rounds "${ROUNDS:-3}" \
        --iters "${ITERS:-20}" --work build/decoder_work --json "$OUT/ab_${TAG:-b}_$model.json" 2>&1 | filter | tail -20
    done ;;
  decoder)
    for pdl in ${PDLS:-1 0}; do
      echo "-- ORT_TRITON_PDL=$pdl"
      ORT_TRITON_PDL=$pdl timeout "${DECODER_TIMEOUT:-300}" python3 -m ort_triton.bench.decoder --model "${MODEL:-llama-1b}" \
        --prefill "${PREFILL-1x512}" --decode "${DECODE:-1x1024,16x1024}" \
        --runtimes "${RUNTIMES:-$A,$A+add_rms_norm_swiglu,$A+add_rms_norm_swiglu+linear}" --iters "${ITERS:-30}" \
        --work build/decoder_work --json "$OUT/decoder_${MODEL:-llama-1b}_pdl$pdl.json" 2>&1 | filter | grep -E "p50|rror|skipped" | tail -12
    done ;;
  profile)
    timeout "${PROFILE_TIMEOUT:-200}" python3 -m ort_triton.bench.decoder --model llama-1b --prefill '' \
      --decode "${PROFILE_DECODE:-1x1024}" --runtimes "${PROFILE_RUNTIMES:-$A,$B}" --iters 20 \
      --work build/decoder_work --profile --json "$OUT/profile_llama-1b_decode.json" 2>&1 | filter | tail -8
    python3 - "$OUT/profile_llama-1b_decode.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    p = r.get("gpu_profile")
    if not p:
        continue
    print(r["runtime"], f"{r['batch']}x{r['past']}", f"p50 {r['p50_ms']:.3f} ms,",
          f"{p['total_us']:.0f} us GPU in {p['kernels_per_inference']:.0f} kernels")
    for t in p["top"][:16]:
        print(f"  {t['us']:8.1f}  {t['kernel'][:100]}")
PY
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
