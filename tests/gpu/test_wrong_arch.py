"""On the GPU: a library built only for sm_80, loaded on a newer GPU (the H200 is sm_90), refuses every node
with an ORT error that names the op, the GPU's arch, the arches the library holds and the command that fixes
it; the process carries on, and a session with a library built for this GPU then runs (issue 7, item 3).

The sm_80 library is built here; on a fresh device machine that compiles every default kernel for sm_80
once (19 s on the 16-core device machine; cached in ORT_TRITON_CACHE after)."""

import numpy as np
import onnxruntime as ort
import pytest
import torch

from ort_triton.ops.layer_norm import reference_layer_norm
from ort_triton.runtime import launch_count, make_session
from tests.conftest import layer_norm_node_model, run_cli

pytestmark = pytest.mark.gpu
ORT_ERRORS = (ort.capi.onnxruntime_pybind11_state.InvalidArgument, ort.capi.onnxruntime_pybind11_state.Fail)


@pytest.fixture(scope="module")
def sm80_library(tmp_path_factory):
    out = tmp_path_factory.mktemp("lib_sm80")
    run_cli("build", "--arch", "80", "-o", out, timeout=1800)
    return out / "libort_triton.so"


def test_library_without_this_arch_is_an_ort_error_and_a_matching_library_then_runs(sm80_library, gpu_library):
    major, minor = torch.cuda.get_device_capability()
    arch = 10 * major + minor
    if arch == 80:
        pytest.skip("this GPU is sm_80: the sm_80 library is the right one here")
    h = 768
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(4, h)).astype(np.float32), "g": rng.normal(1, 0.3, h).astype(np.float32),
             "b": rng.normal(0, 0.3, h).astype(np.float32)}
    model = layer_norm_node_model(h)
    wrong = make_session(model, providers=["CUDAExecutionProvider"], library=sm80_library)
    expected = (rf"ort_triton LayerNorm \(float\).*no kernel image for this GPU \(sm_{arch}\); this library holds "
                rf"kernels for sm_80; rebuild with: ort-triton build --arch {arch}")
    for _ in range(2):  # the same error every time, not a crash on the second call
        with pytest.raises(ORT_ERRORS, match=expected):
            wrong.run(None, feeds)
    right = make_session(model, providers=["CUDAExecutionProvider"], library=gpu_library)
    before = launch_count(gpu_library)
    (y,) = right.run(None, feeds)
    assert launch_count(gpu_library) > before  # the Triton kernel ran, not the function body
    (want,) = reference_layer_norm(feeds["x"], feeds["g"], feeds["b"])
    assert np.abs(y - want).max() < 1e-4
