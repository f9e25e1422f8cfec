"""BERT-family embeddings: LayerNorm((word[ids] + type[tt]) + pos[pp]) -> EmbedLayerNorm. Contract:
ort_triton/ops/embed_layer_norm.py.

Stage 3: every layer normalisation is an ot.LayerNorm by then (stages 1-2), and none has taken in its Add
yet (add_layer_norm is stage 4, and takes RoBERTa's, whose Add operands have equal shapes, but not
BERT's, whose position rows broadcast), so the rule sees one form for every exporter. The ids' subgraphs
(BERT's constant position slice, RoBERTa's CumSum over the padding mask, the token-type buffer's Expand) stay
in the graph and feed the op. DistilBERT adds two lookups: the rule gives it a [1, H] zero token-type table
and a [1, 1] zero id, so `(word + 0) + pos` is its sum exactly. ViT adds patch embeddings (a Conv) and a
position parameter, no Gather: the pattern never matches it.

embedding_shape (stage 1) clears the way for DistilBERT's torchscript export, which reads its sequence
length from the word rows' shape: that Shape would otherwise be a second reader of the lookup.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from ort_triton.contract import DOMAIN
from ort_triton.ops.embed_layer_norm import EMBED_LAYER_NORM, MAX_HIDDEN

from .common import FLOAT_TYPES, fresh_name


def _check_lookup(result: pattern.MatchResult, gather: ir.Node, hidden: int, dtype):
    """Refuse (result.fail) unless the matched Gather reads a constant [V, H] table of the norm's type on axis
    0 with int64 ids of rank 2."""
    table, ids = gather.inputs[0], gather.inputs[1]
    if gather.attributes.get_int("axis", 0) != 0:
        return result.fail(f"Gather has axis={gather.attributes.get_int('axis', 0)}, not 0 (a row lookup)", gather)
    if table.const_value is None:
        return result.fail(f"table {table.name} is not a constant or initializer (the op reads a fixed [V, H] table)",
                           table)
    sh = table.shape
    if sh is None or sh.rank() != 2 or not all(isinstance(d, int) for d in sh) or sh[1] != hidden:
        return result.fail(f"table {table.name} has shape {sh}, not [V, {hidden}] (H from gamma)", table)
    if table.dtype != dtype:
        return result.fail(f"table {table.name} is {table.dtype} but the norm is {dtype}", table)
    if ids.dtype != ir.DataType.INT64:
        return result.fail(f"ids {ids.name} are {ids.dtype}, not int64 (the kernel reads int64 ids)"
                           if ids.dtype else f"ids {ids.name} have no known element type", ids)
    if ids.shape is None or ids.shape.rank() != 2:
        return result.fail(f"ids {ids.name} have shape {ids.shape}, not [B or 1, S or 1] (rank 2)", ids)
    return result


class EmbedLayerNormRule(pattern.RewriteRuleClassBase):
    """ot.LayerNorm((Gather(t0, i0) + Gather(t1, i1)) + Gather(t2, i2)) -> ot.EmbedLayerNorm (three tables:
    BERT, RoBERTa), or ot.LayerNorm(Gather(t0, i0) + Gather(t2, i2)) with a zero token-type table (two:
    DistilBERT). The Adds commute (the rule tries every operand order): the op adds the first two rows,
    then the third, the graph's order up to swapping two operands of one Add, which is exact."""

    def __init__(self, name: str, *, tables: int):
        super().__init__(name)
        self.tables = tables

    def pattern(self, op, t0, i0, t1, i1, t2, i2, gamma, beta):
        g = dict(_allow_other_attributes=True)
        e0, e2 = op.Gather(t0, i0, **g), op.Gather(t2, i2, **g)
        s = op.Add(op.Add(e0, op.Gather(t1, i1, **g)), e2) if self.tables == 3 else op.Add(e0, e2)
        return op.LayerNorm(s, gamma, beta, _domain=DOMAIN, _outputs=["y"], _allow_other_attributes=True)

    def check(self, context, t0, i0, t2, i2, gamma, beta, y, t1=None, i1=None, **_):
        result = pattern.MatchResult()
        g = gamma.shape
        if g is None or g.rank() != 1 or not isinstance(g[0], int):
            return result.fail(f"gamma must be 1-D of static size, its shape is {g}", gamma)
        if not 1 <= g[0] <= MAX_HIDDEN:
            return result.fail(f"hidden size {g[0]} is outside 1..{MAX_HIDDEN}, the kernel's range", gamma)
        if gamma.dtype not in FLOAT_TYPES:
            return result.fail(f"element type {gamma.dtype} is not one of float, float16, bfloat16", gamma)
        pairs = [(t0, i0), (t2, i2)] + ([(t1, i1)] if self.tables == 3 else [])
        if len({id(t) for t, _ in pairs}) != len(pairs):
            return result.fail("one table feeds two of the lookups (not BERT's word/type/position embeddings)",
                               t0)
        for table, ids in pairs:
            gather = next(n for n in context.nodes if n.op_type == "Gather" and n.inputs[0] is table
                          and n.inputs[1] is ids)
            result = _check_lookup(result, gather, g[0], gamma.dtype)
            if not result:
                return result
        return result

    def rewrite(self, op, t0, i0, t2, i2, gamma, beta, y, t1=None, i1=None, **_):
        eps = y.producer().attributes.get_float("epsilon", 1e-5)
        if self.tables == 2:  # no token types: a zero row under a zero id adds nothing, exactly
            graph = gamma.graph
            h = gamma.shape[0]
            t1 = op.initializer(ir.tensor(np.zeros((1, h), dtype=gamma.dtype.numpy()),
                                          name=fresh_name(graph, f"{t0.name}__ot_zero_token_type")))
            i1 = op.initializer(ir.tensor(np.zeros((1, 1), dtype=np.int64),
                                          name=fresh_name(graph, f"{t0.name}__ot_zero_token_type_id")))
        return EMBED_LAYER_NORM.node(op, i0, i1, i2, t0, t1, t2, gamma, beta, epsilon=eps)


