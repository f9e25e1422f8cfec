"""On the GPU: one MultiHeadAttention node on ORT's CUDA EP with the library, against the float64 reference.

The node carries its function body (as the rewriter leaves it) and sits between Casts, so fp16 and bf16 run
with fp32 numpy I/O; inputs are rounded to the element type before the reference sees them, and padding
masks are written in the element type's own finfo.min (as exporters do) or -inf. BERT-like shapes: every
head dim the library holds, S from 1 to 512. `ort_triton_launches` proves the Triton kernel ran, not the
body.
"""


import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ort_triton.contract import DOMAIN
from ort_triton.ops.attention import MULTI_HEAD_ATTENTION, reference_attention
from ort_triton.ops.packed_attention import PACKED_MULTI_HEAD_ATTENTION, reference_packed_attention
from ort_triton.runtime import launch_count, make_session

pytestmark = pytest.mark.gpu

OPSET = 17
TYPES = {"float": (TensorProto.FLOAT, torch.float32, 1e-4), "float16": (TensorProto.FLOAT16, torch.float16, 1e-2),
         "bfloat16": (TensorProto.BFLOAT16, torch.bfloat16, 2e-2)}
HEADS = [(12, 64), (16, 64), (12, 32), (8, 40), (8, 80), (8, 96), (8, 128)]  # (N, D)
SEQS = {1: 8, 37: 4, 128: 4, 512: 2}  # S -> B


def _model(type_name, b, sq, skv, hidden, num_heads, scale):
    names = ["q", "k", "v", "key_bias", "k_bias", "v_bias"]
    shapes = [[b, sq, hidden], [b, skv, hidden], [b, skv, hidden], [b, skv], [hidden], [hidden]]
    return _node_model(MULTI_HEAD_ATTENTION, type_name, names, shapes, shapes[0], num_heads, scale)


def _node_model(op, type_name, names, shapes, out_shape, num_heads, scale):
    """One `op` node between Casts from and to float32 inputs `<name>32`, with its function body."""
    t = TYPES[type_name][0]
    nodes = [helper.make_node("Cast", [n + "32"], [n], to=t) for n in names]
    nodes += [helper.make_node(op.name, names, ["y"], domain=DOMAIN, num_heads=num_heads, scale=scale),
              helper.make_node("Cast", ["y"], ["y32"], to=TensorProto.FLOAT)]
    g = helper.make_graph(nodes, op.name, [helper.make_tensor_value_info(n + "32", TensorProto.FLOAT, s)
                                           for n, s in zip(names, shapes)],
                          [helper.make_tensor_value_info("y32", TensorProto.FLOAT, out_shape)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                          functions=[op.function_proto(OPSET)], ir_version=9)
    onnx.checker.check_model(m)
    return m



def _round(a, torch_dtype):
    return torch.from_numpy(a).to(torch_dtype).double().numpy()


def _key_bias(b, skv, type_name, rng, low, fully_masked_row=True):
    """Right padding to a random length per batch row; the last row (of several) has no key left."""
    lengths = rng.integers(1, skv + 1, b)
    if fully_masked_row and b > 1:
        lengths[-1] = 0
    kb = np.where(np.arange(skv)[None, :] < lengths[:, None], 0.0, low)
    return kb.astype(np.float32), lengths


def _run_and_check(lib, type_name, b, sq, skv, num_heads, d, low, rng):
    _, torch_dtype, tol = TYPES[type_name]
    hidden, scale = num_heads * d, d**-0.5
    q, k, v = (rng.normal(size=(b, s, hidden)).astype(np.float32) for s in (sq, skv, skv))
    biases = [rng.normal(0, 0.5, hidden).astype(np.float32) for _ in range(2)]  # K's and V's projections'
    kb, lengths = _key_bias(b, skv, type_name, rng, low)
    sess = make_session(_model(type_name, b, sq, skv, hidden, num_heads, scale), providers=["CUDAExecutionProvider"],
                        library=lib)
    before = launch_count(lib)
    feeds = {"q32": q, "k32": k, "v32": v, "key_bias32": kb, "k_bias32": biases[0], "v_bias32": biases[1]}
    (got,) = sess.run(None, feeds)
    assert launch_count(lib) == before + 1, "the Triton kernel did not run"
    (want,) = reference_attention(*(_round(a, torch_dtype) for a in (q, k, v, kb, *biases)), num_heads, scale)
    assert np.isfinite(got).all()
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)
    assert err < tol, f"rel err {err:.2e}"
    return got, want, _round(v, torch_dtype) + _round(biases[1], torch_dtype), lengths


