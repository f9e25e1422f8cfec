"""examples/c on the CUDA EP with the ort_triton library: the C program's output equals Python ORT's
(same library, same inputs)."""

import os
import subprocess

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.gpu


def test_c_example_matches_python_on_cuda(tmp_path, gpu_library):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"OUT": str(tmp_path), "ORT_TRITON_LIBRARY": str(gpu_library), "BATCH": "4", "SEQ": "40"}
    res = subprocess.run(["bash", str(ROOT / "examples/c/build_and_run.sh"), "cuda"], capture_output=True, text=True,
                         env=env, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "on cuda" in res.stdout and "PASSED" in res.stdout