class EmbeddingShapeRule(pattern.RewriteRuleClassBase):
    """Shape(Gather(table, ids)) -> Concat(Shape(ids), [H]), where the lookup's other readers are Adds (an
    embeddings sum). DistilBERT's torchscript export takes its sequence length from the word embeddings'
    shape; that extra reader of the lookup would keep embed_layer_norm from fusing it. Gather on axis 0 of a
    [V, H] table gives ids.shape + [H], so the value is the same."""

    def __init__(self, name: str):
        super().__init__(name, remove_nodes=False)  # the Gather stays (the Adds read it); the dead Shape goes

    def pattern(self, op, table, ids):
        return op.Shape(op.Gather(table, ids, _allow_other_attributes=True, _outputs=["rows"]),
                        _allow_other_attributes=True, _outputs=["shape"])

    def check(self, context, table, rows, shape, **_):
        result = pattern.MatchResult()
        if rows.producer().attributes.get_int("axis", 0) != 0:
            return result.fail("Gather is not on axis 0 (a row lookup)", rows.producer())
        shape_node = shape.producer()
        if shape_node.attributes.get("start") is not None or shape_node.attributes.get("end") is not None:
            return result.fail("Shape has start/end (only the whole shape is rewritten)", shape_node)
        sh = table.shape
        if table.const_value is None or sh is None or sh.rank() != 2 or not isinstance(sh[1], int):
            return result.fail(f"table {table.name} is not a constant [V, H] of static H (shape {sh})", table)
        others = [u.node for u in rows.uses() if u.node is not shape_node]
        if rows.is_graph_output() or not others or any(n.op_type != "Add" for n in others):
            return result.fail("the lookup is read by more than Adds and this Shape (not an embeddings sum)", rows)
        return result

    def rewrite(self, op, table, ids, **_):
        h = op.Constant(value=ir.tensor(np.array([table.shape[1]], dtype=np.int64)))
        return op.Concat(op.Shape(ids), h, axis=0)
