"""`optimize(kv_cache="seq-major")` (graph_rewrites/kv_layout.py): real decoder exports, fused and their cache relaid
sequence first, give the original's logits and presents (relaid) on ORT CPU through the function bodies, at a
prefill over an empty cache, a chunk over a past and a decode step; the interface changes as documented; what stays
heads first says why."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import graph_rewrites
from ort_triton.compare import compare_models
from ort_triton.ops.kv_layout import TO_SEQ, seq_major_names


def _export(tmp_path_factory, name, exporter):
    from ort_triton import decoders

    path = tmp_path_factory.getbasetemp() / "kv_layout_exports" / f"{name}-{exporter}.onnx"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        decoders.export(decoders.build(name), path, exporter=exporter)
    return path


def _session(model):
    return ort.InferenceSession(model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model),
                                providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny", "gpt2-tiny"])
def test_seq_major_decoder_equals_the_original(tmp_path_factory, name, exporter):
    from ort_triton import decoders

    path = _export(tmp_path_factory, name, exporter)
    model = decoders.build(name)
    layers = decoders.cache_spec(model)[0]
    enable = ["qkv_cache"] if name.startswith("gpt2") else None
    out, rep = graph_rewrites.optimize(path, report=True, kv_cache="seq-major", enable=enable)
    assert f"--kv-cache seq-major: {layers} layer(s) relaid [T, B, Nkv, D]; bind each present over its past " \
           "(examples/generate.py)" in rep.notes, rep.notes
    assert not [n for n in rep.notes if "left heads first" in n], rep.notes
    ops = graph_rewrites.op_counts(out)
    assert ops["ai.ort_triton.CausalAttention"] == layers
    seq_major = [n for n in out.graph.node if n.domain == "ai.ort_triton" and
                 any(a.name == "seq_major" and a.i == 1 for a in n.attribute)]
    assert len(seq_major) == 2 * layers  # each layer's cache op and its attention
    past_names = decoders.input_names(model)[2:]
    present_names = decoders.output_names(model)[1:]
    meta = {p.key: p.value for p in out.metadata_props}
    assert seq_major_names(meta) == set(past_names + present_names), meta  # how callers know the layout
    original, relaid = _session(path), _session(out)
    for shape in relaid.get_inputs():
        if shape.name in past_names:
            assert shape.shape[0] != "batch" and len(shape.shape) == 4, shape  # [T, B, Nkv, D]
    for batch, seq, past, pad in ((2, 5, 0, 1), (2, 3, 4, 1), (1, 1, 7, 0)):
        feeds = decoders.sample_inputs(model, batch=batch, seq=seq, past=past, left_pad=pad)
        want = original.run(None, feeds)
        relaid_feeds = {k: (v.transpose(TO_SEQ).copy() if k in past_names else v) for k, v in feeds.items()}
        got = relaid.run(None, relaid_feeds)
        names = [o.name for o in relaid.get_outputs()]
        for n, g in zip(names, got):
            w = want[[o.name for o in original.get_outputs()].index(n)]
            if n in present_names:
                w = w.transpose(TO_SEQ)
            assert g.shape == w.shape, n
            assert np.abs(g - w).max() / max(np.abs(w).max(), 1e-30) < 1e-5, n


def _graph(reader_extra=None, present_out=True):
    """A hand-made layer: QKVCache over graph inputs past_k, past_v into CausalAttention, presents graph outputs."""
    from ort_triton.ops.causal_attention import CAUSAL_ATTENTION
    from ort_triton.ops.qkv_cache import QKV_CACHE

    f = TensorProto.FLOAT
    nodes = [helper.make_node("QKVCache", ["qkv", "bias", "past_k", "past_v"], ["q", "pk", "pv"],
                              domain="ai.ort_triton", name="cache"),
             helper.make_node("CausalAttention", ["q", "pk", "pv", "kb"], ["y"], domain="ai.ort_triton",
                              name="attn", scale=0.5),
             helper.make_node("Shape", ["past_k"], ["past_len"], start=2, end=3)]
    outputs = [helper.make_tensor_value_info("y", f, None), helper.make_tensor_value_info("past_len",
                                                                                          TensorProto.INT64, None)]
    if present_out:
        outputs += [helper.make_tensor_value_info(n, f, None) for n in ("pk", "pv")]
    if reader_extra:
        nodes.append(helper.make_node("Identity", [reader_extra], ["extra"]))
        outputs.append(helper.make_tensor_value_info("extra", f, None))
    inputs = [helper.make_tensor_value_info("qkv", f, ["B", "S", 32]), helper.make_tensor_value_info("bias", f, [32]),
              helper.make_tensor_value_info("past_k", f, ["B", 2, "P", 4]),
              helper.make_tensor_value_info("past_v", f, ["B", 2, "P", 4]),
              helper.make_tensor_value_info("kb", f, ["B", "T"])]
    g = helper.make_graph(nodes, "layer", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ort_triton", 1)],
                             functions=[QKV_CACHE.function_proto(17), CAUSAL_ATTENTION.function_proto(17)],
                             ir_version=9)


def test_the_past_length_shape_still_reads_the_past_length():
    """A Shape(past, start=2, end=3) (the exports' past length) gives P after the relayout, as before."""
    m = _graph()
    out, rep = graph_rewrites.optimize(m, report=True, kv_cache="seq-major", only=["qkv_cache"])
    rng = np.random.default_rng(0)
    b, s, p = 2, 3, 5
    feeds = {"qkv": rng.normal(size=(b, s, 32)).astype(np.float32), "bias": rng.normal(size=32).astype(np.float32),
             "past_k": rng.normal(size=(b, 2, p, 4)).astype(np.float32),
             "past_v": rng.normal(size=(b, 2, p, 4)).astype(np.float32), "kb": np.zeros((b, p + s), np.float32)}
    want = dict(zip(["y", "past_len", "pk", "pv"], _session(m).run(None, feeds)))
    relaid = {k: (v.transpose(TO_SEQ).copy() if k.startswith("past") else v) for k, v in feeds.items()}
    got = dict(zip([o.name for o in out.graph.output], _session(out).run(None, relaid)))
    assert got["past_len"].tolist() == [p]
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-6)
    np.testing.assert_allclose(got["pk"], want["pk"].transpose(TO_SEQ), rtol=1e-6)
    assert not any(n.op_type == "Shape" and any(a.name == "start" for a in n.attribute) for n in out.graph.node)


