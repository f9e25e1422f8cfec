#!/usr/bin/env bash
# Issue 5's GPU calls (carry [".ortgpu", ".ortinc"], start with `source .ortgpu/activate.sh &&`; session 15's
# gpu_session15.sh, kept up to date since): the side-by-side run, every peer the issue names, at every shape it names,
# and the A/B checks of single rules. STEPS picks them, each bounded so a
# call ends inside 10 minutes, and each call writes its rows under $OUT (bench.decoder rewrites its JSON after
# every runtime, so a step cut short keeps what it measured):
#   gpt2           GPT-2 small: ORT stock, ORT on the opset-23 export (dynamic, and specialised per shape with
#                  its CUDA graphs), ORT's transformers optimizer (dynamic, and specialised with CUDA graphs),
#                  onnxscript's optimize_for_ort, ort_triton with CUDA graphs, torch eager, torch.compile
#                  (reduce-overhead), bounded by GPT2_TIMEOUT;
#   llama          Llama-1B: ort_triton with CUDA graphs, ORT's opset-23 export specialised with CUDA graphs, ORT
#                  stock, ORT opset 23, onnxscript's optimize_for_ort (its GroupQueryAttention nodes: do they
#                  run?), torch eager, bounded by LLAMA_TIMEOUT;
#   llama_compile  Llama-1B under torch.compile (reduce-overhead: CUDA graphs), bounded by COMPILE_TIMEOUT;
#   gpt2_compile   the same for GPT-2 small;
#   gpt2_profile   GPT-2 small with ort_triton and CUDA graphs, kernel by kernel (bench.decoder --profile) at
#                  PROFILE_PREFILL (8x512) and PROFILE_DECODE (1x1024), bounded by PROFILE_TIMEOUT;
#   pw             GPT-2 small with padded_weight against without (bench.ab, CUDA graphs), bounded by PW_TIMEOUT;
#   qkvc_tests     the QKVCache kernel's GPU tests (native and through ORT's CUDA EP);
#   qkvc           GPT-2 small without qkv_cache against with (bench.ab, CUDA graphs), bounded by QKVC_TIMEOUT;
#   attn           decode attention's split GPU tests, then the sweep (scripts/decode_attention_sweep.py) of the
#                  merge variants at Llama-1B's and GPT-2's heads beside torch sdpa;
#   lib_ab         the library built from OLD_SRC against this tree's, same fused model (bench.ab, CUDA graphs),
#                  AB_MODEL (gpt2-small) at AB_PREFILL ('') and AB_DECODE (1x1024,1x4096,16x4096), ROUNDS (3)
#                  rounds, rows in $OUT/AB_JSON.json (ab_lib);
#   summary        ort_triton against the best ORT and the best PyTorch runtime per shape, from every
#                  decoder_*.json under $OUT (bench.decoder_summary).
# PREFILL / DECODE override the shapes (default: issue 5's, bench.decoder's defaults); GPT2_RUNTIMES the gpt2 step's
# runtimes (e.g. ours and the peers that were best at some shape, so the call fits in 10 minutes).
# Next (session 16's device time ran out): STEPS="llama summary" (Llama-1B with the blocked merge; 16x4096 is where
# decode attention dominates), then `MODEL=llama-1b bash scripts/gpu_tune.sh` (the decode candidates now carry
# the register cap, DECODE_MAXNREG) or a lib_ab of a tree whose decode config names maxnreg.
source "$(dirname "$0")/gpu_env.sh"
# decoder MODEL RUNTIMES NAME TIMEOUT: bench.decoder, rows in $OUT/NAME.json, the log in $OUT/NAME.txt
decoder() {
  timeout "$4" python3 -m ort_triton.bench.decoder --model "$1" --runtimes "$2" ${PREFILL:+--prefill "$PREFILL"} \
    ${DECODE:+--decode "$DECODE"} --iters "${ITERS:-30}" --work build/decoder_work --json "$OUT/$3.json" 2>&1 |
    filter | tee "$OUT/$3.txt" | grep -v "^\s*$" | tail -80
}
for step in ${STEPS:-gpt2}; do
  case $step in
  gpt2)
    decoder gpt2-small "${GPT2_RUNTIMES:-ort_triton_cuda_graph,ort_stock,ort_opset23,ort_opset23_static_cuda_graph,\
ort_optimizer,ort_optimizer_static_cuda_graph,onnxscript_fusions,torch_eager,torch_compile_cuda_graph}" \
      decoder_gpt2-small "${GPT2_TIMEOUT:-480}" ;;
  llama)
    decoder llama-1b ort_triton_cuda_graph,ort_opset23_static_cuda_graph,ort_stock,ort_opset23,onnxscript_fusions,\
