"""Real exports: BERT-style encoders from transformers configs (random weights), both torch exporters.

Every LayerNorm must be fused (the embeddings one as LayerNorm: its Add broadcasts the position
embeddings; every encoder one as AddLayerNorm), every GELU with its bias as BiasGelu, and the rewritten
model must give the original's outputs on ORT CPU through the function bodies (fp32, rel err < 1e-5).
"""

import numpy as np
import onnxruntime as ort
import pytest

import graph_rewrites
from ort_triton import models
from ort_triton.compare import random_inputs

CASES = [("bert-tiny", "dynamo", None), ("bert-tiny", "torchscript", 17), ("bert-odd", "dynamo", None),
         ("bert-odd", "torchscript", 17), ("bert-tiny", "torchscript", 15)]  # opset 15: decomposed LayerNorm


@pytest.fixture(scope="module")
def built():
    return {name: models.build(name) for name in {c[0] for c in CASES}}


@pytest.mark.slow
@pytest.mark.parametrize("name, exporter, opset", CASES, ids=lambda v: str(v))
def test_every_layer_norm_fused_and_outputs_equal(built, tmp_path, name, exporter, opset):
    model = built[name]
    src = models.export(model, tmp_path / "m.onnx", exporter=exporter, opset=opset)
    out, rep = graph_rewrites.optimize(str(src), report=True)
    layers = model.config.num_hidden_layers
    after = rep.ops_after
    assert after["ai.ort_triton.LayerNorm"] == 1, after
    assert after["ai.ort_triton.AddLayerNorm"] == 2 * layers, after
    assert after["LayerNormalization"] == 0 and after["ReduceMean"] == 0, after
    assert after["ai.ort_triton.BiasGelu"] == layers and after["Gelu"] == after["Erf"] == 0, after
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    new = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch, seq in ((2, 13), (1, 7)):  # shapes other than the export's: the model stays dynamic
        feeds = random_inputs(ref, batch, seq, model.config.vocab_size, seed=batch)
        (a,), (b,) = ref.run(None, feeds), new.run(None, feeds)
        assert np.abs(a - b).max() / np.abs(a).max() < 1e-5
