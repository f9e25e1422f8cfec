"""`optimize` where users trip: outputs that overlap the input's files, a directory or an unwritable path as
the output, -q, the progress bar (terminal only), --only, --explain's best partial match, --float16's fp32
keep-list, and the Python API keeping the input's type."""

import hashlib
import os
import pty
import shutil
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import ROOT, run_cli


def _ln_model(path, h=32):
    """Add -> LayerNormalization: add_layer_norm fuses it."""
    nodes = [helper.make_node("Add", ["a", "c"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1)]
    inits = [numpy_helper.from_array(np.linspace(0.5, 1.5, h, dtype=np.float32), "g"),
             numpy_helper.from_array(np.linspace(-1, 1, h, dtype=np.float32), "b")]
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, h]) for n in ("a", "c")]
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, h])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    return path


def _norm_without_eps(path):
    """(x - mean) / sqrt(var) * g: layer_norm_decomposed's pattern but for the `+ eps`, so nothing fuses, and
    Pow, ReduceMean and Sqrt (the fp32 keep-list's) stay beside Sub, Div and Mul (not on it)."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1]), helper.make_node("Sub", ["x", "m"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["p"]), helper.make_node("ReduceMean", ["p"], ["v"], axes=[-1]),
             helper.make_node("Sqrt", ["v"], ["s"]), helper.make_node("Div", ["d", "s"], ["n"]),
             helper.make_node("Mul", ["n", "g"], ["y"])]
    inits = [numpy_helper.from_array(np.array(2, np.float32), "two"),
             numpy_helper.from_array(np.linspace(0.5, 1.5, 32, dtype=np.float32), "g")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 32])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    return path


def _external(d, name="in"):
    """The LN model with its weights in NAME.weights (2.5 KB vectors: over the 1 KB external threshold)."""
    m = onnx.load(_ln_model(d / "plain.onnx", h=640))
    onnx.save(m, d / f"{name}.onnx", save_as_external_data=True, location=f"{name}.weights", size_threshold=0)
    return d / f"{name}.onnx", d / f"{name}.weights"


def _digests(*paths):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def test_output_over_a_copy_of_the_input_keeps_the_inputs_weights(tmp_path):
    src, weights = _external(tmp_path)
    copy = tmp_path / "copy.onnx"
    shutil.copy(src, copy)  # names in.weights, like the input
    before = _digests(src, weights)
    run_cli("optimize", src, "-o", copy)
    assert _digests(src, weights) == before
    assert run_cli("compare", src, copy).returncode == 0


def test_output_over_a_model_that_shares_the_inputs_data_file(tmp_path):
    # c.onnx written by optimize (its data file c.onnx.<hex>.data); x.onnx a copy of it, then optimized over c
    src, _ = _external(tmp_path)
    c, x = tmp_path / "c.onnx", tmp_path / "x.onnx"
    run_cli("optimize", src, "-o", c)
    shutil.copy(c, x)
    data = [p for p in tmp_path.iterdir() if p.suffix == ".data"]
    before = _digests(x, *data)
    run_cli("optimize", x, "-o", c)
    assert _digests(x, *data) == before  # x's weights were c's old data file: still there
    assert run_cli("compare", x, c).returncode == 0


@pytest.mark.parametrize("case", ["data_file", "directory", "unwritable"])
def test_bad_output_paths_exit_2(tmp_path, case):
    src, weights = _external(tmp_path)
    before = _digests(src, weights)
    out, expect = {"data_file": (weights, "is the input's external data file"),
                   "directory": (tmp_path, "is a directory"),
                   "unwritable": ("/proc/no/such/dir/o.onnx", "cannot write")}[case]
    res = run_cli("optimize", src, "-o", out, check=False)
    assert res.returncode == 2 and expect in res.stderr and "Traceback" not in res.stderr, res
    assert _digests(src, weights) == before
    assert not list(tmp_path.glob(".*.tmp"))


def test_an_existing_file_that_is_not_a_model_is_replaced(tmp_path):
    src = _ln_model(tmp_path / "in.onnx")
    out = tmp_path / "out.onnx"
    out.write_text("not a model")
    run_cli("optimize", src, "-o", out)
    assert {n.op_type for n in onnx.load(out).graph.node} == {"AddLayerNorm"}


def test_quiet_prints_nothing_but_errors(tmp_path):
    src = _ln_model(tmp_path / "in.onnx")
    for argv in (["-q", "optimize", src, "-o", tmp_path / "o1.onnx"],
                 ["optimize", src, "-o", tmp_path / "o2.onnx", "-q"]):
        res = run_cli(*argv)
        assert res.stdout == "" and res.stderr == "", res
    assert (tmp_path / "o1.onnx").is_file() and (tmp_path / "o2.onnx").is_file()
    res = run_cli("-q", "optimize", tmp_path / "nope.onnx", "-o", tmp_path / "o3.onnx", check=False)
    assert res.returncode == 2 and "no such file" in res.stderr


@pytest.mark.slow
def test_quiet_on_an_exported_bert_hides_the_shape_probe_warnings(tmp_path):
    # the rewriter's symbolic shape probe (ORT's SymbolicShapeInference) logs "unsupported broadcast ..."
    # on the dynamo export's attention mask
    from ort_triton import models

    src = models.export(models.build("bert-tiny"), tmp_path / "bert.onnx", exporter="dynamo")
    res = run_cli("-q", "optimize", src, "-o", tmp_path / "o.onnx")
    assert res.stdout == "" and res.stderr == "", res
    assert any(n.domain == "ai.ort_triton" for n in onnx.load(tmp_path / "o.onnx").graph.node)


def _run_on_a_terminal(*args) -> str:
    """The CLI with stdout and stderr on a pseudo-terminal; what it wrote there."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TERM"] = "xterm"
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ort_triton", *map(str, args)], stdin=slave, stdout=slave,
                            stderr=slave, env=env, cwd=ROOT)
    os.close(slave)
    chunks = []
    while True:  # read as it writes: a full terminal buffer would block the child
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the child has closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=600) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_a_terminal_only(tmp_path):
    src = _ln_model(tmp_path / "in.onnx")
    assert "fusing" in _run_on_a_terminal("optimize", src, "-o", tmp_path / "o1.onnx")
    assert "fusing" not in _run_on_a_terminal("-q", "optimize", src, "-o", tmp_path / "o2.onnx")
    res = run_cli("optimize", src, "-o", tmp_path / "o3.onnx")  # a pipe: tables only
    assert "fusing" not in res.stdout + res.stderr and "AddLayerNorm" in res.stdout


