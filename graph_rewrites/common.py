"""Small helpers the rules share."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

# A `check` failure whose reason starts with this is no refusal: the node was never a candidate (a rule whose
# pattern is one common op, MatMul, matches every one of them; most fail a condition no user would call a
# defect). The registry's tracer neither counts it as tried nor lists it among the refusals `optimize -v` prints.
NOT_A_CANDIDATE = "not a candidate: "

# The element types our ops take (every contract lists these three).
FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def same_dim(a, b) -> bool:
    """Provably equal dims: the same number, or the same named symbol (onnx_ir calls two unknown dims equal,
    which proves nothing: one of them may be a broadcast 1); None (no dim) equals nothing."""
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int) and a == b
    return a is not None and b is not None and a.value is not None and a.value == b.value


def zero_vector(op, like: ir.Value, length: int, tag: str) -> ir.Value:
    """A [length] zero initializer of like's element type, for an input the contract requires and the
    model lacks (a bias, a beta). Named after `like` and `tag`, with a counter when that name is taken (two
    norms of one value; a model optimized before): unique in the graph, the same on every run."""
    name = fresh_name(like.graph, f"{like.name}__ot_{tag}")
    return op.initializer(ir.tensor(np.zeros(length, dtype=like.dtype.numpy()), name=name))


def fresh_name(graph: ir.Graph | None, base: str) -> str:
    """base, or base_1, base_2...: a name no initializer of graph has yet (a model optimized twice keeps
    the first run's), the same on every run."""
    taken = graph.initializers if graph is not None else {}
    return next(n for n in (base if i == 0 else f"{base}_{i}" for i in range(len(taken) + 1)) if n not in taken)


def check_zero_bias_to_fold(result, zero: ir.Value, bias: ir.Value, x: ir.Value):
    """For the rules that fold `x + bias` into an op whose bias input is still a zero vector: the op's
    bias must be all zeros and `bias` a vector of the same shape and x's type. Returns result, failed or not."""
    z = zero.const_value
    if z is None or np.any(z.numpy()):
        return result.fail("the node already has a bias", zero)
    if bias.shape is None or list(bias.shape) != list(zero.shape) or bias.dtype != x.dtype:
        return result.fail(f"the Add's other operand is {bias.dtype} {bias.shape}, not a [{zero.shape}] bias", bias)
    return result


def transposed_constant(op, graph: ir.Graph | None, w: ir.Value) -> ir.Value:
    """A new initializer holding the constant w transposed ([K, N] -> [N, K], contiguous), named after w: the weight
    as Linear and AddRMSNormLinear / AddRMSNormSwiGLU read it."""
    data = np.ascontiguousarray(ir.convenience.get_const_tensor(w).numpy().T)
    return op.initializer(ir.tensor(data, name=fresh_name(graph, f"{w.name}__ot_t")))


def read_elsewhere(read: ir.Value, copied: ir.Value | None = None) -> bool:
    """Whether a weight a rewrite would store anew (transposed, padded) is also needed as it is: `read`, the value
    the matched node reads, is a graph output or read by another node, or `copied`, the constant the rewrite copies,
    is a graph input (a user may feed another)."""
    return read.is_graph_output() or len(read.uses()) > 1 or (copied is not None and copied.is_graph_input())


def other_perm(transpose: ir.Node) -> list[int] | None:
    """A Transpose's perm when it is not the 2-D swap a transposed weight needs ([1, 0], or none: for two dims the
    default reverses them); None when it is."""
    perm = transpose.attributes.get("perm")
    return None if perm is None or list(perm.as_ints()) == [1, 0] else list(perm.as_ints())


def static_2d(v: ir.Value) -> tuple[int, int] | None:
    """v's dims when its shape is known, 2-D and static (a MatMul's constant weight); else None."""
    s = v.shape
    return (s[0], s[1]) if s is not None and s.rank() == 2 and all(isinstance(d, int) for d in s) else None
