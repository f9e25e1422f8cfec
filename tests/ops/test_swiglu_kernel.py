"""SiluMul (ort_triton/ops/swiglu.py): the kernel against the float64 reference under the interpreter on CPU
(poisoned outputs, odd widths: tails of the 1024-wide column blocks, I not a multiple of 16), the function
body against the reference at every opset, and the native planner through the library's test hook."""

import ctypes
import os
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ort_triton.contract import DOMAIN
from ort_triton.kernels.swiglu import silu_mul
from ort_triton.ops.swiglu import BLOCK_I, ROWS, SILU_MUL, reference_silu_mul

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (2, 5, 1030), (9, 2048), (2, 7, 176)], ids=str)
def test_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    g = (torch.randn(shape, generator=gen, dtype=torch.float64) * 4).to(dtype).to(DEVICE)
    u = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    out = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    y = silu_mul(g, u, out=out).double().cpu().numpy()
    (want,) = reference_silu_mul(g.double().cpu().numpy(), u.double().cpu().numpy())
    assert np.isfinite(y).all(), "unwritten elements"
    err = np.abs(y - want).max() / np.abs(want).max()
    assert err < TOL[dtype], err


def test_large_magnitudes_without_nan():
    """exp(-g) overflows to inf for g << 0: silu(g) must be -0 there, not NaN; g >> 0 gives g."""
    g = torch.tensor([[-1e4, -100.0, 0.0, 100.0, 1e4]], device=DEVICE)
    y = silu_mul(g, torch.full_like(g, 2.0)).cpu()
    torch.testing.assert_close(y, torch.tensor([[0.0, 0.0, 0.0, 200.0, 2e4]]), rtol=1e-6, atol=1e-6)


def test_mismatched_shapes_are_a_clear_error():
    with pytest.raises(ValueError, match="one shape"):
        silu_mul(torch.zeros(2, 8, device=DEVICE), torch.zeros(1, 8, device=DEVICE))


@pytest.mark.parametrize("opset", [15, 17, 20, 23, 24])
def test_body_equals_reference(opset):
    rng = np.random.default_rng(opset)
    g, u = (rng.normal(0, 3, (2, 5, 24)).astype(np.float32) for _ in range(2))
    node = helper.make_node("SiluMul", ["g", "u"], ["y"], domain=DOMAIN)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, g.shape) for n in "gu"],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, g.shape)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)],
                          functions=[SILU_MUL.function_proto(opset)], ir_version=10)
    onnx.checker.check_model(m)
    (y,) = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"g": g, "u": u})
    (want,) = SILU_MUL.reference(g, u)
    assert np.abs(y - want).max() / np.abs(want).max() < 1e-6


# ---- the native planner (ort_triton/native/swiglu.c), no GPU needed ------------------------------------------

FLOAT16 = 10


@pytest.fixture
def lib(native_library):
    lib = ctypes.CDLL(str(native_library))
    lib.ort_triton_plan.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int),
                                    ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    return lib


def plan(lib, shapes):
    n = len(shapes)
    msg = ctypes.create_string_buffer(1024)
    rc = lib.ort_triton_plan(b"SiluMul", FLOAT16, 90, n, (ctypes.c_int * n)(*[1] * n),
                             (ctypes.c_int * n)(*map(len, shapes)),
                             (ctypes.c_int64 * sum(map(len, shapes)))(*[d for s in shapes for d in s]), 1, msg,
                             len(msg))
    return rc, msg.value.decode()


@pytest.mark.parametrize("shape, aligned", [((2, 7, 176), 1), ((5, 2048), 1), ((3, 37), 0), ((1, 1030), 0)])
def test_plan_grid_and_spec(lib, shape, aligned):
    rc, msg = plan(lib, [shape, shape])
    assert rc == 0, msg
    grid = [int(v) for v in re.search(r"grid=(\d+),(\d+),(\d+)", msg).groups()]
    rows = int(np.prod(shape[:-1]))
    assert grid == [-(-rows // ROWS), -(-shape[-1] // BLOCK_I), 1]
    assert int(re.search(r"spec=(\d+)", msg).group(1)) == (0 if aligned else 1)  # the I % 16 == 0 spec first


@pytest.mark.parametrize("shapes, match", [
    ([(2, 176), (1, 176)], r"input up has shape \[1,176\] but input gate has shape \[2,176\]"),
    ([(2, 176), (2, 1, 176)], "they must be equal"),
    ([(2, 0), (2, 0)], "H must be 1.."),
])
def test_plan_refusals_name_the_input(lib, shapes, match):
    rc, msg = plan(lib, shapes)
    assert rc != 0 and re.search(match, msg), msg
    assert "SiluMul" in msg

# (no register spills: tests/ops/test_rotary_kernel.py::test_no_spills covers SiluMul's specs too)



def _typed_model(shape, type_name):
    """SiluMul on element type type_name between fp32 Casts (numpy feeds), with its function body."""
    t = {"float": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}[type_name]
    nodes = [helper.make_node("Cast", [f"{n}32"], [n], to=t) for n in ("gate", "up")]
    nodes += [helper.make_node("SiluMul", ["gate", "up"], ["y"], domain=DOMAIN),
              helper.make_node("Cast", ["y"], ["y32"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "silu_mul", [helper.make_tensor_value_info(f"{n}32", TensorProto.FLOAT, shape)
                                                  for n in ("gate", "up")],
                              [helper.make_tensor_value_info("y32", TensorProto.FLOAT, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                             functions=[SILU_MUL.function_proto(17)], ir_version=10)


@pytest.mark.gpu
@pytest.mark.parametrize("type_name, torch_dtype", [("float", torch.float32), ("float16", torch.float16),
                                                    ("bfloat16", torch.bfloat16)])
@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (2, 7, 176), (4096, 8192), (3, 70000)], ids=str)
def test_cuda_ep_runs_the_kernel(gpu_library, shape, type_name, torch_dtype):
    """Through ORT's CUDA EP and the library: the planner's params in the kernel's order."""
    from ort_triton.runtime import launch_count, make_session

    rng = np.random.default_rng(sum(shape))
    g, u = (torch.from_numpy(rng.normal(0, 3, shape)).to(torch_dtype).float().numpy() for _ in range(2))
    sess = make_session(_typed_model(shape, type_name), providers=["CUDAExecutionProvider"], library=gpu_library)
    before = launch_count(gpu_library)
    (y,) = sess.run(None, {"gate32": g, "up32": u})
    assert launch_count(gpu_library) == before + 1, "the Triton kernel did not run"
    (want,) = reference_silu_mul(g, u)
    assert np.abs(y - want).max() / np.abs(want).max() < TOL[torch_dtype]
