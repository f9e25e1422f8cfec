"""Prove that an attention mask is a key-padding mask, by evaluating it.

Exporters build the [B, 1, Sq, Skv] mask from the 2-D attention_mask with index arithmetic that differs
between the torch exporters and between transformers versions (Range/GreaterOrEqual/And/GatherND from
dynamo, Flatten/Gather/Expand from torchscript, ...). A pattern for each would break with the next
version; what they compute does not change: mask[b, h, q, k] depends on attention_mask[b, k] only. So
the mask is not read, it is run:

1. slice: the nodes the mask depends on, back to graph inputs and constants. The values of exactly one
   2-D graph input may flow into it (that is the attention mask); other inputs only through Shape/Size;
   no control flow.
2. evaluate the slice on ORT CPU for a few (batch, seq) sizes with fixed-seed 0/1 masks, each with an
   all-ones and an all-zero row;
3. compare with keep = attention_mask != 0, for every b, h, q, k: a boolean mask must equal keep[b, k];
   an additive one must be 0 where keep and one fill value <= -1e4 (or -inf) where not.

A mask that reads no input's values (ViT's, built from shapes only) is proven the same way to keep every
key, which is no mask at all.

Limits: the proof covers 0/1 attention masks (what tokenizers produce), not other values; it samples
sizes up to 4 x 7, so a mask that changes behaviour only beyond those is not caught; upstream of a Shape
only shapes are assumed to matter (an input whose values change a shape there would pass the
dependency check, though the evaluation with random values would likely still expose it).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import helper

from ort_triton.contract import DOMAIN, DOMAIN_VERSION
from ort_triton.ops import BY_NAME as OPS

# (batch, seq) sizes the mask is evaluated at: small, distinct, every batch with an all-zero row
_SIZES = ((3, 5), (4, 7), (2, 3))
DROPS = -1e4  # an additive fill at or below this drops the key (exp underflows to 0 in every float type)
_SHAPE_ONLY = ("Shape", "Size")  # ops that read only the shape of their input


@dataclasses.dataclass(frozen=True)
class KeyPadding:
    """A proven key-padding mask: key k of batch row b is kept iff source[b, k] != 0."""

    # the 2-D graph input, by name (verdicts outlive the graph copy they were proven on); None: the mask
    # keeps every key
    source: str | None
    fill: float | None  # additive mask: the value on dropped keys (0 on kept ones); else None
    per_query: bool  # the mask has a query axis (as long as the keys) rather than 1: Sq must equal Skv


class MaskProver:
    """Proves masks, one verdict per mask value (every layer of a model reads the same mask)."""

    def __init__(self):
        self._verdicts: dict[str, KeyPadding | str] = {}

    def prove(self, model: ir.Model, mask: ir.Value) -> KeyPadding | str:
        """The proof, or why there is none."""
        if mask.name is None:
            return _prove(model, mask)
        if mask.name not in self._verdicts:
            self._verdicts[mask.name] = _prove(model, mask)
        return self._verdicts[mask.name]


@dataclasses.dataclass
class _Slice:
    nodes: set[ir.Node]
    inputs: dict[ir.Value, bool]  # graph input -> whether its values (not only its shape) are read
    constants: set[ir.Value]  # initializers


def _slice(mask: ir.Value) -> _Slice | str:
    out = _Slice(set(), {}, set())
    seen: set[tuple[ir.Value, bool]] = set()
    todo = [(mask, True)]
    while todo:
        value, by_value = todo.pop()
        if (value, by_value) in seen:
            continue
        seen.add((value, by_value))
        if value.is_initializer():
            out.constants.add(value)
            continue
        if value.is_graph_input():
            out.inputs[value] = out.inputs.get(value, False) or by_value
            continue
        node = value.producer()
        if node is None:
            return f"the mask reads {value.name}, which is neither computed nor a graph input"
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            return f"the mask is computed with control flow ({node.op_type} {node.name})"
        out.nodes.add(node)
        reads = by_value and node.op_type not in _SHAPE_ONLY
        todo.extend((i, reads) for i in node.inputs if i is not None)
    return out


def mask_session(model: ir.Model, mask: ir.Value) -> tuple[_Slice, ir.Value | None, ort.InferenceSession] | str:
    """The subgraph that computes `mask` as an ORT CPU session, with the one 2-D input whose values it reads
    (None: it reads none), or why it cannot be evaluated. Shared by this module's key-padding proof and
    causal_mask.py's causal one."""
    if mask.graph is not model.graph:
        return "the mask is not computed in the main graph"
    if mask.dtype is None:
        return "the mask's element type is unknown"
    part = _slice(mask)
    if isinstance(part, str):
        return part
    read = [v for v, by_value in part.inputs.items() if by_value]
    if len(read) > 1:
        return f"the mask depends on the values of {', '.join(sorted(v.name for v in read))}, not of one 2-D input"
    source = read[0] if read else None
    if source is not None and (source.shape is None or source.shape.rank() != 2):
        return f"the mask depends on {source.name}, which is not 2-D [batch, keys] (shape {source.shape})"
    try:
        session = ort.InferenceSession(_slice_model(model, mask, part).SerializeToString(), _options(),
                                       providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001  (ORT raises its own types)
        return f"the mask could not be evaluated on ORT CPU: {str(e).splitlines()[0]}"
    return part, source, session


def _prove(model: ir.Model, mask: ir.Value) -> KeyPadding | str:
    found = mask_session(model, mask)
    if isinstance(found, str):
        return found
    part, source, session = found
    rng = np.random.default_rng(0)
    verdicts = set()
    for batch, seq in _SIZES:
        feeds = _feeds(rng, part.inputs, source, batch, seq)
        if isinstance(feeds, str):
            return feeds
        try:
            (value,) = session.run(None, feeds)
        except Exception as e:  # noqa: BLE001
            return f"the mask could not be evaluated on ORT CPU: {str(e).splitlines()[0]}"
        verdict = _compare(value, feeds[source.name] != 0 if source is not None else None)
        if isinstance(verdict, str):
            return verdict if source is not None else f"{verdict} (it reads no input's values: it must keep every key)"
        verdicts.add(verdict)
    if len(verdicts) > 1:
        return f"the mask's fill or layout changes with the input size ({sorted(verdicts, key=str)})"
    return KeyPadding(source.name if source is not None else None, *verdicts.pop())


def _options() -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return so


def _slice_model(model: ir.Model, mask: ir.Value, part: _Slice) -> onnx.ModelProto:
    """A model computing `mask` from the slice's inputs; float16/bfloat16 masks come out as float (exactly:
    0, -inf and finfo.min convert without rounding), which numpy reads."""
    nodes, used = [], set()
    for node in model.graph:  # graph order is topological
        if node in part.nodes:
            proto = ir.serde.serialize_node(node)
            if node.domain == DOMAIN:  # our ops list every output (see ort_triton/contract.py)
                used.add(node.op_type)
                proto.output.extend([""] * (len(OPS[node.op_type].outputs) - len(proto.output)))
            nodes.append(proto)
    out = mask.name
    if mask.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        out = f"{mask.name}__as_float"
        nodes.append(helper.make_node("Cast", [mask.name], [out], to=onnx.TensorProto.FLOAT))
    out_type = onnx.TensorProto.FLOAT if out != mask.name else mask.dtype.value
    inits = []
    for v in part.constants:
        t = ir.serde.serialize_tensor(v.const_value)
        t.name = v.name
        inits.append(t)
    graph = helper.make_graph(nodes, "mask", [helper.make_tensor_value_info(v.name, v.dtype.value, None)
                                              for v in part.inputs],
                              [helper.make_tensor_value_info(out, out_type, None)], initializer=inits)
    opsets = dict(model.opset_imports)
    if used:
        opsets.setdefault(DOMAIN, DOMAIN_VERSION)
    functions = [ir.serde.serialize_function(f) for f in model.functions.values()]
    functions += [OPS[name].function_proto(opsets[""]) for name in sorted(used)]
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
                             functions=functions, ir_version=max(model.ir_version, 8))


