"""qkv_cache (graph_rewrites/qkv_rotary_cache.py, qkv_cache): a layer without rotary (GPT-2) -- its projection's
bias Add, the Split of the packed Q/K/V, head Reshapes, the three head Transposes and the cache Concats -> one
QKVCache. On by default since its H200 run (session 16).

Real exports (gpt2-tiny by both exporters, sdpa and eager, and at opset 23, with the cache): every layer fused,
nothing refused, the outputs of the original on ORT CPU for a left-padded prefill, a decode step and a chunk
over a past; with the rule off nothing changes; the rotary models keep QKVRotaryCache. Synthetic layers: the
forms that fuse (a bias either side of the Add, none, one the op cannot take, a Split by sizes or in equal
parts, head shapes taken from the parts as torchscript writes them, GQA), and the forms it must refuse, with
the reason."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites
from graph_rewrites import registry
from tests.graph_rewrites.test_qkv_rotary_cache_rules import _assert_same
from tests.graph_rewrites.test_rotary_rules import _reasons

RULE = "qkv_cache"
OP = "ai.ort_triton.QKVCache"
B, S, P, H, D = 2, 5, 3, 24, 8
RNG = np.random.default_rng(0)


# ---- synthetic layers -------------------------------------------------------------------------------------------

def _layer(*, nq=4, nkv=4, bias="add", split="sizes", order="qkv", concat_reversed=False, q_perm=(0, 2, 1, 3),
           split_reader=None, part_shapes=False, opset=None):
    """One layer from x [B, S, H] (a graph input) through MatMul(x, W) (+ bias) to Q, present_key, present_value.
    bias: "add" Add(mm, b), "add_swapped" Add(b, mm), "none", "shared" (the sum also a graph output); split:
    "sizes" (a constant input) or "equal" (opset 18's num_outputs); order: the parts in the Split's order;
    part_shapes: each head Reshape's [B, S] by Shape, Gather, Unsqueeze and Concat from its part (torchscript's
    GPT-2); split_reader: "node" v's part also read by a Neg, "output" k's part a graph output, "shape" a Shape
    of q's part whose Gather is also a graph output."""
    n = helper.make_node
    heads = {"q": nq, "k": nkv, "v": nkv}
    width = (nq + 2 * nkv) * D
    inits = [numpy_helper.from_array(RNG.normal(size=(H, width)).astype(np.float32), "W"),
             numpy_helper.from_array(RNG.normal(size=width).astype(np.float32), "b")]
    nodes = [n("MatMul", ["x", "W"], ["mm"])]
    if bias == "none":
        nodes += [n("Identity", ["mm"], ["qkv"])]  # no Add: the Split reads the projection (through an Identity)
    else:
        nodes += [n("Add", ["b", "mm"] if bias == "add_swapped" else ["mm", "b"], ["qkv"])]
    if split == "sizes":
        inits.append(numpy_helper.from_array(np.array([heads[r] * D for r in order], np.int64), "sizes"))
        nodes += [n("Split", ["qkv", "sizes"], [f"{r}_part" for r in order], axis=-1)]
    else:
        nodes += [n("Split", ["qkv"], [f"{r}_part" for r in order], axis=2, num_outputs=3)]
    for r in "qkv":
        if part_shapes:  # (*part.shape[:-1], N, D)
            for i, dim in enumerate("bs"):
                inits.append(numpy_helper.from_array(np.array(i, np.int64), f"{r}_i{i}"))
                nodes += [n("Shape", [f"{r}_part"], [f"{r}_shape{dim}"]),
                          n("Gather", [f"{r}_shape{dim}", f"{r}_i{i}"], [f"{r}_{dim}"], axis=0),
                          n("Unsqueeze", [f"{r}_{dim}", "axis0"], [f"{r}_{dim}1"])]
            inits.append(numpy_helper.from_array(np.array([heads[r], D], np.int64), f"{r}_nd"))
            nodes += [n("Concat", [f"{r}_b1", f"{r}_s1", f"{r}_nd"], [f"shape_{r}"], axis=0)]
        else:
            inits.append(numpy_helper.from_array(np.array([0, 0, heads[r], D], np.int64), f"shape_{r}"))
        nodes += [n("Reshape", [f"{r}_part", f"shape_{r}"], [f"{r}4"]),
                  n("Transpose", [f"{r}4"], [f"{r}t" if r != "q" else "Q"], perm=list(q_perm) if r == "q"
                    else [0, 2, 1, 3])]
    if part_shapes:
        inits.append(numpy_helper.from_array(np.array([0], np.int64), "axis0"))
    nodes += [n("Concat", ["kt", "past_key"] if concat_reversed else ["past_key", "kt"], ["present_key"], axis=2),
              n("Concat", ["past_value", "vt"], ["present_value"], axis=2)]
    extra = []
    if split_reader == "node":
        nodes += [n("Neg", ["v_part"], ["v_neg"])]
        extra = ["v_neg"]
    elif split_reader == "output":
        extra = ["k_part"]
    elif split_reader == "shape":
        inits.append(numpy_helper.from_array(np.array(1, np.int64), "one"))
        nodes += [n("Shape", ["q_part"], ["q_shape"]), n("Gather", ["q_shape", "one"], ["seq_len"], axis=0)]
        extra = ["seq_len"]
    if bias == "shared":
        extra.append("qkv")
    f = lambda name, dims, t=TensorProto.FLOAT: helper.make_tensor_value_info(name, t, dims)
    inputs = [f("x", ["B", "S", H]), f("past_key", ["B", nkv, "P", D]), f("past_value", ["B", nkv, "P", D])]
    outputs = [f(name, None) for name in ("Q", "present_key", "present_value")]
    outputs += [f(name, None, TensorProto.INT64 if name == "seq_len" else TensorProto.FLOAT) for name in extra]
    graph = helper.make_graph(nodes, "layer", inputs, outputs, initializer=inits)
    opset = opset or (18 if split == "equal" else 17)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _feeds(m):
    sizes = {"B": B, "S": S, "P": P}
    return {v.name: RNG.normal(size=[d.dim_value or sizes[d.dim_param] for d in v.type.tensor_type.shape.dim])
            .astype(np.float32) for v in m.graph.input}


