"""CausalAttention: decoder self-attention over a KV cache, grouped-query, causal with an offset.

    Q [B, Nq, S, D]        the new queries, after rotary (the heads layout decoder graphs have)
    K, V [B, Nkv, T, D]    the *present* cache: past keys/values and the S new ones (T >= S); Nq % Nkv == 0
    key_bias [B, T]        additive per key: 0 keeps a key, -inf (or a large negative) drops it (padding)
    Y [B, S, Nq*D]         the heads merged, as o_proj reads them

    G = Nq / Nkv; query head h reads KV head h // G (grouped-query attention; the kernel never repeats K, V)
    query i sits at absolute position T - S + i and sees the keys j <= T - S + i
    s[b, h, i, j] = Q[b, h, i] . K[b, h // G, j] * scale + key_bias[b, j]   where visible, else -inf
    Y[b, i, h*D:(h+1)*D] = softmax_j(s[b, h, i]) V[b, h // G]

A query row whose every score is -inf (each key it sees is padding: a left-padded row's pad positions)
has no softmax; exporters' graphs give it two different values, so the op has both, by `masked_rows`:
- 0: the row is 0. torch's sdpa with a boolean mask (dynamo's export guards the softmax's NaN row with
  IsNaN/Where -> 0);
- 1: the row is the mean of V over all T keys. Eager attention adds finfo.min to every key a row may not
  see, causal or padded alike; on a row that sees nothing every score is then finfo.min (a score is far
  below its ulp), the softmax is uniform over all T keys, future ones included.
The rewriter gives key_bias = -inf on padded keys for both (on a row with a kept key, exp(finfo.min - m)
is 0 exactly as exp(-inf) is), so `masked_rows` alone carries the difference. A finite bias is still
taken (kernels saturate it at -1e38, like MultiHeadAttention's): a row seeing only finfo.min keys is
uniform over the keys it sees, which is what the body computes too.

Why this layout: Q, K, V are taken where the graph has them ([B, N, S, D] after rotary; the present cache
the graph must output anyway), Y where o_proj reads it, so the output Transpose + Reshape go away, and the
exporters' [B, 1, S, T] causal+padding mask (a subgraph of aranges, comparisons and Where) is replaced by
key_bias: the rewriter proves that mask is exactly causal-with-offset and padding (graph_rewrites/
causal_attention.py).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..contract import ANY, IO, Attr, Kernel, OpContract, Spec, Tuning, attr_ref, pow2_bucket
from .attention import HEAD_DIMS, block_d
from .kv_layout import SEQ_MAJOR, heads_in, to_heads
from .tune_space import random_inputs, tile_candidates

# The encoder attention's head dims and Gemma's 256 (Gemma-2B's and -7B's): a decoder's attention left to ORT at
# 256 ran as a dozen small kernels a layer (MatMul, Softmax, the GQA Expand).
CAUSAL_HEAD_DIMS = HEAD_DIMS + (256,)


def reference_causal_attention(q, k, v, key_bias, scale, masked_rows=0, seq_major=0):
    """float64 numpy reference in the contract's layout."""
    q, k, v, kb = (np.asarray(a, np.float64) for a in (q, k, v, key_bias))
    k, v = to_heads(k, seq_major), to_heads(v, seq_major)
    b, nq, s_len, d = q.shape
    nkv, t_len = k.shape[1], k.shape[2]
    g = nq // nkv
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # head h reads kv head h // g
    s = q @ k.transpose(0, 1, 3, 2) * scale + kb[:, None, None, :]
    visible = np.arange(t_len)[None, :] <= (t_len - s_len + np.arange(s_len))[:, None]
    s = np.where(visible, s, -np.inf)
    row_max = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(row_max), row_max, 0.0))
    total = p.sum(-1, keepdims=True)
    empty = np.broadcast_to(total == 0, p.shape)
    p = np.divide(p, total, out=np.zeros_like(p), where=total > 0)
    if masked_rows:
        p = np.where(empty, 1.0 / max(t_len, 1), p)
    y = p @ v  # [B, Nq, S, D]
    return (y.transpose(0, 2, 1, 3).reshape(b, s_len, nq * d),)


