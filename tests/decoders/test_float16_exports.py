"""Models built and exported in fp16, as the GPU bench and users do: every decoder fuses exactly as its fp32
export does (the fp16 exports carry rounded constants and finfo(fp16) fills, which rules read from the graph),
and the fused model gives the original's logits to fp16 rounding on ORT CPU."""

import numpy as np
import onnxruntime as ort
import pytest
import torch

import graph_rewrites
from ort_triton import decoders

pytestmark = pytest.mark.slow

TINY = ("llama-tiny", "mistral-tiny", "qwen2-tiny", "gpt2-tiny", "phi-tiny")


def _fusions(path):
    out, rep = graph_rewrites.optimize(str(path), report=True)
    return out, {name: r.matched for name, r in rep.rules.items() if r.matched}


@pytest.mark.parametrize("name", TINY)
def test_float16_export_fuses_like_float32(tmp_path, name):
    model = decoders.build(name)
    full = _fusions(decoders.export(model, tmp_path / "f32.onnx", exporter="dynamo", cache=True))[1]
    model = model.to(torch.float16)
    src = decoders.export(model, tmp_path / "f16.onnx", exporter="dynamo", cache=True)
    out, half = _fusions(src)
    assert half == full
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    new = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    for past in (0, 4):
        feeds = decoders.sample_inputs(model, 2, 5, past, seed=past)
        a, b = (s.run(None, feeds)[0].astype(np.float32) for s in (ref, new))
        assert np.abs(a - b).max() <= 1e-2 * np.abs(a).max(), (past, np.abs(a - b).max(), np.abs(a).max())
