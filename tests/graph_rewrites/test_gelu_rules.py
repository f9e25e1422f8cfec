"""GELU rules on hand-built graphs: every spelling they claim (with and without the MatMul bias), and the
ones they must refuse; fused graphs give the original's outputs on ORT CPU. gelu_mul (GeGLU) on a
hand-built gated MLP and on Gemma's exports."""

import math

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites

H = 40
RNG = np.random.default_rng(0)


def _c(name, value):
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _model(nodes, inits, opset=17, h=H):
    w = _c("w", RNG.normal(size=(16, h)))
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]), *nodes], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", h])], initializer=[w, *inits])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _biased(with_bias):
    """s = m + b (the MatMul's bias, either operand order) or s = m."""
    if not with_bias:
        return [helper.make_node("Identity", ["m"], ["s"])], []
    return [helper.make_node("Add", ["b", "m"], ["s"])], [_c("b", RNG.normal(size=H))]


def _erf(grouping, scale_by_div):
    nodes = [helper.make_node("Div" if scale_by_div else "Mul", ["s", "k"], ["a"]),
             helper.make_node("Erf", ["a"], ["e"]), helper.make_node("Add", ["one", "e"], ["t1"])]
    nodes += {0: [helper.make_node("Mul", ["s", "t1"], ["p"]), helper.make_node("Mul", ["p", "half"], ["y"])],
              1: [helper.make_node("Mul", ["half", "s"], ["p"]), helper.make_node("Mul", ["p", "t1"], ["y"])],
              2: [helper.make_node("Mul", ["t1", "half"], ["p"]), helper.make_node("Mul", ["s", "p"], ["y"])]}[grouping]
    k = math.sqrt(2) if scale_by_div else 1 / math.sqrt(2)
    return nodes, [_c("k", k), _c("one", 1.0), _c("half", 0.5)]


def _tanh(grouping, pow_form):
    cube = ([helper.make_node("Pow", ["s", "three"], ["cube"])] if pow_form else
            [helper.make_node("Mul", ["s", "s"], ["sq"]), helper.make_node("Mul", ["sq", "s"], ["cube"])])
    nodes = cube + [helper.make_node("Mul", ["k1", "cube"], ["c1"]), helper.make_node("Add", ["s", "c1"], ["in"]),
                    helper.make_node("Mul", ["in", "k0"], ["arg"]), helper.make_node("Tanh", ["arg"], ["t"]),
                    helper.make_node("Add", ["t", "one"], ["t1"])]
    nodes += _erf(grouping, True)[0][3:]
    return nodes, [_c("three", 3.0), _c("k1", 0.044715), _c("k0", math.sqrt(2 / math.pi)), _c("one", 1.0),
                   _c("half", 0.5)]


def _check(m, want_ops):
    out, rep = graph_rewrites.optimize(m, report=True)
    ours = {k: v for k, v in graph_rewrites.op_counts(out).items() if k != "MatMul"}
    assert ours == want_ops, (ours, {k: v for k, v in rep.rules.items() if v.tried})
    feeds = {"x": RNG.normal(0, 2, (5, 16)).astype(np.float32)}
    a = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    b = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.abs(a - b).max() / np.abs(a).max() < 1e-5
    return rep


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_op(with_bias, approximate):
    pre, inits = _biased(with_bias)
    m = _model(pre + [helper.make_node("Gelu", ["s"], ["y"], approximate=approximate)], inits, opset=20)
    _check(m, {"ai.ort_triton.BiasGelu" + ("Tanh" if approximate == "tanh" else ""): 1,
               **({} if with_bias else {"Identity": 1})})


@pytest.mark.parametrize("grouping", [0, 1, 2])
@pytest.mark.parametrize("scale_by_div", [True, False])
def test_erf_expression(grouping, scale_by_div):
    pre, inits = _biased(True)
    nodes, consts = _erf(grouping, scale_by_div)
    rep = _check(_model(pre + nodes, inits + consts), {"ai.ort_triton.BiasGelu": 1})
    assert rep.rules["gelu_erf"].matched == 1 and rep.rules["bias_gelu"].matched == 1