def _body(_opset: int) -> list[onnx.NodeProto]:
    """Opset 15 on. GQA without repeating K: Q [B, Nq, S, D] is viewed as [B, Nkv, G, S, D] and K, V get a
    broadcast axis, [B, Nkv, 1, T, D], so one MatMul serves the G heads of a KV head."""
    n = helper.make_node
    i64 = lambda name, vals: n("Constant", [], [name], value=helper.make_tensor(name, onnx.TensorProto.INT64,
                                                                                   [len(vals)], vals))
    scalar = lambda name, val: n("Constant", [], [name], value=helper.make_tensor(name, onnx.TensorProto.INT64,
                                                                                     [], [val]))
    scale = n("Constant", [], ["scale_f"])
    scale.attribute.append(attr_ref("scale", onnx.AttributeProto.FLOAT, name="value_float"))
    rows = n("Constant", [], ["masked_rows_i"])
    rows.attribute.append(attr_ref("masked_rows", onnx.AttributeProto.INT, name="value_int"))
    return [
        scale, rows, *heads_in([("K", "K_h"), ("V", "V_h")]),
        i64("ax0", [0]), i64("ax1", [1]), i64("ax2", [2]), i64("ax4", [4]), i64("minus1", [-1]),
        i64("ax123", [1, 2, 3]), scalar("zero", 0), scalar("one", 1),
        n("Shape", ["Q"], ["q_shape"]), n("Shape", ["K_h"], ["k_shape"]),
        n("Slice", ["q_shape", "ax0", "ax1"], ["batch"]), n("Slice", ["k_shape", "ax1", "ax2"], ["nkv"]),
        n("Slice", ["q_shape", "ax2", "ax4"], ["s_d"]),
        n("Concat", ["batch", "nkv", "minus1", "s_d"], ["grouped_shape"], axis=0),  # [B, Nkv, G, S, D]
        n("Reshape", ["Q", "grouped_shape"], ["q5"]),
        n("Unsqueeze", ["K_h", "ax2"], ["k5"]), n("Unsqueeze", ["V_h", "ax2"], ["v5"]),  # [B, Nkv, 1, T, D]
        n("Transpose", ["k5"], ["k5t"], perm=[0, 1, 2, 4, 3]),
        n("CastLike", ["scale_f", "Q"], ["scale_t"]),
        n("MatMul", ["q5", "k5t"], ["qk"]), n("Mul", ["qk", "scale_t"], ["scores"]),  # [B, Nkv, G, S, T]
        n("Unsqueeze", ["key_bias", "ax123"], ["bias5"]),  # [B, 1, 1, 1, T]
        n("Add", ["scores", "bias5"], ["biased"]),
        # causal with offset: query i (of S) sees key j (of T) iff j <= T - S + i
        n("Gather", ["q_shape", "ax2"], ["s_len1"], axis=0), n("Gather", ["k_shape", "ax2"], ["t_len1"], axis=0),
        n("Squeeze", ["s_len1", "ax0"], ["s_len"]), n("Squeeze", ["t_len1", "ax0"], ["t_len"]),
        n("Range", ["zero", "s_len", "one"], ["q_idx"]), n("Range", ["zero", "t_len", "one"], ["k_idx"]),
        n("Sub", ["t_len", "s_len"], ["offset"]), n("Add", ["q_idx", "offset"], ["q_pos"]),
        n("Unsqueeze", ["q_pos", "minus1"], ["q_col"]),  # [S, 1]
        n("LessOrEqual", ["k_idx", "q_col"], ["visible"]),  # [S, T]
        n("Constant", [], ["ninf_f"], value_float=float("-inf")), n("CastLike", ["ninf_f", "Q"], ["ninf_t"]),
        n("Where", ["visible", "biased", "ninf_t"], ["logits"]),
        n("Softmax", ["logits"], ["probs"], axis=-1),
        # a row of only -inf: softmax gives NaN; the op gives 0 (masked_rows 0) or 1/T (masked_rows 1)
        n("Cast", ["masked_rows_i"], ["rows_f"], to=onnx.TensorProto.FLOAT),
        n("Cast", ["t_len"], ["t_f"], to=onnx.TensorProto.FLOAT),
        n("Div", ["rows_f", "t_f"], ["fill_f"]), n("CastLike", ["fill_f", "Q"], ["fill_t"]),
        n("IsNaN", ["probs"], ["nan_rows"]), n("Where", ["nan_rows", "fill_t", "probs"], ["probs_ok"]),
        n("MatMul", ["probs_ok", "v5"], ["o5"]),  # [B, Nkv, G, S, D]
        n("Shape", ["o5"], ["o_shape"]),
        n("Slice", ["o_shape", "ax0", "ax1"], ["o_batch"]),
        n("Concat", ["o_batch", "minus1", "s_d"], ["heads_shape"], axis=0),  # [B, Nq, S, D]
        n("Reshape", ["o5", "heads_shape"], ["o4"]),
        n("Transpose", ["o4"], ["o3"], perm=[0, 2, 1, 3]),
        i64("merge", [0, 0, -1]),
        n("Reshape", ["o3", "merge"], ["Y"]),
    ]


