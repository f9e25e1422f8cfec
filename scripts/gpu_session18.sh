#!/usr/bin/env bash
# Session 18's GPU calls, for the warp-specialised attention kernel (kernels/attention.py `_attention_ws`,
# experimental: the ws steps set ORT_TRITON_EXPERIMENTAL_WS=1; its first launch on the H200 did not return in
# session 19, so each is bounded) and the fused merge; carry [".ortgpu", ".ortinc"], start with
# `source .ortgpu/activate.sh &&`. STEPS picks them
# (default "ws_tests ws_micro"), each bounded so a call ends inside 10 minutes:
#   ws_tests  the WS kernel natively on CUDA (tests/ops/test_attention_ws_kernel.py), through ORT from a library
#             built with WS entries (tests/gpu/test_attention_ws_ort.py), and the existing attention kernel tests
#             (the kernel file changed); what Triton made of each WS spec (scripts/ws_attention_compile.py);
#   ws_micro  issue 3: the WS configs against the built-in kernel and torch's sdpa at BERT-base's shapes, head dims
#             64 (packed and not) and 128 (scripts/ws_attention_micro.py), bounded by MICRO_TIMEOUT;
#   tune_ab   issues 3 and 8: tune BERT-base (the WS candidates among the rest, BUDGET_MIN), build the tuned library
#             and time it against the default one with CUDA graphs in alternating rounds (bench.ab), bounded by
#             AB_TIMEOUT. The table goes to $OUT/bert-base.tuning.json;
#   fm_tests  issue 5: CausalAttention's fused merge (one launch for a split decode) natively on CUDA (programs
#             racing for the tickets) and through ORT (shapes in a row, threads, a CUDA graph), with the
#             CausalAttention kernel and GPU tests (the kernel file changed);
#   fm_micro  issue 5: the fused merge against the two launches, the kernel alone at Llama-1B's decode heads, CUDA-graph
#             replays (scripts/decode_attention_sweep.py --merge blocked,fused), bounded by MICRO_TIMEOUT;
#   fm_ab     issue 5: Llama-1B's decode with the merge in a second launch on every split decode bucket
#             (scripts/fused_merge_table.py --merge two, built as a tuned library: B) against the default library
#             (the fused merge since session 19: A), CUDA graphs, alternating rounds
#             (scripts/gpu_ab_decoder.sh with TABLE; a cold machine spends ~3 min exporting first).
source "$(dirname "$0")/gpu_env.sh"
for step in ${STEPS:-ws_tests ws_micro}; do
  case $step in
  ws_tests)
    ORT_TRITON_EXPERIMENTAL_WS=1 TEST_LOG=ws_tests PYTEST_PATHS="tests/ops/test_attention_ws_kernel.py tests/gpu/test_attention_ws_ort.py tests/ops/test_attention_kernel.py" \
      TEST_TIMEOUT=${TEST_TIMEOUT:-240} gpu_tests
    [ "${COMPILE_TIMEOUT:-120}" = 0 ] ||  # 0: skip (the CPU's compile report is the same Triton's)
      ORT_TRITON_EXPERIMENTAL_WS=1 timeout "${COMPILE_TIMEOUT:-120}" python3 scripts/ws_attention_compile.py --json "$OUT/ws_attention_compile.jsonl" \
        2>&1 | filter | tail -3 ;;
  ws_micro)
    ORT_TRITON_EXPERIMENTAL_WS=1 timeout "${MICRO_TIMEOUT:-240}" python3 scripts/ws_attention_micro.py --shapes "${SHAPES:-1x128,8x128,32x128,1x512,8x512,32x512,8x2048}" \
      --json "$OUT/ws_attention_micro.jsonl" 2>&1 | filter | tail -25 ;;
  tune_ab)
    fused=build/tune_work/bert-base.fp16.opt.onnx
    python3 scripts/fused_bert_fp16.py "$fused" || exit 1
    timeout "${TUNE_TIMEOUT:-240}" python3 -m ort_triton tune "$fused" --shapes "${SHAPES:-1x128,8x128,32x128,1x512,8x512,32x512,8x2048}" \
      --budget-min "${BUDGET_MIN:-2}" -o "$OUT/bert-base.tuning.json" 2>&1 | filter | tee "$OUT/tune_bert-base.txt" | tail -25
    timeout 150 python3 -m ort_triton build --arch 90 --tuning "$OUT/bert-base.tuning.json" -o build/lib_tuned -q || exit 1
    export ORT_TRITON_TUNED_LIBRARY=$PWD/build/lib_tuned/libort_triton.so
    timeout "${AB_TIMEOUT:-220}" python3 -m ort_triton.bench.ab --hf-config bert-base --a ort_triton_cuda_graph \
      --b ort_triton_tuned_cuda_graph --shapes "${SHAPES:-1x128,8x128,32x128,1x512,8x512,32x512,8x2048}" \
      --json "$OUT/ab_bert-base_default_vs_tuned.json" 2>&1 | filter | tail -12 ;;
  fm_tests)
    TEST_LOG=fm_tests PYTEST_PATHS="tests/ops/test_causal_attention_fused_merge.py tests/gpu/test_causal_attention_fused_merge_ort.py tests/gpu/test_causal_attention_gpu.py tests/ops/test_causal_attention_kernel.py" \
      TEST_TIMEOUT=${TEST_TIMEOUT:-240} gpu_tests ;;
  fm_micro)
    timeout "${MICRO_TIMEOUT:-150}" python3 scripts/decode_attention_sweep.py --shapes "${DECODE:-1x1024,1x4096,16x1024,16x4096}" \
      --block-n 128 --warps 4 --stages 2,3 --split-target 128,256 --split-min-keys 256 --merge blocked,fused \
      --json "$OUT/fm_micro.jsonl" 2>&1 | filter | tail -30 ;;
  fm_ab)
    mkdir -p build/ab_decoder
    python3 scripts/fused_merge_table.py build/ab_decoder/fused_merge.json --merge two || exit 1
    rm -f build/ab_decoder/lib_tuned/libort_triton.so
    TABLE=build/ab_decoder/fused_merge.json AA=0 PREFILL=${PREFILL:-1x512} DECODE=${DECODE:-1x1024,1x4096,16x1024} \
      ROUNDS=${ROUNDS:-4} bash scripts/gpu_ab_decoder.sh ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
