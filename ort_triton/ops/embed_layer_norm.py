"""EmbedLayerNorm: BERT's embeddings (three table lookups, summed) and their LayerNorm, as one op.

    e0, e1, e2 = word_embeddings[input_ids], token_type_embeddings[token_type_ids],
                 position_embeddings[position_ids]                  (ONNX Gather on axis 0: [.., .., H] each)
    s = (e0 + e1) + e2                                              (the order HF's exports add them in:
                                                                     BertEmbeddings adds the token types to
                                                                     the words, then the positions)
    Y = LayerNormalization(s, gamma, beta) over the last axis       Y: [B, S, H]

Ids are int64 (every export of BERT, RoBERTa and DistilBERT feeds int64 input_ids; the rule refuses other
types) and each id tensor is [B', S'] with B' in {1, B} and S' in {1, S}: [B, S] is their broadcast, as the
function body's Adds broadcast them (input_ids is [B, S]; BERT's position ids are a constant [1, S] slice,
RoBERTa computes [B, S] ones from input_ids with a CumSum over the padding mask; those subgraphs stay in
the graph and feed the op). DistilBERT has no token types: the rule gives it a [1, H] zero table and a
[1, 1] zero id (`(e0 + 0) + e2` is `e0 + e2` exactly), so one op and one kernel serve both families.

Negative ids index from the end, as Gather's do. An id outside [-V, V) of its table makes ONNX's Gather
fail; the kernel never reads outside a table: it writes NaN over that token's row of Y (every other row is
computed as usual), so a bad id gives a loud result, never a silent wrong one.

The kernel (ort_triton/kernels/embed_layer_norm.py): one program per ROWS tokens, the three rows gathered
into registers, the sums and a two-pass LayerNorm in fp32 (like LayerNorm's kernel; for fp16/bf16 the graph
rounds each Add to the element type, the kernel does not), H in one power-of-two block of LayerNorm's
BLOCKS (no three-block layout: the op runs once per model). Launch configs are LayerNorm's for its
residual mode (three row streams in, one out), not measured for this op.
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from ..contract import IO, Attr, Kernel, OpContract, Spec
from .layer_norm import BLOCKS, _ln_nodes
from .layer_norm import launch_config as _ln_launch_config
from .tune_space import pow2_layout

MAX_HIDDEN = BLOCKS[-1]
layout = pow2_layout(BLOCKS)  # H -> {"BLOCK_H": the smallest of LayerNorm's blocks that holds it}

KERNEL = Kernel(
    module="ort_triton.kernels.embed_layer_norm",
    fn_name="embed_layer_norm_fwd",
    signature={
        "I0": "*i64", "I1": "*i64", "I2": "*i64", "T0": "*{T}", "T1": "*{T}", "T2": "*{T}",
        "W": "*{T}", "B": "*{T}", "Y": "*{T}",
        "n_rows": "i32", "S": "i32",
        "b0": "i32", "s0": "i32", "b1": "i32", "s1": "i32", "b2": "i32", "s2": "i32",  # id strides (0: broadcast)
        "V0": "i32", "V1": "i32", "V2": "i32", "H": "i32", "eps": "fp32",
    },
    native_plan="ot_embed_layer_norm_plan",
    native_params="ot_embed_layer_norm_params",
    dispatch_keys=("h_div16", "H"),
)


def launch_config(block_h: int) -> tuple[int, int]:
    """(ROWS, num_warps) for a block width: LayerNorm's residual-mode config (copied, not swept)."""
    return _ln_launch_config(block_h, has_res=True, store_sum=False)


def _specs(_type_name: str) -> list[Spec]:
    """Aligned specs first (H % 16 == 0: 16-byte rows, vector loads), then one per block for any H; the
    native planner takes the first whose keys fit."""
    specs = []
    for aligned in (1, 0):
        for lo, hi in zip((1, *(b + 1 for b in BLOCKS[:-1])), BLOCKS):
            rows, warps = launch_config(hi)
            specs.append(Spec(constexprs={"BLOCK_H": hi, "ROWS": rows}, num_warps=warps,
                              keys=((aligned, 1), (lo, hi)), consts=(hi, rows),
                              divisible_by_16=("I0", "I1", "I2", "T0", "T1", "T2", "W", "B", "Y")
                              + (("H",) if aligned else ())))
    return specs


# ---- reference (float64 numpy) ----------------------------------------------------------------------
def _lookup(table, ids):
    """(table[ids] in float64, ids outside [-V, V)); a bad id's row is zeros here, NaN in the output."""
    t, ids = np.asarray(table, np.float64), np.asarray(ids, np.int64)
    bad = (ids < -t.shape[0]) | (ids >= t.shape[0])
    rows = t[np.where(bad, 0, ids)] if t.shape[0] else np.zeros((*ids.shape, t.shape[1]))
    return rows, bad


def reference_embed_layer_norm(input_ids, token_type_ids, position_ids, word_embeddings, token_type_embeddings,
                               position_embeddings, gamma, beta, epsilon=1e-12):
    e0, bad0 = _lookup(word_embeddings, input_ids)
    e1, bad1 = _lookup(token_type_embeddings, token_type_ids)
    e2, bad2 = _lookup(position_embeddings, position_ids)
    s = (e0 + e1) + e2
    mean = s.mean(-1, keepdims=True)
    var = ((s - mean) ** 2).mean(-1, keepdims=True)
    y = (s - mean) / np.sqrt(var + epsilon) * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64)
    return (np.where((bad0 | bad1 | bad2)[..., None], np.nan, y),)


# ---- function body ----------------------------------------------------------------------------------
def _body(opset: int):
    n = helper.make_node
    return [
        n("Gather", ["word_embeddings", "input_ids"], ["e0"], axis=0),
        n("Gather", ["token_type_embeddings", "token_type_ids"], ["e1"], axis=0),
        n("Add", ["e0", "e1"], ["e01"]),
        n("Gather", ["position_embeddings", "position_ids"], ["e2"], axis=0),
        n("Add", ["e01", "e2"], ["sum"]),
        *_ln_nodes("sum", opset),  # LayerNormalization from 17, its decomposition before
    ]


_IDS = "int64, [1 or B, 1 or S]"
EMBED_LAYER_NORM = OpContract(
    name="EmbedLayerNorm",
    doc="Y = LayerNormalization((word_embeddings[input_ids] + token_type_embeddings[token_type_ids]) + "
        "position_embeddings[position_ids], gamma, beta) over the last axis; [B, S] is the ids' broadcast; a "
        "token with an id outside its table gets a NaN row from the kernel.",
    inputs=(IO("input_ids", _IDS, type="int64"), IO("token_type_ids", _IDS, type="int64"),
            IO("position_ids", _IDS, type="int64"), IO("word_embeddings", "[V0, H]"),
            IO("token_type_embeddings", "[V1, H] (a [1, H] zero table where the model has none)"),
            IO("position_embeddings", "[V2, H]"), IO("gamma", "[H]"), IO("beta", "[H]")),
    outputs=(IO("Y", "[B, S, H]"),),
    attrs=(Attr("epsilon", "float", 1e-12, "added to the variance before the square root (BERT: 1e-12)"),),
    types=("float", "float16", "bfloat16"),
    body=_body,
    reference=reference_embed_layer_norm,
    kernel=KERNEL,
    specializations=_specs,
)
