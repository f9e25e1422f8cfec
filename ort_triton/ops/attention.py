"""MultiHeadAttention: softmax(Q K^T * scale + key_bias) V over heads, on the projections' own layout.

    Q [B, Sq, N*D], K and V [B, Skv, N*D]     (the projections' MatMul outputs, before any head reshape)
    key_bias [B, Skv]                          additive, per key: 0 keeps a key, a large negative drops it
    k_bias, v_bias [N*D]                       the K and V projections' biases (zeros when there are none)
    K' = K + k_bias, V' = V + v_bias
    for each head n:  Y[b, :, n*D:(n+1)*D] = softmax(Q_n K'_n^T * scale + key_bias[b]) V'_n

The K and V biases are inputs so that two of the three bias Adds of the projections go away
(graph_rewrites folds them; the three took 0.71 ms of 11.7 in BERT-base at 8x2048 on the H200), and the
kernel needs neither as an add over K or V: q . (k + k_bias) = q . k + q . k_bias adds the same number to
every score of a query row, which softmax cancels exactly, so k_bias drops out; and the weights of a row
sum to 1, so sum_j p_j (v_j + v_bias) = sum_j p_j v_j + v_bias: v_bias is added once per output row (not
to a row with no key left, which stays 0). Q's bias stays a graph Add here: adding it to the Q tile in
registers spills on sm_90 (tests/aot/test_register_budget.py). Where the three projections read one input,
graph_rewrites/pack_qkv.py makes them one GEMM and PackedMultiHeadAttention, whose kernel adds Q's bias
by staging the Q tile through memory (ops/packed_attention.py, kernels/attention.py).

Taking the projections before the Reshape/Transpose to [B, N, S, D], and the padding mask as one bias
per key, is what lets the kernel skip both the head transposes and the [B, 1, Sq, Skv] mask that
exporters materialise: the rewriter proves the graph's mask is a key-padding mask and replaces it with
key_bias (graph_rewrites/attention.py).

A row with no key left (a fully padded sequence) is defined, NaN-free, two ways, because exporters differ:
- key_bias = finfo.min on every key (eager attention's additive mask): every score is equally tiny, the
  weights are uniform and the row is the mean of V rows;
- key_bias = -inf on every key (sdpa's boolean mask, whose export zeroes NaN rows with IsNaN/Where): the
  row is 0. The body does that too (softmax's NaN row -> 0), so the rewriter keeps either meaning exactly.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import helper

from ..contract import ANY, IO, Attr, Kernel, OpContract, Spec, Tuning, attr_ref, pow2_bucket
from .tune_space import random_inputs, tile_candidates

HEAD_DIMS = (32, 40, 64, 80, 96, 128)


def reference_attention(q, k, v, key_bias, k_bias, v_bias, num_heads, scale):
    """float64 numpy reference; inputs in the contract's layout."""
    q, k, v, kb = (np.asarray(a, np.float64) for a in (q, k, v, key_bias))
    k, v = k + np.asarray(k_bias, np.float64), v + np.asarray(v_bias, np.float64)
    b, sq, hidden = q.shape
    d = hidden // num_heads
    heads = lambda t: t.reshape(t.shape[0], t.shape[1], num_heads, d).transpose(0, 2, 1, 3)
    s = heads(q) @ heads(k).transpose(0, 1, 3, 2) * scale + kb[:, None, None, :]
    row_max = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(row_max), row_max, 0.0))  # a row of -inf: p = 0
    total = p.sum(-1, keepdims=True)
    p = np.divide(p, total, out=np.zeros_like(p), where=total > 0)  # ... and its output 0
    return ((p @ heads(v)).transpose(0, 2, 1, 3).reshape(b, sq, hidden),)


