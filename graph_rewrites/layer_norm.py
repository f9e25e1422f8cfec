"""LayerNorm fusions: ONNX LayerNormalization and its decomposed form -> LayerNorm; a residual Add in
front of either -> AddLayerNorm. Contracts: ort_triton/ops/layer_norm.py.

Stages 1-2 turn every layer normalisation into ot.LayerNorm; stage 4 folds a residual Add into it (so
the residual rules see one form whatever the exporter wrote), stage 6 the bias of the MatMul that feeds
the residual.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import _ir_utils, pattern

from ort_triton.contract import DOMAIN
from ort_triton.ops.layer_norm import ADD_LAYER_NORM, LAYER_NORM, MAX_HIDDEN

from .common import FLOAT_TYPES, check_zero_bias_to_fold, same_dim, zero_vector


def _check_hidden(result: pattern.MatchResult, x: ir.Value, gamma: ir.Value, beta: ir.Value | None):
    """The hidden size H (last dim of x) as an int, or a failed MatchResult saying why not."""
    if x.dtype not in FLOAT_TYPES:
        return result.fail(f"element type {x.dtype} is not one of float, float16, bfloat16"
                           if x.dtype else "element type of the input is unknown (run shape inference)", x)
    for name, v in (("gamma", gamma), ("beta", beta)):
        if v is not None and v.dtype is not None and v.dtype != x.dtype:
            return result.fail(f"{name} is {v.dtype} but the input is {x.dtype}", v)
    h = x.shape[-1] if x.shape is not None and x.shape.rank() >= 1 else None
    g = gamma.shape
    if g is None or g.rank() != 1 or not isinstance(g[0], int):
        return result.fail(f"gamma must be 1-D of static size, its shape is {g}", gamma)
    if isinstance(h, int) and h != g[0]:
        return result.fail(f"gamma has {g[0]} elements, the normalised axis {h}", gamma)
    if beta is not None and (beta.shape is None or list(beta.shape) != [g[0]]):
        return result.fail(f"beta must be [{g[0]}], its shape is {beta.shape}", beta)
    if not 1 <= g[0] <= MAX_HIDDEN:
        return result.fail(f"hidden size {g[0]} is outside 1..{MAX_HIDDEN}, the kernel's range", x)
    return g[0]


class _LayerNormRule(pattern.RewriteRuleClassBase):
    """Shared rewrite: emit ot.LayerNorm, inventing a zero beta where the model has none (the contract
    takes no absent inputs, see ort_triton/contract.py)."""

    def _beta(self, op, beta, x: ir.Value, hidden: int):
        return beta if beta is not None else zero_vector(op, x, hidden, "zero_beta")


class LayerNormalizationRule(_LayerNormRule):
    """LayerNormalization(x, gamma, beta?, axis=-1) -> ot.LayerNorm"""

    def pattern(self, op, x, gamma):
        return op.LayerNormalization(x, gamma, _allow_other_inputs=True, _allow_other_attributes=True,
                                     _outputs=["y"])

    def check(self, context, x, gamma, y, **_):
        result = pattern.MatchResult()
        node = y.producer()  # (a used Mean/InvStdDev output already fails the match: it is not removable)
        axis = node.attributes.get_int("axis", -1)
        rank = x.shape.rank() if x.shape is not None else None
        if axis != -1 and axis != (rank or 0) - 1:
            return result.fail(f"axis={axis} is not the last axis (rank {rank}); only the last axis is fused", node)
        if node.attributes.get_int("stash_type", 1) != 1:
            return result.fail("stash_type is not float32", node)
        beta = node.inputs[2] if len(node.inputs) > 2 else None
        hidden = _check_hidden(result, x, gamma, beta)
        if not isinstance(hidden, int):
            return hidden
        self._hidden, self._beta_value = hidden, beta
        return result

    def rewrite(self, op, x, gamma, y, **_):
        eps = y.producer().attributes.get_float("epsilon", 1e-5)
        return LAYER_NORM.node(op, x, gamma, self._beta(op, self._beta_value, x, self._hidden), epsilon=eps)


class DecomposedLayerNormRule(_LayerNormRule):
    """(x - mean) / sqrt(var + eps) * gamma [+ beta], mean/var by ReduceMean over the last axis -> ot.LayerNorm"""

    def __init__(self, name: str, *, axes_as_input: bool, with_beta: bool):
        super().__init__(name)
        self._axes_as_input, self._with_beta = axes_as_input, with_beta

    def _mean(self, op, v, axes):
        if self._axes_as_input:  # opset >= 18
            return op.ReduceMean(v, axes, _allow_other_attributes=True)
        return op.ReduceMean(v, axes=axes, _allow_other_attributes=True)

    def pattern(self, op, x, axes1, axes2, eps, gamma, beta, two):
        d = op.Sub(x, self._mean(op, x, axes1))
        var = self._mean(op, pattern.OrValue([op.Mul(d, d), op.Pow(d, two)]), axes2)
        std = op.Sqrt(op.Add(var, eps))
        normed = pattern.OrValue([op.Div(d, std), op.Mul(d, op.Reciprocal(std))])
        y = op.Mul(normed, gamma)
        return op.Add(y, beta) if self._with_beta else y

    def check(self, context, x, axes1, axes2, eps, gamma, two, beta=None, **_):
        result = pattern.MatchResult()
        rank = x.shape.rank() if x.shape is not None else None
        for axes in (axes1, axes2):
            values = axes.as_ints() if isinstance(axes, ir.Attr) else _ir_utils.get_numpy_value(axes)
            values = None if values is None else [int(a) for a in np.ravel(values)]
            if values is None or len(values) != 1 or values[0] not in (-1, (rank or 0) - 1):
                return result.fail(f"ReduceMean axes {values} are not the last axis (rank {rank})", axes)
        for node in context.nodes:
            if node.op_type == "ReduceMean" and node.attributes.get_int("keepdims", 1) != 1:
                return result.fail("ReduceMean has keepdims=0", node)
        if two is not None and _ir_utils.get_singleton_value(two) != 2:
            return result.fail("Pow exponent is not the constant 2", two)
        eps_value = _ir_utils.get_singleton_value(eps)
        if eps_value is None:
            return result.fail("epsilon is not a constant scalar", eps)
        hidden = _check_hidden(result, x, gamma, beta)
        if not isinstance(hidden, int):
            return hidden
        self._hidden, self._eps = hidden, float(eps_value)
        return result

    def rewrite(self, op, x, gamma, beta=None, **_):
        return LAYER_NORM.node(op, x, gamma, self._beta(op, beta, x, self._hidden), epsilon=self._eps)


def _same_shape(a: ir.Value, b: ir.Value) -> bool:
    return a.shape is not None and b.shape is not None and a.shape.rank() == b.shape.rank() and all(
        same_dim(da, db) for da, db in zip(a.shape, b.shape))


class _AddLayerNormBase(pattern.RewriteRuleClassBase):
    def _emit(self, op, a, b, gamma, beta, y, keep_sum: bool):
        """AddLayerNorm with a zero bias: bias_add_layer_norm folds the producing MatMul's bias in later."""
        eps = y.producer().attributes.get_float("epsilon", 1e-5)
        bias = zero_vector(op, gamma, gamma.shape[0], "zero_bias")
        return ADD_LAYER_NORM.node(op, a, b, bias, gamma, beta, epsilon=eps, outputs=[True, keep_sum])

    def _ln(self, op, a, b, gamma, beta):
        s = op.Add(a, b, _outputs=["sum"])
        return op.LayerNorm(s, gamma, beta, _domain=DOMAIN, _outputs=["y"], _allow_other_attributes=True), s

    def check(self, context, a, b, **_):
        result = pattern.MatchResult()
        if not _same_shape(a, b):
            return result.fail(f"Add operands have shapes {a.shape} and {b.shape}, not provably equal "
                               "(a broadcasting add, e.g. a bias, is not a residual)", [a, b])
        if a.dtype != b.dtype:
            return result.fail(f"Add operands are {a.dtype} and {b.dtype}", [a, b])
        return result


