"""MultiHeadAttention over three projections of one input -> one packed projection and PackedMultiHeadAttention
(contract: ort_triton/ops/packed_attention.py).

    MultiHeadAttention(x @ Wq [+ bq], x @ Wk, x @ Wv, key_bias, bk, bv)
        -> PackedMultiHeadAttention(x @ [Wq | Wk | Wv], key_bias, [bq | bk | bv])

Runs after attention_bias and attention_bias_one, which have already moved the K and V bias Adds into the
op; Q's bias Add goes too (the kernel adds it). One GEMM of 3*H columns instead of three of H: 2.72x faster
at BERT-base's 128 rows on the H200, 1.05x at 16384 (bench/results/session6). Only self-attention
qualifies (one x for all three) and only constant weights of one shape and type (the packed weight is built
here, once).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from ort_triton.contract import DOMAIN
from ort_triton.ops.packed_attention import PACKED_MULTI_HEAD_ATTENTION

from .common import fresh_name


def _constant(v: ir.Value) -> np.ndarray | None:
    return v.const_value.numpy() if v is not None and v.const_value is not None else None


class PackQkvRule(pattern.RewriteRuleClassBase):
    """q_bias=True: Q is MatMul + bias Add (BERT); False: a bare MatMul (a projection without bias)."""

    def __init__(self, name: str, q_bias: bool):
        super().__init__(name, remove_nodes=False)  # the old MatMuls die with their last reader
        self._q_bias = q_bias

    def pattern(self, op, x, wq, bq, wk, wv, key_bias, bk, bv):
        q = op.MatMul(x, wq, _outputs=["mq"])
        if self._q_bias:
            q = op.Add(q, bq)
        return op.MultiHeadAttention(q, op.MatMul(x, wk, _outputs=["mk"]), op.MatMul(x, wv, _outputs=["mv"]),
                                     key_bias, bk, bv, _domain=DOMAIN, _allow_other_attributes=True,
                                     _outputs=["y"])

    def check(self, context, x, wq, wk, wv, bk, bv, mq, mk, mv, bq=None, **_):
        result = pattern.MatchResult()
        # a projection read elsewhere (a graph output, say) keeps its MatMul: packing would compute it twice
        for m in (mq, mk, mv):
            if len(m.uses()) > 1 or m.is_graph_output():
                return result.fail(f"projection {m.name} is also read outside the attention", m)
        weights = [_constant(w) for w in (wq, wk, wv)]
        for value, w, name in zip(weights, (wq, wk, wv), "QKV"):
            if value is None:
                return result.fail(f"the {name} projection's weight {w.name} is not a constant", w)
        shapes = {w.shape for w in weights}
        if len(shapes) != 1 or len(weights[0].shape) != 2 or len({w.dtype for w in weights}) != 1:
            return result.fail(f"the Q, K, V weights are not three 2-D constants of one shape and type "
                               f"({[list(w.shape) for w in weights]})", wq)
        hidden = weights[0].shape[1]
        if x.shape is None or x.shape.rank() != 3:
            return result.fail(f"the projections' input {x.name} is not [B, S, H] (shape {x.shape})", x)
        biases = [bq, bk, bv] if self._q_bias else [bk, bv]
        for b in biases:
            c = _constant(b)
            if c is None or c.shape != (hidden,) or c.dtype != weights[0].dtype:
                return result.fail(f"bias {b.name} is not a constant [{hidden}] vector of the weights' type "
                                   f"({b.dtype} {b.shape})", b)
        return result

    def rewrite(self, op, x, wq, wk, wv, key_bias, bk, bv, y, bq=None, **_):
        node = y.producer()
        w = np.concatenate([_constant(v) for v in (wq, wk, wv)], axis=1)
        bq_value = _constant(bq) if self._q_bias else np.zeros_like(_constant(bk))
        b = np.concatenate([bq_value, _constant(bk), _constant(bv)])
        graph = wq.graph
        w_init = op.initializer(ir.tensor(w, name=fresh_name(graph, f"{wq.name}__ot_qkv")))
        b_init = op.initializer(ir.tensor(b, name=fresh_name(graph, f"{wq.name}__ot_qkv_bias")))
        return PACKED_MULTI_HEAD_ATTENTION.node(op, op.MatMul(x, w_init), key_bias, b_init,
                                                num_heads=node.attributes.get_int("num_heads", 1),
                                                scale=node.attributes.get_float("scale", 1.0))
