"""SwiGLU rules (graph_rewrites/swiglu.py): hand-built graphs in every operand order, ONNX Swish, the ones
they must refuse, and real Llama / Mistral / Qwen2 exports by both exporters: one SiluMul per layer, the
outputs of the original on ORT CPU."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites

H, INTER = 16, 24
RNG = np.random.default_rng(0)
MINE = ["silu_mul", "swish_mul"]


def _model(nodes, opset=17, up_shape=("n", INTER)):
    """x [n, H] -> gate = x @ wg, up = x @ wu (or a graph input `up` of up_shape) -> nodes -> y"""
    inits = [numpy_helper.from_array(RNG.normal(size=(H, INTER)).astype(np.float32), w) for w in ("wg", "wu")]
    pre = [helper.make_node("MatMul", ["x", "wg"], ["g"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", H])]
    if up_shape == ("n", INTER):
        pre.append(helper.make_node("MatMul", ["x", "wu"], ["u"]))
    else:
        inputs.append(helper.make_tensor_value_info("u", TensorProto.FLOAT, list(up_shape)))
    graph = helper.make_graph(pre + nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _run(m, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _check(m, want_ops, feeds=None):
    out, rep = graph_rewrites.optimize(m, only=MINE, report=True)
    ops = {k: v for k, v in graph_rewrites.op_counts(out).items() if k != "MatMul"}
    assert ops == want_ops, (ops, {k: v for k, v in rep.rules.items() if v.tried})
    feeds = feeds or {"x": RNG.normal(0, 2, (5, H)).astype(np.float32)}
    a, b = _run(m, feeds)[0], _run(out, feeds)[0]
    assert np.abs(a - b).max() / np.abs(a).max() < 1e-5
    return rep


@pytest.mark.parametrize("sig_first", [False, True])
@pytest.mark.parametrize("up_first", [False, True])
def test_sigmoid_mul_every_order(sig_first, up_first):
    silu = helper.make_node("Mul", ["s", "g"] if sig_first else ["g", "s"], ["silu"])
    mul = helper.make_node("Mul", ["u", "silu"] if up_first else ["silu", "u"], ["y"])
    rep = _check(_model([helper.make_node("Sigmoid", ["g"], ["s"]), silu, mul]), {"ai.ort_triton.SiluMul": 1})
    assert rep.rules["silu_mul"].matched == 1


def test_swish_alpha_one():
    m = _model([helper.make_node("Swish", ["g"], ["s"], alpha=1.0), helper.make_node("Mul", ["u", "s"], ["y"])],
               opset=24)
    rep = _check(m, {"ai.ort_triton.SiluMul": 1})
    assert rep.rules["swish_mul"].matched == 1


def test_swish_other_alpha_is_refused():
    m = _model([helper.make_node("Swish", ["g"], ["s"], alpha=1.702), helper.make_node("Mul", ["s", "u"], ["y"])],
               opset=24)
    rep = _check(m, {"Swish": 1, "Mul": 1})
    assert any("alpha=1.702 is not silu" in r.reason for r in rep.rules["swish_mul"].refused)


def test_hardswish_is_not_silu():
    m = _model([helper.make_node("HardSwish", ["g"], ["s"]), helper.make_node("Mul", ["s", "u"], ["y"])], opset=22)
    _check(m, {"HardSwish": 1, "Mul": 1})


def test_sigmoid_of_another_value_is_not_silu():
    m = _model([helper.make_node("Sigmoid", ["u"], ["s"]), helper.make_node("Mul", ["g", "s"], ["t"]),
                helper.make_node("Mul", ["t", "u"], ["y"])])
    _check(m, {"Sigmoid": 1, "Mul": 2})


def test_broadcasting_up_is_refused():
    """up [n, 1] broadcasts in the graph; the op takes one shape: refused with the reason."""
    nodes = [helper.make_node("Sigmoid", ["g"], ["s"]), helper.make_node("Mul", ["g", "s"], ["silu"]),
             helper.make_node("Mul", ["silu", "u"], ["y"])]
    m = _model(nodes, up_shape=("n", 1))
    feeds = {"x": RNG.normal(size=(5, H)).astype(np.float32), "u": RNG.normal(size=(5, 1)).astype(np.float32)}
    rep = _check(m, {"Sigmoid": 1, "Mul": 2}, feeds)
    assert any("not provably one shape" in r.reason for r in rep.rules["silu_mul"].refused)


def test_silu_read_elsewhere_is_refused():
    """silu(g) is also a graph output: fusing would compute it twice; the rule leaves it."""
    nodes = [helper.make_node("Sigmoid", ["g"], ["s"]), helper.make_node("Mul", ["g", "s"], ["silu"]),
             helper.make_node("Mul", ["silu", "u"], ["y"])]
    m = _model(nodes)
    m.graph.output.append(helper.make_tensor_value_info("silu", TensorProto.FLOAT, None))
    out, rep = graph_rewrites.optimize(m, only=MINE, report=True)
    assert rep.rules["silu_mul"].matched == 0 and rep.rules["silu_mul"].refused
    assert "ai.ort_triton.SiluMul" not in graph_rewrites.op_counts(out)


# ---- real exports ---------------------------------------------------------------------------------------------

def _export(tmp_path_factory, name, exporter, opset=None):
    """One export per (model, exporter, opset) per test session, shared with test_rotary_rules.py."""
    from ort_triton import decoders

    path = tmp_path_factory.getbasetemp() / "swiglu_rotary_exports" / f"{name}-{exporter}-{opset}.onnx"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        decoders.export(decoders.build(name), path, exporter=exporter, opset=opset)
    return path


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("name", ["llama-tiny", "mistral-tiny", "qwen2-tiny"])
def test_decoder_export(tmp_path_factory, name, exporter):
    from ort_triton import decoders

    path = _export(tmp_path_factory, name, exporter)
    layers = decoders.cache_spec(decoders.build(name))[0]
    out, rep = graph_rewrites.optimize(path, report=True)  # every rule: the MLP's epilogue is still ours
    ops = graph_rewrites.op_counts(out)
    assert ops["ai.ort_triton.SiluMul"] == layers and "Sigmoid" not in ops, ops
    assert rep.rules["silu_mul"].matched == layers and not rep.rules["silu_mul"].refused
    mine = graph_rewrites.optimize(path, only=MINE)  # the equality of this rule alone
    feeds = decoders.sample_inputs(decoders.build(name), batch=2, seq=5, past=3, left_pad=1)
    for a, b in zip(_run(onnx.load(path), feeds), _run(mine, feeds)):
        assert np.abs(a - b).max() / np.abs(a).max() < 1e-5
