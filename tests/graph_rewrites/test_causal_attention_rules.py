"""The causal_attention rule (graph_rewrites/causal_attention.py) on synthetic decoder graphs and on real exports.

Synthetic: one GQA attention over a KV cache (present = Concat(past, new)), with a mask built the way
decoders build it (aranges, LessOrEqual, And with the 2-D attention_mask, Where) — fused and equal on ORT
CPU — and variants that must be refused with the reason: a padding-only mask, a causal mask without the
cache offset, a mask reading two inputs, a -inf mask without the NaN guard, a fill too small to swamp the
scores, a head dim the kernel lacks, an Unsqueeze that is not repeat_kv's.

Real exports (ort_triton.decoders; transformers 5, both torch exporters, sdpa and eager attention, with and
without the cache): every layer fused, no Softmax left, the rewritten model (through the function
bodies) equal to the original on ORT CPU — fp32, rel err < 1e-5 on the logits and every present output —
for a left-padded prefill (P = 0; a row whose first queries see no key), a decode step (S = 1, P > 0) and
a chunk (S > 1, P > 0); and masked_rows as the original means such rows (0: torchscript's sdpa -inf mask
with its IsNaN guard; 1: the finfo.min masks of eager and dynamo's sdpa).
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import graph_rewrites
from ort_triton import decoders

OPSET = 18
F32 = np.float32


def _rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-6))


def _session(model):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _causal_nodes(n):
    return [node for node in n.graph.node if node.op_type == "CausalAttention"]


# ---- synthetic graphs --------------------------------------------------------------------------------
FINFO_MIN = float(np.finfo(F32).min)


def _graph(*, head_dim=32, nq=4, nkv=2, mask="causal", fill=FINFO_MIN, guard=False, unsqueeze_axis=2,
           onnx_attention=False, is_causal=0):
    """q [batch, Nq, seq, D], past_k/v [batch, Nkv, past, D], new k/v [batch, Nkv, seq, D], attention_mask
    [batch, total] -> y [batch, seq, Nq*D], present_k/v. mask: "causal" (with the cache offset), "padding"
    (no causal part), "no_offset" (j <= i, upper-left), "two_inputs" (also reads q's values). onnx_attention:
    the core as ONNX Attention (opset 23) with the boolean mask."""
    g = nq // nkv
    n = helper.make_node
    i64 = lambda name, vals: helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals)
    scalar = lambda name, v, t=TensorProto.INT64: helper.make_tensor(name, t, [], [v])
    inits = [i64("ax0", [0]), i64("ax1", [1]), i64("ax2", [2]), i64("ax3", [3]), i64("ax12", [1, 2]),
             i64("minus1", [-1]), scalar("zero", 0), scalar("one", 1), i64("unsq", [unsqueeze_axis]),
             i64("g", [g]), i64("nkv", [nkv]), i64("nq", [nq]), i64("d", [head_dim]), i64("merge", [0, 0, -1]),
             scalar("zf", 0.0, TensorProto.FLOAT), scalar("fill", fill, TensorProto.FLOAT),
             scalar("scale", head_dim**-0.5, TensorProto.FLOAT)]
    nodes = [
        n("Concat", ["past_k", "k_new"], ["present_k"], axis=2),
        n("Concat", ["past_v", "v_new"], ["present_v"], axis=2),
        # sizes
        n("Shape", ["q"], ["q_shape"]), n("Shape", ["past_k"], ["p_shape"]),
        n("Gather", ["q_shape", "ax2"], ["s1"], axis=0), n("Gather", ["p_shape", "ax2"], ["p1"], axis=0),
        n("Gather", ["q_shape", "ax0"], ["b1"], axis=0),
        n("Add", ["s1", "p1"], ["t1"]),
        n("Squeeze", ["s1", "ax0"], ["s0"]), n("Squeeze", ["t1", "ax0"], ["t0"]), n("Squeeze", ["p1", "ax0"], ["p0"]),
        n("Range", ["zero", "s0", "one"], ["qi"]), n("Range", ["zero", "t0", "one"], ["kj"]),
    ]
    offset = "p0" if mask != "no_offset" else "zero"
    nodes += [n("Add", ["qi", offset], ["qpos"]), n("Unsqueeze", ["qpos", "minus1"], ["qcol"]),
              n("LessOrEqual", ["kj", "qcol"], ["visible"]),
              # the mask's keys: attention_mask[:, arange(T)] (transformers' padding_mask[:, kv_idx])
              n("Gather", ["attention_mask", "kj"], ["mask_t"], axis=1),
              n("Cast", ["mask_t"], ["keep2"], to=TensorProto.BOOL),
              n("Unsqueeze", ["keep2", "ax12"], ["keep4"])]
    if mask == "padding":
        nodes.append(n("Identity", ["keep4"], ["allowed"]))
    elif mask == "causal_only":  # reads no input's values: the op gets a zero key_bias
        nodes.append(n("Identity", ["visible"], ["allowed"]))
    elif mask == "two_inputs":  # also drops keys where q's first value is negative: not a function of the mask
        nodes += [n("And", ["visible", "keep4"], ["allowed0"]),
                  n("Slice", ["q", "ax0", "ax1", "ax3"], ["q_first"]),  # q[..., :1]
                  n("ReduceMax", ["q_first"], ["q_max"], keepdims=0),
                  n("Greater", ["q_max", "zf"], ["q_pos"]), n("And", ["allowed0", "q_pos"], ["allowed"])]
    else:
        nodes.append(n("And", ["visible", "keep4"], ["allowed"]))
    nodes += [
        n("Where", ["allowed", "zf", "fill"], ["mask"]),
        # repeat_kv
        n("Unsqueeze", ["present_k", "unsq"], ["k5"]), n("Unsqueeze", ["present_v", "unsq"], ["v5"]),
        n("Concat", ["b1", "nkv", "g", "t1", "d"], ["exp_shape"], axis=0),
        n("Concat", ["b1", "nq", "t1", "d"], ["rep_shape"], axis=0),
        n("Expand", ["k5", "exp_shape"], ["k5e"]), n("Expand", ["v5", "exp_shape"], ["v5e"]),
        n("Reshape", ["k5e", "rep_shape"], ["kr"]), n("Reshape", ["v5e", "rep_shape"], ["vr"]),
    ]
    if onnx_attention:
        nodes.append(n("Attention", ["q", "kr", "vr", "allowed"], ["ctx"], scale=head_dim**-0.5, is_causal=is_causal))
    else:
        nodes += [n("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
                  n("MatMul", ["q", "kt"], ["qk"]), n("Mul", ["qk", "scale"], ["scores"]),
                  n("Add", ["scores", "mask"], ["logits"]), n("Softmax", ["logits"], ["probs"], axis=-1)]
        probs = "probs"
        if guard:
            nodes += [n("IsNaN", ["probs"], ["nan"]), n("Where", ["nan", "zf", "probs"], ["probs_ok"])]
            probs = "probs_ok"
        nodes.append(n("MatMul", [probs, "vr"], ["ctx"]))
    nodes += [n("Transpose", ["ctx"], ["merged"], perm=[0, 2, 1, 3]), n("Reshape", ["merged", "merge"], ["y"])]
    kv = lambda name, t: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", nkv, t, head_dim])
    graph = helper.make_graph(
        nodes, "causal",
        [helper.make_tensor_value_info("q", TensorProto.FLOAT, ["batch", nq, "seq", head_dim]),
         kv("past_k", "past"), kv("past_v", "past"), kv("k_new", "seq"), kv("v_new", "seq"),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", nq * head_dim]),
         kv("present_k", "total"), kv("present_v", "total")],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23 if onnx_attention else OPSET)],
                              ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds(b, s, p, nq=4, nkv=2, d=32, seed=0, left_pad=None):
    rng = np.random.default_rng(seed)
    mask = np.ones((b, p + s), np.int64)
    mask[-1, : p + 2 if left_pad is None else left_pad] = 0  # its first two queries see no key
    r = lambda *shape: rng.standard_normal(shape).astype(F32)
    return {"q": r(b, nq, s, d), "past_k": r(b, nkv, p, d), "past_v": r(b, nkv, p, d), "k_new": r(b, nkv, s, d),
            "v_new": r(b, nkv, s, d), "attention_mask": mask}


def _fuse(model, rule="causal_attention"):
    out, rep = graph_rewrites.optimize(model, only=[rule], report=True)
    return out, rep.rules[rule]


@pytest.mark.parametrize("guard, fill, masked_rows, onnx_attention, mask", [
    (False, FINFO_MIN, 1, False, "causal"), (True, -np.inf, 0, False, "causal"), (True, FINFO_MIN, 1, False, "causal"),
    (False, 0.0, 0, True, "causal"), (False, FINFO_MIN, 1, False, "causal_only")])
def test_synthetic_gqa_over_a_cache_is_fused_and_equal(guard, fill, masked_rows, onnx_attention, mask):
    """The decomposed core with each mask meaning, ONNX Attention with the boolean mask (ORT gives 0 on a
    query that sees no key: masked_rows 0), and a causal mask without padding."""
    model = _graph(guard=guard, fill=fill, onnx_attention=onnx_attention, mask=mask)
    out, stats = _fuse(model, "causal_attention_onnx" if onnx_attention else "causal_attention")
    assert stats.matched == 1, stats
    (node,) = _causal_nodes(out)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["masked_rows"] == masked_rows and abs(attrs["scale"] - 32**-0.5) < 1e-7
    assert not [n for n in out.graph.node if n.op_type in ("Softmax", "Attention", "Expand", "LessOrEqual")]
    a, b = _session(model), _session(out)
    for size in ((3, 5, 0), (2, 1, 6), (2, 4, 3), (1, 7, 9)):
        feeds = _feeds(*size, seed=sum(size))
        want, got = a.run(None, feeds), b.run(None, feeds)
        assert all(np.isfinite(x).all() for x in got)
        assert max(_rel(x, y) for x, y in zip(want, got)) < 1e-5, size


@pytest.mark.parametrize("kwargs, reason", [
    (dict(mask="padding"), "the mask has shape [3, 1, 1, 8], not [B or 1, 1, S=5, T=8]"),
    (dict(mask="no_offset"), "the mask is not causal-with-offset padding: at batch 0, query 0 it drops key 1 "
                             "(visible, unpadded)"),
    (dict(mask="two_inputs"), "the mask depends on the values of attention_mask, q, not of one 2-D input"),
    (dict(fill=-np.inf), "a query that sees no key gives NaN here (a -inf mask and no IsNaN guard)"),
    (dict(fill=-1e9, guard=True), "the mask's finite fill -1e+09 does not swamp the scores"),
    (dict(head_dim=48), "head dim 48 not in (32, 40, 64, 80, 96, 128, 256)"),
    (dict(unsqueeze_axis=1), "the Unsqueeze before the Expand is over axes [1], not [2] (repeat_kv)"),
    (dict(onnx_attention=True, is_causal=1), "is_causal=1 (upper-left causal, without the cache offset)"),
    (dict(onnx_attention=True, mask="no_offset"), "the mask is not causal-with-offset padding"),
])
def test_synthetic_refusals_name_the_reason(kwargs, reason):
    rule = "causal_attention_onnx" if kwargs.get("onnx_attention") else "causal_attention"
    out, stats = _fuse(_graph(**kwargs), rule)
    assert stats.matched == 0 and not _causal_nodes(out)
    assert [r.reason for r in stats.refused if reason in r.reason], [r.reason for r in stats.refused]


# ---- real exports -------------------------------------------------------------------------------------
# (model, exporter, attn implementation, cache, opset, masked_rows the original means: torchscript's sdpa
# -inf mask and ONNX Attention's boolean one give 0 on a query that sees no key, the finfo.min masks of
# eager and dynamo's sdpa the mean of V)
CASES = [("llama-tiny", e, i, c, None, 0 if (e, i) == ("torchscript", "sdpa") else 1)
         for e in decoders.EXPORTERS for i in ("sdpa", "eager") for c in (True, False)]
CASES += [("gpt2-tiny", e, i, True, None, 0 if (e, i) == ("torchscript", "sdpa") else 1)
          for e in decoders.EXPORTERS for i in ("sdpa", "eager")]
CASES += [("gpt2-tiny", "torchscript", "sdpa", False, None, 0), ("gpt2-tiny", "dynamo", "eager", False, None, 1),
          ("mistral-tiny", "dynamo", "sdpa", True, None, 1), ("qwen2-tiny", "torchscript", "eager", True, None, 1),
          ("llama-tiny", "dynamo", "sdpa", True, 23, 0), ("gpt2-tiny", "dynamo", "sdpa", True, 23, 0),
          # Gemma's head dim 256
          ("gemma-tiny", "dynamo", "sdpa", True, None, 1), ("gemma-tiny", "torchscript", "eager", True, None, 1)]


@pytest.fixture(scope="module")
def exported(decoder_exports):
    return decoder_exports


@pytest.mark.slow
@pytest.mark.parametrize("name, exporter, impl, cache, opset, masked_rows", CASES, ids=lambda v: str(v))
def test_every_layer_fused_and_outputs_equal(exported, name, exporter, impl, cache, opset, masked_rows):
    model, path = exported(name, exporter, impl, cache, opset)
    out, rep = graph_rewrites.optimize(str(path), report=True)
    layers = decoders.cache_spec(model)[0]
    stats = rep.rules["causal_attention_onnx" if opset == 23 and impl == "sdpa" else "causal_attention"]
    assert stats.matched == layers and not stats.refused, stats
    after = rep.ops_after
    assert after["ai.ort_triton.CausalAttention"] == layers and after["Softmax"] == after["Attention"] == 0, after
    # Q, K and V as one MatMul and a Split in every layer; GPT-2's Conv1D is one projection already. With a
    # cache, qkv_rotary_cache takes each packed Split (with the rotaries and the cache Concats) into its op, and
    # qkv_cache GPT-2's Split (with its bias Add, head Transposes and cache Concats) into its own.
    packed, cached = rep.rules["pack_projections"], rep.rules["qkv_rotary_cache"]
    gpt2 = name.startswith("gpt2")
    rotary_layers = 0 if gpt2 else layers
    assert cached.matched == after["ai.ort_triton.QKVRotaryCache"] == (rotary_layers if cache else 0), cached
    plain = rep.rules["qkv_cache"].matched
    assert plain == after["ai.ort_triton.QKVCache"] == (layers if cache and gpt2 else 0), rep.rules["qkv_cache"]
    made = after["Split"] - rep.ops_before["Split"] + cached.matched + plain
    assert packed.matched == made == rotary_layers, packed
    for node in _causal_nodes(out):
        assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["masked_rows"] == masked_rows
    a, b = _session(path), _session(out)
    # a left-padded prefill whose padded row's first queries see no key; a decode step; a chunk over a past
    sizes = [(3, 6, 0, 3), (3, 1, 5, 2), (2, 4, 3, 5)] if cache else [(3, 6, 0, 3), (2, 9, 0, 8)]
    for batch, seq, past, pad in sizes:
        feeds = decoders.sample_inputs(model, batch, seq, past, seed=seq + past, left_pad=pad, cache=cache)
        want, got = a.run(None, feeds), b.run(None, feeds)
        assert all(np.isfinite(x).all() for x in got)
        errs = [_rel(x, y) for x, y in zip(want, got)]
        assert max(errs) < 1e-5, (batch, seq, past, pad, errs)


@pytest.mark.slow
def test_float16_export_fuses_with_its_finfo_min_fill(tmp_path):
    """An fp16 model exported as it is (dynamo fills dropped keys with -65504, fp16's finfo.min): every layer
    fused, masked_rows 1, and the logits of every real position equal the original's to fp16 rounding (a
    left-padded row included; its padding positions see no key and have no meaningful value)."""
    import torch

    model = decoders.build("llama-tiny", dtype=torch.float16)
    src = decoders.export(model, tmp_path / "l16.onnx", exporter="dynamo", cache=True)
    out, rep = graph_rewrites.optimize(str(src), report=True)
    fused = [n for n in out.graph.node if n.op_type == "CausalAttention"]
    assert len(fused) == model.config.num_hidden_layers, rep.rules["causal_attention"]
    assert all(a.i == 1 for n in fused for a in n.attribute if a.name == "masked_rows")
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    new = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    for past, left_pad in ((0, 3), (4, 0)):
        feeds = decoders.sample_inputs(model, 2, 6, past, seed=past, left_pad=left_pad)
        a, b = (s.run(None, feeds)[0].astype(np.float32) for s in (ref, new))
        real = feeds["attention_mask"][:, -6:].astype(bool)
        assert np.abs(a - b)[real].max() <= 1e-2 * np.abs(a[real]).max()