torch_eager decoder_llama-1b "${LLAMA_TIMEOUT:-480}" ;;
  llama_compile)
    decoder llama-1b torch_compile_cuda_graph decoder_llama-1b_compile "${COMPILE_TIMEOUT:-480}" ;;
  gpt2_compile)  # GPT-2 small under torch.compile alone (the gpt2 step's time limit can cut its last runtime)
    decoder gpt2-small torch_compile_cuda_graph decoder_gpt2-small_compile "${COMPILE_TIMEOUT:-480}" ;;
  gpt2_profile)  # where GPT-2 small's time goes with ort_triton (CUPTI through the CUDA-graph replays)
    timeout "${PROFILE_TIMEOUT:-240}" python3 -m ort_triton.bench.decoder --model gpt2-small --prefill "${PROFILE_PREFILL:-8x512}" \
      --decode "${PROFILE_DECODE:-1x1024}" --runtimes ort_triton_cuda_graph --iters 20 --work build/decoder_work --profile \
      --json "$OUT/profile_gpt2-small.json" 2>&1 | filter | grep -v "^\s*$" | tail -90 ;;
  pw)  # GPT-2 small with padded_weight (the lm_head on a weight padded to 16-byte rows, then a Slice) against without
    timeout "${PW_TIMEOUT:-150}" python3 -m ort_triton.bench.ab --decoder gpt2-small --a ort_triton_cuda_graph \
      --b ort_triton_pw_cuda_graph --prefill "${PW_PREFILL:-1x512,8x512}" --decode "${PW_DECODE:-1x1024}" --rounds 3 \
      --iters 20 --warmup 5 --work build/decoder_work --json "$OUT/ab_gpt2-small_pw.json" 2>&1 | filter |
      tee "$OUT/ab_gpt2-small_pw.txt" | tail -8 ;;
  qkvc_tests)  # the QKVCache kernel natively on CUDA and through ORT's CUDA EP (its launch counted)
    PYTEST_PATHS="tests/ops/test_qkv_cache_kernel.py" TEST_TIMEOUT=${TEST_TIMEOUT:-60} gpu_tests ;;
  qkvc)  # GPT-2 small without qkv_cache against with (one QKVCache a layer, the default), alternating rounds
    timeout "${QKVC_TIMEOUT:-150}" python3 -m ort_triton.bench.ab --decoder gpt2-small --a ort_triton_no_qkvc_cuda_graph \
      --b ort_triton_cuda_graph --prefill "${QKVC_PREFILL:-8x512}" --decode "${QKVC_DECODE:-1x1024,16x1024}" \
      --rounds 3 --iters 20 --warmup 5 --work build/decoder_work --json "$OUT/ab_gpt2-small_qkvc.json" 2>&1 |
      filter | tee "$OUT/ab_gpt2-small_qkvc.txt" | tail -8 ;;
  attn)  # decode attention's split GPU tests (blocked merge included), then the sweep of the merge variants
    PYTEST_PATHS="tests/ops/test_causal_attention_kernel.py -k split" TEST_TIMEOUT=${TEST_TIMEOUT:-200} gpu_tests
    for heads in 32x8 12x12; do
      timeout "${ATTN_TIMEOUT:-90}" python3 scripts/decode_attention_sweep.py --shapes 1x1024,1x4096,16x1024,16x4096 \
        --heads "${heads%x*}" --kv-heads "${heads#*x}" --block-n 128 --warps 4 --stages 2 --split-target 128,256 \
        --split-min-keys 256 --merge loop,blocked,blocked4 --json "$OUT/decode_attention_merge_$heads.jsonl" 2>&1 |
        filter | grep -v "^     "
    done ;;
  lib_ab)  # GPT-2 small's decode with the library built from OLD_SRC (a copy of the repo, e.g. `git archive REV |
    # tar -x -C DIR`) as A against this tree's as B, same fused model, alternating rounds
    build_tree "${OLD_SRC:-}" build/old_lib || continue
    ORT_TRITON_TUNED_LIBRARY=$PWD/build/old_lib/libort_triton.so timeout "${AB_TIMEOUT:-300}" \
      python3 -m ort_triton.bench.ab --decoder "${AB_MODEL:-gpt2-small}" --a ort_triton_tuned_cuda_graph \
      --b ort_triton_cuda_graph --prefill "${AB_PREFILL:-}" --decode "${AB_DECODE-1x1024,1x4096,16x4096}" \
      --rounds "${ROUNDS:-3}" --iters 20 --warmup 5 --work build/decoder_work --json "$OUT/${AB_JSON:-ab_lib}.json" 2>&1 |
      filter | tee "$OUT/${AB_JSON:-ab_lib}.txt" | tail -6 ;;
  summary)
    python3 -m ort_triton.bench.decoder_summary "$OUT"/decoder_*.json --markdown "$OUT/summary.md" ;;
  esac
done
