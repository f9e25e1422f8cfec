"""GELU fusions -> BiasGelu / BiasGeluTanh (contracts: ort_triton/ops/bias_gelu.py).

Stage 1 turns every GELU, whatever its spelling, into BiasGelu[Tanh](s, zero bias): the Gelu op
(opset 20), the erf expression (0.5 * s * (1 + erf(s / sqrt 2))) and the tanh expression, in the operand
orders exporters use. Stage 2 folds the MatMul's bias Add in front (s = x + b, b a [H] vector) into the
op. The MatMul stays ORT's (cuBLAS); only what follows it is fused.

Stage 3, GeGLU (Gemma's MLP, down(gelu_tanh(gate(x)) * up(x))): Mul(BiasGelu[Tanh](x, b), u) with u of x's shape
-> BiasGelu[Tanh]Mul(x, b, u), one pass for two (contracts in the same module). After stage 2, so the bias is
folded first; the activation's output read by nothing else.
"""

from __future__ import annotations

import math

import onnx_ir as ir
from onnxscript.rewriter import _ir_utils, pattern

from ort_triton.contract import DOMAIN
from ort_triton.ops.bias_gelu import BIAS_GELU, BIAS_GELU_MUL, BIAS_GELU_TANH, BIAS_GELU_TANH_MUL

from .common import FLOAT_TYPES, check_zero_bias_to_fold, zero_vector
from .swiglu import check_gate_and_up


def _hidden(result: pattern.MatchResult, s: ir.Value):
    """H, the static last dim of s, or a failed MatchResult."""
    if s.dtype not in FLOAT_TYPES:
        return result.fail(f"element type {s.dtype} is not one of float, float16, bfloat16", s)
    if s.shape is None or s.shape.rank() < 1 or not isinstance(s.shape[-1], int):
        return result.fail(f"the last dimension of the input is not static (shape {s.shape})", s)
    return s.shape[-1]


# Relative rounding error of a constant stored in a narrow type (half an ulp): an fp16 export holds
# 0.044715 as 0.04471 and sqrt(2) as 1.414, which are still gelu's constants.
_ROUNDING = {ir.DataType.FLOAT16: 2.0**-11, ir.DataType.BFLOAT16: 2.0**-8}


def _is(value: ir.Value | None, want: float, rel: float = 1e-6) -> bool:
    got = None if value is None else _ir_utils.get_singleton_value(value)
    if got is None:
        return False
    rel = max(rel, _ROUNDING.get(value.dtype, 0.0))
    return abs(float(got) - want) <= rel * abs(want)


def _outer(op, s, t1, half, form: int):
    """0.5 * s * t1 in the three groupings exporters write (a pattern's result cannot be a choice, so
    each grouping is its own rule; commute=True covers the operand orders)."""
    if form == 0:
        return op.Mul(op.Mul(s, t1), half)
    if form == 1:
        return op.Mul(op.Mul(s, half), t1)
    return op.Mul(s, op.Mul(t1, half))


class _GeluToOp(pattern.RewriteRuleClassBase):
    """Shared check/rewrite: the input must have a static H; emit the op with a zero bias."""

    tanh = False

    def __init__(self, name: str, *, form: int = 0):
        super().__init__(name)
        self.form = form

    def _check_constants(self, result, **bindings):
        return result

    def check(self, context, s, **bindings):
        result = pattern.MatchResult()
        hidden = _hidden(result, s)
        if not isinstance(hidden, int):
            return hidden
        self._hidden = hidden
        return self._check_constants(result, **bindings)

    def rewrite(self, op, s, **_):
        contract = BIAS_GELU_TANH if self.tanh else BIAS_GELU
        return contract.node(op, s, zero_vector(op, s, self._hidden, "zero_bias"))


