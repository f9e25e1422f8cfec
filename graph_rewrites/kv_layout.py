"""`--kv-cache seq-major`: a fused decoder's KV cache laid out sequence first, so a caller can bind each present over
its past and no decode step copies the cache (ops/kv_layout.py says why and how).

After the rules, each layer's cache op (QKVRotaryCache, QKVNormRotaryCache or QKVCache) reads past_key and
past_value from graph inputs and writes present_key and present_value as graph outputs, which the layer's
CausalAttention reads. Relaid:
- the four graph values' shapes go from [B, Nkv, T, D] to [T, B, Nkv, D] (the same dims, permuted; the names stay);
- the cache op and every CausalAttention reading its presents get seq_major = 1;
- a `Shape` of a past (the exports take the past length from it, for positions and masks) becomes
  `Gather(Shape(past), [1, 2, 0, 3])`, then its start/end as a `Slice`: the values it gave before, so the rest of
  the graph computes what it did.

A layer whose past or present has any other reader, a past that is not a graph input, a present that is not a graph
output, or a CausalAttention reading one layer's key and another's value, stays heads first; the reason is returned
(and optimize's report says it). The model's interface changes with the layout: a caller feeds and binds the cache
sequence first (examples/generate.py --kv-cache seq-major).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ort_triton.contract import DOMAIN
from ort_triton.ops import BY_NAME as OPS
from ort_triton.ops.kv_layout import METADATA_KEY, TO_HEADS, TO_SEQ, seq_major_names

WRITERS = ("QKVRotaryCache", "QKVNormRotaryCache", "QKVCache")
READER = "CausalAttention"
_INT64_MAX = np.iinfo(np.int64).max


def _index(op: str, name: str, outputs: bool = False) -> int:
    return [io.name for io in (OPS[op].outputs if outputs else OPS[op].inputs)].index(name)


def _ours(node: ir.Node, ops) -> bool:
    return node.domain == DOMAIN and node.op_type in ops


def _desc(node: ir.Node) -> str:
    return f"{node.op_type} {node.name!r}" if node.name else node.op_type


def _bypass_copies(graph: ir.Graph, writer: ir.Node) -> None:
    """A past read through an Identity or a one-input Concat (torchscript's export has one in front of layer 0's
    past_key) that nothing else reads: the cache op reads the value behind it, and the copy goes."""
    for name in ("past_key", "past_value"):
        index = _index(writer.op_type, name)
        while True:
            past = writer.inputs[index]
            node = past.producer() if past is not None else None
            if node is None or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1 or \
                    node.op_type not in ("Identity", "Concat") or len(past.uses()) != 1 or past.is_graph_output():
                break
            writer.replace_input_with(index, node.inputs[0])
            graph.remove(node, safe=True)


def _check(writer: ir.Node) -> str | tuple[list[ir.Node], list[ir.Node]]:
    """(the past's Shape readers, the attentions reading the presents) of one cache op, or why it stays."""
    shapes, readers = [], []
    for name in ("past_key", "past_value"):
        past = writer.inputs[_index(writer.op_type, name)]
        if past is None or not past.is_graph_input() or past.is_initializer():
            return f"{_desc(writer)}: its {name} is not a graph input"
        if past.shape is None or len(past.shape) != 4:
            return f"{_desc(writer)}: its {name} {past.name!r} has no rank-4 shape"
        for use in past.uses():
            node = use.node
            if node is writer:
                continue
            if node.domain in ("", "ai.onnx") and node.op_type == "Shape":
                shapes.append(node)
                continue
            return f"{_desc(writer)}: its {name} {past.name!r} is also read by {_desc(node)}"
    for name, slot in (("present_key", 1), ("present_value", 2)):
        present = writer.outputs[_index(writer.op_type, name, outputs=True)]
        if not present.is_graph_output():
            return f"{_desc(writer)}: its {name} {present.name!r} is not a graph output"
        for use in present.uses():
            node = use.node
            if not _ours(node, (READER,)) or use.idx != slot:
                return f"{_desc(writer)}: its {name} {present.name!r} is read by {_desc(node)} (input {use.idx})"
            other = node.inputs[3 - slot]  # the attention's other cache input: this op's other present
            if other is None or other.producer() is not writer:
                return f"{_desc(node)} reads {present.name!r} and a {('value', 'key')[slot - 1]} of another op"
            if node not in readers:
                readers.append(node)
    return shapes, readers


def _permuted(value: ir.Value, perm) -> str:
    dims = list(value.shape)
    value.shape = ir.Shape([dims[p] for p in perm])
    return value.name


def _const(graph: ir.Graph, name: str, values) -> ir.Value:
    tensor = ir.tensor(np.asarray(values, np.int64), name=name)
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


def _heads_first_shape(graph: ir.Graph, shape: ir.Node, perm: ir.Value, n: int) -> None:
    """Shape(past[, start, end]) -> Slice(Gather(Shape(past), [1, 2, 0, 3]), start, end): the heads-first dims."""
    start = shape.attributes.get_int("start", 0)
    end = shape.attributes.get_int("end", None)
    base = shape.name or f"kv_shape_{n}"
    full = ir.node("Shape", [shape.inputs[0]], name=f"{base}__ot_full")
    nodes = [full, ir.node("Gather", [full.outputs[0], perm], {"axis": 0}, name=f"{base}__ot_heads_first")]
    if start != 0 or end is not None:
        starts = _const(graph, f"{base}__ot_start", [start])
        ends = _const(graph, f"{base}__ot_end", [_INT64_MAX if end is None else end])
        nodes.append(ir.node("Slice", [nodes[-1].outputs[0], starts, ends], name=f"{base}__ot_slice"))
    out, old = nodes[-1].outputs[0], shape.outputs[0]
    name = old.name  # the new value takes it: a graph output keeps its name
    old.name = f"{name}__ot_replaced"
    out.name, out.shape, out.type = name, old.shape, old.type
    graph.insert_after(shape, nodes)
    old.replace_all_uses_with(out, replace_graph_outputs=True)
    graph.remove(shape, safe=True)


def cache_writers(model: ir.Model) -> int:
    """How many fused cache ops (WRITERS) the model's graph has, whatever their layout."""
    return sum(_ours(n, WRITERS) for n in model.graph)


def relay_seq_major(model: ir.Model) -> tuple[int, list[str]]:
    """Lay the cache of every fused layer out sequence first (the module's doc). Returns (layers relaid, the
    reasons the others stay heads first)."""
    graph = model.graph
    writers = [n for n in graph if _ours(n, WRITERS)]
    done, reasons, shapes, relaid = 0, [], [], []
    perm = None
    for writer in writers:
        _bypass_copies(graph, writer)
        found = _check(writer)
        if isinstance(found, str):
            reasons.append(found)
            continue
        past_shapes, readers = found
        for node in (writer, *readers):
            node.attributes["seq_major"] = ir.AttrInt64("seq_major", 1)
        for name in ("past_key", "past_value"):
            relaid.append(_permuted(writer.inputs[_index(writer.op_type, name)], TO_SEQ))
        for name in ("present_key", "present_value"):
            relaid.append(_permuted(writer.outputs[_index(writer.op_type, name, outputs=True)], TO_SEQ))
        shapes += past_shapes
        done += 1
    for n, shape in enumerate(dict.fromkeys(shapes)):  # a Shape may read a past two layers share: once
        if perm is None:
            perm = _const(graph, "kv_seq_major__ot_heads_first_perm", list(TO_HEADS))
        _heads_first_shape(graph, shape, perm, n)
    if relaid:  # the model's interface changed: say which tensors, for its callers (ops/kv_layout.seq_major_names)
        names = seq_major_names(model.metadata_props) | set(relaid)
        model.metadata_props[METADATA_KEY] = ",".join(sorted(names))
    return done, reasons
