"""Specialise a model for fixed input shapes, so that every node runs on the CUDA EP and ORT can capture
the model in a CUDA graph.

Exported models compute their Reshape targets, Expand shapes and masks from `Shape` of the inputs; ORT's
CUDA EP runs those small int64 subgraphs on the CPU and inserts Memcpy nodes around them, and ORT refuses
CUDA-graph capture when any Memcpy exists (shared/notes/FACTS.md). With every input dim fixed those
subgraphs are constants: onnxscript's constant folder evaluates them (without inlining our function-bodied
ops), and whatever it leaves with only constant inputs is evaluated here, one node at a time, on ORT CPU.

    specialized, remaining = specialize(model_ir, {"input_ids": [1, 128], "attention_mask": [1, 128]})

`remaining` lists the nodes that would still run on the CPU side (shape ops, nodes of constants only):
empty when the specialisation worked.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript.optimizer

SHAPE_OPS = frozenset({"Shape", "Size"})
_FOLD_LIMIT = 1 << 16  # elements: float results above it stay nodes


def parse(text: str) -> dict[str, list[int]]:
    """'input_ids=1x128,attention_mask=1x128' -> {name: dims}."""
    shapes = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, dims = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = [int(d) for d in dims.lower().split("x")]
        except ValueError:
            raise ValueError(f"static shape {item!r}: expected NAME=D0xD1x..., e.g. input_ids=1x128") from None
        if any(d < 1 for d in shapes[name]):
            raise ValueError(f"static shape {item!r}: every dim must be >= 1")
    if not shapes:
        raise ValueError("no static shapes given: expected NAME=D0xD1x..., e.g. input_ids=1x128")
    return shapes


def _fix_outputs(model: ir.Model, symbols: dict[str, int]) -> None:
    """Graph outputs whose dims are named after input dims get the fixed sizes (the folder does not
    rewrite output shapes, and a session binding buffers needs them)."""
    for value in model.graph.outputs:
        if value.shape is None:
            continue
        dims = [symbols.get(d.value, d) if isinstance(d, ir.SymbolicDim) else d for d in value.shape]
        value.shape = ir.Shape(dims)


def _fix_inputs(model: ir.Model, shapes: dict[str, list[int]]) -> dict[str, int]:
    inputs = {v.name: v for v in model.graph.inputs}
    have = ", ".join(f"{v.name} {v.shape}" for v in model.graph.inputs)
    missing = sorted(set(inputs) - set(shapes) - set(model.graph.initializers))
    unknown = sorted(set(shapes) - set(inputs))
    if unknown or missing:
        what = f"unknown input(s) {unknown}" if unknown else f"no shape for input(s) {missing}"
        raise ValueError(f"--static-shapes: {what}; the model's inputs are: {have}")
    symbols = {}
    for name, dims in shapes.items():
        value = inputs[name]
        if value.shape is not None:
            symbols.update((d.value, n) for d, n in zip(value.shape, dims)
                           if isinstance(d, ir.SymbolicDim) and d.value is not None)
            if value.shape.rank() != len(dims):
                raise ValueError(f"--static-shapes {name}: {len(dims)} dims given, the input has rank "
                                 f"{value.shape.rank()} ({value.shape})")
            for axis, (old, new) in enumerate(zip(value.shape, dims)):
                if isinstance(old, int) and old != new:
                    raise ValueError(f"--static-shapes {name}: dim {axis} is fixed at {old} in the model, "
                                     f"{new} given")
        value.shape = ir.Shape(dims)
    return symbols


def _constant(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    return value.const_value.numpy()


def _fold_leftovers(model: ir.Model) -> int:
    """Evaluate nodes whose inputs are all constants and that the folder left (it skips some ops and
    sizes); returns how many were replaced by initializers."""
    import onnxruntime as ort  # its CPU EP: onnx.reference gets GatherElements wrong (onnx 1.23)

    opset = model.opset_imports.get("", 1)
    folded = 0
    for node in list(model.graph):
        has_graph = any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())
        if node.domain not in ("", "ai.onnx") or has_graph:
            continue
        args = [_constant(v) if v is not None else None for v in node.inputs]
        if not node.inputs or any(a is None and v is not None for a, v in zip(args, node.inputs)):
            continue
        proto = ir.serde.serialize_node(node)
        names = [f"i{k}" if v is not None else "" for k, v in enumerate(node.inputs)]
        outs = [f"o{k}" for k in range(len(node.outputs))]
        del proto.input[:], proto.output[:]
        proto.input.extend(names)
        proto.output.extend(outs)
        graph = onnx.helper.make_graph(
            [proto], "fold", [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype),
                                                                 a.shape) for n, a in zip(names, args) if n],
            [onnx.helper.make_empty_tensor_value_info(o) for o in outs])
        try:
            one = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)], ir_version=8)
            results = ort.InferenceSession(one.SerializeToString(), providers=["CPUExecutionProvider"]).run(
                None, {n: a for n, a in zip(names, args) if n})
        except Exception:  # noqa: BLE001  (left in place: `remaining` then reports it)
            continue
        if any(out in model.graph.outputs for out in node.outputs) or any(
                np.asarray(r).size > _FOLD_LIMIT and np.asarray(r).dtype.kind == "f" for r in results):
            continue  # a large float constant (e.g. a [B, S, H] embedding): ORT folds it at load, on the GPU
        consts = []
        for out, array in zip(node.outputs, results):
            tensor = ir.tensor(np.asarray(array), name=out.name)
            const = ir.Value(name=out.name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype),
                             const_value=tensor)
            out.replace_all_uses_with(const)
            consts.append(const)
        model.graph.remove(node, safe=True)
        for const in consts:
            model.graph.register_initializer(const)
        folded += 1
    return folded


def _shape_like(value: ir.Value) -> bool:
    return value.dtype is not None and not value.dtype.is_floating_point()


def remaining(model: ir.Model) -> list[str]:
    """Nodes that would still compute shapes on the CPU: shape ops, and nodes of constants only that make
    integer or boolean tensors (index and shape arithmetic, which ORT's CUDA EP leaves to the CPU)."""
    left = []
    for node in model.graph:
        consts = [v is None or v.const_value is not None for v in node.inputs]
        if node.op_type in SHAPE_OPS or (node.inputs and all(consts) and any(map(_shape_like, node.outputs))):
            left.append(f"{node.op_type} {node.name or '(unnamed)'}")
    return left


def specialize(model: ir.Model, shapes: dict[str, list[int]]) -> list[str]:
    """Fix the inputs' shapes and fold every shape computation, in place. Returns remaining(model)."""
    _fix_outputs(model, _fix_inputs(model, shapes))
    for _ in range(3):  # folding can expose more (a Reshape whose target became constant)
        onnxscript.optimizer.optimize_ir(
            model, inline=False,
            # ConstantOfShape is not folded by default (its result can be large); here it builds masks and
            # index tensors of the fixed shapes
            should_fold=lambda n: True if n.op_type == "ConstantOfShape" else None)
        if not _fold_leftovers(model):
            break
    return remaining(model)
