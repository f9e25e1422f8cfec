"""QKVCache: what a decoder layer without rotary (GPT-2) does between its packed Q/K/V projection and attention,
in one op.

    QKV [B, S, (Nq + 2 Nkv) D]     the packed projection's MatMul (GPT-2's c_attn): q | k | v along the last dim
    bias [(Nq + 2 Nkv) D]          its bias (zeros where the model has none)
    past_key, past_value [B, Nkv, P, D]
    q, k, v       = Split(QKV + bias, [Nq D, Nkv D, Nkv D], axis=-1)
    Q             = Transpose(q as [B, S, Nq, D], perm=[0, 2, 1, 3])                           [B, Nq, S, D]
    present_key   = Concat(past_key, Transpose(k as [B, S, Nkv, D]), axis 2)                    [B, Nkv, P + S, D]
    present_value = Concat(past_value, Transpose(v as [B, S, Nkv, D]), axis 2)                  [B, Nkv, P + S, D]

Nkv and D are past_key's dims 1 and 3 (seq_major: 2 and 3), Nq what the rest of QKV's last dim holds, as
QKVRotaryCache's (ort_triton/ops/qkv_rotary_cache.py): no head attributes, so a node cannot disagree with its
inputs; seq_major is the cache's layout (ops/kv_layout.py).

Why one op: a GPT-2 decode step ran seven launch-bound kernels a layer here (the bias Add, the Split, three
Transposes, the two cache Concats) for a few KB of new rows; the past's copy into present is the only real
traffic, and it stays (the graph's cache is functional: present is a new tensor) unless present is bound over its
past in the sequence-first layout.

The body is the original's subgraph in stock ops (Add, then QKVRotaryCache's Split, Reshapes and
Transposes, then the Concats), so a fused model on ORT CPU gives the original's bits.

The kernel is QKVRotaryCache's body (ort_triton/kernels/qkv_rotary_cache.py, qkv_heads_cache) with its
rotary off and the bias on: the bias added in fp32 and rounded once to the output type (for fp16 and bf16
that is the correctly rounded sum, as an Add in the type: fp32 has more than twice their precision).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import helper

from ..contract import IO, Kernel, OpContract, Spec
from .kv_layout import SEQ_MAJOR, to_heads
from .qkv_rotary_cache import BLOCK_C, COPY_PROGRAMS, cache_in, cache_out, heads_body, presents, split_heads
from .rotary import rope_specs

KERNEL = Kernel(
    module="ort_triton.kernels.qkv_rotary_cache",  # qkv_cache_fwd: the body QKVRotaryCache's kernel runs
    fn_name="qkv_cache_fwd",
    signature={"QKV": "*{T}", "BIAS": "*{T}", "PK": "*{T}", "PV": "*{T}", "Q": "*{T}", "K": "*{T}", "V": "*{T}",
               "NQ": "i32", "NKV": "i32", "S": "i32", "P": "i32", "D": "i32", "n_new": "i32", "B": "i32",
               "seq_major": "i32", "copy": "i32"},
    native_plan="ot_qkv_cache_plan",
    native_params="ot_qkv_cache_params",
    dispatch_keys=("head_dim", "aligned"),
)


def _specs(_type_name: str) -> list[Spec]:
    """QKVRotaryCache's blocks (Rotary's per BLOCK_D, an aligned spec then one for any, the copy block fixed),
    aligned meaning D a multiple of 16 (no cos rows here)."""
    specs = rope_specs(("QKV", "BIAS", "PK", "PV", "Q", "K", "V"), {"BLOCK_C": BLOCK_C}, (BLOCK_C, COPY_PROGRAMS),
                       half=False)
    return [dataclasses.replace(s, divisible_by_16=tuple(a for a in s.divisible_by_16 if a not in ("cos_b", "cos_s")))
            for s in specs]


def reference_qkv_cache(qkv, bias, past_key, past_value, seq_major=0):
    """float64 numpy reference, step by step as the decomposed graph does it."""
    qkv, bias = np.asarray(qkv, np.float64), np.asarray(bias, np.float64)
    past_key, past_value = (to_heads(np.asarray(a, np.float64), seq_major) for a in (past_key, past_value))
    q, k, v = split_heads(qkv + bias, past_key.shape)
    return (q, *presents(past_key, past_value, k, v, seq_major))


def _body(_opset: int) -> list[onnx.NodeProto]:
    """Stock ops of opset 15 (Shape's start/end)."""
    n = helper.make_node
    return [
        *cache_in(),
        n("Add", ["QKV", "bias"], ["qkv_b"]),
        *heads_body("qkv_b", q_t="Q", past="past_key_h"),
        *cache_out("k_t", "v_t"),
    ]


QKV_CACHE = OpContract(
    name="QKVCache",
    doc="Packed QKV [B, S, (Nq + 2 Nkv) D] plus bias [(Nq + 2 Nkv) D] split into heads; Q = q [B, Nq, S, D]; "
        "present_key = Concat(past_key, k), present_value = Concat(past_value, v) along the sequence, "
        "[B, Nkv, P + S, D]; Nkv and D from past_key.",
    inputs=(IO("QKV", "[B, S, (Nq + 2 Nkv) D]"), IO("bias", "[(Nq + 2 Nkv) D]"),
            IO("past_key", "[B, Nkv, P, D] (seq_major: [P, B, Nkv, D])"), IO("past_value", "as past_key")),
    outputs=(IO("Q", "[B, Nq, S, D]"), IO("present_key", "[B, Nkv, P + S, D] (seq_major: [P + S, B, Nkv, D])"),
             IO("present_value", "as present_key")),
    attrs=(SEQ_MAJOR,),
    types=("float16", "bfloat16", "float"),
    body=_body,
    reference=reference_qkv_cache,
    kernel=KERNEL,
    specializations=_specs,
)