@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("s", list(SEQS))
@pytest.mark.parametrize("num_heads, d", HEADS, ids=lambda x: str(x))
def test_cuda_ep_runs_the_kernel(gpu_library, type_name, s, num_heads, d):
    """finfo.min padding, the last batch row fully masked: its output is the mean of V + v_bias (fp32, bf16;
    fp16's finfo.min only shifts the scores, and the row equals the reference's plain softmax)."""
    rng = np.random.default_rng(s * 1000 + d)
    low = float(torch.finfo(TYPES[type_name][1]).min)
    got, want, v, lengths = _run_and_check(gpu_library, type_name, SEQS[s], s, s, num_heads, d, low, rng)
    if lengths[-1] == 0 and type_name != "float16":
        mean = v[-1].mean(0)
        assert np.abs(got[-1] - mean[None, :]).max() <= TYPES[type_name][2] * np.abs(mean).max()


@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("sq, skv", [(37, 128), (128, 37), (1, 512), (512, 1)])
def test_queries_and_keys_of_different_lengths(gpu_library, type_name, sq, skv):
    _run_and_check(gpu_library, type_name, 3, sq, skv, 12, 64, float(torch.finfo(TYPES[type_name][1]).min),
                   np.random.default_rng(sq + skv))


@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("num_heads, d", [(12, 64), (8, 40), (8, 128)], ids=lambda x: str(x))
def test_minus_inf_masks(gpu_library, type_name, num_heads, d):
    """sdpa's boolean mask as -inf: masked keys drop out exactly, and a row with no key left is 0 (no
    v_bias either: the graph's softmax row is NaN -> 0 before the V product)."""
    got, _, _, lengths = _run_and_check(gpu_library, type_name, 4, 77, 77, num_heads, d, float("-inf"),
                                        np.random.default_rng(d))
    assert lengths[-1] == 0 and (got[-1] == 0).all()


def test_bad_head_dim_is_an_ort_error_and_the_next_run_works(gpu_library):
    """A node no kernel covers (hand-made: the rewriter would refuse it) fails with a message that names the
    op; the session carries on with a shape it covers."""
    import onnxruntime as ort

    m = _model("float", "b", "s", "s", "h", 1, 0.125)
    sess = make_session(m, providers=["CUDAExecutionProvider"], library=gpu_library)
    feeds = lambda h: {"q32": np.ones((2, 3, h), np.float32), "k32": np.ones((2, 3, h), np.float32),
                       "v32": np.ones((2, 3, h), np.float32), "key_bias32": np.zeros((2, 3), np.float32),
                       **{f"{x}_bias32": np.zeros(h, np.float32) for x in "kv"}}
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match=r"ort_triton MultiHeadAttention \(float\): head dim 12 .* is not supported"):
        sess.run(None, feeds(12))
    (y,) = sess.run(None, feeds(64))
    np.testing.assert_allclose(y, 1.0, rtol=1e-6)


# ---- PackedMultiHeadAttention: the kernel reads Q, K, V through pointers into one QKV tensor ------------
def _packed_model(type_name, b, s, hidden, num_heads, scale):
    return _node_model(PACKED_MULTI_HEAD_ATTENTION, type_name, ["qkv", "key_bias", "bias"],
                       [[b, s, 3 * hidden], [b, s], [3 * hidden]], [b, s, hidden], num_heads, scale)


@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("s", list(SEQS))
@pytest.mark.parametrize("num_heads, d", HEADS, ids=lambda x: str(x))
def test_packed_cuda_ep_runs_the_kernel(gpu_library, type_name, s, num_heads, d):
    """Every bias nonzero (Q's staged into the Q tile, V's added to the rows); finfo.min padding with the
    last batch row fully masked, and -inf on the 40-wide heads."""
    _, torch_dtype, tol = TYPES[type_name]
    rng = np.random.default_rng(s * 1000 + d + 7)
    b, hidden, scale = SEQS[s], num_heads * d, d**-0.5
    low = float("-inf") if d == 40 else float(torch.finfo(torch_dtype).min)
    qkv = rng.normal(size=(b, s, 3 * hidden)).astype(np.float32)
    bias = rng.normal(0, 0.5, 3 * hidden).astype(np.float32)
    kb, lengths = _key_bias(b, s, type_name, rng, low)
    sess = make_session(_packed_model(type_name, b, s, hidden, num_heads, scale),
                        providers=["CUDAExecutionProvider"], library=gpu_library)
    before = launch_count(gpu_library)
    (got,) = sess.run(None, {"qkv32": qkv, "key_bias32": kb, "bias32": bias})
    assert launch_count(gpu_library) == before + 1, "the Triton kernel did not run"
    (want,) = reference_packed_attention(*(_round(a, torch_dtype) for a in (qkv, kb, bias)), num_heads, scale)
    assert np.isfinite(got).all()
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)
    assert err < tol, f"rel err {err:.2e}"
    if low == float("-inf") and lengths[-1] == 0:
        assert (got[-1] == 0).all()
