"""Property tests (hypothesis) for the embed_layer_norm and embedding_shape rules: generated embedding
subgraphs are either fused into one EmbedLayerNorm and give the original's outputs (ORT CPU, through the
function body), or left alone with the reason in the report. Never a changed result.

Variants: hidden sizes 1..80, table sizes 1..24, two lookups (DistilBERT) or three (BERT, RoBERTa), every
order of the Adds and of each Add's operands, each id tensor [B, S], [1, S], [B, 1] or [1, 1] (broadcast
like the graph's Adds), negative ids (ONNX Gather counts them from the end), LayerNormalization (opsets 17,
20) or the opset-15 decomposition, with or without beta, any epsilon, tables as initializers or Constant
nodes, DistilBERT's Shape of the word rows. Defects, each refused: a table that is a graph input, int32 ids,
ids of rank 1 or 3, one table behind two lookups, a partial sum or a lookup read elsewhere.
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
IDS = ("input_ids", "token_type_ids", "position_ids")
DEFECTS = ("table_input", "int32_ids", "rank1_ids", "rank3_ids", "shared_table", "sum_read", "lookup_read")
# the start of the reason the report must give for each
REASONS = {"table_input": "is not a constant or initializer", "int32_ids": "not int64",
           "rank1_ids": "(rank 2)", "rank3_ids": "(rank 2)", "shared_table": "one table feeds two",
           "sum_read": "used outside the fused region", "lookup_read": "used outside the fused region"}


@st.composite
def embeddings(draw, defect=None):
    """(model, feeds, params) for one embeddings subgraph; `defect`: "none", one of DEFECTS, or None (drawn)."""
    if defect is None:
        defect = draw(st.sampled_from(("none",) * 4 + DEFECTS))
    p = dict(defect=defect, h=draw(st.integers(1, 80)), batch=draw(st.integers(1, 4)), seq=draw(st.integers(1, 9)),
             tables=draw(st.sampled_from([2, 3])), opset=draw(st.sampled_from([15, 17, 20])),
             beta=draw(st.booleans()), eps=draw(st.sampled_from([1e-12, 1e-5, 0.1])),
             const_nodes=draw(st.booleans()), shape_of_word=draw(st.booleans()), seed=draw(st.integers(0, 2**31)))
    lookups = ["word", "type", "pos"] if p["tables"] == 3 else ["word", "pos"]
    p["sizes"] = {t: draw(st.integers(1, 24)) for t in lookups}
    p["id_shapes"] = {t: draw(st.sampled_from([("b", "s"), (1, "s"), ("b", 1), (1, 1)])) for t in lookups}
    p["id_shapes"]["word"] = ("b", "s")  # one full [B, S], so the output is [B, S, H]
    p["order"] = draw(st.permutations(lookups))
    p["swaps"] = [draw(st.booleans()) for _ in range(p["tables"] - 1)]
    if defect == "rank1_ids":
        p["id_shapes"][draw(st.sampled_from(lookups[1:]))] = ("s",)
    elif defect == "rank3_ids":
        p["id_shapes"]["word"] = (1, "b", "s")
    elif defect == "shared_table":
        p["shared"] = draw(st.sampled_from(lookups[1:]))
    elif defect == "sum_read" and p["tables"] == 2:
        defect = p["defect"] = "lookup_read"  # two lookups have no partial sum
    if defect == "lookup_read":
        p["read"] = draw(st.sampled_from(lookups))
    return (*_model(p, lookups), p)


def _model(p, lookups):
    rng = np.random.default_rng(p["seed"])
    n, h, defect = helper.make_node, p["h"], p["defect"]
    id_type = TensorProto.INT32 if defect == "int32_ids" else TensorProto.INT64
    nodes, inits, inputs, outputs = [], [], [], []

    def constant(name, value):
        t = numpy_helper.from_array(np.asarray(value, np.float32), name)
        if p["const_nodes"]:
            nodes.append(n("Constant", [], [name], value=t))
        else:
            inits.append(t)

    tables = {}
    for t in lookups:
        name = tables[t] = f"{t}_table"
        if p.get("shared") == t:  # the word table again (its rows must be as many as these ids need)
            tables[t] = "word_table"
            continue
        value = rng.normal(size=(p["sizes"][t], h))
        if defect == "table_input" and t == lookups[-1]:
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [p["sizes"][t], h]))
            p["table_feed"] = value.astype(np.float32)
        else:
            constant(name, value)
    ids = dict(zip(("word", "type", "pos"), IDS))
    for t in lookups:
        inputs.append(helper.make_tensor_value_info(ids[t], id_type, list(p["id_shapes"][t])))
        nodes.append(n("Gather", [tables[t], ids[t]], [f"e_{t}"], axis=0))
    first, *rest = [f"e_{t}" for t in p["order"]]
    acc = first
    for i, (other, swap) in enumerate(zip(rest, p["swaps"])):
        nodes.append(n("Add", [other, acc] if swap else [acc, other], [f"sum{i}"]))
        acc = f"sum{i}"
    constant("gamma", rng.normal(1, 0.2, h))
    if p["beta"]:
        constant("beta", rng.normal(0, 0.2, h))
    if p["opset"] >= 17:
        nodes.append(n("LayerNormalization", [acc, "gamma"] + (["beta"] if p["beta"] else []), ["y"], axis=-1,
                       epsilon=p["eps"]))
    else:  # the torchscript exporter's opset-15 decomposition
        constant("eps", p["eps"])
        constant("two", 2.0)
        nodes += [n("ReduceMean", [acc], ["mean"], axes=[-1]), n("Sub", [acc, "mean"], ["d"]),
                  n("Pow", ["d", "two"], ["dd"]), n("ReduceMean", ["dd"], ["var"], axes=[-1]),
                  n("Add", ["var", "eps"], ["ve"]), n("Sqrt", ["ve"], ["std"]), n("Div", ["d", "std"], ["nd"]),
                  n("Mul", ["nd", "gamma"], ["y" if not p["beta"] else "sc"])]
        if p["beta"]:
            nodes.append(n("Add", ["sc", "beta"], ["y"]))
    outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, None))
    if defect == "sum_read":
        outputs.append(helper.make_tensor_value_info("sum0", TensorProto.FLOAT, None))
    if defect == "lookup_read":
        outputs.append(helper.make_tensor_value_info(f"e_{p['read']}", TensorProto.FLOAT, None))
    if p["shape_of_word"]:  # DistilBERT's torchscript export: the sequence length from the word rows' shape
        inits.append(numpy_helper.from_array(np.array(1, np.int64), "one"))
        nodes += [n("Shape", ["e_word"], ["word_shape"]), n("Gather", ["word_shape", "one"], ["seq_len"], axis=0)]
        outputs.append(helper.make_tensor_value_info("seq_len", TensorProto.INT64, []))
    graph = helper.make_graph(nodes, "embeddings", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", p["opset"])], ir_version=9)
    return model, _feeds(rng, p, lookups)


def _feeds(rng, p, lookups):
    """Ids in [-V, V) of each lookup's table (negative ones count from the end, as in ONNX Gather)."""
    np_type = np.int32 if p["defect"] == "int32_ids" else np.int64
    dims = {"b": p["batch"], "s": p["seq"]}
    ids = dict(zip(("word", "type", "pos"), IDS))
    feeds = {}
    for t in lookups:
        v = p["sizes"]["word" if p.get("shared") == t else t]
        shape = [dims.get(d, d) for d in p["id_shapes"][t]]
        feeds[ids[t]] = rng.integers(-v, v, shape).astype(np_type)
    if "table_feed" in p:
        feeds[f"{lookups[-1]}_table"] = p["table_feed"]
    return feeds


