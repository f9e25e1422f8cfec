"""Find transformer subgraphs in an exported ONNX model and replace each with one op of ai.ort_triton.

    model, report = graph_rewrites.optimize(model, report=True)

Every op used gets its ONNX function body (from its contract), so the result runs on any ONNX Runtime,
with or without the ort_triton library.
"""

from __future__ import annotations

import collections
import dataclasses
import os

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import TopologicalSortPass

from ort_triton.contract import DOMAIN, DOMAIN_VERSION, MIN_OPSET
from ort_triton.ops import BY_NAME as OPS

from .kv_layout import cache_writers, relay_seq_major
from .registry import RULES, RuleStats, apply_rules, select
from .static_shapes import specialize

__all__ = ["FP32_KEEP", "RULES", "Report", "op_counts", "optimize", "to_float16"]

_MIN_IR_VERSION = 8  # model-local functions


@dataclasses.dataclass
class Report:
    rules: dict[str, RuleStats]
    ops_before: collections.Counter
    ops_after: collections.Counter
    notes: list[str] = dataclasses.field(default_factory=list)  # why a whole model was left alone

    def fused(self) -> int:
        return sum(s.matched for s in self.rules.values())


def _graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            for g in attr.graphs:
                yield from _graphs(g)


def op_counts(model: onnx.ModelProto) -> collections.Counter:
    """Op types (domain-qualified where not ai.onnx) over the main graph and its subgraphs."""
    return collections.Counter((f"{n.domain}." if n.domain not in ("", "ai.onnx") else "") + n.op_type
                               for g in _graphs(model.graph) for n in g.node)


def _load(model, inplace: bool = False) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        if inplace:
            return model
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        return proto
    if isinstance(model, ir.Model):
        return ir.serde.serialize_model(model)
    if isinstance(model, (str, os.PathLike)):
        return onnx.load(os.fspath(model))
    raise TypeError(f"optimize takes an onnx.ModelProto, an onnx_ir.Model or a path, not {type(model).__name__}")


_BIG_TENSOR = 1 << 20  # bytes


def _infer_shapes(proto: onnx.ModelProto) -> onnx.ModelProto:
    """onnx shape inference (with data propagation) on the model without its large weights: they carry no
    shape information beyond their dims, onnx would copy them all into its C++ side and back, and past
    protobuf's 2 GiB it cannot serialise the model at all. The weights are moved out of `proto` and into
    the inferred model, so they exist once."""
    data = {}
    for t in proto.graph.initializer:
        if len(t.raw_data) > _BIG_TENSOR:
            data[t.name] = t.raw_data
            t.ClearField("raw_data")
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:  # noqa: BLE001  (onnx raises several types; the rules then refuse with a reason)
        inferred = proto
    for t in inferred.graph.initializer:
        if t.name in data:
            t.raw_data = data.pop(t.name)
    return inferred


def _opset(proto: onnx.ModelProto) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)


def _list_all_outputs(proto: onnx.ModelProto) -> None:
    """onnx_ir drops trailing "" outputs when it reads a model back; ORT needs every output of our nodes
    listed (and onnx's checker rejects a node with fewer outputs than its function body)."""
    for g in _graphs(proto.graph):
        for node in g.node:
            if node.domain == DOMAIN:
                node.output.extend([""] * (len(OPS[node.op_type].outputs) - len(node.output)))