def _feeds(rng, inputs: dict[ir.Value, bool], source: ir.Value | None, batch: int, seq: int) -> dict | str:
    """Random inputs of one size: the mask source 0/1 with an all-ones and an all-zero row, the others
    random (only their shapes may matter). The source is [batch, seq] where not static, and other inputs'
    named dims follow it; without a source, the inputs' named dims take batch and seq in turn."""
    named = {}
    if source is not None:
        named = {dim.value: size for dim, size in zip(source.shape, (batch, seq))
                 if isinstance(dim, ir.SymbolicDim) and dim.value is not None}
    feeds = {}
    for v in inputs:
        if v.dtype is None or v.shape is None:
            return f"input {v.name} has no known type and rank"
        shape = []
        for i, dim in enumerate(v.shape):
            if isinstance(dim, int) or v is source:
                shape.append(dim if isinstance(dim, int) else (batch, seq)[i])
                continue
            if dim.value is None or (source is not None and dim.value not in named):
                return f"the mask depends on the shape of {v.name}, whose dim {dim} is not one of the attention mask's"
            if dim.value not in named:
                if len(named) == 2:
                    return f"the mask depends on the shapes of inputs with more than two named dims ({dim})"
                named[dim.value] = (batch, seq)[len(named)]
            shape.append(named[dim.value])
        dtype = v.dtype.numpy()
        if v is source:
            keep = rng.random(shape) < 0.7
            keep[0, 0] = False  # something to drop even where the batch is one row
            if shape[0] > 1:
                keep[0], keep[1] = True, False  # an unpadded row and a fully padded one
            feeds[v.name] = keep.astype(dtype)
        elif np.issubdtype(dtype, np.floating):
            feeds[v.name] = rng.normal(size=shape).astype(dtype)
        else:  # token ids and the like: small, so any embedding table takes them
            feeds[v.name] = rng.integers(0, 2, size=shape).astype(dtype)
    return feeds