@pytest.mark.parametrize("grouping", [0, 1, 2])
@pytest.mark.parametrize("pow_form", [True, False])
def test_tanh_expression(grouping, pow_form):
    pre, inits = _biased(True)
    nodes, consts = _tanh(grouping, pow_form)
    _check(_model(pre + nodes, inits + consts), {"ai.ort_triton.BiasGeluTanh": 1})


def test_refuses_wrong_constants():
    pre, inits = _biased(True)
    nodes, consts = _erf(0, True)
    consts[2] = _c("half", 0.6)  # not gelu
    m = _model(pre + nodes, inits + consts)
    out, rep = graph_rewrites.optimize(m, report=True)
    assert rep.rules["gelu_erf"].matched == 0
    assert any("constants are not those of gelu" in r.reason for r in rep.rules["gelu_erf"].refused)
    assert "ai.ort_triton.BiasGelu" not in graph_rewrites.op_counts(out)


def test_broadcasting_add_is_not_folded():
    """s = m + c with c [n, H]-broadcastable but not a [H] bias: GELU fused with a zero bias, Add kept."""
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "c"], ["s"]),
                           helper.make_node("Gelu", ["s"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, H])],
                          initializer=[_c("w", RNG.normal(size=(16, H))), _c("c", RNG.normal(size=(5, 1)))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)
    rep = _check(m, {"Add": 1, "ai.ort_triton.BiasGelu": 1})
    assert rep.rules["bias_gelu"].matched == 0 and rep.rules["bias_gelu"].refused


def test_refuses_dynamic_hidden():
    m = _model([helper.make_node("Gelu", ["m"], ["y"])], [], opset=20)
    m.graph.initializer[0].CopyFrom(_c("w", RNG.normal(size=(16, H))))
    m.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16]))
    del m.graph.initializer[:]  # w becomes a graph input of unknown width
    m.graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [16, "h"]))
    out, rep = graph_rewrites.optimize(m, report=True)
    assert "not static" in rep.rules["gelu"].refused[0].reason


def _to_float16(m):
    """The same graph in float16: inputs, outputs and every initializer (what a model exported in fp16 has)."""
    for init in m.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    for v in (*m.graph.input, *m.graph.output):
        v.type.tensor_type.elem_type = TensorProto.FLOAT16
    return m


@pytest.mark.parametrize("form", ["erf", "tanh"])
def test_float16_constants_are_gelus(form):
    """An fp16 export stores 0.044715 as 0.04471 and sqrt(2) as 1.414 (GPT-2 exported in fp16 had its MLP
    GELU refused): a constant that is gelu's rounded to its type is gelu's. The fused graph matches the
    original within fp16 rounding (the kernel uses the exact constants)."""
    pre, inits = _biased(True)
    nodes, consts = _erf(0, True) if form == "erf" else _tanh(0, True)
    m = _to_float16(_model(pre + nodes, inits + consts))
    out, rep = graph_rewrites.optimize(m, report=True)
    op = "ai.ort_triton.BiasGelu" + ("Tanh" if form == "tanh" else "")
    assert graph_rewrites.op_counts(out).get(op) == 1, {k: v for k, v in rep.rules.items() if v.tried}
    feeds = {"x": RNG.normal(0, 1, (5, 16)).astype(np.float16)}
    a = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    b = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    a, b = a.astype(np.float32), b.astype(np.float32)
    assert np.abs(a - b).max() / np.abs(a).max() < 1e-2


def test_float16_constants_still_refuse_another_function():
    """The rounding allowance is half an fp16 ulp, not a loose match: 0.05 in place of 0.044715 is refused."""
    pre, inits = _biased(True)
    nodes, consts = _tanh(0, True)
    consts[1] = _c("k1", 0.0448)  # 0.044715 is 0.04471 in fp16; 0.0448 is 3 ulps off
    out, rep = graph_rewrites.optimize(_to_float16(_model(pre + nodes, inits + consts)), report=True)
    assert rep.rules["gelu_tanh"].matched == 0
    assert any("constants are not those of the tanh gelu" in r.reason for r in rep.rules["gelu_tanh"].refused)


# ---- gelu_mul: GeGLU's product (on by default) -----------------------------------------------------------------