class GeluOpRule(_GeluToOp):
    """Gelu(s, approximate=none|tanh) (opset 20) -> BiasGelu[Tanh](s, 0)"""

    def __init__(self, name: str, *, tanh: bool):
        super().__init__(name)
        self.tanh = tanh

    def pattern(self, op, s):
        return op.Gelu(s, _allow_other_attributes=True, _outputs=["y"])

    def _check_constants(self, result, y, **_):  # the attribute may be absent: its default is "none"
        approximate = y.producer().attributes.get_string("approximate", "none")
        if approximate != ("tanh" if self.tanh else "none"):
            return result.fail(f"approximate={approximate!r} is the other rule's", y.producer())
        return result


class GeluErfRule(_GeluToOp):
    """0.5 * s * (1 + erf(s / sqrt 2)), any operand order -> BiasGelu(s, 0)"""

    def pattern(self, op, s, c, one, half):
        t1 = op.Add(op.Erf(pattern.OrValue([op.Div(s, c, _outputs=["div"]), op.Mul(s, c)])), one)
        return _outer(op, s, t1, half, self.form)

    def _check_constants(self, result, c, one, half, div=None, **_):
        scale_ok = _is(c, math.sqrt(2)) if div is not None else _is(c, 1 / math.sqrt(2))
        if not (scale_ok and _is(one, 1.0) and _is(half, 0.5)):
            return result.fail("constants are not those of gelu (sqrt 2, 1, 0.5)", [c, one, half])
        return result


class GeluTanhRule(_GeluToOp):
    """0.5 * s * (1 + tanh(sqrt(2/pi) * (s + 0.044715 * s^3))), any operand order -> BiasGeluTanh(s, 0)"""

    tanh = True

    def pattern(self, op, s, three, k1, k0, one, half):
        cube = pattern.OrValue([op.Pow(s, three), op.Mul(op.Mul(s, s), s)])
        inner = op.Mul(op.Add(s, op.Mul(cube, k1)), k0)
        t1 = op.Add(op.Tanh(inner), one)
        return _outer(op, s, t1, half, self.form)

    def _check_constants(self, result, k1, k0, one, half, three=None, **_):
        ok = (_is(k0, math.sqrt(2 / math.pi), 1e-5) and _is(k1, 0.044715, 1e-5) and _is(one, 1.0)
              and _is(half, 0.5) and (three is None or _is(three, 3.0)))
        if not ok:
            return result.fail("constants are not those of the tanh gelu (sqrt(2/pi), 0.044715, 1, 0.5, 3)",
                               [k0, k1, one, half])
        return result


class FoldBiasRule(pattern.RewriteRuleClassBase):
    """BiasGelu[Tanh](x + b, 0), b a [H] vector -> BiasGelu[Tanh](x, b)"""

    def __init__(self, name: str, *, tanh: bool):
        super().__init__(name)
        self.contract = BIAS_GELU_TANH if tanh else BIAS_GELU

    def pattern(self, op, x, b, zero):
        return getattr(op, self.contract.name)(op.Add(x, b), zero, _domain=DOMAIN)

    def check(self, context, x, b, zero, **_):
        result = check_zero_bias_to_fold(pattern.MatchResult(), zero, b, x)
        if not result:
            return result
        if x.shape is None or x.shape.rank() < 1 or x.shape[-1] != zero.shape[0]:
            return result.fail(f"the Add broadcasts ({x.shape} + {b.shape}): not a bias over the last axis", x)
        return result

    def rewrite(self, op, x, b, **_):
        return self.contract.node(op, x, b)


class GeluMulRule(pattern.RewriteRuleClassBase):
    """Mul(BiasGelu[Tanh](x, b), u), either order, u of x's shape -> BiasGelu[Tanh]Mul(x, b, u) (GeGLU)"""

    def __init__(self, name: str, *, tanh: bool):
        super().__init__(name)
        self.gelu, self.fused = (BIAS_GELU_TANH, BIAS_GELU_TANH_MUL) if tanh else (BIAS_GELU, BIAS_GELU_MUL)

    def pattern(self, op, x, b, u):
        return op.Mul(getattr(op, self.gelu.name)(x, b, _domain=DOMAIN), u)

    def check(self, context, x, u, **_):
        return check_gate_and_up(pattern.MatchResult(), x, u)

    def rewrite(self, op, x, b, u, **_):
        return self.fused.node(op, x, b, u)
