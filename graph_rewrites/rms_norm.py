"""RMSNorm fusions: ONNX RMSNormalization and HF's LlamaRMSNorm as the exporters write it -> RMSNorm; a
residual Add in front -> AddRMSNorm. Contracts: ort_triton/ops/rms_norm.py.

LlamaRMSNorm (Llama, Mistral, Qwen2) is

    xf = x.to(float32); xf * rsqrt(mean(xf^2, -1, keepdim) + eps); weight * that.to(x.dtype)

which the TorchScript exporter writes as Cast(to float) -> Pow(xf, 2) -> ReduceMean(axes=[-1]) -> Add(eps)
-> Sqrt -> Div(1, .) -> Mul(xf, .) -> Cast -> Mul(weight, .) (the Casts kept even when they are no-ops in
an fp32 model), and the dynamo exporter as the same chain with Reciprocal for the Div, ReduceMean's axes
as an input (opset 18+) and no-op Casts dropped. In an fp32 TorchScript export the first Cast's output is
also the residual (`.to(float32)` of an fp32 tensor returns the tensor itself, so the tracer hands later
uses of it the Cast's output): there the Cast stays and the norm starts after it, so each Cast is
optional on its own (the rules with the Cast run first). Stage 1 turns every form into ot.RMSNorm; stage 4 folds
the residual Add in front (the pre-norm residual stream: `h = residual + attn_out; residual = h;
h = norm(h)`) into ot.AddRMSNorm, keeping the sum as an output when it is read again.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import _ir_utils, pattern

from ort_triton.contract import DOMAIN
from ort_triton.ops.rms_norm import ADD_RMS_NORM, MAX_HIDDEN, RMS_NORM

from .common import FLOAT_TYPES


def _check_hidden(result: pattern.MatchResult, x: ir.Value, gamma: ir.Value):
    """The hidden size H (the static last dim of x, which gamma must be exactly) or a failed MatchResult."""
    if x.dtype not in FLOAT_TYPES:
        return result.fail(f"element type {x.dtype} is not one of float, float16, bfloat16"
                           if x.dtype else "element type of the input is unknown (run shape inference)", x)
    if gamma.dtype is not None and gamma.dtype != x.dtype:
        return result.fail(f"the weight is {gamma.dtype} but the input is {x.dtype}", gamma)
    h = x.shape[-1] if x.shape is not None and x.shape.rank() >= 1 else None
    if not isinstance(h, int):
        return result.fail(f"the hidden size (last dim of the input) is not static: shape {x.shape}", x)
    g = gamma.shape
    if g is None or g.rank() != 1 or g[0] != h:
        return result.fail(f"the weight must be [{h}] (the last dim of the input), its shape is {g}", gamma)
    if not 1 <= h <= MAX_HIDDEN:
        return result.fail(f"hidden size {h} is outside 1..{MAX_HIDDEN}, the kernel's range", x)
    return h


def _last_axis(axes, rank: int | None) -> list[int] | None:
    """The ReduceMean axes (attribute or constant input) if they are exactly the last axis, else None."""
    values = axes.as_ints() if isinstance(axes, ir.Attr) else _ir_utils.get_numpy_value(axes)
    values = None if values is None else [int(a) for a in np.ravel(values)]
    if values is not None and len(values) == 1 and values[0] in (-1, (rank if rank is not None else 0) - 1):
        return values
    return None


def _centered(x: ir.Value) -> ir.Node | None:
    """The Sub node when x = Sub(v, ReduceMean(v)) (through a Cast), i.e. the centring of a LayerNorm."""
    node = x.producer()
    if node is not None and node.op_type == "Cast":
        node = node.inputs[0].producer()
    if node is None or node.op_type != "Sub":
        return None
    mean = node.inputs[1].producer()
    if mean is not None and mean.op_type == "ReduceMean" and mean.inputs[0] is node.inputs[0]:
        return node
    return None


class DecomposedRMSNormRule(pattern.RewriteRuleClassBase):
    """[Cast(float)] -> x^2 -> ReduceMean(last axis) -> + eps -> Sqrt -> 1/. -> * x -> [Cast(back)] -> * weight
    -> ot.RMSNorm   (x^2 as Pow(x, 2) or Mul(x, x); 1/s * x as Reciprocal, Div(1, s) or Div(x, s))"""

    def __init__(self, name: str, *, axes_as_input: bool, cast_in: bool, cast_out: bool):
        super().__init__(name)
        self._axes_as_input, self._cast_in, self._cast_out = axes_as_input, cast_in, cast_out

    def pattern(self, op, x, axes, eps, two, one, gamma):
        xf = op.Cast(x, _allow_other_attributes=True, _outputs=["xf"]) if self._cast_in else x
        sq = pattern.OrValue([op.Pow(xf, two), op.Mul(xf, xf)])
        if self._axes_as_input:  # opset >= 18
            ms = op.ReduceMean(sq, axes, _allow_other_attributes=True, _outputs=["ms"])
        else:
            ms = op.ReduceMean(sq, axes=axes, _allow_other_attributes=True, _outputs=["ms"])
        std = op.Sqrt(op.Add(ms, eps))
        # nested, so that each choice is between distinct ops (onnxscript 0.7.2's backtracking OrValue,
        # used when two alternatives start with the same op, cannot be cloned for commute=True)
        inv = pattern.OrValue([op.Reciprocal(std), op.Div(one, std)])
        normed = pattern.OrValue([op.Mul(xf, inv), op.Div(xf, std)])
        if self._cast_out:
            normed = op.Cast(normed, _allow_other_attributes=True, _outputs=["back"])
        return op.Mul(normed, gamma, _outputs=["y"])

    def check(self, context, x, axes, eps, gamma, ms, y, two=None, one=None, xf=None, back=None, **_):
        result = pattern.MatchResult()
        centered = _centered(x)
        if centered is not None:  # RMSNorm(x - mean(x)) * g + b is a LayerNorm: leave it to that rule
            return result.fail("the input is x - mean(x): a decomposed LayerNorm, not an RMSNorm", centered)
        if self._cast_in and xf.producer().attributes.get_int("to") != ir.DataType.FLOAT:
            to = xf.producer().attributes.get_int("to")
            return result.fail(f"the input is cast to {ir.DataType(to) if to else to}, not float: the "
                               "normalisation would not be in fp32", xf.producer())
        if y.dtype != x.dtype:  # the op's Y has X's type
            return result.fail(f"the result is {y.dtype}, the input {x.dtype} (a Cast back is missing or "
                               "casts to another type)", back.producer() if back is not None else y.producer())
        rank = x.shape.rank() if x.shape is not None else None
        if _last_axis(axes, rank) is None:
            values = axes.as_ints() if isinstance(axes, ir.Attr) else _ir_utils.get_numpy_value(axes)
            return result.fail(f"ReduceMean axes {values} are not the last axis (rank {rank})", ms.producer())
        if ms.producer().attributes.get_int("keepdims", 1) != 1:
            return result.fail("ReduceMean has keepdims=0", ms.producer())
        if two is not None and _ir_utils.get_singleton_value(two) != 2:
            return result.fail("Pow exponent is not the constant 2", two)
        if one is not None and _ir_utils.get_singleton_value(one) != 1:
            return result.fail("the Div's numerator is not the constant 1", one)
        eps_value = _ir_utils.get_singleton_value(eps)
        if eps_value is None:
            return result.fail("epsilon is not a constant scalar", eps)
        hidden = _check_hidden(result, x, gamma)
        if not isinstance(hidden, int):
            return hidden
        self._eps = float(eps_value)
        return result

    def rewrite(self, op, x, gamma, **_):
        return RMS_NORM.node(op, x, gamma, epsilon=self._eps)


class RMSNormalizationRule(pattern.RewriteRuleClassBase):
    """RMSNormalization(x, scale, axis=-1, stash_type=float) (opset 23) -> ot.RMSNorm"""

    def pattern(self, op, x, gamma):
        return op.RMSNormalization(x, gamma, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, gamma, y, **_):
        result = pattern.MatchResult()
        node = y.producer()
        axis = node.attributes.get_int("axis", -1)
        rank = x.shape.rank() if x.shape is not None else None
        if axis != -1 and axis != (rank if rank is not None else 0) - 1:
            return result.fail(f"axis={axis} is not the last axis (rank {rank}); only the last axis is fused", node)
        if node.attributes.get_int("stash_type", 1) != 1:
            return result.fail("stash_type is not float32", node)
        hidden = _check_hidden(result, x, gamma)
        return hidden if not isinstance(hidden, int) else result

    def rewrite(self, op, x, gamma, y, **_):
        return RMS_NORM.node(op, x, gamma, epsilon=y.producer().attributes.get_float("epsilon", 1e-5))


def _same_shape(a: ir.Value, b: ir.Value) -> bool:
    """Provably equal shapes: equal ranks, each dim the same int or the same named symbol (an unknown dim
    proves nothing: a [1, S, H] operand against a [B, S, H] one broadcasts)."""
    if a.shape is None or b.shape is None or a.shape.rank() != b.shape.rank():
        return False
    return all(_ir_utils.same_dim(da, db) for da, db in zip(a.shape, b.shape))


class _AddRMSNormBase(pattern.RewriteRuleClassBase):
    """`through_cast`: a no-op Cast(to the sum's own type) between the Add and the norm, which the fp32
    TorchScript export writes (`.to(float32)` in LlamaRMSNorm, see the module docstring); its output is
    then the residual stream, and the fused node's sum takes its place."""

    keep_sum = False

    def __init__(self, name: str, *, through_cast: bool = False):
        super().__init__(name)
        self._through_cast = through_cast

    def pattern(self, op, a, b, gamma):
        s = op.Add(a, b, _outputs=["sum"])
        if self._through_cast:
            s = op.Cast(s, _allow_other_attributes=True, _outputs=["cast"])
        y = op.RMSNorm(s, gamma, _domain=DOMAIN, _outputs=["y"], _allow_other_attributes=True)
        return (y, s) if self.keep_sum else y

    def check(self, context, a, b, sum, y, cast=None, **_):  # noqa: A002  (the pattern's name for the value)
        result = pattern.MatchResult()
        if not _same_shape(a, b):
            return result.fail(f"Add operands have shapes {a.shape} and {b.shape}, not provably equal "
                               "(a broadcasting add is not a residual)", [a, b])
        if a.dtype != b.dtype:
            return result.fail(f"Add operands are {a.dtype} and {b.dtype}", [a, b])
        if cast is not None and cast.producer().attributes.get_int("to") != sum.dtype:
            return result.fail(f"the Cast between the Add and the norm changes the type ({sum.dtype} to "
                               f"{cast.dtype})", cast.producer())
        s = cast if cast is not None else sum
        read_again = s.is_graph_output() or any(u.node is not y.producer() for u in s.uses())
        if self.keep_sum and not read_again:
            return result.fail("the sum is read only by the norm (add_rms_norm's case)", s)
        return result

    def rewrite(self, op, a, b, gamma, y, **_):
        eps = y.producer().attributes.get_float("epsilon", 1e-6)
        return ADD_RMS_NORM.node(op, a, b, gamma, epsilon=eps, outputs=[True, self.keep_sum])


class AddRMSNormRule(_AddRMSNormBase):
    """ot.RMSNorm(a + b) -> ot.AddRMSNorm(a, b)   (the sum read only by the norm: Llama's final norm)"""


class AddRMSNormKeepSumRule(_AddRMSNormBase):
    """ot.RMSNorm(s = a + b), s read again -> ot.AddRMSNorm(a, b) -> (y, s)   (the pre-norm residual stream)"""

    keep_sum = True