def _fused(m, **kw):
    out, rep = graph_rewrites.optimize(m, report=True, enable=[RULE], **kw)
    return out, rep, rep.rules[RULE]


def test_on_by_default_and_disabled_on_request():
    info = registry.BY_NAME[RULE]
    assert info.default and info.run is not None
    assert info.stage == registry.BY_NAME["qkv_rotary_cache"].stage > registry.BY_NAME["causal_attention"].stage
    m = _layer()
    assert graph_rewrites.op_counts(graph_rewrites.optimize(m))[OP] == 1
    out, rep = graph_rewrites.optimize(m, report=True, disable=[RULE])
    assert RULE not in rep.rules and OP not in graph_rewrites.op_counts(out)
    assert graph_rewrites.op_counts(out) == graph_rewrites.op_counts(m)


@pytest.mark.parametrize("kw", [dict(), dict(bias="add_swapped"), dict(split="equal"), dict(nq=4, nkv=2),
                                dict(nq=4, nkv=1), dict(part_shapes=True), dict(split="equal", part_shapes=True)],
                         ids=["bias", "bias_first", "equal_split", "gqa", "mqa", "shapes_from_parts",
                              "equal_split_shapes_from_parts"])
def test_a_layer_fuses_with_its_bias(kw):
    m = _layer(**kw)
    out, rep, st = _fused(m)
    assert (st.tried, st.matched, st.refused) == (1, 1, []), st
    ops = graph_rewrites.op_counts(out)
    assert ops == {"MatMul": 1, OP: 1}, ops  # the Add, the head shapes' computations: all gone
    node = next(n for n in out.graph.node if n.op_type == "QKVCache")
    assert list(node.input) == ["mm", "b", "past_key", "past_value"]
    assert list(node.output) == [o.name for o in out.graph.output] == ["Q", "present_key", "present_value"]
    assert {a.name: a.i for a in node.attribute} == {"seq_major": 0}  # the cache heads first (ops/kv_layout.py)
    _assert_same(m, out, [_feeds(m)])
    # and again: nothing left to fuse, the model unchanged
    again, rep2, st2 = _fused(out)
    assert (st2.tried, st2.matched) == (0, 0) and graph_rewrites.op_counts(again) == ops


@pytest.mark.parametrize("bias, kept", [("none", "Identity"), ("shared", "Add")])
def test_without_a_foldable_bias_a_zero_one(bias, kept):
    """No Add (or one whose sum something else reads): the op reads QKV as it is, with a zero bias."""
    m = _layer(bias=bias)
    out, rep, st = _fused(m)
    assert (st.tried, st.matched, st.refused) == (1, 1, []), st
    ops = graph_rewrites.op_counts(out)
    assert ops[OP] == 1 and ops[kept] == 1, ops
    node = next(n for n in out.graph.node if n.op_type == "QKVCache")
    zero = next(i for i in out.graph.initializer if i.name == node.input[1])
    assert zero.name == "qkv__ot_qkv_cache_bias" and zero.data_type == TensorProto.FLOAT
    assert not numpy_helper.to_array(zero).any() and numpy_helper.to_array(zero).shape == (12 * D,)
    assert node.input[0] == "qkv"
    _assert_same(m, out, [_feeds(m)])


@pytest.mark.parametrize("variant, reason", [
    (dict(order="kqv"), "'s parts go to a cache Concat, no cache Concat, a cache Concat in that order; the op "
                        "reads QKV packed q | k | v"),
    (dict(concat_reversed=True), "has the inputs (new, past), not (past_key, new)"),
    (dict(q_perm=(0, 2, 3, 1)), "has perm [0, 2, 3, 1], not [0, 2, 1, 3] (the head transpose)"),
    (dict(split_reader="output"), "k_part (k's part of the Split) is a graph output"),
    (dict(split_reader="node"), "v_part (v's part of the Split) is also read by Neg"),
    (dict(split_reader="shape"), "q_part (q's part of the Split) is also read by Shape"),
    (dict(nq=4, nkv=2, split="equal"), "splits qkv of width 64 in 3 equal parts: not a static multiple of 3"),
], ids=["kqv_order", "concat_new_past", "q_perm", "split_output_is_graph_output", "split_output_read_twice",
        "shape_of_part_escapes", "equal_split_of_64"])
