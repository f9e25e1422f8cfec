"""On the GPU: a rewritten BERT (both exporters) on ORT's CUDA EP with the library, against the original
on ORT CPU in fp32; and in fp16 against the same model's fp32 outputs."""

import ctypes

import numpy as np
import onnxruntime as ort
import pytest
import torch

import graph_rewrites
from ort_triton import models
from ort_triton.compare import random_inputs
from ort_triton.runtime import make_session

pytestmark = pytest.mark.gpu


def _launches(lib) -> int:
    fn = ctypes.CDLL(str(lib)).ort_triton_launches
    fn.restype = ctypes.c_long
    return fn()


@pytest.mark.parametrize("exporter", models.EXPORTERS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rewritten_bert_on_cuda(gpu_library, tmp_path, exporter, dtype):
    model = models.build("bert-odd")
    ref_model = models.export(model, tmp_path / "ref.onnx", exporter=exporter)
    src = ref_model
    if dtype == "float16":
        src = models.export(model.half(), tmp_path / "m.onnx", exporter=exporter)
        model.float()
    optimized = graph_rewrites.optimize(str(src))
    layers = model.config.num_hidden_layers
    n_ours = sum(n.domain == "ai.ort_triton" for n in optimized.graph.node)
    assert n_ours == 1 + 2 * layers
    ref = ort.InferenceSession(str(ref_model), providers=["CPUExecutionProvider"])
    sess = make_session(optimized, providers=["CUDAExecutionProvider"], library=gpu_library)
    feeds = random_inputs(ref, 4, 37, model.config.vocab_size)
    before = _launches(gpu_library)
    (got,) = sess.run(None, feeds)
    assert _launches(gpu_library) - before == n_ours
    (want,) = ref.run(None, feeds)
    err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
    assert err < (1e-4 if dtype == "float32" else 2e-2), err
    assert torch.isfinite(torch.from_numpy(got.astype(np.float32))).all()
