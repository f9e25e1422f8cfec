"""The embed_layer_norm and embedding_shape rules on hand-built graphs: BERT's three lookups (position
rows broadcast or not), DistilBERT's two, the opset-15 decomposed norm, and the forms they must refuse,
with the reason in the report. Each fused case must give the original's outputs on ORT CPU (through the
function body)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites

RNG = np.random.default_rng(0)
H, V = 32, 20
TABLES = {"word": V, "type": 2, "pos": 16}


def _init(name, arr, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(arr, dtype), name)


def _embeddings(*, tables=("word", "type", "pos"), order=None, id_type=TensorProto.INT64, pos_shape=(1, "s"),
                opset=17, table_inputs=(), extra_outputs=(), shape_of_word=False):
    """input_ids, token_type_ids, position_ids (graph inputs) -> Gathers -> Adds (`order`: which pairs, the
    graph's order) -> LayerNormalization -> y [b, s, H]."""
    n = helper.make_node
    ids = {"word": "input_ids", "type": "token_type_ids", "pos": "position_ids"}
    nodes = [n("Gather", [f"{t}_table", ids[t]], [f"e_{t}"], axis=0) for t in tables]
    order = order or (["e_word", "e_type", "e_pos"] if len(tables) == 3 else ["e_word", "e_pos"])
    nodes.append(n("Add", order[:2], ["s01"]))
    last = "s01"
    if len(order) == 3:
        nodes.append(n("Add", ["s01", order[2]], ["s012"]))
        last = "s012"
    inits = [_init("gamma", RNG.normal(1, 0.2, H)), _init("beta", RNG.normal(0, 0.2, H))]
    if opset >= 17:
        nodes.append(n("LayerNormalization", [last, "gamma", "beta"], ["y"], axis=-1, epsilon=1e-12))
    else:  # the decomposition the torchscript exporter writes at opset 15
        inits += [_init("eps", 1e-12), _init("two", 2.0)]
        nodes += [n("ReduceMean", [last], ["mean"], axes=[-1]), n("Sub", [last, "mean"], ["d"]),
                  n("Pow", ["d", "two"], ["dd"]), n("ReduceMean", ["dd"], ["var"], axes=[-1]),
                  n("Add", ["var", "eps"], ["ve"]), n("Sqrt", ["ve"], ["std"]), n("Div", ["d", "std"], ["nd"]),
                  n("Mul", ["nd", "gamma"], ["sc"]), n("Add", ["sc", "beta"], ["y"])]
    inputs = [helper.make_tensor_value_info(ids[t], id_type, pos_shape if t == "pos" else ["b", "s"]) for t in tables]
    for t in tables:
        table = RNG.normal(size=(TABLES[t], H))
        if t in table_inputs:
            inputs.append(helper.make_tensor_value_info(f"{t}_table", TensorProto.FLOAT, [TABLES[t], H]))
        else:
            inits.append(_init(f"{t}_table", table))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", H])]
    outputs += [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in extra_outputs]
    if shape_of_word:  # DistilBERT's torchscript export: the sequence length from the word rows' shape
        nodes += [n("Shape", ["e_word"], ["word_shape"]), n("Gather", ["word_shape", "one"], ["seq_len"], axis=0)]
        inits.append(numpy_helper.from_array(np.array(1, np.int64), "one"))
        outputs.append(helper.make_tensor_value_info("seq_len", TensorProto.INT64, []))
    g = helper.make_graph(nodes, "emb", inputs, outputs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _feeds(m, batch=3, seq=7, np_type=np.int64):
    feeds = {}
    for i in m.graph.input:
        dims = [d.dim_value or {"b": batch, "s": seq}[d.dim_param] for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == TensorProto.FLOAT:
            feeds[i.name] = RNG.normal(size=dims).astype(np.float32)
        else:
            high = {"input_ids": V, "token_type_ids": 2, "position_ids": seq}[i.name]
            feeds[i.name] = RNG.integers(0, high, dims).astype(np_type)
    return feeds


def _assert_same(a, b, feeds):
    ra = ort.InferenceSession(a.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    rb = ort.InferenceSession(b.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for x, y in zip(ra, rb):
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-5)


def _fused(m, gathers=0):
    """The rewritten model and report; `gathers`: Gathers the graph has besides the lookups."""
    out, rep = graph_rewrites.optimize(m, report=True)
    onnx.checker.check_model(out, full_check=True)
    assert rep.rules["embed_layer_norm"].matched == 1, rep.rules["embed_layer_norm"]
    counts = graph_rewrites.op_counts(out)
    assert counts["ai.ort_triton.EmbedLayerNorm"] == 1 and counts["Gather"] == gathers and not counts["Add"], counts
    return out, rep


@pytest.mark.parametrize("pos_shape", [(1, "s"), ("b", "s")], ids=["bert", "roberta"])
@pytest.mark.parametrize("opset", [15, 17, 20])
def test_three_lookups_fused(pos_shape, opset):
    m = _embeddings(pos_shape=pos_shape, opset=opset)
    out, _ = _fused(m)
    node = next(n for n in out.graph.node if n.op_type == "EmbedLayerNorm")
    assert list(node.input) == ["input_ids", "token_type_ids", "position_ids", "word_table", "type_table",
                                "pos_table", "gamma", "beta"]
    assert helper.get_attribute_value(node.attribute[0]) == pytest.approx(1e-12)
    _assert_same(m, out, _feeds(m))
    _assert_same(m, out, _feeds(m, batch=1, seq=1))


@pytest.mark.parametrize("order", [["e_type", "e_word", "e_pos"], ["e_word", "e_pos", "e_type"]])
def test_adds_in_another_order_keep_it(order):
    """The op adds its first two rows, then the third: the rule puts them in the slots the graph's order
    gives, so the sum rounds as the graph's."""
    m = _embeddings(order=order)
    out, _ = _fused(m)
    node = next(n for n in out.graph.node if n.op_type == "EmbedLayerNorm")
    slots = {"e_word": "word_table", "e_type": "type_table", "e_pos": "pos_table"}
    assert set(node.input[3:5]) == {slots[order[0]], slots[order[1]]} and node.input[5] == slots[order[2]]
    _assert_same(m, out, _feeds(m))


def test_two_lookups_get_a_zero_token_type():
    m = _embeddings(tables=("word", "pos"))
    out, _ = _fused(m)
    node = next(n for n in out.graph.node if n.op_type == "EmbedLayerNorm")
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    assert inits[node.input[1]].shape == (1, 1) and inits[node.input[1]].dtype == np.int64
    assert inits[node.input[4]].shape == (1, H) and not inits[node.input[4]].any()
    _assert_same(m, out, _feeds(m))


def test_shape_of_the_word_rows_is_taken_from_the_ids():
    """DistilBERT's torchscript form: Shape(word rows) -> Concat(Shape(ids), [H]), then the fusion."""
    m = _embeddings(tables=("word", "pos"), shape_of_word=True)
    out, rep = _fused(m, gathers=1)  # the sequence length's, from the shape
    assert rep.rules["embedding_shape"].matched == 1
    _assert_same(m, out, _feeds(m))


def _refusal(m, rule="embed_layer_norm"):
    out, rep = graph_rewrites.optimize(m, report=True)
    st = rep.rules[rule]
    assert st.matched == 0 and st.refused, st
    assert graph_rewrites.op_counts(out)["ai.ort_triton.EmbedLayerNorm"] == 0
    return out, st.refused[0].reason


def test_refuses_a_table_that_is_not_constant():
    m = _embeddings(table_inputs=("type",))
    _, reason = _refusal(m)
    assert "table type_table is not a constant or initializer" in reason


def test_refuses_int32_ids():
    m = _embeddings(id_type=TensorProto.INT32)
    out, reason = _refusal(m)
    assert "are INT32, not int64" in reason
    _assert_same(m, out, _feeds(m, np_type=np.int32))


def test_refuses_an_intermediate_sum_read_elsewhere():
    m = _embeddings(extra_outputs=("s01",))
    out, reason = _refusal(m)
    assert "also used outside the fused region" in reason
    _assert_same(m, out, _feeds(m))


def test_shape_rule_refuses_a_lookup_read_by_more_than_adds():
    m = _embeddings(tables=("word", "pos"), shape_of_word=True, extra_outputs=("e_word",))
    _, reason = _refusal(m, "embedding_shape")
    assert "read by more than Adds" in reason