def _body(_opset: int) -> list[onnx.NodeProto]:
    """The same ops from opset 15 on (Unsqueeze takes axes as an input since 13, CastLike since 15)."""
    return [helper.make_node("Add", ["K", "k_bias"], ["k_in"]), helper.make_node("Add", ["V", "v_bias"], ["v_in"]),
            *attention_body("Q", "k_in", "v_in")]


def attention_body(q: str, k: str, v: str) -> list[onnx.NodeProto]:
    """Body nodes from Q, K, V [B, S, N*D] (biases added) and the formal key_bias to the formal Y, reading
    the attributes num_heads and scale (PackedMultiHeadAttention's body ends with them too)."""
    n = helper.make_node
    heads = n("Constant", [], ["heads"])
    heads.attribute.append(attr_ref("num_heads", onnx.AttributeProto.INT, name="value_int"))
    scale = n("Constant", [], ["scale_f"])
    scale.attribute.append(attr_ref("scale", onnx.AttributeProto.FLOAT, name="value_float"))
    const = lambda name, vals: n("Constant", [], [name], value=helper.make_tensor(name, onnx.TensorProto.INT64,
                                                                                      [len(vals)], vals))
    return [
        heads, scale,
        const("zero2", [0, 0]), const("minus1", [-1]), const("ax0", [0]), const("ax12", [1, 2]),
        n("Unsqueeze", ["heads", "ax0"], ["heads1"]),
        n("Concat", ["zero2", "heads1", "minus1"], ["split_shape"], axis=0),       # [0, 0, N, -1]
        n("Concat", ["zero2", "minus1"], ["merge_shape"], axis=0),                  # [0, 0, -1]
        n("Reshape", [q, "split_shape"], ["q3"]), n("Transpose", ["q3"], ["q4"], perm=[0, 2, 1, 3]),
        n("Reshape", [k, "split_shape"], ["k3"]), n("Transpose", ["k3"], ["k4t"], perm=[0, 2, 3, 1]),
        n("Reshape", [v, "split_shape"], ["v3"]), n("Transpose", ["v3"], ["v4"], perm=[0, 2, 1, 3]),
        n("CastLike", ["scale_f", q], ["scale_t"]),
        n("MatMul", ["q4", "k4t"], ["qk"]), n("Mul", ["qk", "scale_t"], ["scores"]),
        n("Unsqueeze", ["key_bias", "ax12"], ["bias4"]),                            # [B, 1, 1, Skv]
        n("Add", ["scores", "bias4"], ["biased"]),
        n("Softmax", ["biased"], ["probs"], axis=-1),
        # a row whose keys are all -inf: softmax gives NaN, the op gives 0 (module docstring)
        n("Constant", [], ["zero_f"], value_float=0.0), n("CastLike", ["zero_f", q], ["zero_t"]),
        n("IsNaN", ["probs"], ["nan_rows"]), n("Where", ["nan_rows", "zero_t", "probs"], ["probs_ok"]),
        n("MatMul", ["probs_ok", "v4"], ["o4"]), n("Transpose", ["o4"], ["o3"], perm=[0, 2, 1, 3]),
        n("Reshape", ["o3", "merge_shape"], ["Y"]),
    ]