class AddLayerNormRule(_AddLayerNormBase):
    """ot.LayerNorm(a + b) -> ot.AddLayerNorm(a, b)   (post-LN: the sum is used only by the norm)"""

    def pattern(self, op, a, b, gamma, beta):
        return self._ln(op, a, b, gamma, beta)[0]

    def rewrite(self, op, a, b, gamma, beta, y, **_):
        return self._emit(op, a, b, gamma, beta, y, keep_sum=False)


class AddLayerNormKeepSumRule(_AddLayerNormBase):
    """ot.LayerNorm(s = a + b), s used again -> ot.AddLayerNorm(a, b) -> (y, s)   (pre-LN residual stream)"""

    def pattern(self, op, a, b, gamma, beta):
        return self._ln(op, a, b, gamma, beta)

    def check(self, context, a, b, sum, y, **_):  # noqa: A002  (the pattern's name for the value)
        result = super().check(context, a, b)
        if result and not sum.is_graph_output() and all(u.node is y.producer() for u in sum.uses()):
            return result.fail("the sum is read only by the norm (add_layer_norm's case)", sum)
        return result

    def rewrite(self, op, a, b, gamma, beta, y, **_):
        return self._emit(op, a, b, gamma, beta, y, keep_sum=True)


class BiasAddLayerNormRule(pattern.RewriteRuleClassBase):
    """ot.AddLayerNorm(m + c, r, 0) -> ot.AddLayerNorm(m, r, c)   (c the [H] bias of the MatMul m; either
    residual operand, since X and skip are interchangeable in the sum)"""

    def __init__(self, name: str, *, biased_operand: int, keep_sum: bool):
        super().__init__(name)
        self.biased_operand, self.keep_sum = biased_operand, keep_sum

    def pattern(self, op, m, c, r, zero, gamma, beta):
        biased = op.Add(m, c)
        a, b = (biased, r) if self.biased_operand == 0 else (r, biased)
        return op.AddLayerNorm(a, b, zero, gamma, beta, _domain=DOMAIN, _outputs=["y", "sum"],
                               _allow_other_attributes=True)[0 if not self.keep_sum else slice(None)]

    def check(self, context, m, c, r, zero, y, **_):
        result = check_zero_bias_to_fold(pattern.MatchResult(), zero, c, m)
        if not result:
            return result
        if not _same_shape(m, r):
            return result.fail(f"{m.shape} + bias does not keep the residual's shape {r.shape}", m)
        if self.keep_sum != bool(y.producer().outputs[1].uses() or y.producer().outputs[1].is_graph_output()):
            return result.fail("the other variant's sum usage", y.producer())
        return result

    def rewrite(self, op, m, c, r, gamma, beta, y, **_):
        eps = y.producer().attributes.get_float("epsilon", 1e-5)
        return ADD_LAYER_NORM.node(op, m, r, c, gamma, beta, epsilon=eps, outputs=[True, self.keep_sum])
