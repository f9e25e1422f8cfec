"""On the GPU: EmbedLayerNorm on ORT's CUDA EP with the library, against the float64 reference.

The model is built the way users get it (Gathers, Adds and a LayerNormalization, through graph_rewrites),
its tables initializers of the element type, its output cast to fp32 so fp16 and bf16 give numpy outputs.
`ort_triton_launches` proves the
Triton kernel ran, not the body. An id outside its table must give a NaN row (ORT's Gather would fail).
"""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites
from ort_triton.ops.embed_layer_norm import reference_embed_layer_norm
from ort_triton.runtime import launch_count, make_session

pytestmark = pytest.mark.gpu

TYPES = {"float": (TensorProto.FLOAT, 1e-5), "float16": (TensorProto.FLOAT16, 1e-2),
         "bfloat16": (TensorProto.BFLOAT16, 2e-2)}
VOCAB = {"word": 300, "type": 2, "pos": 64}


def _model(h, type_name, pos_batch):
    """input_ids [b, s], token_type_ids [b, s], position_ids [1 or b, s] -> the embeddings' LayerNorm, the
    tables and the norm's parameters initializers of the element type (as an export of that type has them)."""
    t = TYPES[type_name][0]
    np_type = helper.tensor_dtype_to_np_dtype(t)
    rng = np.random.default_rng(h)
    n = helper.make_node
    inits = [numpy_helper.from_array(rng.normal(size=(v, h)).astype(np_type), f"{name}_table")
             for name, v in VOCAB.items()]
    inits += [numpy_helper.from_array(rng.normal(mean, std, h).astype(np_type), name)
              for name, (mean, std) in (("g", (1, 0.3)), ("b", (0, 0.3)))]
    nodes = [n("Gather", ["word_table", "input_ids"], ["ew"]), n("Gather", ["type_table", "token_type_ids"], ["et"]),
             n("Add", ["ew", "et"], ["s0"]), n("Gather", ["pos_table", "position_ids"], ["ep"]),
             n("Add", ["s0", "ep"], ["s1"]),
             n("LayerNormalization", ["s1", "g", "b"], ["y"], axis=-1, epsilon=1e-12),
             n("Cast", ["y"], ["y32"], to=TensorProto.FLOAT)]
    ids = lambda name, b: helper.make_tensor_value_info(name, TensorProto.INT64, [b, "s"])  # noqa: E731
    g = helper.make_graph(nodes, "eln", [ids("input_ids", "b"), ids("token_type_ids", "b"),
                                         ids("position_ids", pos_batch)],
                          [helper.make_tensor_value_info("y32", TensorProto.FLOAT, ["b", "s", h])], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _run(h, type_name, batch, seq, pos_batch, corrupt=None):
    model = _model(h, type_name, 1 if pos_batch == 1 else "b")
    optimized, rep = graph_rewrites.optimize(model, report=True)
    ours = [n.op_type for n in optimized.graph.node if n.domain == "ai.ort_triton"]
    assert ours == ["EmbedLayerNorm"], (ours, rep.rules["embed_layer_norm"])
    rng = np.random.default_rng(h + seq)
    feeds = {"input_ids": rng.integers(-VOCAB["word"], VOCAB["word"], (batch, seq)),
             "token_type_ids": rng.integers(0, 2, (batch, seq)),
             "position_ids": np.broadcast_to(np.arange(seq), (pos_batch, seq)).copy()}
    if corrupt:
        corrupt(feeds)
    return model, optimized, feeds


@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("h, batch, seq, pos_batch", [(768, 2, 37, 1), (64, 3, 5, 3), (1000, 1, 1, 1),
                                                      (4096, 2, 17, 2), (16384, 1, 3, 1)])
def test_cuda_ep_runs_the_kernel(gpu_library, type_name, h, batch, seq, pos_batch):
    model, optimized, feeds = _run(h, type_name, batch, seq, pos_batch)
    sess = make_session(optimized, providers=["CUDAExecutionProvider"], library=gpu_library)
    before = launch_count(gpu_library)
    (got,) = sess.run(None, feeds)
    assert launch_count(gpu_library) == before + 1, "the Triton kernel did not run"
    tol = TYPES[type_name][1]
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    (want,) = reference_embed_layer_norm(feeds["input_ids"], feeds["token_type_ids"], feeds["position_ids"],
                                         inits["word_table"], inits["type_table"], inits["pos_table"], inits["g"],
                                         inits["b"], 1e-12)
    assert got.shape == (batch, seq, h) and np.isfinite(got).all()
    assert np.abs(got - want).max() / np.abs(want).max() < tol


def test_out_of_range_id_gives_a_nan_row(gpu_library):
    def corrupt(feeds):
        feeds["input_ids"][1, 2] = VOCAB["word"]
    _, optimized, feeds = _run(768, "float16", 2, 9, 1, corrupt)
    sess = make_session(optimized, providers=["CUDAExecutionProvider"], library=gpu_library)
    (got,) = sess.run(None, feeds)
    assert np.isnan(got[1, 2]).all()
    got[1, 2] = 0
    assert np.isfinite(got).all()
