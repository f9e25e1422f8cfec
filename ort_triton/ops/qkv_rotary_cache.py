"""QKVRotaryCache: what a decoder layer does between its packed Q/K/V projection and attention, in one op.

    QKV [B, S, (Nq + 2 Nkv) D]     the packed projection (pack_projections' MatMul): q | k | v along the last dim
    cos, sin                        as Rotary's: [B', S', W] or [B', 1, S', W], W = R or R/2
    past_key, past_value [B, Nkv, P, D]
    Q             = Rotary(Transpose(q as [B, S, Nq, D]))                       [B, Nq, S, D]
    present_key   = Concat(past_key, Rotary(Transpose(k as [B, S, Nkv, D])), axis 2)    [B, Nkv, P + S, D]
    present_value = Concat(past_value, Transpose(v as [B, S, Nkv, D]), axis 2)          [B, Nkv, P + S, D]

Nkv and D are past_key's dims 1 and 3 (seq_major: 2 and 3), Nq what the rest of QKV's last dim holds: the op needs
no head attributes, so a node cannot disagree with its inputs. The rotary attributes and maths are Rotary's
(ort_triton/ops/rotary.py), applied to q and k with the same cos and sin.

Why one op: after packing, a decode step of a Llama layer ran six launch-bound kernels here (the Split, two
Rotary or TransposeRotary, V's Transpose, the two cache Concats), 1.5-2 us each on the H200 for a few KB
of new rows; the past's copy into present is the only real traffic, and it stays (the graph's cache is
functional: present is a new tensor), unless the cache is laid out sequence first (seq_major) and the caller
binds present over past: then the kernel writes the new rows only (ops/kv_layout.py).

The body is the original's subgraph in stock ops (Split by sizes computed from the shapes, Reshape,
Transpose, Rotary's body on q and on k, Concat), so a fused model on ORT CPU gives the original's bits.

The kernel (ort_triton/kernels/qkv_rotary_cache.py), one launch over a flat grid: first one program per
(s-block, head of Nq + 2 Nkv, batch) tile of new rows, read from QKV, rotated (q, k) or not (v), written
to Q or to present at row P + s; then one program per BLOCK_C elements of each (batch, kv head) slab of
past_key and past_value, copied to the start of the same slab of present.

QKVNormRotaryCache: the same with a per-head RMSNorm of q and of k before their rotation (Qwen3's q_norm and
k_norm, over D with a gamma [D] each):

    Q           = Rotary(Transpose(RMSNorm(q as [B, S, Nq, D], q_gamma)))
    present_key = Concat(past_key, Rotary(Transpose(RMSNorm(k as [B, S, Nkv, D], k_gamma))), axis 2)

RMSNorm as ort_triton/ops/rms_norm.py defines it (fp32, rounded once to T), so the rotation reads the same T
values as the unfused RMSNorm -> TransposeRotary chain. Without it such a layer keeps eight small kernels a decode
step (two RMSNorm, two TransposeRotary, the Split, V's Transpose, two cache Concats).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..contract import IO, Kernel, OpContract, Spec, renamed
from .kv_layout import SEQ_MAJOR, from_heads, heads_in, heads_out, to_heads
from .rms_norm import RMS_NORM, reference_rms_norm, rms_norm_body
from .rotary import ROTARY, reference_rotary, rope_specs, rotary_body

# Elements of past one copy program moves: 4096 fp16 at 4 warps is 32 a thread, four 16-byte vectors.
BLOCK_C = 4096
# Copy programs a tensor at most with the cache sequence first (ops/kv_layout.py), each taking every n-th block: a
# present bound over its past launches them all to find nothing to copy, so their count is bounded (about four a SM).
COPY_PROGRAMS = 512

KERNEL = Kernel(
    module="ort_triton.kernels.qkv_rotary_cache",
    fn_name="qkv_rotary_cache_fwd",
    signature={"QKV": "*{T}", "COS": "*{T}", "SIN": "*{T}", "PK": "*{T}", "PV": "*{T}", "Q": "*{T}",
               "K": "*{T}", "V": "*{T}", "NQ": "i32", "NKV": "i32", "S": "i32", "P": "i32", "D": "i32", "R": "i32",
               "cos_b": "i32", "cos_s": "i32", "per_pair": "i32", "interleaved": "i32", "n_new": "i32",
               "B": "i32", "seq_major": "i32", "copy": "i32"},
    native_plan="ot_qkv_rotary_cache_plan",
    native_params="ot_qkv_rotary_cache_params",
    dispatch_keys=("head_dim", "aligned", "half_split"),
)


def _specs(_type_name: str) -> list[Spec]:
    """Rotary's (per BLOCK_D, the half-split spec, an aligned spec, then one for any), the copy block fixed."""
    return rope_specs(("QKV", "COS", "SIN", "PK", "PV", "Q", "K", "V"), {"BLOCK_C": BLOCK_C}, (BLOCK_C, COPY_PROGRAMS))


