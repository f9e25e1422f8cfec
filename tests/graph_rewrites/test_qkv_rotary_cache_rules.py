"""qkv_rotary_cache (graph_rewrites/qkv_rotary_cache.py): a layer's Split of its packed Q/K/V,
head Reshapes, TransposeRotary of q and k, V's Transpose and the cache Concats -> one QKVRotaryCache; with
per-head RMSNorms of q and k before the rotaries (Qwen3), qkv_norm_rotary_cache -> one
QKVNormRotaryCache.

Real exports (Llama / Mistral / Qwen2 / Phi by both exporters and at opset 23, with the cache; Qwen3 by both):
every layer fused, nothing refused, the outputs of the original on ORT CPU for a chunk over a past and for a
prefill with an empty past. Synthetic layers (written with rotate_half, which the default rules turn into
TransposeRotary first): one that fuses, with head norms and without, and the forms it must refuse, with the
reason. A no-cache export has nothing to fuse."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites
from graph_rewrites import registry
from tests.graph_rewrites.test_rotary_rules import EXPORTS, _export, _reasons, _rotate_half

RULE = "qkv_rotary_cache"
B, S, P, NQ, NKV, D = 2, 5, 3, 4, 2, 16
RNG = np.random.default_rng(0)


def _session(model):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _assert_same(original, fused, feeds_list):
    a, b = _session(original), _session(fused)
    for feeds in feeds_list:
        for x, y in zip(a.run(None, feeds), b.run(None, feeds)):
            assert x.shape == y.shape and np.abs(x - y).max() / max(np.abs(x).max(), 1e-6) < 1e-5


# ---- synthetic layers -------------------------------------------------------------------------------------------

def _layer(*, order="qkv", concat_reversed=False, k_cos="cos", split_reader=None, norms=None):
    """One layer from QKV [B, S, (NQ + 2 NKV) D] (a graph input) to Q, present_key, present_value. order: the
    parts in the Split's order (its sizes to match); concat_reversed: present_key = Concat(new, past); k_cos:
    the cos k is rotated with; split_reader "output": k's part of the Split also a graph output, "node": v's
    part also read by a Neg; norms {"q": eps, "k": eps}: those heads RMSNorm-ed over D before the rotary (ONNX's
    RMSNormalization, opset 23, which rms_norm makes our RMSNorm), with gammas q_gamma, k_gamma."""
    n = helper.make_node
    norms = norms or {}
    heads = {"q": NQ, "k": NKV, "v": NKV}
    inits = [numpy_helper.from_array(np.array([heads[r] * D for r in order], np.int64), "sizes")]
    inits += [numpy_helper.from_array(np.array([0, 0, heads[r], D], np.int64), f"shape_{r}") for r in "qkv"]
    nodes = [n("Split", ["qkv", "sizes"], [f"{r}_part" for r in order], axis=-1)]
    for r in "qkv":
        nodes += [n("Reshape", [f"{r}_part", f"shape_{r}"], [f"{r}4" if r not in norms else f"{r}4raw"])]
        if r in norms:
            nodes += [n("RMSNormalization", [f"{r}4raw", f"{r}_gamma"], [f"{r}4"], axis=-1, epsilon=norms[r])]
            inits += [numpy_helper.from_array(RNG.normal(1, 0.3, D).astype(np.float32), f"{r}_gamma")]
        nodes += [n("Transpose", [f"{r}4"], [f"{r}t"], perm=[0, 2, 1, 3])]
    for r, out, cos in (("q", "Q", "cos"), ("k", "k_rot", k_cos)):
        rot_nodes, rot_inits = _rotate_half(f"{r}t", out, cos, "sin", h=D // 2, prefix=f"r{r}")
        nodes, inits = nodes + rot_nodes, inits + rot_inits
    nodes += [n("Concat", ["k_rot", "past_key"] if concat_reversed else ["past_key", "k_rot"], ["present_key"], axis=2),
              n("Concat", ["past_value", "vt"], ["present_value"], axis=2)]
    nodes += [n("Neg", ["v_part"], ["v_neg"])] if split_reader == "node" else []
    f = lambda name, dims: helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)
    inputs = [f("qkv", ["B", "S", (NQ + 2 * NKV) * D]), f("cos", [1, 1, "S", D]), f("sin", [1, 1, "S", D]),
              f("past_key", ["B", NKV, "P", D]), f("past_value", ["B", NKV, "P", D])]
    inputs += [f("cos2", [1, 1, "S", D])] if k_cos == "cos2" else []
    outputs = [f(name, None) for name in ("Q", "present_key", "present_value")]
    outputs += [f({"output": "k_part", "node": "v_neg"}[split_reader], None)] if split_reader else []
    graph = helper.make_graph(nodes, "layer", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23 if norms else 17)], ir_version=10)


def _feeds(m):
    sizes = {"B": B, "S": S, "P": P}
    return {v.name: RNG.normal(size=[d.dim_value or sizes[d.dim_param] for d in v.type.tensor_type.shape.dim])
            .astype(np.float32) for v in m.graph.input}


def test_a_layer_fuses_unless_disabled():
    m = _layer()
    assert registry.BY_NAME[RULE].default
    assert registry.BY_NAME[RULE].stage > registry.BY_NAME["transpose_rotary"].stage  # reads its nodes
    off, rep = graph_rewrites.optimize(m, report=True, disable=[RULE])
    assert RULE not in rep.rules and "ai.ort_triton.QKVRotaryCache" not in graph_rewrites.op_counts(off)
    assert graph_rewrites.op_counts(off)["ai.ort_triton.TransposeRotary"] == 2
    out, rep = graph_rewrites.optimize(m, report=True)
    st = rep.rules[RULE]
    assert (st.tried, st.matched, st.refused) == (1, 1, []), st
    ops = graph_rewrites.op_counts(out)
    assert ops == {"ai.ort_triton.QKVRotaryCache": 1}, ops
    (node,) = out.graph.node
    assert list(node.input) == ["qkv", "cos", "sin", "past_key", "past_value"]
    assert list(node.output) == [o.name for o in out.graph.output] == ["Q", "present_key", "present_value"]
    assert {a.name: a.i for a in node.attribute} == {"interleaved": 0, "rotary_dim": D, "seq_major": 0}
    _assert_same(m, out, [_feeds(m)])


NORM_RULE = "qkv_norm_rotary_cache"


def test_a_layer_with_head_norms_fuses_into_the_norm_op():
    """q and k RMSNorm-ed per head before their rotaries (Qwen3): qkv_norm_rotary_cache (on by default) makes one
    QKVNormRotaryCache with both gammas and the norms' epsilon, the outputs the original's; without it,
    qkv_rotary_cache refuses the layer, naming it."""
    m = _layer(norms={"q": 1e-5, "k": 1e-5})
    assert registry.BY_NAME[NORM_RULE].default
    off, rep = graph_rewrites.optimize(m, report=True, disable=[NORM_RULE])
    assert NORM_RULE not in rep.rules and rep.rules[RULE].matched == 0
    assert f"rule {NORM_RULE} takes such layers" in _reasons(rep, RULE), _reasons(rep, RULE)
    assert graph_rewrites.op_counts(off)["ai.ort_triton.TransposeRotary"] == 2
    out, rep = graph_rewrites.optimize(m, report=True)
    st = rep.rules[NORM_RULE]
    assert (st.tried, st.matched, st.refused) == (1, 1, []), st
    assert (rep.rules[RULE].tried, rep.rules[RULE].matched) == (0, 0), rep.rules[RULE]
    assert graph_rewrites.op_counts(out) == {"ai.ort_triton.QKVNormRotaryCache": 1}, graph_rewrites.op_counts(out)
    (node,) = out.graph.node
    assert list(node.input) == ["qkv", "cos", "sin", "past_key", "past_value", "q_gamma", "k_gamma"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["rotary_dim"] == D and attrs["interleaved"] == 0 and attrs["epsilon"] == pytest.approx(1e-5)
    _assert_same(m, out, [_feeds(m)])


@pytest.mark.parametrize("norms, reason", [
    ({"q": 1e-5}, "only q is RMSNorm-ed per head"),
    ({"k": 1e-5}, "only k is RMSNorm-ed per head"),
    ({"q": 1e-5, "k": 1e-6}, "the op takes one"),
], ids=["q_only", "k_only", "epsilons_differ"])
def test_head_norm_refusals(norms, reason):
    m = _layer(norms=norms)
    out, rep = graph_rewrites.optimize(m, report=True, enable=[NORM_RULE])
    st = rep.rules[NORM_RULE]
    assert (st.tried, st.matched) == (1, 0), st
    assert reason in _reasons(rep, NORM_RULE), _reasons(rep, NORM_RULE)
    assert rep.rules[RULE].matched == 0
    ops = graph_rewrites.op_counts(out)
    assert ops["ai.ort_triton.RMSNorm"] == len(norms) and ops["ai.ort_triton.TransposeRotary"] == 2, ops
    _assert_same(m, out, [_feeds(m)])


@pytest.mark.parametrize("variant, reason", [
    (dict(order="kqv"), "gives k, q, v in that order (by what reads them); the op reads QKV packed q | k | v"),
    (dict(concat_reversed=True), "has the inputs (new, past), not (past_key, new)"),
    (dict(k_cos="cos2"), "rotate with different cos (cos, cos2)"),
    (dict(split_reader="output"), "k_part (k's part of the Split) is a graph output"),
    (dict(split_reader="node"), "v_part (v's part of the Split) is also read by Neg"),
], ids=["kqv_order", "concat_new_past", "cos_differs", "split_output_is_graph_output", "split_output_read_twice"])
def test_refusals(variant, reason):
    m = _layer(**variant)
    out, rep = graph_rewrites.optimize(m, report=True)
    st = rep.rules[RULE]
    assert (st.tried, st.matched) == (1, 0), st
    assert reason in _reasons(rep, RULE), _reasons(rep, RULE)
    ops = graph_rewrites.op_counts(out)
    assert "ai.ort_triton.QKVRotaryCache" not in ops and ops["ai.ort_triton.TransposeRotary"] == 2, ops
    _assert_same(m, out, [_feeds(m)])



# ---- real exports -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, exporter, opset", EXPORTS, ids=lambda v: str(v))
def test_decoder_export(tmp_path_factory, name, exporter, opset):
    """Every layer fused, the Split, V's Transpose, both TransposeRotary and the cache Concats gone, the outputs
    (graph output names kept) the original's: a chunk of 5 over a past of 3, and a prefill (past 0)."""
    from ort_triton import decoders

    path = _export(tmp_path_factory, name, exporter, opset)
    model = decoders.build(name)
    layers = decoders.cache_spec(model)[0]
    base = graph_rewrites.op_counts(graph_rewrites.optimize(path, disable=[RULE]))
    out, rep = graph_rewrites.optimize(path, report=True)
    st = rep.rules[RULE]
    assert st.tried == st.matched == layers and not st.refused, st
    ops = graph_rewrites.op_counts(out)
    assert "ai.ort_triton.QKVRotaryCache" not in base and base["ai.ort_triton.TransposeRotary"] == 2 * layers, base
    assert ops["ai.ort_triton.QKVRotaryCache"] == layers and "ai.ort_triton.TransposeRotary" not in ops, ops
    assert ops["Split"] == base["Split"] - layers and ops["Transpose"] == base["Transpose"] - layers, (ops, base)
    # two cache Concats a layer, and the Concats that built the head Reshapes' shapes where only those read them
    assert ops["Concat"] <= base["Concat"] - 2 * layers, (ops, base)
    assert [o.name for o in out.graph.output] == decoders.output_names(model)
    _assert_same(path, out, [decoders.sample_inputs(model, batch=2, seq=5, past=p, left_pad=1) for p in (3, 0)])


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_qwen3_export_fuses_its_head_norms(tmp_path_factory, exporter):
    """Qwen3 (q_norm and k_norm per head before the rotary): every layer one QKVNormRotaryCache, the Split, both
    head RMSNorms, both TransposeRotary, V's Transpose and the cache Concats gone, the outputs the original's."""
    from ort_triton import decoders

    path = _export(tmp_path_factory, "qwen3-tiny", exporter, None)
    model = decoders.build("qwen3-tiny")
    layers = decoders.cache_spec(model)[0]
    # without the rule: the layers refused by qkv_rotary_cache, with the reason
    base, rep = graph_rewrites.optimize(path, report=True, disable=[NORM_RULE])
    assert rep.rules[RULE].tried == layers and len(rep.rules[RULE].refused) == layers, rep.rules[RULE]
    base = graph_rewrites.op_counts(base)
    out, rep = graph_rewrites.optimize(path, report=True)
    st = rep.rules[NORM_RULE]
    assert st.tried == st.matched == layers and not st.refused, st
    ops = graph_rewrites.op_counts(out)
    assert ops["ai.ort_triton.QKVNormRotaryCache"] == layers and "ai.ort_triton.QKVRotaryCache" not in ops, ops
    assert "ai.ort_triton.TransposeRotary" not in ops and base["ai.ort_triton.TransposeRotary"] == 2 * layers, ops
    assert ops["ai.ort_triton.RMSNorm"] == base["ai.ort_triton.RMSNorm"] - 2 * layers, (ops, base)
    assert ops["Concat"] <= base["Concat"] - 2 * layers, (ops, base)
    _assert_same(path, out, [decoders.sample_inputs(model, batch=2, seq=5, past=p, left_pad=1) for p in (3, 0)])
    _assert_same(path, out, [decoders.sample_inputs(model, batch=3, seq=1, past=6, left_pad=2)])  # a decode step


def test_no_cache_export_has_nothing_to_fuse(tmp_path_factory):
    """Without a cache, k and v go straight to the attention: no layer has the structure."""
    from ort_triton import decoders

    model = decoders.build("llama-tiny")
    path = tmp_path_factory.mktemp("qkv_rotary_cache") / "llama-tiny-no-cache.onnx"
    decoders.export(model, path, exporter="torchscript", cache=False)
    out, rep = graph_rewrites.optimize(path, report=True)
    st = rep.rules[RULE]
    assert (st.tried, st.matched, st.refused) == (0, 0, []), st
    assert "ai.ort_triton.QKVRotaryCache" not in graph_rewrites.op_counts(out)
    _assert_same(path, out, [decoders.sample_inputs(model, batch=2, seq=5, past=0, left_pad=1, cache=False)])
