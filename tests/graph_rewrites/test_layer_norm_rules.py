"""LayerNorm rules on hand-built graphs: every form they claim, and the forms they must refuse.

Each fused case must give the original's outputs on ORT CPU (through the function bodies); each refused
case must be left alone, with the reason in the report.
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites

RNG = np.random.default_rng(0)


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr, np.float32), name)


def _model(nodes, inputs, outputs, inits, opset=17):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _vi(name, shape, t=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, t, shape)


def _decomposed(x, out, h, *, pow_form=True, div_form=True, axes_input=False, gamma_first=False, beta=True,
                eps=1e-6, prefix="ln"):
    """The decomposed LayerNorm the way exporters write it, in several spellings."""
    p = lambda s: f"{prefix}_{s}"
    nodes, inits = [], [_init(p("g"), RNG.normal(1, 0.2, h)), _init(p("eps"), eps), _init(p("two"), 2.0)]
    if beta:
        inits.append(_init(p("b"), RNG.normal(0, 0.2, h)))

    def mean(src, dst):
        if axes_input:
            nodes.append(helper.make_node("ReduceMean", [src, p("axes")], [dst], keepdims=1))
        else:
            nodes.append(helper.make_node("ReduceMean", [src], [dst], axes=[-1], keepdims=1))

    if axes_input:
        inits.append(numpy_helper.from_array(np.array([-1], np.int64), p("axes")))
    mean(x, p("mean"))
    nodes.append(helper.make_node("Sub", [x, p("mean")], [p("d")]))
    if pow_form:
        nodes.append(helper.make_node("Pow", [p("d"), p("two")], [p("dd")]))
    else:
        nodes.append(helper.make_node("Mul", [p("d"), p("d")], [p("dd")]))
    mean(p("dd"), p("var"))
    nodes.append(helper.make_node("Add", [p("var"), p("eps")], [p("ve")]))
    nodes.append(helper.make_node("Sqrt", [p("ve")], [p("std")]))
    if div_form:
        nodes.append(helper.make_node("Div", [p("d"), p("std")], [p("n")]))
    else:
        nodes.append(helper.make_node("Reciprocal", [p("std")], [p("r")]))
        nodes.append(helper.make_node("Mul", [p("d"), p("r")], [p("n")]))
    scaled = p("scaled") if beta else out
    operands = [p("g"), p("n")] if gamma_first else [p("n"), p("g")]
    nodes.append(helper.make_node("Mul", operands, [scaled]))
    if beta:
        nodes.append(helper.make_node("Add", [scaled, p("b")], [out]))
    return nodes, inits


def _layer_norm(x, out, h, *, axis=-1, beta=True, prefix="ln", outputs=1):
    inits = [_init(f"{prefix}_g", RNG.normal(1, 0.2, h))]
    ins = [x, f"{prefix}_g"]
    if beta:
        inits.append(_init(f"{prefix}_b", RNG.normal(0, 0.2, h)))
        ins.append(f"{prefix}_b")
    outs = [out] + [f"{prefix}_extra{i}" for i in range(outputs - 1)]
    return [helper.make_node("LayerNormalization", ins, outs, axis=axis, epsilon=1e-5)], inits


def _run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _assert_same(original, optimized, feeds, rtol=1e-5):
    for a, b in zip(_run(original, feeds), _run(optimized, feeds)):
        assert a.shape == b.shape
        err = np.abs(a - b).max() / np.abs(a).max()
        assert err < rtol, f"rel err {err:.2e}"


def _feeds(*names, shape=(2, 5, 48)):
    return {n: RNG.normal(0.5, 2.0, shape).astype(np.float32) for n in names}


def _fused(report):
    return {k: v.matched for k, v in report.rules.items() if v.matched}


H = 48


@pytest.mark.parametrize("beta", [True, False])
def test_layer_normalization(beta):
    nodes, inits = _layer_norm("x", "y", H, beta=beta)
    m = _model(nodes, [_vi("x", [2, 5, H])], [_vi("y", [2, 5, H])], inits)
    out, rep = graph_rewrites.optimize(m, report=True)
    assert _fused(rep) == {"layer_norm": 1}
    assert graph_rewrites.op_counts(out) == {"ai.ort_triton.LayerNorm": 1}
    _assert_same(m, out, _feeds("x"))


@pytest.mark.parametrize("pow_form", [True, False])
@pytest.mark.parametrize("div_form", [True, False])
@pytest.mark.parametrize("axes_input", [True, False])
@pytest.mark.parametrize("gamma_first", [True, False])
@pytest.mark.parametrize("beta", [True, False])
def test_decomposed(pow_form, div_form, axes_input, gamma_first, beta):
    nodes, inits = _decomposed("x", "y", H, pow_form=pow_form, div_form=div_form, axes_input=axes_input,
                               gamma_first=gamma_first, beta=beta)
    m = _model(nodes, [_vi("x", ["batch", "seq", H])], [_vi("y", ["batch", "seq", H])], inits,
               opset=18 if axes_input else 15)
    out, rep = graph_rewrites.optimize(m, report=True)
    rule = "layer_norm_decomposed" if beta else "layer_norm_decomposed_no_beta"
    assert _fused(rep) == {rule: 1}, rep.rules[rule]
    assert graph_rewrites.op_counts(out) == {"ai.ort_triton.LayerNorm": 1}
    _assert_same(m, out, _feeds("x"))


def test_post_ln_residual_drops_the_sum():
    nodes, inits = _layer_norm("s", "y", H)
    nodes.insert(0, helper.make_node("Add", ["a", "b"], ["s"]))
    m = _model(nodes, [_vi("a", [2, 5, H]), _vi("b", [2, 5, H])], [_vi("y", [2, 5, H])], inits)
    out, rep = graph_rewrites.optimize(m, report=True)
    assert _fused(rep) == {"layer_norm": 1, "add_layer_norm": 1}
    (node,) = out.graph.node
    assert node.op_type == "AddLayerNorm" and list(node.output) == ["y", ""]  # "" = the kernel skips the sum
    _assert_same(m, out, _feeds("a", "b"))


@pytest.mark.parametrize("bias_first", [True, False])
@pytest.mark.parametrize("biased_operand", [0, 1])
@pytest.mark.parametrize("keep_sum", [False, True])
def test_matmul_bias_folds_into_add_layer_norm(bias_first, biased_operand, keep_sum):
    nodes, inits = _layer_norm("s", "y", H)
    lin = ["c", "m"] if bias_first else ["m", "c"]
    res = ["lin", "r"] if biased_operand == 0 else ["r", "lin"]
    nodes[:0] = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", lin, ["lin"]),
                 helper.make_node("Add", res, ["s"])]
    outputs = [_vi("y", [2, 5, H])]
    if keep_sum:
        nodes.append(helper.make_node("Mul", ["s", "s"], ["next"]))
        outputs.append(_vi("next", [2, 5, H]))
    inits += [_init("w", RNG.normal(size=(16, H))), _init("c", RNG.normal(size=H))]
    m = _model(nodes, [_vi("x", [2, 5, 16]), _vi("r", [2, 5, H])], outputs, inits)
    out, rep = graph_rewrites.optimize(m, report=True)
    assert rep.rules["bias_add_layer_norm"].matched == 1, rep.rules["bias_add_layer_norm"]
    node = next(n for n in out.graph.node if n.op_type == "AddLayerNorm")
    assert list(node.input)[2] == "c" and "Add" not in graph_rewrites.op_counts(out)
    _assert_same(m, out, {"x": RNG.normal(size=(2, 5, 16)).astype(np.float32), **_feeds("r")})


def test_pre_ln_residual_keeps_the_sum():
    nodes, inits = _decomposed("s", "y", H)
    nodes.insert(0, helper.make_node("Add", ["a", "b"], ["s"]))
    nodes.append(helper.make_node("Mul", ["s", "s"], ["next"]))  # the residual stream goes on
    m = _model(nodes, [_vi("a", [2, 5, H]), _vi("b", [2, 5, H])], [_vi("y", [2, 5, H]), _vi("next", [2, 5, H])],
               inits)
    out, rep = graph_rewrites.optimize(m, report=True)
    assert _fused(rep) == {"layer_norm_decomposed": 1, "add_layer_norm_keep_sum": 1}
    node = next(n for n in out.graph.node if n.op_type == "AddLayerNorm")
    assert node.output[1] and node.output[1] in {i for n in out.graph.node for i in n.input}
    _assert_same(m, out, _feeds("a", "b"))


def test_sum_that_is_a_graph_output_is_kept():
    nodes, inits = _layer_norm("s", "y", H)
    nodes.insert(0, helper.make_node("Add", ["a", "b"], ["s"]))
    m = _model(nodes, [_vi("a", [2, H]), _vi("b", [2, H])], [_vi("y", [2, H]), _vi("s", [2, H])], inits)
    out, rep = graph_rewrites.optimize(m, report=True)
    assert rep.rules["add_layer_norm_keep_sum"].matched == 1
    _assert_same(m, out, _feeds("a", "b", shape=(2, H)))


def _refusal(rep, rule):
    st = rep.rules[rule]
    assert st.matched == 0 and st.refused, st
    return st.refused[0].reason


def test_refuses_broadcasting_add():
    nodes, inits = _layer_norm("s", "y", H)
    nodes.insert(0, helper.make_node("Add", ["a", "bias"], ["s"]))
    inits.append(_init("bias", RNG.normal(size=H)))
    m = _model(nodes, [_vi("a", [2, 5, H])], [_vi("y", [2, 5, H])], inits)
    out, rep = graph_rewrites.optimize(m, report=True)
    assert "not provably equal" in _refusal(rep, "add_layer_norm")
    assert graph_rewrites.op_counts(out) == {"Add": 1, "ai.ort_triton.LayerNorm": 1}
    _assert_same(m, out, _feeds("a"))


def test_refuses_an_add_of_two_unknown_dims():
    """[?, H] + [?, H] with unnamed dims: one may be a broadcast 1, so the Add is not provably a residual."""
    nodes, inits = _layer_norm("s", "y", H)
    nodes.insert(0, helper.make_node("Add", ["a", "b"], ["s"]))
    m = _model(nodes, [_vi("a", [None, H]), _vi("b", [None, H])], [_vi("y", [None, H])], inits)
    out, rep = graph_rewrites.optimize(m, report=True)
    assert "not provably equal" in _refusal(rep, "add_layer_norm")
    assert graph_rewrites.op_counts(out)["ai.ort_triton.AddLayerNorm"] == 0
    feeds = {"a": RNG.normal(size=(3, H)).astype(np.float32), "b": RNG.normal(size=(1, H)).astype(np.float32)}
    _assert_same(m, out, feeds)


def test_refuses_a_norm_over_other_axes():
    nodes, inits = _layer_norm("x", "y", 5 * H, axis=1)
    m = _model(nodes, [_vi("x", [2, 5, H])], [_vi("y", [2, 5, H])], inits)
    # gamma for axis=1 would be [5, H]; a 1-D one of 5*H elements is what a bad rewrite would accept
    m.graph.initializer[0].CopyFrom(_init("ln_g", RNG.normal(size=(5, H))))
    m.graph.initializer[1].CopyFrom(_init("ln_b", RNG.normal(size=(5, H))))
    out, rep = graph_rewrites.optimize(m, report=True)
    assert "not the last axis" in _refusal(rep, "layer_norm")
    assert graph_rewrites.op_counts(out) == {"LayerNormalization": 1}


def test_refuses_hidden_size_beyond_the_kernel():
    nodes, inits = _layer_norm("x", "y", 20000)
    m = _model(nodes, [_vi("x", [2, 20000])], [_vi("y", [2, 20000])], inits)
    _, rep = graph_rewrites.optimize(m, report=True)
    assert "outside 1..16384" in _refusal(rep, "layer_norm")


def test_refuses_when_mean_output_is_used():
    nodes, inits = _layer_norm("x", "y", H, outputs=2)
    m = _model(nodes, [_vi("x", [2, H])], [_vi("y", [2, H]), _vi("ln_extra0", None)], inits)
    _, rep = graph_rewrites.optimize(m, report=True)
    assert "used outside the fused region" in _refusal(rep, "layer_norm")


def test_refuses_double():
    nodes, inits = _layer_norm("x", "y", H)
    inits = [numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name) for t in inits]
    m = _model(nodes, [_vi("x", [2, H], TensorProto.DOUBLE)], [_vi("y", [2, H], TensorProto.DOUBLE)], inits)
    _, rep = graph_rewrites.optimize(m, report=True)
    assert "DOUBLE" in _refusal(rep, "layer_norm")


def test_float16_model_fuses_with_float16_zero_beta():
    nodes, inits = _layer_norm("x", "y", H, beta=False)
    inits = [numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name) for t in inits]
    m = _model(nodes, [_vi("x", [2, H], TensorProto.FLOAT16)], [_vi("y", [2, H], TensorProto.FLOAT16)], inits)
    out = graph_rewrites.optimize(m)
    zero = next(t for t in out.graph.initializer if t.name.endswith("__ot_zero_beta"))
    assert zero.data_type == TensorProto.FLOAT16 and not numpy_helper.to_array(zero).any()
    onnx.checker.check_model(out)


def test_optimizing_twice_is_the_same_as_once():
    nodes, inits = _layer_norm("s", "y", H)
    nodes.insert(0, helper.make_node("Add", ["a", "b"], ["s"]))
    m = _model(nodes, [_vi("a", [2, H]), _vi("b", [2, H])], [_vi("y", [2, H])], inits)
    once = graph_rewrites.optimize(m)
    twice, rep = graph_rewrites.optimize(once, report=True)
    assert rep.fused() == 0
    assert graph_rewrites.op_counts(twice) == graph_rewrites.op_counts(once)
    assert len(twice.functions) == len(once.functions) == 1
    _assert_same(m, twice, _feeds("a", "b", shape=(2, H)))


def test_input_model_is_not_modified():
    nodes, inits = _layer_norm("x", "y", H)
    m = _model(nodes, [_vi("x", [2, H])], [_vi("y", [2, H])], inits)
    before = m.SerializeToString()
    graph_rewrites.optimize(m)
    assert m.SerializeToString() == before


def test_old_opset_is_left_alone_with_a_note():
    nodes, inits = _decomposed("x", "y", H)
    m = _model(nodes, [_vi("x", [2, H])], [_vi("y", [2, H])], inits, opset=14)
    out, rep = graph_rewrites.optimize(m, report=True)
    assert rep.fused() == 0 and "opset 14 < 15" in rep.notes[0]
    assert graph_rewrites.op_counts(out) == graph_rewrites.op_counts(m)


def test_unknown_rule_name_is_an_error():
    with pytest.raises(ValueError, match="unknown rule 'nope'"):
        graph_rewrites.optimize(_model([], [], [], []), only=["nope"])


def test_two_norms_of_one_value_without_beta_get_two_zero_betas():
    """Found by the property test: both invented betas were named after x, one was dropped and the model
    referenced a missing initializer."""
    n1, i1 = _layer_norm("x", "y1", H, beta=False, prefix="p")
    n2, i2 = _layer_norm("x", "y2", H, beta=False, prefix="q")
    m = _model(n1 + n2, [_vi("x", [2, H])], [_vi("y1", [2, H]), _vi("y2", [2, H])], i1 + i2)
    out = graph_rewrites.optimize(m)
    onnx.checker.check_model(out, full_check=True)
    zeros = [t.name for t in out.graph.initializer if "__ot_zero_beta" in t.name]
    assert len(zeros) == 2 and len(set(zeros)) == 2
    _assert_same(m, out, _feeds("x", shape=(2, H)))


def test_unnamed_nodes_are_counted_one_by_one():
    n1, i1 = _layer_norm("x", "y1", H, prefix="p")
    n2, i2 = _layer_norm("x", "y2", H, prefix="q")
    m = _model(n1 + n2, [_vi("x", [2, H])], [_vi("y1", [2, H]), _vi("y2", [2, H])], i1 + i2)
    for n in m.graph.node:
        n.name = ""
    _, rep = graph_rewrites.optimize(m, report=True)
    assert rep.rules["layer_norm"].tried == rep.rules["layer_norm"].matched == 2
