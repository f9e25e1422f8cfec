#!/usr/bin/env bash
# Session 13's GPU calls (carry [".ortgpu", ".ortinc", and the LN_SOURCES dirs], start with
# `source .ortgpu/activate.sh &&`); STEPS picks them (default "tests ln gemv"), each bounded so a call ends
# inside 10 minutes:
#   tests     the LayerNorm kernel natively on CUDA and the ORT-level LayerNorm GPU tests;
#   ln        issue 2: the default library in the ORT chains against ORT's kernels and against the kernel
#             variants of LN_SOURCES (default: base=build/src_base, red=build/src_red when they exist),
#             LN_INSTANCES sessions a variant, at LN_ROWS x LN_HIDDEN (default the three-block sizes);
#   gemv      issue 5: scripts/gemv_decode_micro.py, a split-K Triton GEMV against cuBLAS at Llama-1B's
#             decode shapes;
#   pack      issue 5: Llama-1B with Q, K and V packed (pack_projections) against without, CUDA graphs, in
#             alternating rounds (bench.ab --decoder; ROUNDS, ITERS, PREFILL, DECODE), bounded by PACK_TIMEOUT;
#   tr        issue 5: the Rotary GPU tests (TransposeRotary among them), then Llama-1B with transpose_rotary (off by
#             default) against without, CUDA graphs, alternating rounds, bounded by TR_TIMEOUT;
#   generate  issue 5: 32 greedy tokens of GEN_MODEL (default llama-1b) with ort_triton against ORT fp16.
source "$(dirname "$0")/gpu_env.sh"
# ab_llama A B NAME TIMEOUT: Llama-1B, runtime B against A (bench.decoder's), alternating rounds; $OUT/NAME.json
ab_llama() {
  timeout "$4" python3 -m ort_triton.bench.ab --decoder llama-1b --a "$1" --b "$2" --prefill "${PREFILL:-1x512,8x512}" \
    --decode "${DECODE:-1x1024,16x1024}" --rounds "${ROUNDS:-6}" --iters "${ITERS:-20}" --work build/decoder_work \
    --json "$OUT/$3.json" 2>&1 | filter | tee "$OUT/$3.txt" | tail -8
}
for step in ${STEPS:-tests ln gemv}; do
  case $step in
  tests)
    gpu_tests ;;
  ln)
    if [ -z "${LN_SOURCES+x}" ]; then
      LN_SOURCES=""
      for d in build/src_*; do [ -d "$d/ort_triton" ] && LN_SOURCES+="${LN_SOURCES:+;}${d#build/src_}=$d"; done
    fi
    ln_chains 768,1536,3072 || exit 1 ;;
  gemv)
    timeout "${GEMV_TIMEOUT:-100}" python3 scripts/gemv_decode_micro.py --rows 1,16 --splits 1,4,8,16 \
      --block-n 64,128,256 --block-k 64 --rep 10 --json "$OUT/gemv_decode_micro.jsonl" 2>&1 | filter | tail -40 ;;
  pack)
    ab_llama ort_triton_unpacked_cuda_graph ort_triton_cuda_graph ab_llama-1b_unpacked_vs_packed "${PACK_TIMEOUT:-540}" ;;
  tr)
    PYTEST_PATHS="tests/ops/test_rotary_kernel.py tests/gpu -k rotary" TEST_TIMEOUT=${TEST_TIMEOUT:-120} gpu_tests
    ab_llama ort_triton_cuda_graph ort_triton_tr_cuda_graph ab_llama-1b_tr "${TR_TIMEOUT:-420}" ;;
  generate)
    timeout "${GEN_TIMEOUT:-500}" python3 examples/generate.py --model "${GEN_MODEL:-llama-1b}" --cuda --optimize \
      --float16 --steps 32 --batch 2 --prompt 16 --no-torch 2>&1 | filter | tee "$OUT/generate_${GEN_MODEL:-llama-1b}.txt" | tail -30 ;;
  esac
done
