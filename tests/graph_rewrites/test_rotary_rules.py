"""Rotary rules (graph_rewrites/rotary.py): HF's decomposed rotate_half in every operand order, with constant
or shape-computed (torchscript) Slice bounds, partial rotary, ONNX RotaryEmbedding, the forms they must
refuse (with the reason), and real exports: Llama / Mistral / Qwen2 / Phi by both exporters and at opset
23, two Rotary per layer (q and k), the outputs of the original on ORT CPU."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites

B, N, S, D = 2, 3, 5, 16
RNG = np.random.default_rng(0)
MINE = ["rotary", "rotary_onnx", "rotary_partial"]
INT_MAX = np.iinfo(np.int64).max


def _ints(name, *values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _bounds(prefix, x, h, computed):
    """Nodes and initializers for [0, h) and [h, INT_MAX) on the last axis; computed: h as torchscript
    writes it, Unsqueeze(Cast(Div(Gather(Shape(x), 3), 2)))."""
    inits = [_ints(f"{prefix}_zero", 0), _ints(f"{prefix}_max", INT_MAX), _ints(f"{prefix}_axis", 3),
             _ints(f"{prefix}_step", 1)]
    if not computed:
        return [], inits + [_ints(f"{prefix}_h", h)]
    scalar = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)
    inits += [scalar(f"{prefix}_i3", 3), scalar(f"{prefix}_two", 2), _ints(f"{prefix}_ax0", 0)]
    n = helper.make_node
    nodes = [n("Shape", [x], [f"{prefix}_shape"]), n("Gather", [f"{prefix}_shape", f"{prefix}_i3"], [f"{prefix}_d"]),
             n("Div", [f"{prefix}_d", f"{prefix}_two"], [f"{prefix}_half"]),
             n("Cast", [f"{prefix}_half"], [f"{prefix}_cast"], to=TensorProto.INT64),
             n("Unsqueeze", [f"{prefix}_cast", f"{prefix}_ax0"], [f"{prefix}_h"])]
    return nodes, inits


def _rotate_half(x, out, cos, sin, *, h=D // 2, computed=False, x_first=True, rot_first=True, add_swap=False,
                 swap_halves=False, prefix="r"):
    """out = x * cos + cat(-x[..., h:], x[..., :h]) * sin, operands in the given orders"""
    n = helper.make_node
    nodes, inits = _bounds(prefix, x, h, computed)
    z, hh, mx, ax, st = (f"{prefix}_{k}" for k in ("zero", "h", "max", "axis", "step"))
    first, second = (f"{prefix}_x2", f"{prefix}_x1") if swap_halves else (f"{prefix}_x1", f"{prefix}_x2")
    nodes += [
        n("Slice", [x, z, hh, ax, st], [first]), n("Slice", [x, hh, mx, ax, st], [second]),
        n("Neg", [f"{prefix}_x2"], [f"{prefix}_neg"]),
        n("Concat", [f"{prefix}_neg", f"{prefix}_x1"], [f"{prefix}_rot"], axis=-1),
        n("Mul", [x, cos] if x_first else [cos, x], [f"{prefix}_xc"]),
        n("Mul", [f"{prefix}_rot", sin] if rot_first else [sin, f"{prefix}_rot"], [f"{prefix}_rs"]),
        n("Add", [f"{prefix}_rs", f"{prefix}_xc"] if add_swap else [f"{prefix}_xc", f"{prefix}_rs"], [out]),
    ]
    return nodes, inits


def _model(nodes, inits, *, x_shape=("B", N, "S", D), cos_shape=(1, 1, "S", D), opset=17, extra_inputs=()):
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape)),
              helper.make_tensor_value_info("cos", TensorProto.FLOAT, list(cos_shape)),
              helper.make_tensor_value_info("sin", TensorProto.FLOAT, list(cos_shape)), *extra_inputs]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _feeds(m, **sizes):
    sizes = {"B": B, "S": S, **sizes}
    feeds = {}
    for v in m.graph.input:
        dims = [d.dim_value or sizes[d.dim_param] for d in v.type.tensor_type.shape.dim]
        feeds[v.name] = (RNG.normal(size=dims).astype(np.float32) if v.type.tensor_type.elem_type == TensorProto.FLOAT
                         else RNG.integers(0, S, size=dims).astype(np.int64))
    return feeds


def _run(m, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _check(m, rotary_count, **sizes):
    out, rep = graph_rewrites.optimize(m, only=MINE, report=True)
    ops = graph_rewrites.op_counts(out)
    assert ops.get("ai.ort_triton.Rotary", 0) == rotary_count, (ops, {k: v for k, v in rep.rules.items() if v.tried})
    feeds = _feeds(m, **sizes)
    for a, b in zip(_run(m, feeds), _run(out, feeds)):
        assert a.shape == b.shape and np.abs(a - b).max() / np.abs(a).max() < 1e-5
    return out, rep


def _reasons(rep, rule):
    return " | ".join(r.reason for r in rep.rules[rule].refused)


@pytest.mark.parametrize("computed", [False, True], ids=["const_bounds", "shape_bounds"])
@pytest.mark.parametrize("x_first, rot_first, add_swap", [(True, True, False), (False, False, True),
                                                          (True, False, True), (False, True, False)])
def test_rotate_half_every_order(computed, x_first, rot_first, add_swap):
    nodes, inits = _rotate_half("x", "y", "cos", "sin", computed=computed, x_first=x_first, rot_first=rot_first,
                                add_swap=add_swap)
    out, rep = _check(_model(nodes, inits), 1)
    assert rep.rules["rotary"].matched == 1
    ops = graph_rewrites.op_counts(out)
    assert not {"Neg", "Slice", "Concat", "Shape", "Div"} & set(ops), ops  # the shape chain died too


@pytest.mark.parametrize("cos_shape", [(1, 1, "S", D), ("B", 1, "S", D), (1, "S", D), (1, 1, 1, D)], ids=str)
def test_cos_layouts(cos_shape):
    nodes, inits = _rotate_half("x", "y", "cos", "sin")
    node = _check(_model(nodes, inits, cos_shape=cos_shape), 1)[0].graph.node[-1]
    assert node.op_type == "Rotary" and {a.name: a.i for a in node.attribute} == {"interleaved": 0, "rotary_dim": D}


@pytest.mark.parametrize("computed", [False, True])
def test_partial_rotary(computed):
    """Phi / GPT-NeoX: cat(rotary(x[..., :R]), x[..., R:]) with R = 8 of D = 16 -> one Rotary(rotary_dim=8)."""
    r = 8
    n = helper.make_node
    nodes = [n("Slice", ["x", "p_zero", "p_r", "p_axis"], ["x_rot"]),
             n("Slice", ["x", "p_r", "p_max", "p_axis"], ["x_pass"])]
    inits = [_ints("p_zero", 0), _ints("p_r", r), _ints("p_max", INT_MAX), _ints("p_axis", -1)]
    rot_nodes, rot_inits = _rotate_half("x_rot", "x_emb", "cos", "sin", h=r // 2, computed=computed)
    nodes += rot_nodes + [n("Concat", ["x_emb", "x_pass"], ["y"], axis=-1)]
    out, rep = _check(_model(nodes, inits + rot_inits, cos_shape=("B", 1, "S", r)), 1)
    assert rep.rules["rotary"].matched == 1 and rep.rules["rotary_partial"].matched == 1
    node = next(node for node in out.graph.node if node.op_type == "Rotary")
    assert node.input[0] == "x" and {a.name: a.i for a in node.attribute}["rotary_dim"] == r
    assert not {"Slice", "Concat"} & set(graph_rewrites.op_counts(out))


def test_partial_with_a_gap_is_refused():
    """x[..., :8] rotated, x[..., 10:] passed: not a partial rotary (the stage-1 Rotary stays)."""
    n = helper.make_node
    nodes = [n("Slice", ["x", "p_zero", "p_r", "p_axis"], ["x_rot"]),
             n("Slice", ["x", "p_s", "p_max", "p_axis"], ["x_pass"])]
    inits = [_ints("p_zero", 0), _ints("p_r", 8), _ints("p_s", 10), _ints("p_max", INT_MAX), _ints("p_axis", -1)]
    rot_nodes, rot_inits = _rotate_half("x_rot", "x_emb", "cos", "sin", h=4)
    nodes += rot_nodes + [n("Concat", ["x_emb", "x_pass"], ["y"], axis=-1)]
    _, rep = _check(_model(nodes, inits + rot_inits, cos_shape=("B", 1, "S", 8)), 1)
    assert "not a partial rotary" in _reasons(rep, "rotary_partial")


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary_dim", [0, 8])
def test_onnx_rotary_embedding(interleaved, rotary_dim):
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"], interleaved=interleaved, num_heads=N,
                            rotary_embedding_dim=rotary_dim)
    m = _model([node], [], cos_shape=("B", "S", (rotary_dim or D) // 2), opset=23)
    out, rep = _check(m, 1)
    attrs = {a.name: a.i for a in out.graph.node[0].attribute}
    assert attrs == {"interleaved": interleaved, "rotary_dim": rotary_dim or D}


# ---- refusals ---------------------------------------------------------------------------------------------------

def _refused(m, rule, reason):
    out, rep = graph_rewrites.optimize(m, only=MINE, report=True)
    assert "ai.ort_triton.Rotary" not in graph_rewrites.op_counts(out)
    assert reason in _reasons(rep, rule), _reasons(rep, rule) or rep.rules[rule]
    return rep


def test_cos_per_head_is_refused():
    nodes, inits = _rotate_half("x", "y", "cos", "sin")
    _refused(_model(nodes, inits, cos_shape=(1, N, "S", D)), "rotary", "must broadcast against x")


def test_cos_over_a_fixed_length_is_refused():
    """cos for 64 positions against x of any length S: not x's sequence, not 1."""
    nodes, inits = _rotate_half("x", "y", "cos", "sin")
    _refused(_model(nodes, inits, cos_shape=(1, 1, 64, D)), "rotary", "sequence dim 64, which is neither 1 nor x's")


