"""SwiGLU's epilogue -> SiluMul (contract: ort_triton/ops/swiglu.py).

    Mul(Mul(g, Sigmoid(g)), u)     both torch exporters, default opset and 23 (silu as Sigmoid and Mul)
    Mul(Swish(g, alpha=1), u)      ONNX Swish (opset 24); torch 2.13 does not emit it at 20, 23 or 24

with every operand order (commute). gate and up must be provably one shape (the op does not broadcast):
in the MLP they are two MatMuls of the same normed input, so shape inference gives them the same dims.
HardSwish is not silu and is not matched. The MatMuls stay ORT's.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from ort_triton.ops.swiglu import SILU_MUL

from .common import FLOAT_TYPES, same_dim


def check_gate_and_up(result: pattern.MatchResult, gate: ir.Value, up: ir.Value) -> pattern.MatchResult:
    """gate and up of a gated MLP's product: a float type, one type, provably one shape, a static last dim (also
    GeGLU's rule, graph_rewrites/gelu.py)."""
    if gate.dtype not in FLOAT_TYPES:
        return result.fail(f"element type {gate.dtype} is not one of float, float16, bfloat16", gate)
    if up.dtype != gate.dtype:
        return result.fail(f"gate is {gate.dtype} but up is {up.dtype}", up)
    gs, us = gate.shape, up.shape
    if gs is None or us is None or gs.rank() < 1 or gs.rank() != us.rank() or not all(map(same_dim, gs, us)):
        return result.fail(f"gate {gs} and up {us} are not provably one shape (the op does not broadcast)", up)
    if not isinstance(gs[-1], int):
        return result.fail(f"the last dimension of gate is not static (shape {gs})", gate)
    return result


class SiluMulRule(pattern.RewriteRuleClassBase):
    """Mul(Mul(g, Sigmoid(g)), u), any operand order -> SiluMul(g, u)"""

    def pattern(self, op, g, u):
        return op.Mul(op.Mul(g, op.Sigmoid(g)), u)

    def check(self, context, g, u, **_):
        return check_gate_and_up(pattern.MatchResult(), g, u)

    def rewrite(self, op, g, u, **_):
        return SILU_MUL.node(op, g, u)


class SwishMulRule(pattern.RewriteRuleClassBase):
    """Mul(Swish(g, alpha=1), u) (opset 24), either order -> SiluMul(g, u)"""

    def pattern(self, op, g, u):
        return op.Mul(op.Swish(g, _allow_other_attributes=True, _outputs=["swish"]), u)

    def check(self, context, g, u, swish, **_):
        result = pattern.MatchResult()
        alpha = swish.producer().attributes.get_float("alpha", 1.0)
        if alpha != 1.0:
            return result.fail(f"Swish with alpha={alpha:g} is not silu (alpha 1)", swish.producer())
        return check_gate_and_up(result, g, u)

    def rewrite(self, op, g, u, **_):
        return SILU_MUL.node(op, g, u)