# The kernel: ort_triton/kernels/attention.py. One program computes BLOCK_M query rows of one (batch, head)
# and streams the keys in blocks of BLOCK_N with the online softmax; BLOCK_D is D rounded up to a power of
# two (40 -> 64, 80/96 -> 128: Triton's tiles are powers of two), the extra lanes masked. The grid is one
# flat axis of ceil(Sq / BLOCK_M) * B * N programs, the query block fastest (grid.y would stop B * N at
# 65535). Only the pointers are promised 16-byte aligned: every head dim here is a multiple of 8, so row
# starts (n * D elements) and the row stride (N * D) are 16-byte multiples in fp16/bf16/fp32 too, and Triton
# sees that through the constexpr HEAD_DIM (16-byte vector loads without a hint on N). The packed form
# (PACKED, ops/packed_attention.py) keeps both: its row stride 3 * N * D and the K and V pointers, N * D and
# 2 * N * D elements into QKV, are 16-byte multiples too.
KERNEL = Kernel(
    module="ort_triton.kernels.attention",
    fn_name="attention_fwd",
    signature={"Q": "*{T}", "K": "*{T}", "V": "*{T}", "KB": "*{T}", "BQ": "*{T}", "BV": "*{T}", "Y": "*{T}",
               "N": "i32", "SQ": "i32", "SKV": "i32", "scale": "fp32"},
    native_plan="ot_attention_plan",
    native_params="ot_attention_params",
    dispatch_keys=("head_dim", "seq_div16", "sq", "batch_heads"),  # sq, B * N: narrow tuned specs only
)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per element type and BLOCK_D. fp16/bf16 at BLOCK_D=64 (BERT's
# head dim) comes from the H200 sweep: 4 warps, 3 stages, 1.8x the first choice at 8x2048; the others are
# first choices, to be swept. Checked with ptxas (Triton 3.6): no spills on sm_90 (255 registers at D=64);
# on sm_8x 4 warps at D=64 spill, so those GPUs keep 8 warps, 2 stages (_PRE_HOPPER). fp32 spills (ptxas, Triton
# 3.6, session 27): 96-144 bytes at BLOCK_D=64, 1.2-1.3 KB at 128 on sm_80 and sm_90, and no tile tried at 128 is
# spill-free (16 x 16 at 8 warps still 80-104 bytes); fp32 runs right but is not a timed target.
# Shared memory: at most 48 KB on sm_8x, 64 KB on sm_90 (fp16/bf16),
# 72 KB (fp32): under sm_86/89's 99 KB, so an image also runs on a later GPU of its major. fp16/bf16 take
# 128 query rows per program like FlashAttention-2; fp32 dots run as 3xTF32, which holds each operand
# twice: 32x32 tiles.
_CONFIGS = {
    ("half", 32): (128, 64, 4, 2),
    ("half", 64): (128, 64, 4, 3),  # H200 sweep: bench/results/attention_sweep_h200_*.json
    ("half", 128): (128, 32, 8, 2),
    ("float", 32): (32, 32, 4, 2),
    ("float", 64): (32, 32, 4, 2),
    ("float", 128): (32, 32, 4, 2),
}
# (num_warps, num_stages) on sm_8x where the sm_90 choice spills there (ptxas: 72-104 bytes of stack at
# 4 warps, where mma.sync holds the tiles in registers): the pre-sweep 8 warps, 2 stages
_PRE_HOPPER = {("half", 64): (8, 2)}


def block_d(head_dim: int) -> int:
    """The head dim rounded up to a power of two, at least 16: Triton's tiles are powers of two (the extra
    lanes are masked) and tl.dot takes K >= 16. Both attention kernels' BLOCK_D."""
    return max(16, 1 << (head_dim - 1).bit_length())


# The warp-specialised kernel (kernels/attention.py `_attention_ws`, the spec constexpr WS): Hopper on, fp16 and
# bf16, head dims that are a power of two (its TMA boxes are [rows, D] at column n * D, with no lanes to mask),
# key counts that are multiples of 16 (the key bias as a [B, SKV] descriptor: TMA wants its rows 16-byte aligned).
# Triton 3.6's pass rejects the packed kernel at head dim 128 (Q's bias in registers: the compile fails inside
# the warp-specialisation pass).
# Experimental, off unless ORT_TRITON_EXPERIMENTAL_WS=1: on the H200 (session 19) its first launch, BERT-base's
# packed attention at 8x2048, head dim 64, had not returned after 5 minutes, and the kernel tests gave no result in
# 2 minutes. Most likely a hang in the kernel (the same specs compiled for sm_90 on a CPU, session 18), not yet
# shown. Until a GPU run shows where it waits, `ort-triton tune` does not offer it (a hung launch would take the
# tuner and the GPU with it), and a table, a build or a call that asks for it is refused with the variable's name.
WS_ARCH = 90
WS_HEAD_DIMS = (32, 64, 128)
WS_ENV = "ORT_TRITON_EXPERIMENTAL_WS"


def ws_enabled() -> bool:
    """Whether the experimental warp-specialised kernel may be tuned, built and run (WS_ENV=1)."""
    return os.environ.get(WS_ENV) == "1"


def require_ws() -> None:
    """Raise ValueError, naming WS_ENV, unless the experimental warp-specialised kernel was asked for."""
    if not ws_enabled():
        raise ValueError(f"attention: the warp-specialised (WS) kernel is experimental: its first launch on the H200 "
                         f"did not return; set {WS_ENV}=1 to tune, build or run it anyway, or drop the WS entries "
                         "from the tuning table")


def ws_supported(head_dim: int, type_name: str, arch: int, packed: bool = False) -> bool:
    """Whether the warp-specialised kernel compiles for this head dim, element type and arch."""
    return (arch >= WS_ARCH and type_name != "float" and head_dim in WS_HEAD_DIMS
            and not (packed and head_dim == 128))


def block_config(head_dim: int, type_name: str) -> dict:
    """Tile sizes and launch options for a head dim and element type (pre_hopper: those for sm_8x, or None
    for the same). BLOCK_D is the head dim rounded up to a power of two (Triton's tiles are powers of two;
    the extra lanes are masked)."""
    kind = ("float" if type_name == "float" else "half", block_d(head_dim))
    block_m, block_n, warps, stages = _CONFIGS[kind]
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=kind[1], num_warps=warps, num_stages=stages,
                pre_hopper=_PRE_HOPPER.get(kind))