def _run(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _refusals(rep):
    return [r.reason for name in ("embed_layer_norm", "embedding_shape")
            if name in rep.rules for r in rep.rules[name].refused]


def _check(model, feeds, p) -> int:
    """The rewritten model is valid and gives the original's outputs; returns the EmbedLayerNorm nodes."""
    out, rep = graph_rewrites.optimize(model, report=True)
    onnx.checker.check_model(out, full_check=True)
    for a, b in zip(_run(model, feeds), _run(out, feeds), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * max(1.0, float(np.abs(a).max())))
    counts = graph_rewrites.op_counts(out)
    fused = counts["ai.ort_triton.EmbedLayerNorm"]
    if p["defect"] == "none":
        assert fused == 1, (p, _refusals(rep))
        # every lookup and Add is inside it (the Gather left is the sequence length's, from a shape)
        assert counts["Gather"] == p["shape_of_word"] and not counts["Add"], dict(counts)
    else:
        assert fused == 0, p
        assert any(REASONS[p["defect"]] in r for r in _refusals(rep)), (p["defect"], _refusals(rep))
    return fused


@SETTINGS
@given(embeddings("none"))
def test_embeddings_fuse_and_keep_results(case):
    model, feeds, p = case
    event(f"{p['tables']} tables, opset {p['opset']}, beta {p['beta']}")
    event(f"ids: {sorted(str(s) for s in set(p['id_shapes'].values()))}")
    assert _check(model, feeds, p) == 1


@pytest.mark.parametrize("defect", DEFECTS)
@settings(SETTINGS, max_examples=8)
@given(data=st.data())
def test_embeddings_defects_are_refused_with_a_reason(defect, data):
    model, feeds, p = data.draw(embeddings(defect), label="case")
    assert _check(model, feeds, p) == 0
