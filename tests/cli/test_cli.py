"""The CLI as users run it (a subprocess): optimize, build, doctor; bad input gives a clear message and
exit code 2, and never touches the input or leaves a partial output."""

import json

import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import HAS_CUDA, run_cli


def _ln_model(path, with_add=True, h=32):
    nodes = [helper.make_node("LayerNormalization", ["s" if with_add else "a", "g", "b"], ["y"], axis=-1)]
    if with_add:
        nodes.insert(0, helper.make_node("Add", ["a", "c"], ["s"]))
    import numpy as np

    inits = [numpy_helper.from_array(np.linspace(0.5, 1.5, h, dtype=np.float32), "g"),
             numpy_helper.from_array(np.linspace(-1, 1, h, dtype=np.float32), "b")]
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, h]) for n in (["a", "c"] if with_add else ["a"])]
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, h])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    return path


def test_optimize_prints_tables_and_writes_json(tmp_path):
    src = _ln_model(tmp_path / "in.onnx")
    before = src.read_bytes()
    res = run_cli("optimize", src, "-o", tmp_path / "out.onnx", "--json", tmp_path / "r.json", "-v")
    assert "ai.ort_triton.AddLayerNorm" in res.stdout and "add_layer_norm" in res.stdout
    assert src.read_bytes() == before
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["rules"]["add_layer_norm"]["matched"] == 1
    assert report["ops_after"] == {"ai.ort_triton.AddLayerNorm": 1}
    onnx.checker.check_model(onnx.load(tmp_path / "out.onnx"))
    # every rule's one-line identity, brackets and all (rich would take "[bq|bk|bv]" for markup and drop it)
    text = " ".join(res.stdout.split())
    assert "PackedMultiHeadAttention(x [Wq|Wk|Wv], [bq|bk|bv])" in text, res.stdout


def test_only_and_disable(tmp_path):
    src = _ln_model(tmp_path / "in.onnx")
    run_cli("optimize", src, "-o", tmp_path / "o1.onnx", "--disable", "add_layer_norm")
    ops = {n.op_type for n in onnx.load(tmp_path / "o1.onnx").graph.node}
    assert ops == {"Add", "LayerNorm"}
    res = run_cli("optimize", src, "-o", tmp_path / "o2.onnx", "--only", "bogus", check=False)
    assert res.returncode == 2 and "unknown rule 'bogus'" in res.stderr


def test_rules_off_by_default_are_named_in_the_help_and_enabled_on_request(tmp_path, monkeypatch):
    """--enable's help lists every rule that is off by default, or says there is none (the help text is written
    by hand); --enable puts one in, `only` takes any, and the default set leaves them out. With every rule on by
    default today, the selection is checked on a registry with one rule turned off."""
    import dataclasses

    import graph_rewrites
    from graph_rewrites import registry
    from graph_rewrites.registry import select

    off = [r.name for r in graph_rewrites.RULES if not r.default]
    help_text = " ".join(run_cli("optimize", "--help").stdout.split())
    assert all(name in help_text for name in off) if off else "today: none" in help_text, help_text
    name = off[0] if off else "layer_norm"
    monkeypatch.setattr(registry, "RULES", tuple(dataclasses.replace(r, default=False) if r.name == name else r
                                                 for r in registry.RULES))
    names = lambda rules: {r.name for r in rules}  # noqa: E731
    assert name not in names(select())
    assert names(select(enable=[name])) - names(select()) == {name}
    assert names(select(only=[name])) == {name}
    assert name not in names(select(enable=[name], disable=[name]))
    src = _ln_model(tmp_path / "in.onnx")
    run_cli("optimize", src, "-o", tmp_path / "o.onnx", "--enable", name)
    res = run_cli("optimize", src, "-o", tmp_path / "o2.onnx", "--enable", "bogus", check=False)
    assert res.returncode == 2 and "unknown rule 'bogus'" in res.stderr


def test_nothing_to_fuse_says_so(tmp_path):
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    src = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    res = run_cli("optimize", src, "-o", tmp_path / "o.onnx")
    assert "nothing fused" in res.stdout


@pytest.mark.parametrize("case", ["same_path", "corrupt", "missing"])
def test_bad_input_exits_2_with_a_message(tmp_path, case):
    src = _ln_model(tmp_path / "in.onnx")
    out = tmp_path / "out.onnx"
    if case == "same_path":
        out = src
        expect = "is the input"
    elif case == "corrupt":
        src.write_bytes(src.read_bytes()[: 40])
        expect = "not a readable ONNX model"
    else:
        src = tmp_path / "nope.onnx"
        expect = "no such file"
    before = src.read_bytes() if src.exists() else None
    res = run_cli("optimize", src, "-o", out, check=False)
    assert res.returncode == 2, res
    assert expect in res.stderr and "Traceback" not in res.stderr
    if before is not None:
        assert src.read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp")), "a partial output was left behind"
    if case != "same_path":
        assert not out.exists()


def test_build_rejects_a_bad_arch():
    res = run_cli("build", "--arch", "banana", check=False)
    assert res.returncode == 2 and "compute capabilities" in res.stderr


@pytest.mark.skipif(HAS_CUDA, reason="checks what doctor says on a machine without a GPU")
def test_doctor_reports_what_is_missing(native_library):
    res = run_cli("doctor", check=False, env={"ORT_TRITON_LIBRARY": str(native_library)})
    assert "onnxruntime" in res.stdout and str(native_library) in res.stdout
    assert "registers in ORT" in res.stdout
    # This machine has no GPU: doctor must say so and how it matters, and exit non-zero.
    assert res.returncode == 1 and ("no CUDA driver" in res.stdout or "cuInit failed" in res.stdout)


