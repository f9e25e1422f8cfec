"""The op contracts: every function body runs on ORT CPU at every supported opset and equals the op's
reference; and the ORT facts the contract design rests on still hold."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ort_triton.contract import DOMAIN, MIN_OPSET
from ort_triton.ops import BY_NAME
from ort_triton.ops.attention import MULTI_HEAD_ATTENTION
from ort_triton.ops.bias_gelu import BIAS_GELU, BIAS_GELU_MUL, BIAS_GELU_TANH, BIAS_GELU_TANH_MUL
from ort_triton.ops.embed_layer_norm import EMBED_LAYER_NORM
from ort_triton.ops.layer_norm import ADD_LAYER_NORM, LAYER_NORM
from ort_triton.ops.packed_attention import PACKED_MULTI_HEAD_ATTENTION
from ort_triton.ops.qkv_cache import QKV_CACHE
from ort_triton.ops.qkv_rotary_cache import QKV_NORM_ROTARY_CACHE, QKV_ROTARY_CACHE

RNG = np.random.default_rng(0)
X = RNG.normal(1.0, 2.0, (2, 5, 24)).astype(np.float32)
CASES = {  # op -> (inputs, attributes)
    LAYER_NORM: ([X, RNG.normal(1, 0.3, 24), RNG.normal(0, 0.3, 24)], {"epsilon": 1e-3}),
    ADD_LAYER_NORM: ([X, RNG.normal(size=X.shape), RNG.normal(size=24), RNG.normal(1, 0.3, 24),
                      RNG.normal(0, 0.3, 24)],
                     {"epsilon": 1e-5}),
    BIAS_GELU: ([X, RNG.normal(size=24)], {}),
    BIAS_GELU_TANH: ([X, RNG.normal(size=24)], {}),
    BIAS_GELU_MUL: ([X, RNG.normal(size=24), RNG.normal(size=X.shape)], {}),
    BIAS_GELU_TANH_MUL: ([X, RNG.normal(size=24), RNG.normal(size=X.shape)], {}),
    MULTI_HEAD_ATTENTION: ([X, RNG.normal(size=(2, 7, 24)), RNG.normal(size=(2, 7, 24)),
                            np.where(RNG.random((2, 7)) < 0.3, np.finfo(np.float32).min, 0.0),
                            RNG.normal(size=24), RNG.normal(size=24)],
                           {"num_heads": 3, "scale": 0.35}),
    PACKED_MULTI_HEAD_ATTENTION: ([RNG.normal(size=(2, 5, 72)), np.where(RNG.random((2, 5)) < 0.3, -np.inf, 0.0),
                                   RNG.normal(size=72)],
                                  {"num_heads": 3, "scale": 0.35}),
    # ids [2, 5], [1, 1], [1, 5] broadcast to [2, 5]; a negative id counts from the end, as Gather's
    EMBED_LAYER_NORM: ([np.array([[3, 0, 9, -1, 4], [5, 5, 1, 2, 8]]), np.zeros((1, 1), np.int64), np.arange(5)[None],
                        RNG.normal(size=(10, 24)), RNG.normal(size=(2, 24)), RNG.normal(size=(7, 24)),
                        RNG.normal(1, 0.3, 24), RNG.normal(0, 0.3, 24)],
                       {"epsilon": 1e-12}),
    # QKV [2, 5, (3 + 2 * 1) * 8], cos/sin [1, 1, 5, 4] (partial: 4 of 8 channels), a cache of 3
    QKV_ROTARY_CACHE: ([RNG.normal(size=(2, 5, 40)), RNG.normal(size=(1, 1, 5, 4)), RNG.normal(size=(1, 1, 5, 4)),
                        RNG.normal(size=(2, 1, 3, 8)), RNG.normal(size=(2, 1, 3, 8))],
                       {"interleaved": 1, "rotary_dim": 4}),
    # the same with q and k RMSNorm-ed per head (gammas [8]), rotate-half over all 8 channels, cos [1, 5, 8]
    QKV_NORM_ROTARY_CACHE: ([RNG.normal(size=(2, 5, 40)), RNG.normal(size=(1, 5, 8)), RNG.normal(size=(1, 5, 8)),
                             RNG.normal(size=(2, 1, 3, 8)), RNG.normal(size=(2, 1, 3, 8)), RNG.normal(1, 0.3, 8),
                             RNG.normal(1, 0.3, 8)],
                            {"interleaved": 0, "rotary_dim": 0, "epsilon": 1e-5}),
    # QKV [2, 5, (3 + 2 * 1) * 8] and its bias, a cache of 3
    QKV_CACHE: ([RNG.normal(size=(2, 5, 40)), RNG.normal(size=40), RNG.normal(size=(2, 1, 3, 8)),
                 RNG.normal(size=(2, 1, 3, 8))], {}),
}


def _typed(op, inputs):
    """The case's inputs as the op takes them: int64 where the contract fixes it (ids), float32 else."""
    return [np.asarray(a, np.int64 if io.type == "int64" else np.float32) for a, io in zip(inputs, op.inputs)]


def _single_node_model(op, inputs, attrs, opset):
    names = [f"in{i}" for i in range(len(inputs))]
    outs = [f"out{i}" for i in range(len(op.outputs))]
    node = helper.make_node(op.name, names, outs, domain=DOMAIN, **attrs)
    out_shapes = [r.shape for r in op.reference(*inputs, **attrs)]
    g = helper.make_graph([node], op.name,
                          [helper.make_tensor_value_info(n, io.element_type("float"), a.shape)
                           for n, a, io in zip(names, inputs, op.inputs)],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, sh) for o, sh in zip(outs, out_shapes)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)],
                             functions=[op.function_proto(opset)], ir_version=9)


@pytest.mark.parametrize("opset", [15, 16, 17, 18, 20, 23])
@pytest.mark.parametrize("op", list(CASES), ids=lambda op: op.name)
def test_body_equals_reference_at_every_opset(op, opset):
    inputs, attrs = CASES[op]
    inputs = _typed(op, inputs)
    m = _single_node_model(op, inputs, attrs, opset)
    onnx.checker.check_model(m)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {f"in{i}": a for i, a in enumerate(inputs)})
    want = op.reference(*inputs, **attrs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert np.abs(g - w).max() / np.abs(w).max() < 1e-5


def test_every_contract_is_registered_by_name():
    assert set(BY_NAME) >= {op.name for op in CASES}


def test_old_opset_is_refused():
    with pytest.raises(ValueError, match=f"opset >= {MIN_OPSET}"):
        LAYER_NORM.function_proto(14)


def _add_ln_with_outputs(outputs):
    inputs = [np.asarray(a, np.float32) for a in CASES[ADD_LAYER_NORM][0]]
    m = _single_node_model(ADD_LAYER_NORM, inputs, {}, 17)
    del m.graph.node[0].output[:]
    m.graph.node[0].output.extend(outputs)
    del m.graph.output[:]
    m.graph.output.extend(helper.make_tensor_value_info(o, TensorProto.FLOAT, X.shape) for o in outputs if o)
    return m


def test_ort_fact_every_output_must_be_listed():
    """Why nodes list unused outputs as "": ORT fails a node that lists fewer than its function has."""
    with pytest.raises(Exception, match="out of range"):
        ort.InferenceSession(_add_ln_with_outputs(["y"]).SerializeToString(), providers=["CPUExecutionProvider"])
    ort.InferenceSession(_add_ln_with_outputs(["y", ""]).SerializeToString(), providers=["CPUExecutionProvider"])