def attention_specs(type_name: str, packed: bool = False) -> list[Spec]:
    """Per head dim two specs, the first for Sq and Skv multiples of 16 (the native planner takes the first
    that fits). Knowing Skv % 16 == 0 tells Triton that each batch's key-bias row starts 16-byte aligned, so
    those loads become asynchronous copies pipelined with K and V; without it they are synchronous loads
    inside the key loop (SASS for sm_90, D=64: 24 -> 48 LDGSTS). Measured on the H200 in BERT-base
    (8x2048): the kernel without the hint took 0.46 ms a layer inside ORT against 0.31 ms through Triton's
    JIT, which adds the hint by itself."""
    specs = []
    for d in HEAD_DIMS:
        cfg = block_config(d, type_name)
        for aligned in (1, 0):
            # tuned specs narrow Sq and B * N
            specs.append(_spec(type_name, ((d, d), (aligned, 1), (0, ANY), (0, ANY)), cfg, packed))
    return specs


def _spec(type_name: str, keys: tuple[tuple[int, int], ...], cfg: dict, packed: bool = False) -> Spec:
    """The spec of a config for the key ranges ((D, D), (aligned lo, 1), (Sq lo, hi), (B * N lo, hi));
    aligned lo = 1 promises Sq and Skv multiples of 16. packed: the kernel of PackedMultiHeadAttention
    (ops/packed_attention.py)."""
    d, aligned = keys[0][0], keys[1][0]
    if cfg.get("WS"):
        require_ws()
    if cfg.get("WS") and not aligned:
        raise ValueError("attention: a warp-specialised (WS) spec needs the aligned keys (Sq, Skv multiples of 16)")
    return Spec(
        constexprs={"HEAD_DIM": d, "BLOCK_D": block_d(d), "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"],
                    "PACKED": packed, "WS": bool(cfg.get("WS", False))},
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        keys=tuple(keys),
        pre_hopper=cfg.get("pre_hopper"),
        consts=(cfg["BLOCK_M"], cfg["BLOCK_N"], d),
        divisible_by_16=("Q", "K", "V", "KB", "BQ", "BV", "Y") + (("SQ", "SKV") if aligned else ()),
        min_arch=WS_ARCH if cfg.get("WS") else 0,
    )