def test_python_m_entry_point():
    res = run_cli("--help")
    assert "optimize" in res.stdout and "build" in res.stdout


def test_compare_passes_equal_models_and_fails_different_ones(tmp_path):
    src = _ln_model(tmp_path / "in.onnx")
    run_cli("optimize", src, "-o", tmp_path / "opt.onnx")
    res = run_cli("compare", src, tmp_path / "opt.onnx", "--inputs", "3x32")
    assert "PASSED: 1/1" in res.stdout and "p99 abs" in res.stdout
    other = onnx.load(src)  # a model that really differs: another beta
    other.graph.initializer[1].CopyFrom(numpy_helper.from_array(
        numpy_helper.to_array(other.graph.initializer[1]) + 0.5, "b"))
    onnx.save(other, tmp_path / "other.onnx")
    res = run_cli("compare", src, tmp_path / "other.onnx", check=False)
    assert res.returncode == 1 and "FAILED: 0/1" in res.stdout


def test_compare_with_given_inputs_and_bad_arguments(tmp_path):
    import numpy as np

    src = _ln_model(tmp_path / "in.onnx", with_add=False)
    np.savez(tmp_path / "in.npz", a=np.ones((3, 32), np.float32))
    assert run_cli("compare", src, src, "--inputs", tmp_path / "in.npz").returncode == 0
    for bad in ("banana", "2x1+x", "0x4", "2x4+-1"):
        res = run_cli("compare", src, src, "--inputs", bad, check=False)
        assert res.returncode == 2 and "BATCHxSEQ or BATCHxSEQ+PAST" in res.stderr, (bad, res.stderr)
    assert run_cli("compare", src, src, "--inputs", "2x1+64").returncode == 0  # PAST: only a cache reads it
    res = run_cli("compare", src, tmp_path / "missing.onnx", check=False)
    assert res.returncode == 2 and "no such file" in res.stderr


def test_optimized_file_has_ordinary_permissions(tmp_path):
    src = _ln_model(tmp_path / "in.onnx")
    run_cli("optimize", src, "-o", tmp_path / "out.onnx")
    assert (tmp_path / "out.onnx").stat().st_mode & 0o044 == 0o044  # group/other readable (umask 022)


@pytest.mark.slow
def test_float16_keeps_io_types_and_matches_fp32(tmp_path):
    from ort_triton import models

    src = models.export(models.build("bert-tiny"), tmp_path / "bert.onnx", exporter="dynamo")
    out = tmp_path / "bert16.onnx"
    run_cli("optimize", src, "-o", out, "--float16", "--keep-io-types")
    m = onnx.load(out)
    assert {i.type.tensor_type.elem_type for i in m.graph.output} == {TensorProto.FLOAT}
    floats = [t for t in m.graph.initializer if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16)]
    assert floats and all(t.data_type == TensorProto.FLOAT16 for t in floats if t.dims)
    assert sum(n.domain == "ai.ort_triton" for n in m.graph.node) > 0
    res = run_cli("compare", src, out, "--rtol", "2e-2", "--inputs", "2x9")
    assert "PASSED" in res.stdout


def test_explain_shows_the_rules_refusals(tmp_path):
    src = _ln_model(tmp_path / "in.onnx")
    res = run_cli("optimize", src, "-o", tmp_path / "o.onnx", "--disable", "add_layer_norm", "--explain",
                  "add_layer_norm_keep_sum")
    assert "add_layer_norm_keep_sum" in res.stdout and "read only by the norm" in res.stdout
    res = run_cli("optimize", src, "-o", tmp_path / "o.onnx", "--explain", "nope", check=False)
    assert res.returncode == 2 and "unknown rule 'nope'" in res.stderr


def _external(tmp_path):
    src = _ln_model(tmp_path / "in.onnx", h=640)  # 2.5 KB vectors: over the 1 KB external-data threshold
    m = onnx.load(src)
    onnx.save(m, tmp_path / "ext.onnx", save_as_external_data=True, location="ext.weights", size_threshold=0)
    return tmp_path / "ext.onnx", tmp_path / "ext.weights"


def test_external_data_model_is_written_with_external_data(tmp_path):
    src, weights = _external(tmp_path)
    out = tmp_path / "out" / "opt.onnx"
    run_cli("optimize", src, "-o", out)
    data = [p for p in out.parent.iterdir() if p.suffix == ".data"]
    assert len(data) == 1 and data[0].stat().st_size > 0
    assert run_cli("compare", src, out).returncode == 0
    run_cli("optimize", src, "-o", out)  # again over the first: the old data file goes, the new one stays
    assert len([p for p in out.parent.iterdir() if p.suffix == ".data"]) == 1
    assert run_cli("compare", src, out).returncode == 0


def test_missing_external_data_file_is_named(tmp_path):
    src, weights = _external(tmp_path)
    weights.unlink()
    res = run_cli("optimize", src, "-o", tmp_path / "o.onnx", check=False)
    assert res.returncode == 2 and "ext.weights are missing" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("case", ["corrupt", "missing_data", "no_file"])
def test_compare_names_a_bad_model_and_exits_2(tmp_path, case):
    good = _ln_model(tmp_path / "good.onnx")
    if case == "corrupt":
        bad = tmp_path / "bad.onnx"
        bad.write_bytes(good.read_bytes()[:40])
        expect = "not a readable ONNX model"
    elif case == "missing_data":
        bad, weights = _external(tmp_path)
        weights.unlink()
        expect = "ext.weights are missing"
    else:
        bad, expect = tmp_path / "nope.onnx", "no such file"
    for args in ((good, bad), (bad, good)):
        res = run_cli("compare", *args, check=False)
        assert res.returncode == 2 and expect in res.stderr and "Traceback" not in res.stderr, res