def heads(qkv_shape, past_shape) -> tuple[int, int, int]:
    """(Nq, Nkv, D) of a QKV and past_key shape; ValueError when QKV's last dim is not (Nq + 2 Nkv) D."""
    nkv, d = int(past_shape[1]), int(past_shape[3])
    width = int(qkv_shape[-1])
    if d < 1 or nkv < 1 or width % d or width // d <= 2 * nkv:
        raise ValueError(f"QKV's last dim {width} is not (Nq + 2 * {nkv}) * {d} with Nq >= 1 (past_key "
                         f"{list(past_shape)})")
    return width // d - 2 * nkv, nkv, d


def split_heads(qkv, past_shape):
    """QKV [B, S, (Nq + 2 Nkv) D] (numpy) as q [B, Nq, S, D], k and v [B, Nkv, S, D]: the split and head
    transpose QKVRotaryCache and QKVCache share (the references)."""
    nq, nkv, d = heads(qkv.shape, past_shape)
    b, s = qkv.shape[:2]
    parts = np.split(qkv, [nq * d, (nq + nkv) * d], axis=-1)
    return tuple(t.reshape(b, s, n, d).transpose(0, 2, 1, 3) for t, n in zip(parts, (nq, nkv, nkv)))


def reference_qkv_rotary_cache(qkv, cos, sin, past_key, past_value, interleaved=0, rotary_dim=0, seq_major=0):
    """float64 numpy reference, step by step as the decomposed graph does it."""
    qkv = np.asarray(qkv, np.float64)
    past_key, past_value = (to_heads(np.asarray(a, np.float64), seq_major) for a in (past_key, past_value))
    q, k, v = split_heads(qkv, past_key.shape)
    (q_rot,) = reference_rotary(q, cos, sin, interleaved, rotary_dim)
    (k_rot,) = reference_rotary(k, cos, sin, interleaved, rotary_dim)
    return (q_rot, *presents(past_key, past_value, k_rot, v, seq_major))


def presents(past_key, past_value, k, v, seq_major: int):
    """(present_key, present_value) in the op's layout from heads-first pasts and new rows (the references)."""
    return (from_heads(np.concatenate([past_key, k], axis=2), seq_major),
            from_heads(np.concatenate([past_value, v], axis=2), seq_major))


def heads_body(qkv: str, q_t: str = "q_t", past: str = "past_key") -> list[onnx.NodeProto]:
    """The body nodes that split `qkv` [B, S, (Nq + 2 Nkv) D] into `q_t` [B, Nq, S, D], k_t and v_t
    [B, Nkv, S, D] (Split by sizes computed from the shapes, Reshape, Transpose; stock ops of opset 15), Nkv
    and D from `past` (the function's past_key, heads first): QKVRotaryCache's and QKVCache's bodies
    (ort_triton/ops/qkv_cache.py)."""
    n = helper.make_node
    ints = lambda name, vals: n("Constant", [], [name], value=helper.make_tensor(name, onnx.TensorProto.INT64,
                                                                                 [len(vals)], vals))
    return [
        ints("two1", [2]), ints("keep_bs", [0, 0, -1]),
        # sizes [Nq D, Nkv D, Nkv D] from the shapes: Nkv D = past_key's dims 1 x 3, Nq D the rest
        n("Shape", [past], ["nkv"], start=1, end=2), n("Shape", [past], ["d"], start=3),
        n("Shape", [qkv], ["width"], start=2), n("Mul", ["nkv", "d"], ["kv_w"]),
        n("Mul", ["kv_w", "two1"], ["kv_w2"]), n("Sub", ["width", "kv_w2"], ["q_w"]),
        n("Concat", ["q_w", "kv_w", "kv_w"], ["sizes"], axis=0),
        n("Split", [qkv, "sizes"], ["q", "k", "v"], axis=2),
        # each to [B, S, N, D] (Reshape's 0 keeps B and S), then heads first
        n("Concat", ["keep_bs", "d"], ["bsnd"], axis=0),
        *[node for t in "qkv" for node in (n("Reshape", [t, "bsnd"], [f"{t}4"]),
                                           n("Transpose", [f"{t}4"], [q_t if t == "q" else f"{t}_t"],
                                             perm=[0, 2, 1, 3]))],
    ]


def _body(opset: int, norm: bool = False) -> list[onnx.NodeProto]:
    """QKVRotaryCache's body; norm: QKVNormRotaryCache's, q and k RMSNorm-ed (the RMSNorm op's body) first."""
    nodes, q, k = cache_in() + heads_body("QKV", past="past_key_h"), "q_t", "k_t"
    if norm:  # RMSNorm over the last axis, D, is the same before the head transpose or after it
        nodes += [*renamed(rms_norm_body("q_t", opset), "nq_", {"gamma": "q_gamma", "Y": "q_n"}),
                  *renamed(rms_norm_body("k_t", opset), "nk_", {"gamma": "k_gamma", "Y": "k_n"})]
        q, k = "q_n", "k_n"
    return nodes + [
        *rotary_body(opset, q, "Q", prefix="rq_"),
        *rotary_body(opset, k, "k_rot", prefix="rk_"),
        *cache_out("k_rot", "v_t"),
    ]


def cache_in() -> list[onnx.NodeProto]:
    """The body's past_key and past_value heads first, as past_key_h and past_value_h (ops/kv_layout.py)."""
    return heads_in([("past_key", "past_key_h"), ("past_value", "past_value_h")])