# The kernel: ort_triton/kernels/causal_attention.py. One program takes BLOCK_M rows of one (batch b, KV
# head g): the G query heads that read g and the S queries, packed as row r = i * G + (h - g * G), so a
# decode step (S = 1) fills the M dimension with the G heads and reads its KV head once, and a prefill
# reads each K/V block once for G heads. Key blocks past the tile's last visible key are not visited;
# those wholly visible to every row of the tile load without a causal mask. The grid is one flat axis of
# ceil(G * S / BLOCK_M) * B * Nkv programs, the row block fastest. A decode spec may split the cache into
# chunks (split_keys): two launches, chunks then their merge, over an fp32 workspace from ORT's arena.
KERNEL = Kernel(
    module="ort_triton.kernels.causal_attention",
    fn_name="causal_attention_fwd",
    signature={"Q": "*{T}", "K": "*{T}", "V": "*{T}", "KB": "*{T}", "Y": "*{T}", "WS": "*fp32",
               "NQ": "i32", "NKV": "i32", "S": "i32", "T": "i32", "scale": "fp32", "MEAN_ROWS": "i32",
               "SPLIT": "i32", "PHASE": "i32", "CNT": "*i32", "B": "i32"},
    native_plan="ot_causal_attention_plan",
    native_params="ot_causal_attention_params",
    # rows = G * S; programs = B * Nkv and keys = T only narrow tuned specs (the built-in ones take any); seq_major the
    # cache's layout (ops/kv_layout.py), a spec of its own (KV_SEQ_MAJOR) for each
    dispatch_keys=("head_dim", "rows", "batch_kv_heads", "keys", "seq_major"),
)

# Packed rows (G * S) up to this take the decode spec: BLOCK_M = 16 (tl.dot's least), long key blocks.
DECODE_ROWS = 16
# (BLOCK_M, BLOCK_N, num_warps, num_stages) by (decode or prefill, element kind, BLOCK_D). First choices,
# to be swept on the H200; each checked with ptxas (Triton 3.6) for no spills on sm_80 and sm_90
# (tests/aot: test_register_budget covers MultiHeadAttention's; this kernel's were read the same way).
# Prefill starts from MultiHeadAttention's tiles; at BLOCK_D = 64 its 4 warps spill here (the causal
# row indices are live too), so 8. fp32 dots are 3xTF32, which holds each operand twice: small tiles
# (BLOCK_D = 128 spilled 144 bytes at 32 x 32). The decode specs, with their merge block, spill nothing but 8
# bytes at head dim 64 (fp16, bf16) on sm_90, where ptxas holds the kernel to 168 registers once the merge is
# unrolled, at any merge block (test_llama_head_dims_do_not_spill); the library with it was still 1.03-1.04x
# faster at GPT-2 small's decode (session 16). BLOCK_D = 64 (fp16/bf16) from `ort-triton tune` of Llama-1B on the
# H200 (bench/results/tune-h200/llama-1b.tuning.json): 64 x 64 tiles, 4 warps, 3 stages were 1.53-1.58x the
# first choice (128 x 64, 8 warps, 2 stages) at prefill 2048 and best or near it at 512; decode's best key block
# was 128 at every shape (1.13-1.42x).
_CONFIGS = {
    ("decode", "half", 32): (16, 64, 4, 2),
    ("decode", "half", 64): (16, 128, 4, 2),  # H200 tuning of Llama-1B (below)
    ("decode", "half", 128): (16, 64, 4, 2),
    ("decode", "float", 32): (16, 32, 4, 2),
    ("decode", "float", 64): (16, 32, 4, 2),
    ("decode", "float", 128): (16, 32, 8, 2),
    ("prefill", "half", 32): (128, 64, 4, 2),
    ("prefill", "half", 64): (64, 64, 4, 3),  # H200 tuning of Llama-1B (below)
    ("prefill", "half", 128): (128, 32, 8, 2),
    ("prefill", "float", 32): (32, 32, 4, 2),
    ("prefill", "float", 64): (32, 32, 4, 2),
    ("prefill", "float", 128): (16, 32, 8, 2),
    # Head dim 256, first choices read off ptxas (Triton 3.6), not yet timed: fp16/bf16 decode 16 x 32 tiles at 8
    # warps (4 spill 48 bytes at 64-key blocks on sm_90), prefill 64 x 32 at 8 warps (4 spill 160-304 bytes, 128 rows
    # 64-464), both spill-free on sm_80 and sm_90 in 42 and 70-98 KB of shared memory. fp32 spills at any tile; the
    # smallest, 16 x 16 at 8 warps, spills 64-72 bytes at prefill and about 300 at decode (test_register_budget's
    # known spills): an fp32 Gemma on the GPU runs, slower than it could.
    ("decode", "half", 256): (16, 32, 8, 2),
    ("decode", "float", 256): (16, 16, 8, 2),
    ("prefill", "half", 256): (64, 32, 8, 2),
    ("prefill", "float", 256): (16, 16, 8, 2),
}
# Decode specs split the cache into at most this many programs (one wave of the H100's and H200's 132 SMs;
# split_keys rounds down), never into chunks under SPLIT_MIN_KEYS. 0: one pass (the prefill specs: enough row
# tiles). One wave, not two, from the H200 sweep at Llama-1B's heads (scripts/decode_attention_sweep.py, session
# 14): 1x4096 15.9 us against 18.8 (chunks of 384 keys, not 256), 16x1024 16.1 against 16.8 (128 programs: one
# pass, the merge launch saved), 1x1024 the same 10.3. Rounded down, 132 splits batch 1 as the rounded-up 128 did
# (8 programs of Llama-1B: 16 chunks; 12 of GPT-2: 11).
SPLIT_TARGET = 132
SPLIT_MIN_KEYS = 256