def _finish(proto: onnx.ModelProto) -> None:
    """Drop initializers nothing reads, attach one function body per op used, import the domain, and list
    every output of our nodes, with "" for optional ones nobody reads (ORT needs all listed; "" tells the
    kernel to skip writing them; see ort_triton/contract.py)."""
    read = {o.name for o in proto.graph.output}
    for g in _graphs(proto.graph):
        read.update(i for n in g.node for i in n.input)
    used = set()
    _list_all_outputs(proto)
    for g in _graphs(proto.graph):
        for node in g.node:
            if node.domain != DOMAIN:
                continue
            contract = OPS[node.op_type]
            used.add(node.op_type)
            for i, out in enumerate(contract.outputs):
                if out.optional and i < len(node.output) and node.output[i] not in read:
                    node.output[i] = ""
    # initializers nothing reads any more: constants of the fused subgraphs, zero biases a stage-1 rule
    # invented and a later stage replaced (graph inputs stay: they are part of the model's interface)
    inputs = {i.name for i in proto.graph.input}
    for t in [t for t in proto.graph.initializer if t.name not in read and t.name not in inputs]:
        proto.graph.initializer.remove(t)
    # our ops' bodies come from their contracts, always: a model optimized before (whose bodies shape
    # inference has annotated since, or an older version wrote) gets the same bodies as a fresh one
    for f in [f for f in proto.functions if f.domain == DOMAIN]:
        proto.functions.remove(f)
    for name in sorted(used):
        proto.functions.append(OPS[name].function_proto(_opset(proto)))
    if used and not any(o.domain == DOMAIN for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    if used:
        proto.ir_version = max(proto.ir_version, _MIN_IR_VERSION)


# Ops --float16 leaves in fp32 besides onnxruntime's own block list: the ones whose fp16 results overflow
# or lose the most (sums of squares, exponentials). Fused ops compute in fp32 inside, whatever their type.
FP32_KEEP = ("Pow", "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "Exp", "Log", "Sqrt", "Reciprocal")


def to_float16(proto: onnx.ModelProto, *, keep_io_types: bool = False,
               keep_fp32: tuple[str, ...] = FP32_KEEP) -> onnx.ModelProto:
    """fp32 -> fp16 with onnxruntime's converter: initializers and activations in fp16, the ops in
    keep_fp32 (and ORT's block list) behind Casts, graph inputs/outputs fp32 when keep_io_types. The
    result is topologically sorted. Drops proto's value_info entries that describe an initializer. Works
    past protobuf's 2 GiB: the types come from _infer_shapes, which leaves the weights out (the converter's
    own inference serialises the whole model, and an fp32 model of 540 M parameters or more cannot be)."""
    from onnxruntime.transformers import float16

    proto = _infer_shapes(proto)
    # An initializer that only keep-listed ops read stays fp32, but the converter turns a value_info of the
    # same name (onnx_ir writes one per initializer) to fp16, which onnx's checker rejects; the initializer
    # carries its own type and shape, so the entry says nothing more.
    for g in _graphs(proto.graph):
        inits = {t.name for t in g.initializer}
        for v in [v for v in g.value_info if v.name in inits]:
            g.value_info.remove(v)
    out = float16.convert_float_to_float16(proto, keep_io_types=keep_io_types, disable_shape_infer=True,
                                           op_block_list=sorted(set(float16.DEFAULT_OP_BLOCK_LIST) | set(keep_fp32)))
    # The converter appends every Cast it adds (after a graph input, around a keep-listed op) at the end of
    # the main graph, after the nodes that read it: ORT runs that, but onnx.checker (full_check) and other
    # tools reject a graph that is not topologically sorted. onnx_ir's stable sort moves only what must move,
    # in the main graph, every subgraph and every function.
    model = ir.serde.deserialize_model(out)
    del out  # the IR holds its tensors; serialising copies them, so only one copy stays alive
    TopologicalSortPass()(model)
    out = ir.serde.serialize_model(model)
    _list_all_outputs(out)
    return out


def optimize(model, *, only: list[str] | None = None, disable: list[str] | None = None,
             enable: list[str] | None = None, report: bool = False,
             float16: bool = False, keep_io_types: bool = False, keep_fp32: tuple[str, ...] = FP32_KEEP,
             progress=None, inplace: bool = False, static_shapes: dict[str, list[int]] | None = None,
             kv_cache: str = "heads-first"):
    """Fuse what the rules find, then (float16=True) convert to fp16 (see to_float16). Returns a model
    of the input's type (a path gives an onnx.ModelProto); with report=True, (model, Report). The input
    is never modified, unless inplace=True hands over an onnx.ModelProto to be consumed (its weights move
    to the result: one copy of them instead of two, for models of several GB). progress(done, total,
    what) is called between rule stages. static_shapes {input: dims} specialises the model for those
    shapes after fusing (graph_rewrites/static_shapes.py: every shape computation folded, so ORT's CUDA EP
    runs every node and can capture a CUDA graph); a shape node it cannot fold is named in the notes.
    kv_cache "seq-major" lays each fused layer's cache out [T, B, Nkv, D] (graph_rewrites/kv_layout.py: a caller
    binds present over past and no step copies the cache); the model's cache inputs and outputs change with it,
    and static_shapes then names their dims in that order. Layers left heads first are named in the notes."""
    if kv_cache not in ("heads-first", "seq-major"):
        raise ValueError(f"kv_cache {kv_cache!r}: expected 'heads-first' (the export's [B, Nkv, T, D]) or "
                         "'seq-major' ([T, B, Nkv, D])")
    selected = rules = select(only, disable, enable)
    proto = _load(model, inplace)
    before = op_counts(proto)
    notes = []
    if _opset(proto) < MIN_OPSET:
        notes.append(f"model opset {_opset(proto)} < {MIN_OPSET}: nothing fused (the ops' function bodies need "
                     f"CastLike); re-export with opset >= {MIN_OPSET} or convert with onnx.version_converter")
        rules = []
    elif _opset(proto) > onnx.defs.onnx_opset_version():
        notes.append(f"model opset {_opset(proto)} is newer than this onnx knows ({onnx.defs.onnx_opset_version()}): "
                     "nothing fused (the rules cannot know what its ops mean); upgrade onnx and onnxscript")
        rules = []
    # shapes and types let `check` prove what it needs; a model that defeats inference still rewrites
    proto = _infer_shapes(proto)
    ir_model = ir.serde.deserialize_model(proto)
    del proto  # the IR holds its tensors; serialising below copies them, so only one copy stays alive
    stats = {r.name: RuleStats(r.name, r.identity) for r in selected}
    stats.update(apply_rules(ir_model, rules, progress))
    if kv_cache == "seq-major":
        relaid, kept = relay_seq_major(ir_model)
        if not relaid and not kept:
            notes.append("--kv-cache seq-major: no fused cache op (QKVRotaryCache, QKVNormRotaryCache, QKVCache) to "
                         "relay: export the model with its KV cache, and leave the qkv_*cache rules on")
        else:
            notes.append(f"--kv-cache seq-major: {relaid} layer(s) relaid [T, B, Nkv, D]; bind each present over its "
                         "past (examples/generate.py)")
        notes += [f"--kv-cache seq-major: left heads first: {r}" for r in kept]
    elif caches := cache_writers(ir_model):
        notes.append(f"{caches} layer(s) write their KV cache heads first, as exported: each decode step copies the "
                     "whole past into present; --kv-cache seq-major lets a caller bind each present over its past "
                     "and copy nothing")
    if static_shapes:
        left = specialize(ir_model, static_shapes)
        if left:
            notes.append(f"--static-shapes: {len(left)} node(s) still compute shapes and would run on the CPU "
                         f"(no CUDA graph capture): {', '.join(left[:8])}")
    out = ir.serde.serialize_model(ir_model)
    _finish(out)
    if float16:
        out = to_float16(out, keep_io_types=keep_io_types, keep_fp32=tuple(keep_fp32))
    result = ir.serde.deserialize_model(out) if isinstance(model, ir.Model) else out
    if report:
        return result, Report(stats, before, op_counts(out), notes)
    return result

