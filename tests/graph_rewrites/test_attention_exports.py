"""Real exports: every self-attention of BERT models fused into one MultiHeadAttention, for transformers'
eager and sdpa attention, through torch's dynamo exporter (opset 18+: decomposed; opset 23: ONNX
Attention) and the torchscript one (opset 17).

The rewritten model must give the original's outputs on ORT CPU through the function bodies (fp32, rel
err < 1e-5) at shapes other than the export's, with a fully padded batch row: eager's finite mask makes
that row the mean of V, sdpa's -inf mask (torchscript, ONNX Attention) makes it 0, and the rewrite must
keep whichever the original computes. A head dim the kernel does not take (bert-odd's 24) is refused,
with the reason, in every layer.
"""

import numpy as np
import onnxruntime as ort
import pytest

import graph_rewrites
from ort_triton import models
from ort_triton.compare import random_inputs
from ort_triton.ops.attention import HEAD_DIMS

FORMS = (("dynamo", None), ("torchscript", 17), ("dynamo", 23))
# head dims 32 and 24 in every form; 40 (a tile with masked lanes in the kernel) in two unlike ones
CASES = [(name, impl, *form) for name in ("bert-tiny", "bert-odd") for impl in ("eager", "sdpa") for form in FORMS]
CASES += [("bert-40", "eager", "torchscript", 17), ("bert-40", "sdpa", "dynamo", 23)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(config, path) per model, implementation and export form, each built and exported once."""
    built, paths = {}, {}

    def get(name, impl, exporter, opset):
        if (name, impl) not in built:
            built[name, impl] = models.build(name, attn_implementation=impl)
        key = (name, impl, exporter, opset)
        if key not in paths:
            out = tmp_path_factory.mktemp("-".join(map(str, key))) / "m.onnx"
            paths[key] = models.export(built[name, impl], out, exporter=exporter, opset=opset)
        return built[name, impl].config, paths[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name, impl, exporter, opset", CASES, ids=lambda v: str(v))
def test_every_attention_fused_and_outputs_equal(exported, name, impl, exporter, opset):
    config, path = exported(name, impl, exporter, opset)
    out, rep = graph_rewrites.optimize(str(path), report=True)
    rule = rep.rules["attention_onnx" if impl == "sdpa" and opset == 23 else "attention"]
    layers, head_dim = config.num_hidden_layers, config.hidden_size // config.num_attention_heads
    after = rep.ops_after
    if head_dim in HEAD_DIMS:
        assert rule.matched == layers and not rule.refused, rule
        # and the projections' bias Adds went into it (BERT's Q, K, V projections all have biases), then
        # the three projections into one packed MatMul
        assert rep.rules["attention_bias"].matched == layers, rep.rules["attention_bias"]
        assert rep.rules["pack_qkv"].matched == layers and not rep.rules["pack_qkv"].refused, rep.rules["pack_qkv"]
        assert after["ai.ort_triton.PackedMultiHeadAttention"] == layers, after
        # per layer the packed projection, the output projection and the two of the MLP: no MatMul left over
        assert after["ai.ort_triton.MultiHeadAttention"] == 0 and after["MatMul"] == 4 * layers, after
        # the [B, 1, S, S] mask subgraph went with the last layer that read it
        assert after["Softmax"] == after["Attention"] == after["And"] == after["GatherND"] == 0, after
    else:
        assert rule.matched == 0 and len(rule.refused) == layers, rule
        assert all(f"head dim {head_dim} not in {HEAD_DIMS}" in r.reason for r in rule.refused), rule.refused
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    new = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch, seq in ((3, 13), (4, 6)):
        feeds = random_inputs(ref, batch, seq, config.vocab_size, seed=batch)
        feeds["attention_mask"][1] = 0  # a fully padded row (and the last one padded from seq // 2)
        (a,), (b,) = ref.run(None, feeds), new.run(None, feeds)
        assert np.isfinite(a).all()
        assert np.abs(a - b).max() / np.abs(a).max() < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("impl, exporter, opset", [("eager", "dynamo", None), ("sdpa", "torchscript", 17)])
def test_without_packing_the_projections_stay_three(exported, impl, exporter, opset):
    """--disable pack_qkv keeps MultiHeadAttention over the three projections (the form any attention whose
    projections cannot be packed takes), with the same outputs."""
    config, path = exported("bert-tiny", impl, exporter, opset)
    out, rep = graph_rewrites.optimize(str(path), report=True, disable=["pack_qkv"])
    layers = config.num_hidden_layers
    assert rep.ops_after["ai.ort_triton.MultiHeadAttention"] == layers, rep.ops_after
    assert rep.ops_after["ai.ort_triton.PackedMultiHeadAttention"] == 0
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    new = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = random_inputs(ref, 3, 13, config.vocab_size, seed=3)
    feeds["attention_mask"][1] = 0
    (a,), (b,) = ref.run(None, feeds), new.run(None, feeds)
    assert np.abs(a - b).max() / np.abs(a).max() < 1e-5