# A decode step of many (batch, KV head) programs streams its cache better with one more stage in flight: on the
# H200 (scripts/decode_attention_sweep.py, session 17, fp16, head dim 64, 128-key blocks, 4 warps), 3 stages against
# 2 at batch 16: Llama-1B's 8 KV heads 58.5 against 71.0 us at cache 4096; GPT-2's 12 heads 65.9 against 78.0 at
# 4096 and 21.2 against 22.3 at 1024. At batch 1 (8 or 12 programs, split into chunks) 2 stages stay ahead, 13.6
# against 13.9 us and 9.9 against 10.3. So from DECODE_WIDE programs (B * Nkv) on, the decode spec takes
# _WIDE_STAGES where the sweep measured it: fp16/bf16 at BLOCK_D 64 (head dims 64 and 40, which share its tiles
# everywhere); other head dims and fp32 keep one decode spec.
DECODE_WIDE = 64
_WIDE_STAGES = {("half", 64): 3}
# With the merge in the chunks' launch, the wide spec splits up to two programs a SM (scripts/gpu_session20.sh
# micro, H100, fp16, head dim 64, 3 stages, kernel alone, session 21): 16x4096 53.4 against 59.8 us one pass and
# 61.6 at one wave at Llama-1B's heads, 8x4096 31.8 against 36.4; GPT-2's 8x4096 44.4 against 54.7, its batch 16
# left whole (192 programs). Rounded up (session 20), 256 had lost at GPT-2's: 192 x 2 = 384 programs on 264
# slots, 86.3 us at 16x4096. End to end, Llama-1B decode 16x4096 1.030x and 16x1024 1.011x (bench/results).
_WIDE_SPLIT = {("half", 64): 2 * SPLIT_TARGET}


def block_config(head_dim: int, type_name: str, rows: int, kv_programs: int = 1) -> dict:
    """Tiles and launch options for a head dim, element type, packed row count G * S (the decode tiles for
    rows <= DECODE_ROWS) and B * Nkv programs (kv_programs: the decode stages from DECODE_WIDE on). BLOCK_D is
    the head dim rounded up to a power of two (masked lanes)."""
    decode = rows <= DECODE_ROWS
    kind = ("decode" if decode else "prefill", "float" if type_name == "float" else "half", block_d(head_dim))
    block_m, block_n, warps, stages = _CONFIGS[kind]
    split = SPLIT_TARGET if decode else 0
    if decode and kv_programs >= DECODE_WIDE:
        stages = _WIDE_STAGES.get(kind[1:], stages)
        split = _WIDE_SPLIT.get(kind[1:], split)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=kind[2], num_warps=warps, num_stages=stages,
                SPLIT_TARGET=split, FUSED_MERGE=int(decode))


