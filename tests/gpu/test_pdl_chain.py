"""On the GPU: a chain of kernels of ours, three of every four launched with programmatic dependent launch
(contract.Kernel.pdl: Linear and AddRMSNormSwiGLU; AddRMSNorm, on every default path, is not), each reading what
the one before wrote, through ORT's CUDA EP with and without its CUDA graph, against float64. PDL is opt-in
(ORT_TRITON_PDL=1, read once a process): each case runs in a child process, with it set and without. A kernel that
read or wrote before its gdc_wait would see the earlier kernel's half-written output, and the chain would drift from
the reference; replays with fresh inputs check that the captured graph keeps the order too. 1 row runs the GEMV and
the fused SwiGLU, 3 rows the skinny product."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ort_triton.contract import DOMAIN
from ort_triton.ops import BY_NAME
from ort_triton.ops.linear import reference_linear
from ort_triton.ops.norm_linear import reference_add_rms_norm_swiglu
from ort_triton.ops.rms_norm import reference_add_rms_norm

pytestmark = pytest.mark.gpu

K, INNER, LAYERS = 256, 512, 6
EPS = 1e-6


def _chain(rows, rng):
    """LAYERS x (AddRMSNorm -> Linear(o) -> AddRMSNormSwiGLU -> Linear(down)) in fp16, fp32 I/O, with its weights."""
    w = {}
    nodes = [helper.make_node("Cast", ["x32"], ["h0"], to=TensorProto.FLOAT16),
             helper.make_node("Cast", ["r32"], ["s0"], to=TensorProto.FLOAT16)]
    for i in range(LAYERS):
        w[f"g{i}"] = rng.normal(1, 0.2, K)
        w[f"o{i}"] = rng.normal(0, 1, (K, K)) / np.sqrt(K)
        w[f"gg{i}"] = rng.normal(1, 0.2, K)
        w[f"wg{i}"] = rng.normal(0, 1, (INNER, K)) / np.sqrt(K)
        w[f"wu{i}"] = rng.normal(0, 1, (INNER, K)) / np.sqrt(K)
        w[f"d{i}"] = rng.normal(0, 1, (K, INNER)) / np.sqrt(INNER)
        nodes += [
            helper.make_node("AddRMSNorm", [f"h{i}", f"s{i}", f"g{i}"], [f"n{i}", f"t{i}"], domain=DOMAIN,
                             epsilon=EPS),
            helper.make_node("Linear", [f"n{i}", f"o{i}"], [f"a{i}"], domain=DOMAIN),
            helper.make_node("AddRMSNormSwiGLU", [f"a{i}", f"t{i}", f"gg{i}", f"wg{i}", f"wu{i}"],
                             [f"m{i}", f"u{i}"], domain=DOMAIN, epsilon=EPS),
            helper.make_node("Linear", [f"m{i}", f"d{i}"], [f"h{i + 1}"], domain=DOMAIN),
        ]
        nodes.append(helper.make_node("Identity", [f"u{i}"], [f"s{i + 1}"]))
    nodes.append(helper.make_node("Cast", [f"h{LAYERS}"], ["y32"], to=TensorProto.FLOAT))
    inits = [onnx.numpy_helper.from_array(v.astype(np.float16), k) for k, v in w.items()]
    graph = helper.make_graph(nodes, "pdl_chain", [helper.make_tensor_value_info(n, TensorProto.FLOAT, (rows, K))
                                                   for n in ("x32", "r32")],
                              [helper.make_tensor_value_info("y32", TensorProto.FLOAT, (rows, K))], inits)
    functions = [BY_NAME[n].function_proto(17) for n in ("AddRMSNorm", "Linear", "AddRMSNormSwiGLU")]
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                              functions=functions, ir_version=10)
    return model, {k: v.astype(np.float16).astype(np.float64) for k, v in w.items()}


def _reference(x, r, w):
    h, s = x, r
    for i in range(LAYERS):
        n, t = reference_add_rms_norm(h, s, w[f"g{i}"])
        a = reference_linear(n, w[f"o{i}"])[0]  # the node's weight is Linear's WT [N, K]
        m, u = reference_add_rms_norm_swiglu(a, t, w[f"gg{i}"], w[f"wg{i}"], w[f"wu{i}"])
        h, s = reference_linear(m, w[f"d{i}"])[0], u
    return h


def check(library: str, rows: int, cuda_graph: bool) -> tuple[int, int]:
    """Runs the chain 4 times with fresh inputs against float64; returns the library's (launches, PDL launches)."""
    import ctypes

    from ort_triton.runtime import make_session

    rng = np.random.default_rng(rows)
    model, w = _chain(rows, rng)
    options = {"enable_cuda_graph": "1"} if cuda_graph else {}
    sess = make_session(model, providers=[("CUDAExecutionProvider", options)], library=library)
    x_dev = ort.OrtValue.ortvalue_from_numpy(np.zeros((rows, K), np.float32), "cuda", 0)
    r_dev = ort.OrtValue.ortvalue_from_numpy(np.zeros((rows, K), np.float32), "cuda", 0)
    y_dev = ort.OrtValue.ortvalue_from_shape_and_type((rows, K), np.float32, "cuda", 0)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x32", x_dev)
    binding.bind_ortvalue_input("r32", r_dev)
    binding.bind_ortvalue_output("y32", y_dev)
    for step in range(4):  # with the graph: the first run captures, the others replay
        x = rng.normal(0, 1, (rows, K)).astype(np.float16).astype(np.float32)
        r = rng.normal(0, 1, (rows, K)).astype(np.float16).astype(np.float32)
        x_dev.update_inplace(x)
        r_dev.update_inplace(r)
        sess.run_with_iobinding(binding)
        want = _reference(x.astype(np.float64), r.astype(np.float64), w)
        got = y_dev.numpy()
        assert np.isfinite(got).all(), step
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 2e-2, (step, err)
    lib = ctypes.CDLL(library)
    lib.ort_triton_launches.restype = lib.ort_triton_pdl_launches.restype = ctypes.c_long
    return lib.ort_triton_launches(), lib.ort_triton_pdl_launches()


@pytest.mark.parametrize("pdl", ["1", None], ids=["pdl", "plain"])
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["stream", "cuda_graph"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_chain_of_pdl_kernels_matches_float64(gpu_library, rows, cuda_graph, pdl):
    """In a child process: ORT_TRITON_PDL is read once a process. With it, on sm_90, the Linear and
    AddRMSNormSwiGLU launches (3 of the chain's 4 a layer) are PDL ones; without, none."""
    env = {k: v for k, v in os.environ.items() if k != "ORT_TRITON_PDL"} | ({"ORT_TRITON_PDL": pdl} if pdl else {})
    code = (f"from tests.gpu.test_pdl_chain import check; print(*check({str(gpu_library)!r}, {rows}, {cuda_graph}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=pathlib.Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    launches, pdl_launches = map(int, out.stdout.split()[-2:])
    assert launches > 0, "the chain did not run through the library"
    import torch

    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert 4 * pdl_launches == (3 * launches if pdl and hopper else 0)
