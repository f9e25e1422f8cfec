"""Three or more projections of one input -> one MatMul and a Split (decoders' Q, K and V).

    y_i = x @ W_i [+ b_i],  i = 1..n, n >= 3, each W_i a constant [K, N_i] of one type, b_i a constant [N_i]
        -> y_1, ..., y_n = Split(x @ [W_1 | ... | W_n] [+ [b_1 | ... | b_n]], [N_1, ..., N_n], axis=-1)

Why: a decode step's projections are GEMVs too small to reach the GPU's bandwidth, so their cost is mostly
per launch. At Llama-1B's shapes, one token (fp16, H200, cuBLAS, scripts/gemv_decode_micro.py, session 13):
Q 4.90 us, K 5.02, V 5.02, against 5.19 for the three packed; the Split that hands the parts back costs one
small copy. Two projections (SwiGLU's gate and up) are not packed: each streams its 33 MB weight near the
bandwidth already, and packed they measured slower (18.1 us against 2 x 8.43), and SiluMul takes them apart.
The biases are packed too when every projection's one reader is an Add of a constant vector (Qwen2); readers
with a bias and readers without are grouped apart (Phi: Q, K, V with theirs; fc1, whose bias BiasGelu took).

Not a pattern rule: onnxscript's matcher binds one node per pattern node, so n siblings of one input cannot
be a pattern; the grouping is a walk over each value's MatMul readers. BERT's Q/K/V are packed earlier, into
PackedMultiHeadAttention (pack_qkv); the MatMuls that rule left behind have no readers and are skipped here.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .common import fresh_name

MIN_GROUP = 3


def _weight(node: ir.Node) -> ir.TensorProtocol | None:
    """The MatMul's constant weight (its data is read only when a group is packed: a 1B model's are large)."""
    w = node.inputs[1]
    return w.const_value if w is not None else None


def _bias_add(y: ir.Value, n: int) -> tuple[ir.Node, ir.TensorProtocol] | None:
    """y's one reader, when it is an Add of y and a constant [n] vector of y's type: (the Add, the vector)."""
    uses = list(y.uses())
    if len(uses) != 1 or y.is_graph_output():
        return None
    add = uses[0].node
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2 or \
            add.outputs[0].is_graph_output():  # a graph output keeps its Add (packed without the biases)
        return None
    other = add.inputs[1 - uses[0].idx]
    b = other.const_value if other is not None else None
    if b is None or tuple(b.shape) != (n,) or b.dtype != y.dtype:
        return None
    return add, b


def _refuse(group: list[ir.Node], x: ir.Value) -> str | None:
    """Why this group of MatMuls reading x stays as it is, or None."""
    if x.shape is None or x.shape.rank() < 2:
        return f"input {x.name} has no known rank >= 2"
    weights = [_weight(m) for m in group]
    for m, w in zip(group, weights):
        if w is None or len(w.shape) != 2:
            return f"the weight {m.inputs[1].name} of MatMul {m.name} is not a 2-D constant"
    if len({w.dtype for w in weights}) != 1 or len({w.shape[0] for w in weights}) != 1:
        return f"the weights are not of one type and K ({[f'{w.dtype} {list(w.shape)}' for w in weights]})"
    for m in group:
        if m.outputs[0].is_graph_output():
            return f"the output {m.outputs[0].name} of MatMul {m.name} is a graph output"
    return None


def _bias_of(m: ir.Node) -> tuple[ir.Node, ir.TensorProtocol] | None:
    """_bias_add of a MatMul with a 2-D constant weight, None for any other."""
    w = _weight(m)
    return _bias_add(m.outputs[0], w.shape[1]) if w is not None and len(w.shape) == 2 else None


def _pack(graph: ir.Graph, x: ir.Value, group: list[ir.Node]) -> None:
    """Pack one group of one kind: every projection with a bias Add, or none."""
    weights = [_weight(m).numpy() for m in group]
    sizes = [w.shape[1] for w in weights]
    adds = [_bias_of(m) for m in group]
    with_bias = adds[0] is not None
    base = group[0].outputs[0].name or "proj"

    def const(values: np.ndarray, tag: str) -> ir.Value:
        v = ir.Value(name=fresh_name(graph, f"{base}__ot_{tag}"), const_value=ir.tensor(values))
        v.shape, v.dtype = ir.Shape(values.shape), ir.DataType.from_numpy(values.dtype)
        graph.register_initializer(v)
        return v

    new_nodes = [ir.Node("", "MatMul", [x, const(np.concatenate(weights, axis=1), "packed_weight")],
                         name=f"{base}__ot_packed")]
    packed = new_nodes[-1].outputs[0]
    if with_bias:
        bias = const(np.concatenate([b.numpy() for _, b in adds]), "packed_bias")
        new_nodes.append(ir.Node("", "Add", [packed, bias], name=f"{base}__ot_packed_bias"))
        packed = new_nodes[-1].outputs[0]
    olds = [a[0].outputs[0] for a in adds] if with_bias else [m.outputs[0] for m in group]
    split = ir.Node("", "Split", [packed, const(np.array(sizes, np.int64), "split_sizes")], attributes=[
        ir.AttrInt64("axis", -1)], num_outputs=len(group), name=f"{base}__ot_split")
    new_nodes.append(split)
    for old, new in zip(olds, split.outputs):
        new.name, new.shape, new.dtype = f"{old.name}__ot_part", old.shape, old.dtype
    graph.insert_before(group[0], new_nodes)
    for old, new in zip(olds, split.outputs):
        ir.convenience.replace_all_uses_with(old, new)
    dead = ([a[0] for a in adds] if with_bias else []) + group
    graph.remove(dead, safe=True)
    for m in group:  # the separate weights, unless something else reads them
        w = m.inputs[1] if m.inputs else None
        if w is not None and w.name in graph.initializers and not w.uses():
            graph.initializers.pop(w.name)


def pack_projections(model: ir.Model) -> tuple[int, int, list[tuple[str, str]]]:
    """Pack every group of >= MIN_GROUP live MatMuls reading one value (main graph). Returns (groups tried,
    groups packed, (node, reason) for each group left alone)."""
    graph = model.graph
    tried, packed, refused = 0, 0, []
    groups: dict[int, tuple[ir.Value, list[ir.Node]]] = {}
    for node in graph:
        if (node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and len(node.inputs) == 2
                and node.inputs[0] is not None and node.outputs[0].uses()):
            groups.setdefault(id(node.inputs[0]), (node.inputs[0], []))[1].append(node)
    for x, readers in groups.values():
        if len(readers) < MIN_GROUP:
            continue
        # with a bias Add and without, packed apart: Phi's fc1 reads the attention's input too, and its bias
        # has gone into BiasGelu by now; with Q, K and V it would be packed into one zero-padded bias Add
        biased = [m for m in readers if _bias_of(m) is not None]
        kinds = [k for k in (biased, [m for m in readers if m not in biased]) if len(k) >= MIN_GROUP]
        tried += max(1, len(kinds))
        if not kinds:
            refused.append((readers[0].name or "MatMul", f"{len(biased)} of the {len(readers)} projections of "
                            f"{x.name} have a bias Add, {len(readers) - len(biased)} have none: fewer than "
                            f"{MIN_GROUP} of a kind"))
            continue
        for group in kinds:
            reason = _refuse(group, x)
            if reason:
                refused.append((group[0].name or "MatMul", reason))
                continue
            _pack(graph, x, group)
            packed += 1
    graph.sort()
    return tried, packed, refused
