"""examples/c: the no-Python serving path builds with the system C compiler against the onnxruntime wheel's
libonnxruntime and gives Python ORT's outputs (CPU here: the fused ops run their function bodies; the CUDA
run with the library is tests/gpu/test_c_example_gpu.py). ORT errors come back as a message and exit 1."""

import os
import shutil
import subprocess

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc")]


def _script(device: str, tmp_path, **env):
    e = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OUT": str(tmp_path)} | env
    return subprocess.run(["bash", str(ROOT / "examples/c/build_and_run.sh"), device], capture_output=True, text=True,
                          env=e, timeout=900)


def test_c_example_matches_python_on_cpu(tmp_path):
    res = _script("cpu", tmp_path, BATCH="3", SEQ="13")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "last_hidden_state: shape [3, 13, 64] on cpu" in res.stdout
    assert "PASSED" in res.stdout


def test_c_example_reports_ort_errors(tmp_path, native_library):
    assert _script("cpu", tmp_path).returncode == 0  # builds run_model and the model into tmp_path
    # a CPU session with the CUDA-only library registered fails to create (FACTS.md): a message, exit 1
    res = subprocess.run([str(tmp_path / "run_model"), str(tmp_path / "bert-tiny.ot.onnx"), str(native_library),
                          "cpu", "1", "8"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert "run_model: creating the session failed:" in res.stderr
    res = subprocess.run([str(tmp_path / "run_model"), str(tmp_path / "missing.onnx"), "-", "cpu", "1", "8"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "creating the session failed" in res.stderr