def _geglu(approximate, up_shape=("n", H), swap=False):
    """y = Gelu(x @ w + b) * (x @ w2), the product's operands in either order; up_shape: the up operand's declared
    shape (a broadcasting [1, H] is refused)."""
    w2 = _c("w2", RNG.normal(size=(16, H)))
    nodes = [helper.make_node("Add", ["m", "b"], ["s"]),
             helper.make_node("Gelu", ["s"], ["g"], approximate=approximate),
             helper.make_node("MatMul", ["x", "w2"], ["u"] if up_shape == ("n", H) else ["u0"])]
    inits = [_c("b", RNG.normal(size=H)), w2]
    if up_shape != ("n", H):  # u = a [1, H] slice of the up product: broadcasts against the gate
        inits += [numpy_helper.from_array(np.array([v], np.int64), name) for name, v in (("z", 0), ("o", 1))]
        nodes += [helper.make_node("Slice", ["u0", "z", "o", "z"], ["u"])]
    nodes += [helper.make_node("Mul", ["u", "g"] if swap else ["g", "u"], ["y"])]
    return _model(nodes, inits, opset=20)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("swap", [False, True])
def test_gelu_mul(approximate, swap):
    m = _geglu(approximate, swap=swap)
    plain = graph_rewrites.optimize(m, disable=["gelu_mul"])  # without it BiasGelu[Tanh] and the Mul stay two ops
    fused_op = "BiasGeluTanhMul" if approximate == "tanh" else "BiasGeluMul"
    plain_ops = graph_rewrites.op_counts(plain)
    assert plain_ops["Mul"] == 1 and f"ai.ort_triton.{fused_op}" not in plain_ops, plain_ops
    out, rep = graph_rewrites.optimize(m, report=True)
    assert rep.rules["gelu_mul"].matched == 1, rep.rules["gelu_mul"]
    ops = graph_rewrites.op_counts(out)
    assert ops == {"MatMul": 2, f"ai.ort_triton.{fused_op}": 1}, ops
    (node,) = [n for n in out.graph.node if n.domain]
    assert list(node.input)[1:] == ["b", "u"]  # the bias folded first, then the product
    feeds = {"x": RNG.normal(0, 2, (3, 16)).astype(np.float32)}
    (a,), (b,) = (ort.InferenceSession(g.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
                  for g in (m, out))
    assert np.abs(a - b).max() / np.abs(a).max() < 1e-5


def test_gelu_mul_refuses_a_broadcasting_product():
    m = _geglu("tanh", up_shape=(1, H))
    out, rep = graph_rewrites.optimize(m, report=True)
    st = rep.rules["gelu_mul"]
    assert st.matched == 0 and any("not provably one shape" in r.reason for r in st.refused), st
    assert "ai.ort_triton.BiasGeluTanh" in graph_rewrites.op_counts(out)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_gemma_export_fuses_its_geglu(tmp_path_factory, exporter):
    """Gemma's MLP, down(gelu_tanh(gate(x)) * up(x)): with gelu_mul every layer's product is one BiasGeluTanhMul, and
    the rewritten model (every rule) gives the original's outputs on ORT CPU, prefill and a decode step."""
    from ort_triton import decoders
    from tests.graph_rewrites.test_swiglu_rules import _export

    path = _export(tmp_path_factory, "gemma-tiny", exporter)
    model = decoders.build("gemma-tiny")
    layers = decoders.cache_spec(model)[0]
    out, rep = graph_rewrites.optimize(path, report=True)
    ops = graph_rewrites.op_counts(out)
    assert rep.rules["gelu_mul"].matched == layers and not rep.rules["gelu_mul"].refused, rep.rules["gelu_mul"]
    assert ops["ai.ort_triton.BiasGeluTanhMul"] == layers and "ai.ort_triton.BiasGeluTanh" not in ops, ops
    a = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch, seq, past in ((2, 5, 3), (3, 1, 6)):
        feeds = decoders.sample_inputs(model, batch=batch, seq=seq, past=past, left_pad=1)
        for x, y in zip(a.run(None, feeds), b.run(None, feeds)):
            assert np.abs(x - y).max() / np.abs(x).max() < 1e-5