def test_dynamic_head_dim_is_refused():
    nodes, inits = _rotate_half("x", "y", "cos", "sin")
    _refused(_model(nodes, inits, x_shape=("B", N, "S", "D"), cos_shape=(1, 1, "S", "D")), "rotary",
             "head dim of x x is not static")


def test_odd_head_dim_is_refused():
    """D = 15: rotate_half splits at 7 (x1 7 wide, x2 8): no pairs, not the op."""
    nodes, inits = _rotate_half("x", "y", "cos", "sin", h=7)
    _refused(_model(nodes, inits, x_shape=("B", N, "S", 15), cos_shape=(1, 1, "S", 15)), "rotary", "not in the middle")


def test_swapped_halves_are_refused():
    """cat(-x1, x2): the inverse rotation's sign pattern, not rotate_half."""
    nodes, inits = _rotate_half("x", "y", "cos", "sin", swap_halves=True)
    _refused(_model(nodes, inits), "rotary", "not the two halves")


def test_rotated_half_read_elsewhere_is_refused():
    nodes, inits = _rotate_half("x", "y", "cos", "sin")
    m = _model(nodes, inits)
    m.graph.output.append(helper.make_tensor_value_info("r_rot", TensorProto.FLOAT, None))
    _refused(m, "rotary", "r_rot, computed inside the rotary, is also used outside it")