def test_refusals(variant, reason):
    m = _layer(**variant)
    out, rep, st = _fused(m)
    assert (st.tried, st.matched) == (1, 0), st
    assert reason in _reasons(rep, RULE), _reasons(rep, RULE)
    assert OP not in graph_rewrites.op_counts(out)
    if variant.get("split") != "equal":  # an equal split of GQA's unequal parts: not a model ORT can run
        _assert_same(m, out, [_feeds(m)])


# ---- real exports -----------------------------------------------------------------------------------------------

GPT2 = [("dynamo", "sdpa", None), ("torchscript", "sdpa", None), ("dynamo", "eager", None),
        ("torchscript", "eager", None), ("dynamo", "sdpa", 23)]


@pytest.fixture(scope="module")
def exported(decoder_exports):
    return decoder_exports


@pytest.mark.parametrize("exporter, impl, opset", GPT2, ids=str)
def test_every_gpt2_layer_fused_and_outputs_equal(exported, exporter, impl, opset):
    """Every layer's bias Add, Split, three Transposes and two cache Concats -> one QKVCache (the head Reshapes
    and their shape computations gone too), the CausalAttention reading its Q and present; the outputs
    (graph output names kept) the original's for a left-padded prefill, a decode step and a chunk over a past.
    With the rule disabled, the model is what it was."""
    from ort_triton import decoders

    model, path = exported("gpt2-tiny", exporter, impl, opset=opset)
    layers = decoders.cache_spec(model)[0]
    off, base_rep = graph_rewrites.optimize(str(path), report=True, disable=[RULE])
    assert RULE not in base_rep.rules and OP not in base_rep.ops_after
    out, rep = graph_rewrites.optimize(str(path), report=True)  # on by default
    st = rep.rules[RULE]
    assert st.tried == st.matched == layers and not st.refused, st
    assert rep.rules["qkv_rotary_cache"].tried == 0
    before, after = base_rep.ops_after, rep.ops_after
    assert after[OP] == layers and after["ai.ort_triton.CausalAttention"] == layers, after
    assert after["Split"] == before["Split"] - layers, (after, before)
    assert after["Transpose"] == before["Transpose"] - 3 * layers, (after, before)
    assert after["Add"] == before["Add"] - layers, (after, before)  # the c_attn biases
    assert after["Concat"] <= before["Concat"] - 2 * layers, (after, before)
    for node in (n for n in out.graph.node if n.op_type == "CausalAttention"):
        producer = {o: n for n in out.graph.node for o in n.output}
        assert {producer[v].op_type for v in node.input[:3]} == {"QKVCache"}, list(node.input)
    assert [o.name for o in out.graph.output] == decoders.output_names(model)
    # (batch, seq, past, left pad): a left-padded prefill, a decode step, a chunk over a past
    feeds = [decoders.sample_inputs(model, b, s, p, seed=s + p, left_pad=pad)
             for b, s, p, pad in [(3, 6, 0, 3), (3, 1, 5, 2), (2, 4, 3, 5)]]
    _assert_same(path, out, feeds)
    # the fusion alone, not the others' rounding: the same bits as the model without it (ORT's own fusions off)
    _assert_bits(off, out, feeds)


def _assert_bits(a, b, feeds_list):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sa, sb = (ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]) for m in (a, b))
    for feeds in feeds_list:
        for x, y in zip(sa.run(None, feeds), sb.run(None, feeds)):
            np.testing.assert_array_equal(x, y)


def test_no_cache_export_has_nothing_to_fuse(exported):
    """Without a cache, k and v go straight to the attention: no layer has the structure."""
    from ort_triton import decoders

    model, path = exported("gpt2-tiny", "torchscript", cache=False)
    out, rep, st = _fused(str(path))
    assert (st.tried, st.matched, st.refused) == (0, 0, []), st
    assert OP not in graph_rewrites.op_counts(out)
    _assert_same(path, out, [decoders.sample_inputs(model, batch=2, seq=5, past=0, left_pad=1, cache=False)])


@pytest.mark.parametrize("name, exporter", [("llama-tiny", "dynamo"), ("qwen2-tiny", "torchscript")], ids=str)
def test_rotary_models_keep_their_op(exported, name, exporter):
    """Enabled on a Llama-family export, the rule finds nothing (its layers have TransposeRotary, not plain
    Transposes): QKVRotaryCache fuses every layer as before, the model unchanged by the enable."""
    from ort_triton import decoders

    model, path = exported(name, exporter)
    layers = decoders.cache_spec(model)[0]
    base = graph_rewrites.optimize(str(path))
    out, rep, st = _fused(str(path))
    assert (st.tried, st.matched, st.refused) == (0, 0, []), st
    assert rep.rules["qkv_rotary_cache"].matched == layers
    assert graph_rewrites.op_counts(out) == graph_rewrites.op_counts(base)
