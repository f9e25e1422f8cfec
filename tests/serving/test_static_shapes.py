"""Static-shape specialisation (graph_rewrites/static_shapes.py, `optimize --static-shapes`): on real BERT
exports (both exporters, already fused) every shape computation folds away, so no node is left that ORT's
CUDA EP would put on the CPU (the Memcpy nodes that block CUDA-graph capture), and the outputs stay those
of the dynamic model at that shape."""

import collections
import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import graph_rewrites
from graph_rewrites import static_shapes
from ort_triton import models
from ort_triton.compare import random_inputs
from tests.conftest import run_cli

SHAPE = {"input_ids": [3, 24], "attention_mask": [3, 24]}


@pytest.fixture(scope="module", params=models.EXPORTERS)
def exported(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "bert.onnx"
    return models.export(models.build("bert-tiny"), path, exporter=request.param)


def _cpu_side(proto: onnx.ModelProto) -> list[str]:
    """An independent count of what ORT's CUDA EP leaves to the CPU: shape ops, and integer/bool nodes whose
    inputs are all initializers or constants (shape and index arithmetic)."""
    consts = {t.name for t in proto.graph.initializer}
    consts |= {o for n in proto.graph.node if n.op_type == "Constant" for o in n.output}
    left = []
    for n in proto.graph.node:
        if n.op_type in ("Shape", "Size") or (n.op_type != "Constant" and n.input and
                                             all(i in consts or not i for i in n.input)):
            left.append(n.op_type)
    return left


@pytest.mark.slow
def test_bert_exports_fold_every_shape_computation(exported):
    fused = graph_rewrites.optimize(str(exported))
    assert collections.Counter(n.op_type for n in fused.graph.node)["Shape"] > 0  # there was work to do
    model = ir.serde.deserialize_model(fused)
    assert static_shapes.specialize(model, SHAPE) == []
    out = ir.serde.serialize_model(model)
    assert _cpu_side(out) == [], _cpu_side(out)
    assert [[d.dim_value for d in i.type.tensor_type.shape.dim] for i in out.graph.input] == list(SHAPE.values())
    ops = collections.Counter(n.op_type for n in out.graph.node)
    assert ops["PackedMultiHeadAttention"] == 2 and ops["AddLayerNorm"] == 4, ops  # the fused ops survive
    ref = ort.InferenceSession(str(exported), providers=["CPUExecutionProvider"])
    new = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = random_inputs(ref, 3, 24, 512, seed=3)
    (a,), (b,) = ref.run(None, feeds), new.run(None, feeds)
    assert np.abs(a - b).max() / np.abs(a).max() < 1e-5


@pytest.mark.slow
def test_cli_static_shapes(exported, tmp_path):
    out, js = tmp_path / "s.onnx", tmp_path / "r.json"
    run_cli("optimize", exported, "-o", out, "--static-shapes", "input_ids=3x24,attention_mask=3x24", "--json", js)
    proto = onnx.load(str(out))
    assert _cpu_side(proto) == []
    assert not json.loads(js.read_text())["notes"]
    assert json.loads(js.read_text())["ops_after"]["ai.ort_triton.PackedMultiHeadAttention"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("spec, message", [
    ("input_ids=3x24", "no shape for input(s) ['attention_mask']"),
    ("input_ids=3x24,attention_mask=3x24,pixels=1x3", "unknown input(s) ['pixels']"),
    ("input_ids=3x24x2,attention_mask=3x24", "3 dims given, the input has rank 2"),
    ("input_ids=3,24", "expected NAME=D0xD1x"),
    ("input_ids=0x24,attention_mask=3x24", "every dim must be >= 1"),
])
def test_cli_bad_static_shapes_exit_2(exported, tmp_path, spec, message):
    out = tmp_path / "s.onnx"
    res = run_cli("optimize", exported, "-o", out, "--static-shapes", spec, check=False)
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stdout + res.stderr
    assert not out.exists()


def test_a_fixed_dim_that_disagrees_is_refused():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, "n"])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    model = ir.serde.deserialize_model(onnx.helper.make_model(
        onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])))
    with pytest.raises(ValueError, match="dim 0 is fixed at 4 in the model, 2 given"):
        static_shapes.specialize(model, {"x": [2, 3]})
    assert static_shapes.specialize(model, {"x": [4, 3]}) == []
