#!/usr/bin/env bash
# Session 20's and 21's GPU calls (carry [".ortgpu", ".ortinc"], start with `source .ortgpu/activate.sh &&`), for
# the decode defaults of ops/causal_attention.py: the split's merge in the chunks' launch (FUSED_MERGE), and the
# wide decode spec's split target (the comment at _WIDE_SPLIT). STEPS picks them (default "tests micro"), each
# bounded so a call ends inside 10 minutes:
#   tests  CausalAttention through ORT from the AOT library (tests/gpu: the fused merge with programs racing,
#          threads, a CUDA graph; every decode and prefill spec), then the kernel natively (Triton's JIT);
#   micro  the kernel alone in CUDA-graph replays at batch 8 and 16, Llama-1B's heads (32/8) and GPT-2's (12/12),
#          head dim 64: the default against split targets SPLITS (default 0,132,264,528; split_keys rounds down
#          since session 21, up before) with the fused merge, and torch's sdpa (scripts/decode_attention_sweep.py;
#          JSONL in $OUT/micro_HEADS.jsonl);
#   batch1 the same at batch 1 (the narrow spec, 2 stages, one wave): the least keys a chunk (SPLIT_MIN_KEYS 64,
#          128, 256) and the key block, caches 1024-4096 (JSONL in $OUT/batch1_HEADS.jsonl);
#   ab     MODEL's (llama-1b) prefill and decode through ORT with CUDA graphs, the default library (A) against one
#          built from a table of every decode bucket (B, scripts/fused_merge_table.py --merge B_MERGE --split-target
#          B_SPLIT; default two and 128: session 18's decode; fused and 132: session 20's, one wave everywhere),
#          alternating rounds (scripts/gpu_ab_decoder.sh; a cold machine spends ~3 min exporting first). B/A < 1 is
#          the default's gain.
source "$(dirname "$0")/gpu_env.sh"
for step in ${STEPS:-tests micro}; do
  case $step in
  tests)
    TEST_LOG=tests PYTEST_PATHS="tests/gpu/test_causal_attention_gpu.py tests/gpu/test_causal_attention_fused_merge_ort.py tests/ops/test_causal_attention_fused_merge.py tests/ops/test_causal_attention_kernel.py" \
      TEST_TIMEOUT=${TEST_TIMEOUT:-300} gpu_tests ;;
  micro)
    for heads in 32/8 12/12; do
      timeout "${MICRO_TIMEOUT:-100}" python3 scripts/decode_attention_sweep.py --heads "${heads%/*}" --kv-heads "${heads#*/}" \
        --shapes "${DECODE:-8x1024,8x4096,16x1024,16x4096}" --block-n 128 --warps 4 --stages 3 \
        --split-target "${SPLITS:-0,132,264,528}" --split-min-keys 256 --merge fused --json "$OUT/micro_${heads%/*}.jsonl" 2>&1 |
        filter | tail -28
    done ;;
  batch1)
    for heads in 32/8 12/12; do
      timeout "${MICRO_TIMEOUT:-100}" python3 scripts/decode_attention_sweep.py --heads "${heads%/*}" --kv-heads "${heads#*/}" \
        --shapes "${DECODE:-1x1024,1x2048,1x4096}" --block-n 64,128 --warps 4 --stages 2 --split-target 132 \
        --split-min-keys 64,128,256 --merge fused --json "$OUT/batch1_${heads%/*}.jsonl" 2>&1 | filter | tail -24
    done ;;
  ab)
    mkdir -p build/ab_decoder
    table=build/ab_decoder/decode_${B_MERGE:-two}_${B_SPLIT:-128}.json
    python3 scripts/fused_merge_table.py "$table" --merge "${B_MERGE:-two}" --split-target "${B_SPLIT:-128}" || exit 1
    rm -f build/ab_decoder/lib_tuned/libort_triton.so
    TABLE=$table AA=0 PREFILL=${PREFILL-1x512} \
      DECODE=${DECODE:-1x1024,1x4096,16x1024,16x4096} ROUNDS=${ROUNDS:-3} bash scripts/gpu_ab_decoder.sh ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