def _compare(mask: np.ndarray, keep: np.ndarray | None) -> tuple[float | None, bool] | str:
    """If mask[b, h, q, k] means keep[b, k] everywhere (keep None: every key kept): (the fill of an additive
    mask that drops keys, else None; whether it has a query axis). Else why not."""
    if mask.ndim > 4:
        return f"the mask has rank {mask.ndim}, more than [B, heads, q, k]"
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    if keep is None:  # it reads no input's values, so it must keep every key: of its own batch, which is the
        # inputs' static batch where they have one (not the sampled size), and which the scores broadcast with
        keep = np.ones((mask.shape[0], mask.shape[3]), bool)
    batch, seq = keep.shape
    # broadcast against scores [B, N, Sq, Skv] it must not widen them: its heads axis 1, its query axis
    # 1 or as long as the keys (self-attention)
    if mask.shape[0] not in (1, batch) or mask.shape[1] != 1 or mask.shape[2] not in (1, seq) or mask.shape[3] != seq:
        return (f"the mask has shape {list(mask.shape)} for an attention mask of {[batch, seq]}, not "
                "[B or 1, 1, keys or 1, keys]")
    per_query = mask.shape[2] != 1
    keep = np.broadcast_to(keep[:, None, None, :], (batch,) + mask.shape[1:])
    mask = np.broadcast_to(mask, keep.shape)
    dropped = ~mask if mask.dtype == bool else mask != 0
    if (dropped == ~keep).all():
        fills = np.unique(mask[dropped])
        if mask.dtype == bool or len(fills) == 0:  # boolean, or nothing to drop
            return None, per_query
        if len(fills) > 1:
            return f"the mask drops keys with several values ({fills[:3].tolist()}...)"
        fill = float(fills[0])
        if not fill <= DROPS:
            return f"the mask adds {fill} to padded keys, not a large negative (<= {DROPS:g}): it does not drop them"
        return fill, per_query
    if (dropped != dropped[:, :, :1, :]).any():
        return "the mask depends on the query position (causal?)"
    b, _, _, k = np.argwhere(dropped == keep)[0]
    return (f"the mask is not a key padding mask: at batch {b}, key {k} it "
            f"{'drops' if dropped[b, 0, 0, k] else 'keeps'} a key the attention mask "
            f"{'keeps' if keep[b, 0, 0, k] else 'drops'}")