# PHASE 2 merges the chunk states MERGE_BLOCK chunks at a time (kernels/causal_attention.py `_merge_blocked`),
# their loads issued together; 0 merges them one after another (the first design, kept for the GPU sweep).
# MERGE_BLOCK chunk tiles of acc (fp32 [BLOCK_M, BLOCK_D] each) held at about 64 registers a thread, so 8 chunks
# for the fp16 decode spec at head dim 64 (a split makes 2 to ~16 chunks at Llama's and GPT-2's decode shapes;
# H200, Llama-1B heads, PHASE 2 alone, the Triton JIT's build: 4, 8 and 16 chunks a block 4.2, 4.1, 4.8 us at
# 5 chunks, 5.5, 5.7, 5.8 at 11, the loop 4.8 and 7.4). Through the AOT library, GPT-2 small's whole decode step
# with CUDA graphs: 1.027x at 1x1024, 1.040x at 1x4096 against the loop (session 16, bench/results/README.md).
MERGE_REGISTERS = 64


def merge_block(head_dim: int, block_m: int, num_warps: int) -> int:
    """Chunks PHASE 2 merges at once: a power of two from 2 to 8 whose acc tiles take about MERGE_REGISTERS
    fp32 registers a thread (BLOCK_D: the head dim rounded up). At most 8: 16 spilled 8 bytes at head dim 32 on
    sm_80 (ptxas, Triton 3.6)."""
    per_thread = max(1, MERGE_REGISTERS * 32 * num_warps // (block_m * block_d(head_dim)))
    return max(2, min(8, 1 << (per_thread.bit_length() - 1)))


def merge_of(cfg: dict, head_dim: int) -> int:
    """The MERGE_BLOCK a config runs: 0 without a split (nothing to merge), else the config's own or
    merge_block's for its tiles. The library's spec (_spec) and the torch entry point both take it from here."""
    if int(cfg.get("SPLIT_TARGET", 0)) <= 0:
        return 0
    return int(cfg.get("MERGE_BLOCK", merge_block(head_dim, cfg["BLOCK_M"], cfg["num_warps"])))


# A split spec with FUSED_MERGE runs the chunks and their merge in one launch (PHASE 3, kernels/causal_attention.py):
# the last chunk of each row tile to finish, by a ticket counter, merges. That saves the merge launch, but needs
# zeroed counters that outlive the launch: the native library keeps MERGE_COUNTERS of them per node and CUDA stream
# (concurrent runs of a session may run on different streams), made at the node's first run on that stream outside
# a CUDA-graph capture; a node first met inside one, or with more row tiles than counters, runs the two launches.
# The decode specs' default since the H200 timed it (session 19, fp16, Llama-1B's heads, head dim 64):
# - the kernel alone, CUDA-graph replays (scripts/decode_attention_sweep.py --merge blocked,fused): 1x1024 7.59
#   against 9.69 us, 1x4096 11.58 against 13.71 (the built-in tiles and split);
# - Llama-1B's decode step through ORT with CUDA graphs, in alternating rounds against the two launches (bench.ab):
#   1.033x at 1x1024, 1.028x at 1x4096, the same logits (bench/results/README.md, "Session 19").
MERGE_COUNTERS = 4096


def split_keys(t: int, programs: int, block_n: int, target: int, min_keys: int = SPLIT_MIN_KEYS) -> int:
    """Keys per chunk when `programs` programs stream T keys and a spec allows at most `target` programs;
    0 for one pass (no split asked, fewer than two chunks fit under the target, or a cache that makes one
    chunk). Chunks round down: programs * chunks never passes the target, so a target of whole waves never
    starts a partial one (rounded up, 96 programs x 3 chunks ran 288 programs on 264 slots). A multiple of
    BLOCK_N, so no key block straddles two chunks. native/causal_attention.c computes the same (min_keys:
    the spec's SPLIT_MIN_KEYS const; tests lower it to split small caches)."""
    want = target // programs if target > 0 and programs > 0 else 0
    if want < 2 or t <= min_keys:
        return 0
    chunk = max(-(-t // want), min_keys)
    chunk = -(-chunk // block_n) * block_n
    return chunk if chunk < t else 0


def split_chunks(t: int, chunk: int) -> int:
    """How many chunks split_keys' `chunk` keys make of T keys (the last one partial); 1 for one pass."""
    return -(-t // chunk) if chunk else 1


def workspace_floats(programs: int, n_split: int, block_m: int, block_d: int) -> int:
    """fp32 workspace of a split launch: each chunk's acc [BLOCK_M, BLOCK_D], then its (m, l) per row."""
    return programs * n_split * block_m * (block_d + 2)


def _spec(type_name: str, keys: tuple[tuple[int, int], ...], cfg: dict) -> Spec:
    """The spec of a config (tiles, launch options, split target, and `maxnreg`, ptxas' register cap, when
    the config names one) for the key ranges ((D, D), (rows lo, rows hi), (B * Nkv lo, hi), (T lo, hi), (seq_major,
    seq_major))."""
    d = keys[0][0]
    split = int(cfg.get("SPLIT_TARGET", 0))
    return Spec(
        constexprs={"HEAD_DIM": d, "BLOCK_D": block_d(d), "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"],
                    "SPLIT_K": split > 0, "MERGE_BLOCK": merge_of(cfg, d), "KV_SEQ_MAJOR": keys[4][0]},
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        keys=tuple(keys),
        consts=(cfg["BLOCK_M"], cfg["BLOCK_N"], d, block_d(d), split, SPLIT_MIN_KEYS, int(cfg.get("FUSED_MERGE", 0))),
        divisible_by_16=("Q", "K", "V", "KB", "Y", "WS"),
        maxnreg=cfg.get("maxnreg"),
    )


def _specs(type_name: str) -> list[Spec]:
    """Per cache layout (heads first, then sequence first) and head dim: the decode spec (rows 0..DECODE_ROWS; split
    at DECODE_WIDE programs where the wide one differs), then the prefill spec (any more rows)."""
    specs = []
    for sm in (0, 1):
        layout = ((sm, sm),)
        for d in CAUSAL_HEAD_DIMS:
            narrow = block_config(d, type_name, DECODE_ROWS)
            wide = block_config(d, type_name, DECODE_ROWS, DECODE_WIDE)
            decode_rows = (0, DECODE_ROWS)
            if wide == narrow:
                specs.append(_spec(type_name, ((d, d), decode_rows, (0, ANY), (0, ANY), *layout), narrow))
            else:
                specs.append(_spec(type_name, ((d, d), decode_rows, (0, DECODE_WIDE - 1), (0, ANY), *layout), narrow))
                specs.append(_spec(type_name, ((d, d), decode_rows, (DECODE_WIDE, ANY), (0, ANY), *layout), wide))
            specs.append(_spec(type_name, ((d, d), (DECODE_ROWS + 1, ANY), (0, ANY), (0, ANY), *layout),
                               block_config(d, type_name, DECODE_ROWS + 1)))
    return specs


# ---- tuning (ort-triton tune) -------------------------------------------------------------------------
_TILE = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
_TUNED = _TILE + ("SPLIT_TARGET", "FUSED_MERGE")
# The register cap a decode candidate may carry: ptxas gives the fp16 decode spec at head dim 64 168 registers
# on sm_90 (3 programs of 4 warps an SM), 128 fits 4. A Triton JIT build that happened to take 168 ran PHASE 1
# at GPT-2's 12 heads, 16x4096 in 58 us against 82 with 229 (session 16, not yet an A/B of the AOT library).
DECODE_MAXNREG = 128


def _tune_keys(type_name: str, shapes: list, attrs: dict, n_outputs: int = 1) -> tuple[int, ...]:
    (b, nq, s, d), k = shapes[0], shapes[1]
    sm = int(attrs.get("seq_major", 0))
    nkv, t = (k[2], k[0]) if sm else (k[1], k[2])
    return (d, (nq // nkv) * s, b * nkv, t, sm)


def _tune_bucket(keys: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    # a decode bucket never crosses DECODE_ROWS: the built-in split stays where a tuned one is absent
    lo, hi = pow2_bucket(keys[1])
    lo, hi = (lo, min(hi, DECODE_ROWS)) if keys[1] <= DECODE_ROWS else (max(lo, DECODE_ROWS + 1), hi)
    return ((keys[0], keys[0]), (lo, hi), pow2_bucket(keys[2]), pow2_bucket(keys[3]), (keys[4], keys[4]))


# The tuner's split targets: one pass, then up to one, two and four waves of the H100/H200 (split_keys rounds down).
_TUNE_SPLITS = (0, SPLIT_TARGET, 2 * SPLIT_TARGET, 4 * SPLIT_TARGET)


def _tune_candidates(type_name: str, keys: tuple[int, ...], arch: int) -> list[dict]:
    """The built-in config, then tiles around it: BLOCK_M 16 only for decode rows (tl.dot's least; more rows
    would be masked), with the split targets (0: one pass); fp32's 3xTF32 dots hold operands twice, so
    smaller tiles there."""
    d, rows, programs = keys[:3]
    builtin = {k: v for k, v in block_config(d, type_name, rows, programs).items() if k in _TUNED}
    half = type_name != "float"
    ns = (32, 64, 128) if half else (16, 32, 64)
    tile = {k: builtin[k] for k in _TILE}
    if rows <= DECODE_ROWS:  # a decode kernel streams the cache: one tile height, 4 warps, the split (its merge in
        # a second launch, or fused), and ptxas' register cap (DECODE_MAXNREG: more programs an SM, for the long
        # caches of a large batch; not with the fused merge, whose PHASE 3 holds the merge's tiles too)
        tiles = tile_candidates(tile, (16,), ns, warps=(4,))
        plain = [dict(t, SPLIT_TARGET=target, FUSED_MERGE=0) for target in _TUNE_SPLITS for t in tiles]
        configs = [builtin] + plain + [dict(c, maxnreg=DECODE_MAXNREG) for c in plain]
        configs += [dict(c, FUSED_MERGE=1) for c in plain if c["SPLIT_TARGET"]]
        unique: dict[tuple, dict] = {}  # each once, first come first (the built-in repeats one)
        for c in configs:
            unique.setdefault(tuple(sorted(c.items())), c)
        return list(unique.values())
    ms = (32, 64, 128) if half else (16, 32)
    return [dict(c, SPLIT_TARGET=0, FUSED_MERGE=0) for c in tile_candidates(tile, ms, ns)]


def _tune_runner(type_name: str, shapes: list, attrs: dict, keys: tuple, config: dict, device: str):
    import torch

    from ..kernels.causal_attention import causal_attention

    dtype, (q, k, v, kb) = random_inputs(type_name, shapes[:4], device)
    b, nq, s, d = shapes[0]
    y = torch.empty((b, s, nq * d), device=device, dtype=dtype)
    scale, rows = float(attrs.get("scale", 1.0)), int(attrs.get("masked_rows", 0))
    sm = int(attrs.get("seq_major", 0))
    return lambda: causal_attention(q, k, v, kb, scale, rows, out=y, config=config, seq_major=sm)


def _upgrade(keys: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """A table from before the seq_major key (session 30): its entries are for the cache heads first."""
    return (*keys, (0, 0)) if len(keys) == 4 else keys


TUNING = Tuning(keys=_tune_keys, bucket=_tune_bucket, candidates=_tune_candidates, spec=_spec, runner=_tune_runner,
                upgrade=_upgrade)


CAUSAL_ATTENTION = OpContract(
    name="CausalAttention",
    doc="Y[b, i, h*D:(h+1)*D] = softmax_j(Q[b,h,i] . K[b,h//G,j] * scale + key_bias[b,j], j <= T-S+i) "
        "V[b,h//G]; Q [B, Nq, S, D], K/V [B, Nkv, T, D] (the present cache), key_bias [B, T], Y [B, S, Nq*D]; "
        "a row with no key: 0 (masked_rows=0) or the mean of V (1).",
    inputs=(IO("Q", "[B, Nq, S, D]"), IO("K", "[B, Nkv, T, D], T >= S (seq_major: [T, B, Nkv, D])"),
            IO("V", "as K"),
            IO("key_bias", "[B, T], additive per key")),
    outputs=(IO("Y", "[B, S, Nq*D]"),),
    attrs=(Attr("scale", "float", 1.0, "multiplies Q K^T (1/sqrt(D) usually)"),
           Attr("masked_rows", "int", 0, "a row that sees no key: 0 gives 0, 1 the mean of V over all T keys"),
           SEQ_MAJOR),
    types=("float16", "bfloat16", "float"),
    body=_body,
    reference=reference_causal_attention,
    kernel=KERNEL,
    specializations=_specs,
    tuning=TUNING,
)
