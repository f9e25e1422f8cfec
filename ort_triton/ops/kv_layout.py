"""The KV cache's layout, one attribute shared by the ops that write the cache (QKVRotaryCache, QKVNormRotaryCache,
QKVCache) and the one that reads it (CausalAttention).

    seq_major = 0:  past [B, Nkv, P, D], present [B, Nkv, P + S, D]   (what the exporters emit)
    seq_major = 1:  past [P, B, Nkv, D], present [P + S, B, Nkv, D]

Why a second layout: the graph's cache is functional (present = Concat(past, new)), so every decode step copies
the whole past into present: 22% of Llama-1B's decode step at 16 x 1024 on an H100, about 45% at 16 x 4096
(bench/results/README.md, session 30). Heads first, present's rows of head (b, g) start at (b Nkv + g)(P + S) D
and past's at (b Nkv + g) P D, so every slab moves. Sequence first, past is the first P B Nkv D elements of
present, laid out alike: a caller that binds past and present to one buffer of [L, B, Nkv, D] (L the longest
context; ORT's IO binding takes a pointer and a shape) makes present alias past, and the kernels then write only
the S new rows and skip the copy (they still copy when the two differ, so the op keeps its functional meaning).
`ort-triton optimize --kv-cache seq-major` (graph_rewrites/kv_layout.py) relays a fused decoder's cache so.

The function bodies take both layouts with an If on the attribute: Transpose to heads first on the way in, back
on the way out; the rest of each body is the heads-first one.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..contract import Attr, attr_ref

SEQ_MAJOR = Attr("seq_major", "int", 0, "the cache's layout: 0 [B, Nkv, T, D], 1 [T, B, Nkv, D] (sequence first)")
TO_HEADS = (1, 2, 0, 3)  # [T, B, Nkv, D] -> [B, Nkv, T, D]
TO_SEQ = (2, 0, 1, 3)  # [B, Nkv, T, D] -> [T, B, Nkv, D]
# The model's metadata_props key naming its graph inputs and outputs laid out sequence first (comma-separated), set
# by graph_rewrites/kv_layout.py: how a caller (compare, examples/generate.py) knows which tensors to feed and read so.
METADATA_KEY = "ort_triton.kv_seq_major"


def seq_major_names(metadata: dict) -> set[str]:
    """The graph inputs and outputs a model's metadata (ModelProto.metadata_props as a dict, or ORT's
    `session.get_modelmeta().custom_metadata_map`) lays out sequence first; empty for a heads-first model."""
    return {name for name in metadata.get(METADATA_KEY, "").split(",") if name}


def session_seq_major_names(session) -> set[str]:
    """seq_major_names of an ORT InferenceSession's model."""
    return seq_major_names(session.get_modelmeta().custom_metadata_map)


def to_heads(x, seq_major: int):
    """A cache tensor (numpy) in the heads-first layout the references compute in."""
    return np.asarray(x).transpose(TO_HEADS) if seq_major else np.asarray(x)


def from_heads(x, seq_major: int):
    """A heads-first cache tensor (numpy) in the op's layout."""
    return np.asarray(x).transpose(TO_SEQ) if seq_major else np.asarray(x)


def _flag() -> onnx.NodeProto:
    """`kv_seq_major`, the attribute as a boolean scalar for the bodies' If nodes."""
    node = helper.make_node("Constant", [], ["kv_seq_major_i"])
    node.attribute.append(attr_ref(SEQ_MAJOR.name, onnx.AttributeProto.INT, name="value_int"))
    return node


def _relaid(x: str, out: str, perm: tuple[int, ...]) -> onnx.NodeProto:
    """out = seq_major ? Transpose(x, perm) : x, as an If (a body cannot vary its nodes by an attribute)."""
    n = helper.make_node
    then = helper.make_graph([n("Transpose", [x], [out + "_t"], perm=list(perm))], out + "_then", [],
                             [helper.make_value_info(out + "_t", onnx.TypeProto())])
    other = helper.make_graph([n("Identity", [x], [out + "_i"])], out + "_else", [],
                              [helper.make_value_info(out + "_i", onnx.TypeProto())])
    return n("If", ["kv_seq_major"], [out], then_branch=then, else_branch=other)


def heads_in(pairs: list[tuple[str, str]]) -> list[onnx.NodeProto]:
    """Body nodes that give each (cache input, name) pair the input heads first under `name`, with the flag first."""
    n = helper.make_node
    return [_flag(), n("Cast", ["kv_seq_major_i"], ["kv_seq_major"], to=onnx.TensorProto.BOOL),
            *[_relaid(x, out, TO_HEADS) for x, out in pairs]]


def heads_out(pairs: list[tuple[str, str]]) -> list[onnx.NodeProto]:
    """Body nodes that write each (heads-first value, cache output) pair in the op's layout (after heads_in)."""
    return [_relaid(x, out, TO_SEQ) for x, out in pairs]
