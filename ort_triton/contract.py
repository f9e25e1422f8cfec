"""One contract per fused op.

A contract is the single place where an op's name, inputs, outputs, attributes, element types and
meaning (its ONNX function body) are written down. Everything else reads it:

- graph_rewrites builds the replacement node with `OpContract.node` and attaches `function_proto`;
- tests compare kernels with `reference`;
- the AOT build compiles `specializations` and generates the native registration and dispatch tables.

Two facts about ONNX Runtime 1.31 shape the contract (both checked on ORT CPU, see tests/test_contract.py):
- a node of a function-bodied op with an *absent optional input* crashes ORT while it inlines the body,
  so every input is required (the rewriter supplies e.g. a zero bias where the model has none);
- a node that lists *fewer outputs* than its function declares fails type inference, so a node always
  lists every output, with "" for an output nobody reads;
- an inlined body's ops are resolved at the *model's* ai.onnx opset, whatever the function imports, so a
  body is built for the model's opset (`body(opset)`), from ops that exist there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper

DOMAIN = "ai.ort_triton"
DOMAIN_VERSION = 1
# The oldest ai.onnx opset a rewritten model may have: bodies make typed constants with CastLike (15).
MIN_OPSET = 15

# The open end of a dispatch key's range ([lo, ANY]: any value from lo).
ANY = 1 << 62

# Element types a contract may allow, by the ONNX names used in messages and in the native table.
ELEMENT_TYPES = {
    "float": onnx.TensorProto.FLOAT,
    "float16": onnx.TensorProto.FLOAT16,
    "bfloat16": onnx.TensorProto.BFLOAT16,
}


# Element types an input may be fixed to, whatever the op's type (the native table registers it as such).
FIXED_TYPES = {"int64": onnx.TensorProto.INT64}


@dataclasses.dataclass(frozen=True)
class IO:
    name: str
    doc: str
    optional: bool = False  # only outputs may be optional (see module docstring)
    type: str | None = None  # a FIXED_TYPES name (EmbedLayerNorm's ids: "int64"); None: the op's element type

    def element_type(self, op_type: str) -> int:
        """The ONNX element type of this input of a node whose op type is `op_type` (an ELEMENT_TYPES name)."""
        return FIXED_TYPES[self.type] if self.type else ELEMENT_TYPES[op_type]


@dataclasses.dataclass(frozen=True)
class Attr:
    name: str
    kind: str  # "float" or "int"
    default: float | int
    doc: str

    def proto_type(self) -> int:
        return {"float": onnx.AttributeProto.FLOAT, "int": onnx.AttributeProto.INT}[self.kind]


@dataclasses.dataclass(frozen=True)
class Spec:
    """One specialisation of a kernel: constexprs and launch options fixed, chosen at run time when every
    dispatch key lies in its [min, max] range. `consts` are the launch constants the native planner reads."""

    constexprs: dict[str, Any]
    num_warps: int
    keys: tuple[tuple[int, int], ...]
    consts: tuple[int, ...]
    num_stages: int = 1
    divisible_by_16: tuple[str, ...] = ()  # int/pointer arguments promised to be multiples of 16
    # (num_warps, num_stages) for GPUs before sm_90, where a tile tuned for Hopper's wgmma can spill
    pre_hopper: tuple[int, int] | None = None
    # ptxas' register cap a thread (PTX .maxnreg); None: ptxas' own choice. Fewer registers fit more programs on
    # an SM, which pays where a kernel streams memory from many programs (a decode step's long caches).
    maxnreg: int | None = None
    # The oldest GPU arch the kernel compiles for (the warp-specialised attention's TMA needs sm_90); 0 for any.
    # Only tuned specs have one: they are compiled for their table entry's arch alone.
    min_arch: int = 0

    def launch(self, arch: int) -> tuple[int, int]:
        """(num_warps, num_stages) this spec compiles with for `arch`."""
        return self.pre_hopper if self.pre_hopper and arch < 90 else (self.num_warps, self.num_stages)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """What `ort-triton tune` (ort_triton/tune.py) needs to search an op's kernel configurations. A config is
    a dict of the kernel's tile constexprs and num_warps / num_stages; shapes are the node's input shapes.

    keys(type, shapes, attrs, n_outputs): the dispatch keys, as the native planner computes them from those
                                shapes (n_outputs: the node's outputs up to its last named one); None where
                                no kernel of ours runs at those shapes (Linear past 16 rows: cuBLAS)
    bucket(keys):               the key ranges one tuned config serves (a spec's `keys`)
    candidates(type, keys, arch): the configs to time, first the built-in one (what the library runs on arch)
    spec(type, bucket, config): the Spec that compiles a config for that bucket
    runner(type, shapes, attrs, keys, config, device): a no-argument launch of the Triton kernel with that
                                config on fresh inputs, for the node those shapes, attributes and dispatch
                                keys describe (imports Triton: only tuning calls it)
    """

    keys: Callable[[str, list, dict, int], tuple[int, ...] | None]
    bucket: Callable[[tuple[int, ...]], tuple[tuple[int, int], ...]]
    candidates: Callable[[str, tuple[int, ...], int], list[dict]]
    spec: Callable[[str, tuple[tuple[int, int], ...], dict], Spec]
    runner: Callable[..., Callable[[], Any]]
    # keys of an entry from an older table (fewer dispatch keys then) as the op's keys today; None: none changed
    upgrade: Callable[[tuple[tuple[int, int], ...]], tuple[tuple[int, int], ...]] | None = None


def pow2_bucket(n: int) -> tuple[int, int]:
    """(lo, hi): the power-of-two range holding n (3..4, 5..8, 513..1024; 0..1 for n <= 1), the size range a
    tuned config serves."""
    if n <= 1:
        return (0, 1)
    hi = 1 << (n - 1).bit_length()
    return (hi // 2 + 1, hi)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A Triton kernel as the AOT build sees it: the jit function, its runtime signature (argument name ->
    Triton type with `{T}` for the element type), and the native planner that launches it."""

    module: str  # imported only by the AOT build and tests: rewriting and serving need no Triton
    fn_name: str
    signature: dict[str, str]
    native_plan: str  # C symbols in ort_triton/native, see ot_table.h
    native_params: str
    dispatch_keys: tuple[str, ...]  # names of the keys, in the order the native planner computes them
    # Programmatic dependent launch: the kernel takes a `PDL: tl.constexpr` (0 in the torch entry points) and, with
    # PDL = 1, runs gdc_wait before it reads or writes anything an earlier kernel may touch (only constants, the
    # weights, before it) and lets the next kernel start early (gdc_launch_dependents). The AOT build sets PDL = 1 for
    # sm_90 and later (griddepcontrol is Hopper's); with ORT_TRITON_PDL=1 the native launcher launches it with
    # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, so it may start while the kernel before it finishes
    # (without, the wait returns at once).
    pdl: bool = False

    @property
    def fn(self):
        import importlib

        return getattr(importlib.import_module(self.module), self.fn_name)


@dataclasses.dataclass(frozen=True, eq=False)  # one object per op: compared and hashed by identity
class OpContract:
    name: str
    doc: str
    inputs: tuple[IO, ...]
    outputs: tuple[IO, ...]
    attrs: tuple[Attr, ...]
    types: tuple[str, ...]
    # function body over the formal names, attributes by reference, valid at the given ai.onnx opset (ORT
    # resolves an inlined body's ops at the *model's* opset, so the body must be written for it)
    body: Callable[[int], list[onnx.NodeProto]]
    reference: Callable[..., tuple[np.ndarray, ...]]
    kernel: Kernel
    specializations: Callable[[str], list[Spec]]  # element type name -> specs, in dispatch order
    tuning: Tuning | None = None  # None: `ort-triton tune` leaves the op's built-in configs

    # ---- the function body -------------------------------------------------------------------------
    def function_proto(self, opset: int) -> onnx.FunctionProto:
        if opset < MIN_OPSET:
            raise ValueError(f"{self.name}: function bodies need ai.onnx opset >= {MIN_OPSET} (CastLike), got {opset}")
        return helper.make_function(
            DOMAIN,
            self.name,
            [i.name for i in self.inputs],
            [o.name for o in self.outputs],
            self.body(opset),
            [helper.make_opsetid("", opset)],
            # with their defaults: a node made before an attribute existed (seq_major) still inlines
            attribute_protos=[helper.make_attribute(a.name, _attr_value(a, a.default)) for a in self.attrs],
            doc_string=self.doc,
        )

    # ---- the replacement node (onnxscript rewriter builder) ----------------------------------------
    def node(self, op, *inputs, outputs: Sequence[bool] | None = None, **attrs):
        """Emit this op through an onnxscript rewriter `op` builder. `outputs[i]` says whether output i is
        used; unused optional outputs are still listed so the node has every output its function body
        declares (graph_rewrites blanks their names to "" on save, which tells the kernel to skip them).
        Returns the used outputs, in order."""
        if len(inputs) != len(self.inputs) or any(v is None for v in inputs):
            raise ValueError(f"{self.name} takes {[i.name for i in self.inputs]}, all required")
        unknown = set(attrs) - {a.name for a in self.attrs}
        if unknown:
            raise ValueError(f"{self.name} has no attribute(s) {sorted(unknown)}")
        values = {a.name: _attr_value(a, attrs.get(a.name, a.default)) for a in self.attrs}
        used = list(outputs) if outputs is not None else [True] + [False] * (len(self.outputs) - 1)
        for o, u in zip(self.outputs, used):
            if not u and not o.optional:
                raise ValueError(f"{self.name} output {o.name!r} is required")
        result = getattr(op, self.name)(*inputs, _domain=DOMAIN, _outputs=len(self.outputs), **values)
        result = list(result) if isinstance(result, Sequence) else [result]
        picked = [v for v, u in zip(result, used) if u]
        return picked[0] if len(picked) == 1 else tuple(picked)

    def element_type(self, type_name: str) -> int:
        return ELEMENT_TYPES[type_name]


def _attr_value(attr: Attr, value):
    return float(value) if attr.kind == "float" else int(value)


def attr_ref(ref: str, proto_type: int, name: str | None = None) -> onnx.AttributeProto:
    """An attribute `name` (default: `ref`) of a body node that takes the function's attribute `ref`."""
    a = onnx.AttributeProto()
    a.name, a.ref_attr_name, a.type = name or ref, ref, proto_type
    return a


def renamed(nodes: list[onnx.NodeProto], prefix: str, names: dict[str, str]) -> list[onnx.NodeProto]:
    """Body nodes with the values they make prefixed and those in `names` (the function's inputs and outputs the
    copy reads and writes) renamed: one op's body used twice in another's (QKVRotaryCache rotates q and k)."""
    made = {o for node in nodes for o in node.output}
    name = lambda v: names[v] if v in names else prefix + v if v in made else v
    for node in nodes:
        node.input[:] = [name(v) for v in node.input]
        node.output[:] = [name(v) for v in node.output]
    return nodes