def test_only_applies_just_that_rule(tmp_path):
    import json

    src = _ln_model(tmp_path / "in.onnx")
    run_cli("optimize", src, "-o", tmp_path / "o.onnx", "--only", "layer_norm", "--json", tmp_path / "r.json")
    assert sorted(n.op_type for n in onnx.load(tmp_path / "o.onnx").graph.node) == ["Add", "LayerNorm"]
    assert list(json.loads((tmp_path / "r.json").read_text())["rules"]) == ["layer_norm"]


def test_explain_shows_the_best_partial_match(tmp_path):
    src = _norm_without_eps(tmp_path / "in.onnx")
    res = run_cli("optimize", src, "-o", tmp_path / "o.onnx", "--explain", "layer_norm_decomposed_no_beta")
    text = " ".join(res.stdout.split())
    assert "best partial match" in text and "expected Add" in text and "nothing fused" in text


def _input_types(path) -> dict[str, list[int]]:
    """Per op type (each once in these models): the element types its inputs arrive in (a Cast's output in
    the type it casts to, else the graph's record)."""
    m = onnx.load(path)
    elem = {t.name: t.data_type for t in m.graph.initializer}
    elem.update({v.name: v.type.tensor_type.elem_type for v in [*m.graph.input, *m.graph.value_info]})
    for n in m.graph.node:
        if n.op_type == "Cast":
            elem[n.output[0]] = helper.get_attribute_value(n.attribute[0])
    return {n.op_type: [elem[i] for i in n.input] for n in m.graph.node if n.op_type not in ("Cast", "ReduceMean")}


def test_float16_keeps_the_overflow_prone_ops_in_fp32(tmp_path):
    src = _norm_without_eps(tmp_path / "in.onnx")
    f32, f16 = TensorProto.FLOAT, TensorProto.FLOAT16
    run_cli("optimize", src, "-o", tmp_path / "h.onnx", "--float16", "--keep-io-types")
    types = _input_types(tmp_path / "h.onnx")
    assert types["Pow"] == [f32, f32] and types["Sqrt"] == [f32]  # the default keep-list
    assert types["Sub"] == [f16, f16] and types["Div"] == [f16, f16] and types["Mul"] == [f16, f16]
    m = onnx.load(tmp_path / "h.onnx")
    assert [v.type.tensor_type.elem_type for v in [*m.graph.input, *m.graph.output]] == [f32, f32]
    res = run_cli("compare", src, tmp_path / "h.onnx", "--rtol", "1e-2")
    assert "PASSED" in res.stdout
    run_cli("optimize", src, "-o", tmp_path / "k.onnx", "--float16", "--keep-fp32", "Sub")  # a list of one's own
    types = _input_types(tmp_path / "k.onnx")
    assert types["Sub"] == [f32, f32] and types["Pow"] == [f16, f16]


