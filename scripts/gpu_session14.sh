#!/usr/bin/env bash
# Session 14's GPU calls (carry [".ortgpu", ".ortinc"], start with `source .ortgpu/activate.sh &&`); STEPS picks
# them (default "qrc_tests attn qrc profile"), each bounded so a call ends inside 10 minutes:
#   tr        issue 5 (first call): the Rotary GPU tests (TransposeRotary among them), then Llama-1B with
#             transpose_rotary against without, CUDA graphs, alternating rounds (bench.ab), bounded by TR_TIMEOUT;
#   qrc_tests the QKVRotaryCache and Rotary kernel tests natively on CUDA and through ORT's CUDA EP;
#   attn      issue 5: decode attention launch configs at Llama-1B's heads (scripts/decode_attention_sweep.py);
#   qrc       issue 5: Llama-1B with qkv_rotary_cache against without, CUDA graphs, alternating rounds, bounded
#             by QRC_TIMEOUT (session 14's call 2 ran it as --a ort_triton_cuda_graph --b ort_triton_qrc_cuda_graph
#             while the rule was opt-in; it is a default now, and the ablation is the A side);
#   final     issue 5: the CausalAttention GPU tests (the decode split target changed), then Llama-1B with every
#             default rule against ORT's best (the opset-23 export with CUDA graphs), bounded by FINAL_TIMEOUT;
#   profile   issue 5: where a Llama-1B decode step's GPU time goes, kernel by kernel (CUPTI through CUDA-graph
#             replays), for PROFILE_RUNTIMES at PROFILE_DECODE, reusing the ab step's exports.
source "$(dirname "$0")/gpu_env.sh"
# ab_llama A B NAME TIMEOUT: Llama-1B, runtime B against A (bench.decoder's), alternating rounds; $OUT/NAME.json
ab_llama() {
  timeout "$4" python3 -m ort_triton.bench.ab --decoder llama-1b --a "$1" --b "$2" --prefill "${PREFILL:-1x512,8x512}" \
    --decode "${DECODE:-1x1024,16x1024}" --rounds "${ROUNDS:-4}" --iters "${ITERS:-20}" --work build/decoder_work \
    --json "$OUT/$3.json" 2>&1 | filter | tee "$OUT/$3.txt" | tail -8
}
for step in ${STEPS:-qrc_tests attn qrc profile}; do
  case $step in
  tr)  # session 14's first call; ort_triton_tr_cuda_graph is gone since transpose_rotary is a default
    PYTEST_PATHS="tests/ops/test_rotary_kernel.py tests/gpu -k rotary" TEST_TIMEOUT=${TEST_TIMEOUT:-120} gpu_tests
    ab_llama ort_triton_cuda_graph ort_triton_tr_cuda_graph ab_llama-1b_tr "${TR_TIMEOUT:-330}" ;;
  qrc_tests)
    PYTEST_PATHS="tests/ops/test_qkv_rotary_cache_kernel.py tests/ops/test_rotary_kernel.py" \
      TEST_TIMEOUT=${TEST_TIMEOUT:-120} gpu_tests ;;
  attn)
    timeout "${ATTN_TIMEOUT:-150}" python3 scripts/decode_attention_sweep.py --json "$OUT/decode_attention_sweep.jsonl" \
      2>&1 | filter | tail -30 ;;
  qrc)
    ab_llama ort_triton_no_qrc_cuda_graph ort_triton_cuda_graph ab_llama-1b_qrc "${QRC_TIMEOUT:-300}" ;;
  final)
    PYTEST_PATHS="tests/gpu/test_causal_attention_gpu.py tests/ops/test_causal_attention_kernel.py" TEST_TIMEOUT=${TEST_TIMEOUT:-90} gpu_tests
    timeout "${FINAL_TIMEOUT:-330}" python3 -m ort_triton.bench.decoder --model llama-1b --prefill "${PREFILL:-1x512}" \
      --decode "${DECODE:-1x1024,16x1024,1x4096}" --runtimes ort_opset23_cuda_graph,ort_triton_cuda_graph --iters 30 \
      --work build/decoder_work --json "$OUT/decoder_llama-1b_final.json" 2>&1 | filter | tail -20 ;;
  profile)
    timeout "${PROFILE_TIMEOUT:-100}" python3 -m ort_triton.bench.decoder --model llama-1b --prefill '' \
      --decode "${PROFILE_DECODE:-1x1024}" --runtimes "${PROFILE_RUNTIMES:-ort_triton_no_qrc_cuda_graph,ort_triton_cuda_graph}" \
      --iters 20 --work build/decoder_work --profile --json "$OUT/profile_llama-1b_decode.json" 2>&1 | filter | tail -30
    python3 - "$OUT/profile_llama-1b_decode.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    p = r.get("gpu_profile")
    if not p:
        continue
    print(r["runtime"], r["phase"], f"{r['batch']}x{r['past']}", f"{p['total_us']:.0f} us GPU in {p['kernels_per_inference']:.0f} kernels")
    for t in p["top"][:40]:
        print(f"  {t['us']:8.1f}  {t['kernel'][:120]}")
PY
    ;;
  esac
done
