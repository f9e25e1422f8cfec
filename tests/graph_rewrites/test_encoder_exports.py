"""Real exports: encoders from transformers configs (random weights), both torch exporters.

Every LayerNorm must be fused (the text encoders' embeddings norm with its three lookups, or DistilBERT's
two, as EmbedLayerNorm; as AddLayerNorm where a residual Add of equal shapes feeds it; else as LayerNorm:
ViT's, whose embeddings are a patch Conv and no lookup), every GELU with its bias as
BiasGelu, every attention whose head dim the kernel takes as MultiHeadAttention, and the rewritten
model must give the original's outputs on ORT CPU through the function bodies (fp32, rel err < 1e-5),
at shapes other than the export's.
"""

import numpy as np
import onnxruntime as ort
import pytest

import graph_rewrites
from ort_triton import models
from ort_triton.compare import random_inputs
from ort_triton.ops.attention import HEAD_DIMS

CASES = [(m, e, None) for m in ("bert-tiny", "bert-40", "bert-odd", "roberta-tiny", "distilbert-tiny", "vit-tiny")
         for e in models.EXPORTERS] + [("bert-tiny", "torchscript", 15)]  # opset 15: LayerNorm decomposed


@pytest.fixture(scope="module")
def built():
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("name, exporter, opset", CASES, ids=lambda v: str(v))
def test_every_layer_norm_and_gelu_fused_and_outputs_equal(built, tmp_path, name, exporter, opset):
    model = built.setdefault(name, models.build(name))
    src = models.export(model, tmp_path / "m.onnx", exporter=exporter, opset=opset)
    out, rep = graph_rewrites.optimize(str(src), report=True)
    before, after = rep.ops_before, rep.ops_after
    layer_norms = before["LayerNormalization"] or before["ReduceMean"] // 2
    assert layer_norms > 0
    embed = 0 if models.is_vision(model) else 1  # BERT, RoBERTa, DistilBERT: one embeddings norm
    assert after["ai.ort_triton.EmbedLayerNorm"] == embed, (after, rep.rules["embed_layer_norm"])
    assert after["ai.ort_triton.LayerNorm"] + after["ai.ort_triton.AddLayerNorm"] + embed == layer_norms, after
    if embed:  # the lookups went into the op (torchscript's shape arithmetic keeps Gathers of its own)
        assert after["Gather"] < before["Gather"] - (1 if model.config.model_type == "distilbert" else 2), after
    assert after["LayerNormalization"] == after["ReduceMean"] == after["Gelu"] == after["Erf"] == 0, after
    layers = getattr(model.config, "num_hidden_layers", None) or model.config.n_layers
    assert after["ai.ort_triton.BiasGelu"] == layers, after
    heads = getattr(model.config, "num_attention_heads", None) or model.config.n_heads
    hidden = getattr(model.config, "hidden_size", None) or model.config.dim
    fused_attention = layers if hidden // heads in HEAD_DIMS else 0  # bert-odd: head dim 24, refused
    # Q/K/V packed in every layer (ViT's too: without a mask its zero key bias reads x's shape, not K's)
    assert after["ai.ort_triton.PackedMultiHeadAttention"] == fused_attention, after
    assert after["ai.ort_triton.MultiHeadAttention"] == 0, after
    if fused_attention:
        assert after["Softmax"] == 0, after
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    new = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    vocab = getattr(model.config, "vocab_size", 1)
    for batch, seq in ((3, 13), (1, 7)):
        feeds = random_inputs(ref, batch, seq, vocab, seed=batch)
        (a,), (b,) = ref.run(None, feeds), new.run(None, feeds)
        assert np.abs(a - b).max() / np.abs(a).max() < 1e-5