def test_float16_output_is_topologically_sorted(tmp_path):
    """onnxruntime's converter appends its Casts (after the fp32 inputs, around the keep-listed Pow) at the end
    of the graph, after the AddLayerNorm and Pow that read them; onnx's full check rejects that. The
    result is sorted, passes the full check (types included: `two`, read only by Pow, stays fp32 and so
    must its value_info) and computes what the fp32 model does, to fp16 rounding, on ORT CPU."""
    import onnxruntime as ort

    h = 32
    nodes = [helper.make_node("Add", ["a", "c"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1),
             helper.make_node("Pow", ["a", "two"], ["p"]),  # the fp32 input straight into a keep-listed op
             helper.make_node("Mul", ["y", "p"], ["z"])]
    inits = [numpy_helper.from_array(np.linspace(0.5, 1.5, h, dtype=np.float32), "g"),
             numpy_helper.from_array(np.linspace(-1, 1, h, dtype=np.float32), "b"),
             numpy_helper.from_array(np.array(2, np.float32), "two")]
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, h]) for n in ("a", "c")]
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, h])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), tmp_path / "in.onnx")
    run_cli("optimize", tmp_path / "in.onnx", "-o", tmp_path / "h.onnx", "--float16", "--keep-io-types")
    m = onnx.load(tmp_path / "h.onnx")
    assert {"AddLayerNorm", "Pow", "Cast"} <= {n.op_type for n in m.graph.node}
    onnx.checker.check_model(m, full_check=True)
    rng = np.random.default_rng(0)
    feeds = {n: rng.normal(0, 1, (3, h)).astype(np.float32) for n in ("a", "c")}
    want, got = (ort.InferenceSession(str(tmp_path / f), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
                 for f in ("in.onnx", "h.onnx"))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_python_optimize_keeps_the_inputs_type(tmp_path):
    import ort_triton

    src = _ln_model(tmp_path / "in.onnx")
    fused = {"AddLayerNorm"}
    out = ort_triton.optimize(str(src))  # a path: the model it names (there is no path to give back)
    assert isinstance(out, onnx.ModelProto) and {n.op_type for n in out.graph.node} == fused
    proto = onnx.load(src)
    before = proto.SerializeToString()
    out = ort_triton.optimize(proto)
    assert isinstance(out, onnx.ModelProto) and {n.op_type for n in out.graph.node} == fused
    assert proto.SerializeToString() == before  # the input is untouched
    model = ir.load(str(src))
    out = ort_triton.optimize(model)
    assert isinstance(out, ir.Model) and {n.op_type for n in out.graph} == fused
    assert [n.op_type for n in model.graph] == ["Add", "LayerNormalization"]
    with pytest.raises(TypeError, match="onnx.ModelProto, an onnx_ir.Model or a path"):
        ort_triton.optimize(src.read_bytes())
    diffs, feeds = ort_triton.compare_models(proto, ort_triton.optimize(proto), batch=3, seq=32)
    assert [d.name for d in diffs] == ["y"] and diffs[0].ok and set(feeds) == {"a", "c"}


def test_a_model_protobuf_cannot_size_goes_to_a_data_file():
    """Past 2 GiB, protobuf's ByteSize raises instead of answering (the fp16 Llama-1B, 2.2 GB, in session 12's
    examples/generate.py run); save_atomic reads that as "too big for one file" and writes the weights
    beside it. A real model that size takes minutes to build, so a stand-in raises as protobuf does."""
    from google.protobuf.message import EncodeError

    from ort_triton.runtime import past_proto_limit

    class TooBig:
        def ByteSize(self):
            raise EncodeError("Failed to serialize proto")

    class Small:
        def ByteSize(self):
            return 1000

    assert past_proto_limit(TooBig()) and not past_proto_limit(Small())


def test_sessions_from_a_proto_past_two_gib_go_through_a_file(monkeypatch):
    """make_session / compare_models / inference_session hand ORT a ModelProto as bytes, which protobuf cannot
    make past 2 GiB; such a model goes through a temporary file with external data instead. A small model
    stands in (past_proto_limit forced), and must give the same outputs as through bytes."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from ort_triton import runtime

    def model():
        w = numpy_helper.from_array(np.arange(4096, dtype=np.float32).reshape(64, 64) / 4096, "w")
        return helper.make_model(helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])], [w]),
            opset_imports=[helper.make_opsetid("", 18)])

    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    want = runtime.inference_session(model()).run(None, {"x": x})[0]
    saved = []
    monkeypatch.setattr(runtime, "past_proto_limit", lambda m: saved.append(m) or True)
    sources, session = [], ort.InferenceSession
    monkeypatch.setattr(ort, "InferenceSession", lambda src, *a, **k: sources.append(src) or session(src, *a, **k))
    got = runtime.make_session(model(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert saved and np.array_equal(got, want)
    assert len(sources) == 1 and isinstance(sources[0], str) and sources[0].endswith("model.onnx")