def cache_out(k: str, v: str) -> list[onnx.NodeProto]:
    """present_key and present_value: the heads-first pasts and new rows k, v concatenated, in the op's layout."""
    n = helper.make_node
    return [n("Concat", ["past_key_h", k], ["present_key_h"], axis=2),
            n("Concat", ["past_value_h", v], ["present_value_h"], axis=2),
            *heads_out([("present_key_h", "present_key"), ("present_value_h", "present_value")])]


QKV_ROTARY_CACHE = OpContract(
    name="QKVRotaryCache",
    doc="Packed QKV [B, S, (Nq + 2 Nkv) D] split into heads; Q = Rotary(q) [B, Nq, S, D]; present_key = "
        "Concat(past_key, Rotary(k)), present_value = Concat(past_value, v) along the sequence, [B, Nkv, P + S, D]; "
        "Nkv and D from past_key; cos, sin and the attributes as Rotary's.",
    inputs=(IO("QKV", "[B, S, (Nq + 2 Nkv) D]"), *ROTARY.inputs[1:],
            IO("past_key", "[B, Nkv, P, D] (seq_major: [P, B, Nkv, D])"), IO("past_value", "as past_key")),
    outputs=(IO("Q", "[B, Nq, S, D]"), IO("present_key", "[B, Nkv, P + S, D] (seq_major: [P + S, B, Nkv, D])"),
             IO("present_value", "as present_key")),
    attrs=(*ROTARY.attrs, SEQ_MAJOR),
    types=ROTARY.types,
    body=_body,
    reference=reference_qkv_rotary_cache,
    kernel=KERNEL,
    specializations=_specs,
)


# ---- QKVNormRotaryCache: q and k each RMSNorm-ed over D first (Qwen3) ------------------------------------------

NORM_KERNEL = Kernel(
    module="ort_triton.kernels.qkv_rotary_cache",
    fn_name="qkv_norm_rotary_cache_fwd",
    signature={"QKV": "*{T}", "COS": "*{T}", "SIN": "*{T}", "PK": "*{T}", "PV": "*{T}", "QG": "*{T}", "KG": "*{T}",
               "Q": "*{T}", "K": "*{T}", "V": "*{T}", "NQ": "i32", "NKV": "i32", "S": "i32", "P": "i32", "D": "i32",
               "R": "i32", "cos_b": "i32", "cos_s": "i32", "per_pair": "i32", "interleaved": "i32", "n_new": "i32",
               "eps": "fp32", "B": "i32", "seq_major": "i32", "copy": "i32"},
    native_plan="ot_qkv_norm_rotary_cache_plan",
    native_params="ot_qkv_norm_rotary_cache_params",
    dispatch_keys=("head_dim", "aligned", "half_split"),
)


def _norm_specs(_type_name: str) -> list[Spec]:
    return rope_specs(("QKV", "COS", "SIN", "PK", "PV", "QG", "KG", "Q", "K", "V"), {"BLOCK_C": BLOCK_C},
                      (BLOCK_C, COPY_PROGRAMS))


def reference_qkv_norm_rotary_cache(qkv, cos, sin, past_key, past_value, q_gamma, k_gamma, interleaved=0,
                                    rotary_dim=0, epsilon=1e-6, seq_major=0):
    """float64 numpy reference: split, RMSNorm of each q and k head over D, then QKVRotaryCache's rotation."""
    qkv = np.asarray(qkv, np.float64)
    past_key, past_value = (to_heads(np.asarray(a, np.float64), seq_major) for a in (past_key, past_value))
    q, k, v = split_heads(qkv, past_key.shape)
    (q,) = reference_rms_norm(q, q_gamma, epsilon)
    (k,) = reference_rms_norm(k, k_gamma, epsilon)
    (q_rot,) = reference_rotary(q, cos, sin, interleaved, rotary_dim)
    (k_rot,) = reference_rotary(k, cos, sin, interleaved, rotary_dim)
    return (q_rot, *presents(past_key, past_value, k_rot, v, seq_major))


QKV_NORM_ROTARY_CACHE = OpContract(
    name="QKVNormRotaryCache",
    doc="QKVRotaryCache with each q and k head RMSNorm-ed over D before its rotation: Q = Rotary(RMSNorm(q, "
        "q_gamma)), present_key = Concat(past_key, Rotary(RMSNorm(k, k_gamma))), present_value = Concat(past_value, "
        "v); RMSNorm as the RMSNorm op's (fp32, rounded once).",
    inputs=(*QKV_ROTARY_CACHE.inputs, IO("q_gamma", "[D], q's RMSNorm weight"), IO("k_gamma", "[D], k's")),
    outputs=QKV_ROTARY_CACHE.outputs,
    attrs=(*ROTARY.attrs, *RMS_NORM.attrs, SEQ_MAJOR),
    types=ROTARY.types,
    body=lambda opset: _body(opset, norm=True),
    reference=reference_qkv_norm_rotary_cache,
    kernel=NORM_KERNEL,
    specializations=_norm_specs,
)
