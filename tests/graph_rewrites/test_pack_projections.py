"""pack_projections: three or more projections of one input become one MatMul (and one bias Add) and a Split."""

import collections

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites

SIZES = (24, 8, 8)  # Q, K, V of a GQA layer: N_i differ
K = 16


def _model(n=3, biases=(True, True, True), weight_input=None, output_matmul=None, seed=0):
    """x [B, S, K] -> n projections (x @ W_i [+ b_i]), each through a Relu (a reader that is not the pattern's)."""
    rng = np.random.default_rng(seed)
    sizes = (SIZES * 2)[:n]
    nodes, inits, inputs = [], [], [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", K])]
    outputs = []
    for i, n_i in enumerate(sizes):
        w = f"w{i}"
        if weight_input == i:
            inputs.append(helper.make_tensor_value_info(w, TensorProto.FLOAT, [K, n_i]))
        else:
            inits.append(numpy_helper.from_array(rng.standard_normal((K, n_i)).astype(np.float32), w))
        nodes.append(helper.make_node("MatMul", ["x", w], [f"m{i}"], name=f"proj{i}"))
        y = f"m{i}"
        if biases[i]:
            inits.append(numpy_helper.from_array(rng.standard_normal(n_i).astype(np.float32), f"b{i}"))
            nodes.append(helper.make_node("Add", [y, f"b{i}"], [f"a{i}"]))
            y = f"a{i}"
        nodes.append(helper.make_node("Relu", [y], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    if output_matmul is not None:
        outputs.append(helper.make_tensor_value_info(f"m{output_matmul}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model, feeds):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _feeds(model, seed=1):
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((2, 5, K)).astype(np.float32)}
    for i in model.graph.input[1:]:
        feeds[i.name] = rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
    return feeds


@pytest.mark.parametrize("n, biases", [(3, (True, True, True)), (3, (False, False, False)), (4, (True,) * 4),
                                       (4, (True, True, True, False))])
def test_projections_packed_and_equal(n, biases):
    model = _model(n, biases)
    out, rep = graph_rewrites.optimize(model, report=True, only=["pack_projections"])
    ops = collections.Counter(node.op_type for node in out.graph.node)
    kind = [i for i in range(n) if biases[i] == biases[0]]  # those of the first one's kind
    left = n - len(kind)  # a projection of the other kind (Phi's fc1 beside Q, K, V) stays as it was
    assert rep.rules["pack_projections"].matched == 1 and ops["MatMul"] == 1 + left and ops["Split"] == 1, ops
    assert ops["Add"] == int(biases[0]) + sum(biases[i] for i in range(n) if i not in kind), ops
    # one packed weight in place of the separate ones: no copy of them is left behind
    weights = sorted([list(i.dims) for i in out.graph.initializer if len(i.dims) == 2], key=lambda d: -d[1])
    assert len(weights) == 1 + left and weights[0] == [K, sum((SIZES * 2)[i] for i in kind)], weights
    feeds = _feeds(model)
    for want, got in zip(_run(model, feeds), _run(out, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_two_projections_stay():
    """SwiGLU's gate and up: packing measured slower at decode (module docstring), and no group is tried."""
    out, rep = graph_rewrites.optimize(_model(2), report=True, only=["pack_projections"])
    assert rep.rules["pack_projections"].tried == 0
    assert collections.Counter(n.op_type for n in out.graph.node)["MatMul"] == 2


@pytest.mark.parametrize("kwargs, reason", [
    (dict(weight_input=1, biases=(False,) * 3), "the weight w1 of MatMul proj1 is not a 2-D constant"),
    (dict(output_matmul=2, biases=(False,) * 3), "the output m2 of MatMul proj2 is a graph output"),
    (dict(biases=(True, False, True)), "2 of the 3 projections of x have a bias Add, 1 have none: fewer than 3 "
                                       "of a kind"),
])
def test_refusals_name_the_reason(kwargs, reason):
    model = _model(**kwargs)
    out, rep = graph_rewrites.optimize(model, report=True, only=["pack_projections"])
    st = rep.rules["pack_projections"]
    assert st.tried == 1 and st.matched == 0 and [r.reason for r in st.refused] == [reason], st
    assert collections.Counter(n.op_type for n in out.graph.node)["MatMul"] == 3
    feeds = _feeds(model)
    for want, got in zip(_run(model, feeds), _run(out, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_input_model_untouched():
    model = _model()
    before = model.SerializeToString()
    graph_rewrites.optimize(model, only=["pack_projections"])
    assert model.SerializeToString() == before


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("name", ["qwen2-tiny", "phi-tiny"])
def test_biased_projections_of_real_exports(tmp_path, name, exporter):
    """Qwen2's and Phi's Q, K and V carry biases: one packed bias Add a layer. Phi's fc1 reads the same input,
    its bias taken by BiasGelu already: it stays apart. Outputs equal the export's (prefill over a past, one
    row left-padded)."""
    from ort_triton import decoders

    model = decoders.build(name)
    path = decoders.export(model, tmp_path / "m.onnx", exporter=exporter)
    out, rep = graph_rewrites.optimize(str(path), report=True)
    layers = decoders.cache_spec(model)[0]
    st = rep.rules["pack_projections"]
    assert st.matched == layers and not st.refused, st
    assert sum(n.op_type == "Add" and n.name.endswith("__ot_packed_bias") for n in out.graph.node) == layers
    feeds = decoders.sample_inputs(model, 2, 5, 3, seed=1, left_pad=1)
    a = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    b = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for want, got in zip(a, b):
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
