"""graph_rewrites.to_float16 (what `optimize --float16` runs). Models past protobuf's 2 GiB: the fp32 export
of a 1B-parameter decoder is 4.4 GB, and onnxruntime's converter, left to its own shape inference, serialises
the whole model and fails there ("Failed to serialize proto", seen on Llama-1B in session 12)."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites


def test_shape_inference_never_sees_the_weights(monkeypatch):
    """Past 2 GiB, onnx cannot serialise a model for its shape inference; a >2 GiB model is too slow to
    build in a test (minutes, 18 GB), so this checks the mechanism on a small one: every shape inference
    to_float16 runs sees the weights left out, and the converter's own (whole-model) inference is off.
    The 4.4 GB Llama-1B export converts on the device (examples/generate.py --float16, session 12)."""
    seen = []
    infer = onnx.shape_inference.infer_shapes

    def spy(model, *args, **kwargs):
        seen.append(max(len(t.raw_data) for t in model.graph.initializer))
        return infer(model, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", spy)
    from onnxruntime.transformers import float16

    monkeypatch.setattr(float16, "infer_shapes", spy, raising=False)
    big = 1 << 21  # 8 MB of fp32: over graph_rewrites' 1 MiB threshold for "large"
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["s"]), helper.make_node("Mul", ["s", "s"], ["y"])], "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [big])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [big])],
        [numpy_helper.from_array(np.full(big, 0.5, np.float32), "w")]), opset_imports=[helper.make_opsetid("", 18)])
    out = graph_rewrites.to_float16(model)
    assert seen and max(seen) == 0, f"shape inference saw weights of {seen} bytes"
    (init,) = out.graph.initializer
    assert init.data_type == TensorProto.FLOAT16 and len(init.raw_data) == 2 * big
    assert numpy_helper.to_array(init)[[0, big - 1]].tolist() == [0.5, 0.5]
    assert [n.op_type for n in out.graph.node] == ["Add", "Mul"]
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert out.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    types = {v.name: v.type.tensor_type.elem_type for v in out.graph.value_info}
    assert types["s"] == TensorProto.FLOAT16 and set(types.values()) == {TensorProto.FLOAT16}


def test_keep_io_types_and_the_fp32_keep_list_still_apply():
    """The small-model behaviour is unchanged: a kept op (ReduceMean) stays fp32 behind Casts, and
    keep_io_types leaves the graph's inputs and outputs fp32."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["s"]), helper.make_node("ReduceMean", ["s"], ["m"], keepdims=1),
         helper.make_node("Sub", ["s", "m"], ["y"])], "small",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [numpy_helper.from_array(np.ones(8, np.float32), "w")]), opset_imports=[helper.make_opsetid("", 18)])
    out = graph_rewrites.to_float16(model, keep_io_types=True)
    onnx.checker.check_model(out, full_check=True)
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert out.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("Cast") >= 3 and "ReduceMean" in ops
    reduce_in = next(n for n in out.graph.node if n.op_type == "ReduceMean").input[0]
    cast = next(n for n in out.graph.node if reduce_in in n.output)
    assert cast.op_type == "Cast" and cast.attribute[0].i == TensorProto.FLOAT
