"""examples/generate.py end to end on CPU: export, graph_rewrites.optimize, greedy decoding through the
IO-binding loop (the one the GPU runs, here on CPU buffers) and through session.run; the stock and the
rewritten model must give torch's tokens."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--io-binding"], ["--exporter", "torchscript"], ["--float16", "--io-binding"],
                                   ["--kv-cache", "seq-major"]],
                         ids=["io-binding", "run", "float16", "seq-major"])
def test_generate_example_tokens_identical(tmp_path, extra):
    res = subprocess.run([sys.executable, "examples/generate.py", "--model", "llama-tiny", "--steps", "8",
                          "--optimize", "--out-dir", str(tmp_path), *extra],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ort_triton fused: {" in res.stdout, res.stdout  # something was fused
    assert "ORT + ort_triton identical to ORT: True" in res.stdout, res.stdout
    assert "torch (fp32) identical to ORT: True" in res.stdout, res.stdout
    if "seq-major" in extra:  # every layer relaid, each present bound over its past by the IO-binding loop
        assert "--kv-cache seq-major: 2 layer(s) relaid" in res.stdout, res.stdout
    if "--io-binding" in extra or "seq-major" in extra:  # each runtime against fp32, teacher-forced: every step
        # fp32's token here
        for label in ("ORT", "ORT + ort_triton"):
            assert f"{label} against torch (fp32): identical for the first [8, 8] steps" in res.stdout, res.stdout
            assert "next-token argmax equal to fp32's at 16 of 16 steps" in res.stdout, res.stdout
