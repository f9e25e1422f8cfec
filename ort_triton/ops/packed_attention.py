"""PackedMultiHeadAttention: self-attention over one packed Q/K/V projection.

    QKV [B, S, 3*N*D]     X @ [Wq | Wk | Wv]: Q, K and V side by side in each row
    key_bias [B, S]       additive, per key, as for MultiHeadAttention
    bias [3*N*D]          [bq | bk | bv], the three projections' biases (zeros where there are none)
    Q, K, V = split(QKV + bias, 3, axis=-1)
    Y = MultiHeadAttention(Q, K, V, key_bias) (ops/attention.py: same attributes, same rows with no key)

Why: BERT's three 768 -> 768 projections as one 768 -> 2304 GEMM ran 2.72x / 1.68x / 1.12x / 1.05x
faster at M = 128 / 1024 / 4096 / 16384 rows on the H200 (cuBLAS; bench/results/session6), and the Q
bias Add goes too. graph_rewrites/pack_qkv.py packs the three MatMuls of a MultiHeadAttention that read one
input.

The kernel is MultiHeadAttention's (kernels/attention.py, PACKED=True): it reads Q, K, V at a row stride
of 3*N*D without a split; of the biases, K's cancels in the softmax, V's is added to each output row, and
Q's to the Q tile, staged through the output (the kernel's docstring says why).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import onnx
from onnx import helper

from ..contract import IO, Attr, OpContract, Tuning
from . import attention as mha
from .tune_space import random_inputs


def reference_packed_attention(qkv, key_bias, bias, num_heads, scale):
    """float64 numpy reference: split, then MultiHeadAttention's reference with the biases."""
    qkv, bias = np.asarray(qkv, np.float64), np.asarray(bias, np.float64)
    q, k, v = np.split(qkv, 3, axis=-1)
    bq, bk, bv = np.split(bias, 3)
    return mha.reference_attention(q + bq, k, v, key_bias, bk, bv, num_heads, scale)


def _body(opset: int) -> list[onnx.NodeProto]:
    """Add the biases, split in three (Split takes the part count as num_outputs from opset 18; before it,
    three outputs and no sizes mean three equal parts), then MultiHeadAttention's body."""
    split_attrs = {"num_outputs": 3} if opset >= 18 else {}
    return [helper.make_node("Add", ["QKV", "bias"], ["qkv_b"]),
            helper.make_node("Split", ["qkv_b"], ["q_in", "k_in", "v_in"], axis=-1, **split_attrs),
            *mha.attention_body("q_in", "k_in", "v_in")]


# ---- tuning: the dispatch keys and kernel are MultiHeadAttention's, from the packed shapes --------------
def _tune_keys(type_name: str, shapes: list, attrs: dict, n_outputs: int = 1) -> tuple[int, ...]:
    """MultiHeadAttention's keys for the Q and K that QKV [B, S, 3*H] holds ([B, S, H] each)."""
    b, s, packed = shapes[0]
    return mha.TUNING.keys(type_name, [[b, s, packed // 3]] * 2, attrs, n_outputs)


def _tune_runner(type_name: str, shapes: list, attrs: dict, keys: tuple, config: dict, device: str):
    from ..kernels.attention import packed_attention

    _, (qkv, bias, key_bias) = random_inputs(type_name, [shapes[0], shapes[2], shapes[1]], device, n_random=2)
    y = qkv.new_empty((*qkv.shape[:2], qkv.shape[2] // 3))
    heads, scale = int(attrs["num_heads"]), float(attrs.get("scale", 1.0))
    return lambda: packed_attention(qkv, key_bias, bias, heads, scale, out=y, config=config)


TUNING = Tuning(keys=_tune_keys, bucket=mha.TUNING.bucket,
                candidates=functools.partial(mha.TUNING.candidates, packed=True),
                spec=functools.partial(mha.TUNING.spec, packed=True), runner=_tune_runner)


PACKED_MULTI_HEAD_ATTENTION = OpContract(
    name="PackedMultiHeadAttention",
    doc="Q, K, V = split(QKV + bias, 3, axis=-1); Y = concat_n softmax(Q_n K_n^T * scale + key_bias) V_n; "
        "QKV [B, S, 3*N*D], key_bias [B, S], bias [3*N*D].",
    inputs=(IO("QKV", "[B, S, 3*N*D], Q, K, V side by side"), IO("key_bias", "[B, S], additive per key"),
            IO("bias", "[3*N*D], Q's, K's and V's biases")),
    outputs=(IO("Y", "[B, S, N*D]"),),
    attrs=(Attr("num_heads", "int", 1, "N"), Attr("scale", "float", 1.0, "multiplies Q K^T (1/sqrt(D) usually)")),
    types=("float16", "bfloat16", "float"),
    body=_body,
    reference=reference_packed_attention,
    # MultiHeadAttention's kernel and keys, with a planner that reads the packed input
    kernel=dataclasses.replace(mha.KERNEL, native_plan="ot_packed_attention_plan",
                               native_params="ot_packed_attention_params"),
    specializations=functools.partial(mha.attention_specs, packed=True),
    tuning=TUNING,
)
