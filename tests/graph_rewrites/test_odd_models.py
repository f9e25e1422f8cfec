"""Unusual models through the rewriter: each is fused correctly or left alone with a reason, never broken."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites
from ort_triton import models
from ort_triton.compare import random_inputs
from ort_triton.ops.layer_norm import reference_layer_norm

H = 24
RNG = np.random.default_rng(1)


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr, np.float32), name)


def _ln(x, y, g="g", b="b"):
    return helper.make_node("LayerNormalization", [x, g, b], [y], axis=-1, epsilon=1e-5)


def _vi(name, shape=(2, H)):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _weights():
    return [_init("g", RNG.normal(1, 0.3, H)), _init("b", RNG.normal(0, 0.3, H))]


def _model(graph, opset=17, extra_opsets=()):
    return helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", opset), *extra_opsets])


def _run(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _same(a, b, feeds):
    for x, y in zip(_run(a, feeds), _run(b, feeds)):
        assert np.abs(x - y).max() <= 1e-5 * np.abs(x).max()


def test_duplicate_node_names():
    """ORT refuses such a model itself; the rewriter still fuses it into one that runs, and is right."""
    g = helper.make_graph([helper.make_node("Add", ["x", "r"], ["s"], name="n"), _ln("s", "y")], "g",
                          [_vi("x"), _vi("r")], [_vi("y")], _weights())
    g.node[1].name = "n"
    out = graph_rewrites.optimize(_model(g))
    assert [n.op_type for n in out.graph.node] == ["AddLayerNorm"]
    x, r = RNG.normal(size=(2, H)).astype(np.float32), RNG.normal(size=(2, H)).astype(np.float32)
    (y,) = _run(out, {"x": x, "r": r})
    w = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    (want,) = reference_layer_norm(x + r, w["g"], w["b"])
    assert np.abs(y - want).max() < 1e-5


def test_graph_input_that_shadows_an_initializer_keeps_its_override():
    """An initializer also listed as a graph input is a default the caller may override: the fused node
    must still read the input, so an override still takes effect."""
    g = helper.make_graph([_ln("x", "y")], "g", [_vi("x"), _vi("g", (H,))], [_vi("y")], _weights())
    m = _model(g)
    out = graph_rewrites.optimize(m)
    assert {i.name for i in out.graph.input} == {"x", "g"}
    feeds = {"x": RNG.normal(size=(2, H)).astype(np.float32), "g": RNG.normal(size=H).astype(np.float32)}
    _same(m, out, feeds)


def test_pattern_inside_an_if_branch_is_fused():
    then = helper.make_graph([helper.make_node("Add", ["x", "r"], ["s"]), _ln("s", "t")], "then", [], [_vi("t")])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [], [_vi("e")])
    g = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
                          [helper.make_tensor_value_info("c", TensorProto.BOOL, []), _vi("x"), _vi("r")], [_vi("y")],
                          _weights())
    m = _model(g)
    out, rep = graph_rewrites.optimize(m, report=True)
    assert rep.ops_after["ai.ort_triton.AddLayerNorm"] == 1 and rep.ops_after["LayerNormalization"] == 0
    for c in (True, False):
        _same(m, out, {"c": np.array(c), "x": RNG.normal(size=(2, H)).astype(np.float32),
                       "r": RNG.normal(size=(2, H)).astype(np.float32)})


def test_contrib_ops_are_left_as_they_are():
    """A model already optimized by ORT (com.microsoft SkipLayerNormalization): nothing to fuse, untouched."""
    node = helper.make_node("SkipLayerNormalization", ["x", "r", "g", "b"], ["y"], domain="com.microsoft",
                            epsilon=1e-5)
    m = _model(helper.make_graph([node], "g", [_vi("x"), _vi("r")], [_vi("y")], _weights()),
               extra_opsets=[helper.make_opsetid("com.microsoft", 1)])
    out, rep = graph_rewrites.optimize(m, report=True)
    assert rep.fused() == 0 and graph_rewrites.op_counts(out) == {"com.microsoft.SkipLayerNormalization": 1}
    _same(m, out, {"x": RNG.normal(size=(2, H)).astype(np.float32), "r": RNG.normal(size=(2, H)).astype(np.float32)})


def test_empty_graph():
    m = _model(helper.make_graph([], "g", [_vi("x")], [_vi("x")]))
    out, rep = graph_rewrites.optimize(m, report=True)
    assert rep.fused() == 0 and len(out.graph.node) == 0
    onnx.checker.check_model(out)


def test_newer_opset_than_onnx_knows_is_left_alone_with_a_note():
    opset = onnx.defs.onnx_opset_version() + 1
    m = _model(helper.make_graph([_ln("x", "y")], "g", [_vi("x")], [_vi("y")], _weights()), opset=opset)
    out, rep = graph_rewrites.optimize(m, report=True)
    assert rep.fused() == 0 and f"opset {opset} is newer" in rep.notes[0]
    assert graph_rewrites.op_counts(out) == {"LayerNormalization": 1}


def test_empty_node_names():
    nodes = [helper.make_node("Add", ["x", "r"], ["s"]), _ln("s", "y")]
    for n in nodes:
        n.name = ""
    model = _model(helper.make_graph(nodes, "g", [_vi("x"), _vi("r")], [_vi("y")], _weights()))
    out, rep = graph_rewrites.optimize(model, report=True)
    assert rep.ops_after["ai.ort_triton.AddLayerNorm"] == 1
    feeds = {"x": RNG.normal(size=(2, H)).astype(np.float32), "r": RNG.normal(size=(2, H)).astype(np.float32)}
    _same(model, out, feeds)


@pytest.mark.slow
@pytest.mark.parametrize("exporter", models.EXPORTERS)
def test_optimizing_twice_is_optimizing_once(tmp_path, exporter):
    """A second optimize of an optimized BERT finds nothing new and changes nothing: same nodes, same function
    bodies, same outputs."""
    src = models.export(models.build("bert-tiny"), tmp_path / "m.onnx", exporter=exporter)
    once = graph_rewrites.optimize(str(src))
    twice, rep = graph_rewrites.optimize(once, report=True)
    assert rep.fused() == 0, {k: v.matched for k, v in rep.rules.items() if v.matched}
    strip = lambda m: [(n.op_type, n.domain, list(n.input), list(n.output)) for n in m.graph.node]
    assert strip(twice) == strip(once)
    bodies = lambda m: {f.name: f.SerializeToString() for f in m.functions}
    assert bodies(twice) == bodies(once)
    feeds = random_inputs(ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]), 2, 11, 512, seed=4)
    _same(once, twice, feeds)
