"""Shared fixtures. Without a GPU, Triton kernels run under its interpreter: TRITON_INTERPRET must be set
before anything imports triton, so it is set here; the AOT build therefore runs in a subprocess (where
it is unset) through the CLI, which is what users run anyway."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _has_cuda() -> bool:
    try:
        import ctypes

        cuda = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_int()
        return cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0
    except OSError:
        return False


HAS_CUDA = _has_cuda()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.triton_interpreter_fixes import fix_interpreter

    fix_interpreter()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_cli(*args, check=True, env=None, timeout=900):
    """`python -m ort_triton ARGS` in a clean subprocess (no TRITON_INTERPRET)."""
    e = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    e.update(env or {})
    res = subprocess.run([sys.executable, "-m", "ort_triton", *map(str, args)], capture_output=True, text=True,
                         env=e, cwd=ROOT, timeout=timeout)
    if check and res.returncode:
        raise AssertionError(f"ort-triton {' '.join(map(str, args))} -> {res.returncode}\n{res.stdout}\n{res.stderr}")
    return res


def layer_norm_node_model(h="h"):
    """One hand-made ai.ort_triton LayerNorm node (fp32, x [n, h], gamma and beta graph inputs) with its
    function body: for runtime-error tests that need sizes or libraries the rewriter's path would not give.
    h: an int, or a name for a symbolic hidden size."""
    import onnx
    from onnx import TensorProto, helper

    from ort_triton.ops import LAYER_NORM

    node = helper.make_node("LayerNorm", ["x", "g", "b"], ["y"], domain="ai.ort_triton", epsilon=1e-5)
    g = helper.make_graph([node], "ln",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", h]),
                           helper.make_tensor_value_info("g", TensorProto.FLOAT, [h]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [h])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", h])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ort_triton", 1)],
                          functions=[LAYER_NORM.function_proto(17)], ir_version=9)
    onnx.checker.check_model(m)
    return m


@pytest.fixture(scope="session")
def native_library(tmp_path_factory) -> pathlib.Path:
    """libort_triton.so for sm_90, built once per test session (kernels cached in ORT_TRITON_CACHE);
    $ORT_TRITON_LIBRARY instead, where scripts/gpu_check.sh has just built one."""
    if os.environ.get("ORT_TRITON_LIBRARY"):
        return pathlib.Path(os.environ["ORT_TRITON_LIBRARY"])
    out = tmp_path_factory.mktemp("lib")
    run_cli("build", "--arch", "90", "-o", out)
    lib = out / "libort_triton.so"
    assert lib.is_file()
    return lib


@pytest.fixture(scope="session")
def gpu_library(native_library) -> pathlib.Path:
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    return native_library


@pytest.fixture
def tmp_copy(tmp_path):
    def copy(path):
        dst = tmp_path / pathlib.Path(path).name
        shutil.copy(path, dst)
        return dst
    return copy