@pytest.mark.parametrize("extra, present_out, reason", [
    ("past_k", True, "its past_key 'past_k' is also read by Identity"),
    ("pk", True, "its present_key 'pk' is read by Identity"),
    (None, False, "its present_key 'pk' is not a graph output"),
])
def test_refusals_say_why(extra, present_out, reason):
    out, rep = graph_rewrites.optimize(_graph(extra, present_out), report=True, kv_cache="seq-major",
                                       only=["qkv_cache"])
    assert any(reason in n for n in rep.notes), rep.notes
    assert not any(a.name == "seq_major" and a.i for n in out.graph.node for a in n.attribute)
    assert not seq_major_names({p.key: p.value for p in out.metadata_props})


@pytest.mark.parametrize("batch, seq, past", [(2, 16, None), (2, 1, 7), (3, 5, 0)])
def test_compare_feeds_and_reads_each_layout(tmp_path_factory, batch, seq, past):
    """compare_models (`ort-triton compare`) on a decoder with a cache: the cache inputs sized by their dims' names
    (a past of `past` positions, the mask past + seq), and a sequence-first model fed and read back transposed, as
    reference or as candidate; a wrong relayout would fail."""
    path = _export(tmp_path_factory, "llama-tiny", "dynamo")
    relaid = graph_rewrites.optimize(path, kv_cache="seq-major")
    diffs, feeds = compare_models(path, relaid, batch=batch, seq=seq, past=past, rtol=1e-5)
    assert all(d.ok for d in diffs), diffs
    p = seq if past is None else past
    assert feeds["past_key_0"].shape == (batch, 2, p, 32) and feeds["attention_mask"].shape == (batch, p + seq)
    assert diffs[1].name == "present_key_0" and diffs[1].shape == (batch, 2, p + seq, 32)
    diffs, feeds = compare_models(relaid, path, batch=batch, seq=seq, past=past, rtol=1e-5)  # the other way round
    assert all(d.ok for d in diffs) and feeds["past_key_0"].shape == (p, batch, 2, 32), diffs
    wrong = onnx.ModelProto()
    wrong.CopyFrom(relaid)
    del wrong.metadata_props[:]  # without the metadata its cache is fed heads first, which ORT refuses
    if past != 0:
        with pytest.raises(Exception, match="invalid dimensions for input: past_"):  # noqa: B017
            compare_models(path, wrong, batch=batch, seq=seq, past=past)


def test_a_heads_first_decoder_is_told_of_the_copy(tmp_path_factory):
    """Fused heads first (the default), the report says each decode step copies the cache and what removes it."""
    path = _export(tmp_path_factory, "llama-tiny", "dynamo")
    out, rep = graph_rewrites.optimize(path, report=True)
    assert "2 layer(s) write their KV cache heads first, as exported: each decode step copies the whole past into " \
           "present; --kv-cache seq-major lets a caller bind each present over its past and copy nothing" in rep.notes
    assert not seq_major_names({p.key: p.value for p in out.metadata_props})