def test_onnx_position_ids_is_refused():
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"])
    m = _model([node], [], cos_shape=(64, D // 2), opset=23,
               extra_inputs=[helper.make_tensor_value_info("pos", TensorProto.INT64, ["B", "S"])])
    _refused(m, "rotary_onnx", "position_ids is given")


def test_onnx_3d_input_is_refused():
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"], num_heads=N)
    m = _model([node], [], x_shape=("B", "S", N * D), cos_shape=("B", "S", D // 2), opset=23)
    _refused(m, "rotary_onnx", "x is 3-D [B, S, hidden]")


def test_onnx_odd_rotary_dim_is_refused():
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"], rotary_embedding_dim=7)
    m = _model([node], [], cos_shape=("B", "S", 3), opset=23)
    _refused(m, "rotary_onnx", "rotary_embedding_dim 7 is odd")


# ---- real exports -----------------------------------------------------------------------------------------------

def _export(tmp_path_factory, name, exporter, opset=None):
    """One export per (model, exporter, opset) per test session, shared with test_swiglu_rules.py."""
    from ort_triton import decoders

    path = tmp_path_factory.getbasetemp() / "swiglu_rotary_exports" / f"{name}-{exporter}-{opset}.onnx"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        decoders.export(decoders.build(name), path, exporter=exporter, opset=opset)
    return path


EXPORTS = [(m, e, None) for m in ("llama-tiny", "mistral-tiny", "qwen2-tiny", "phi-tiny")
           for e in ("dynamo", "torchscript")]
EXPORTS += [("llama-tiny", "dynamo", 23), ("phi-tiny", "dynamo", 23)]


@pytest.mark.parametrize("name, exporter, opset", EXPORTS, ids=lambda v: str(v))
def test_decoder_export(tmp_path_factory, name, exporter, opset):
    from ort_triton import decoders

    path = _export(tmp_path_factory, name, exporter, opset)
    model = decoders.build(name)
    layers = decoders.cache_spec(model)[0]
    # every rule but the one that takes the rotaries into the cache op: q and k still reach ours
    out, rep = graph_rewrites.optimize(path, report=True, disable=["qkv_rotary_cache"])
    ops = graph_rewrites.op_counts(out)
    # transpose_rotary (the last stage) takes each Rotary with its head Transpose
    assert ops["ai.ort_triton.TransposeRotary"] == 2 * layers and "RotaryEmbedding" not in ops, ops
    assert "ai.ort_triton.Rotary" not in ops, ops
    first = "rotary_onnx" if opset == 23 else "rotary"
    assert rep.rules[first].matched == 2 * layers and not rep.rules[first].refused, rep.rules[first]
    if name == "phi-tiny":  # partial: 16 of 32 channels, folded into the op
        assert rep.rules["rotary_partial"].matched == 2 * layers
        assert all(a.i == 16 for n in out.graph.node if n.op_type == "TransposeRotary" for a in n.attribute
                   if a.name == "rotary_dim")
    mine = graph_rewrites.optimize(path, only=MINE)  # the equality of these rules alone
    feeds = decoders.sample_inputs(model, batch=2, seq=5, past=3, left_pad=1)
    for a, b in zip(_run(onnx.load(path), feeds), _run(mine, feeds)):
        assert np.abs(a - b).max() / np.abs(a).max() < 1e-5


@pytest.mark.parametrize("name, exporter, opset", EXPORTS, ids=lambda v: str(v))
def test_decoder_export_transpose_rotary(tmp_path_factory, name, exporter, opset):
    """transpose_rotary: q's and k's head Transposes go into the op, every layer; the outputs are the
    original's."""
    from ort_triton import decoders

    path = _export(tmp_path_factory, name, exporter, opset)
    model = decoders.build(name)
    layers = decoders.cache_spec(model)[0]
    base = graph_rewrites.op_counts(graph_rewrites.optimize(path, disable=["transpose_rotary", "qkv_rotary_cache"]))
    out, rep = graph_rewrites.optimize(path, report=True, disable=["qkv_rotary_cache"])
    ops = graph_rewrites.op_counts(out)
    st = rep.rules["transpose_rotary"]
    assert st.matched == 2 * layers and not st.refused, st
    assert ops["ai.ort_triton.TransposeRotary"] == 2 * layers and "ai.ort_triton.Rotary" not in ops, ops
    assert ops["Transpose"] == base["Transpose"] - 2 * layers, (ops, base)
    feeds = decoders.sample_inputs(model, batch=2, seq=5, past=3, left_pad=1)
    for a, b in zip(_run(onnx.load(path), feeds), _run(out, feeds)):
        assert np.abs(a - b).max() / np.abs(a).max() < 1e-5


def test_transpose_rotary_refuses_another_perm():
    """A Transpose other than the head transpose stays (x given as [B, N, D, S] here)."""
    nodes, inits = _rotate_half("xt", "y", "cos", "sin")
    for perm, want in (([0, 2, 1, 3], 1), ([0, 1, 3, 2], 0)):
        t = helper.make_node("Transpose", ["x"], ["xt"], perm=perm)
        m = _model([t, *nodes], inits, x_shape=("B", "S", N, D) if want else ("B", N, D, "S"))
        out, rep = graph_rewrites.optimize(m, report=True)
        ops = graph_rewrites.op_counts(out)
        assert ops.get("ai.ort_triton.TransposeRotary", 0) == want, (ops, rep.rules["transpose_rotary"])
        if not want:
            assert "perm is [0, 1, 3, 2]" in _reasons(rep, "transpose_rotary")
        feeds = _feeds(m)
        for a, b in zip(_run(m, feeds), _run(out, feeds)):
            assert a.shape == b.shape and np.abs(a - b).max() / np.abs(a).max() < 1e-5