# ---- tuning (ort-triton tune) -------------------------------------------------------------------------


def _tune_keys(type_name: str, shapes: list, attrs: dict, n_outputs: int = 1) -> tuple[int, ...]:
    (b, sq, hidden), skv, heads = shapes[0], shapes[1][1], int(attrs["num_heads"])
    return (hidden // heads, int(sq % 16 == 0 and skv % 16 == 0), sq, b * heads)


def _tune_bucket(keys: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    # B * N too: the grid's size decides the tile (64 rows fill an H200 at batch 1, 128 at batch 32)
    return ((keys[0], keys[0]), (keys[1], 1), pow2_bucket(keys[2]), pow2_bucket(keys[3]))


def _tune_candidates(type_name: str, keys: tuple[int, ...], arch: int, packed: bool = False) -> list[dict]:
    """The built-in config for arch, then the tiles around it (fp32: 3xTF32 dots, smaller tiles), then on Hopper
    with WS_ENV=1 the warp-specialised kernel's: 128 rows (two consumer groups of 64: the pass's data
    partitioning), 4 warps a group, key blocks of 64 and 128, 2 and 3 buffers."""
    cfg = block_config(keys[0], type_name)
    warps, stages = cfg["pre_hopper"] if cfg["pre_hopper"] and arch < 90 else (cfg["num_warps"], cfg["num_stages"])
    builtin = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=warps, num_stages=stages)
    half = type_name != "float"
    ms, ns = ((64, 128), (32, 64, 128)) if half else ((16, 32, 64), (16, 32, 64))
    candidates = tile_candidates(builtin, ms, ns)
    if keys[1] and ws_enabled() and ws_supported(keys[0], type_name, arch, packed):  # aligned: the key bias's rows
        candidates += [dict(c, WS=True) for c in tile_candidates(dict(BLOCK_M=128, BLOCK_N=128, num_warps=4,
                                                                        num_stages=2), (128,), (64, 128), (4,))]
    return candidates


def _tune_runner(type_name: str, shapes: list, attrs: dict, keys: tuple, config: dict, device: str):
    import torch

    from ..kernels.attention import attention

    dtype, (q, k, v, kb) = random_inputs(type_name, shapes[:4], device)
    v_bias = torch.zeros(shapes[0][-1], device=device, dtype=dtype)
    y = torch.empty_like(q)
    heads, scale = int(attrs["num_heads"]), float(attrs.get("scale", 1.0))
    return lambda: attention(q, k, v, kb, heads, scale, v_bias=v_bias, out=y, config=config)


TUNING = Tuning(keys=_tune_keys, bucket=_tune_bucket, candidates=_tune_candidates, spec=_spec, runner=_tune_runner)


MULTI_HEAD_ATTENTION = OpContract(
    name="MultiHeadAttention",
    doc="Y = concat_n softmax(Q_n K'_n^T * scale + key_bias) V'_n with K' = K + k_bias, V' = V + v_bias; "
        "Q/K/V [B, S, N*D], key_bias [B, Skv], biases [N*D].",
    inputs=(IO("Q", "[B, Sq, N*D]"), IO("K", "[B, Skv, N*D]"), IO("V", "[B, Skv, N*D]"),
            IO("key_bias", "[B, Skv], additive per key"), IO("k_bias", "[N*D], added to K"),
            IO("v_bias", "[N*D], added to V")),
    outputs=(IO("Y", "[B, Sq, N*D]"),),
    attrs=(Attr("num_heads", "int", 1, "N"), Attr("scale", "float", 1.0, "multiplies Q K^T (1/sqrt(D) usually)")),
    types=("float16", "bfloat16", "float"),
    body=_body,
    reference=reference_attention,
    kernel=KERNEL,
    specializations=attention_specs,
    tuning=TUNING,
)
