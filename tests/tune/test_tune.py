"""`ort-triton tune` on the CPU path (Triton's interpreter runs every candidate; a scripted timer decides,
so the choice is checked, not the interpreter's speed) and `ort-triton build --tuning`: the table is written,
a config faster by more than the noise margin replaces the built-in one and one within it does not, the
built library holds the tuned spec for its arch only, ahead of the built-in specs, and the native planner
(the same keys the tuner computed in Python) picks it for the tuned bucket on that GPU and the built-in spec
elsewhere. The GPU numbers come from scripts/gpu_check.sh on the device."""

import ctypes
import json

import numpy as np
import onnx
import pytest

import graph_rewrites
from ort_triton import models, tune, tuning
from ort_triton.ops import BY_NAME
from ort_triton.ops.attention import TUNING as MHA_TUNING
from tests.conftest import run_cli

pytestmark = pytest.mark.slow
FLOAT = 1


@pytest.fixture(scope="module")
def bert_export(tmp_path_factory):
    return models.export(models.build("bert-tiny"), tmp_path_factory.mktemp("export") / "bert.onnx")


@pytest.fixture(scope="module")
def fused_bert(tmp_path_factory, bert_export):
    """Fused with the projections left unpacked: these tests check the tuner on MultiHeadAttention (the packed
    op's tuning is test_packed_attention_is_tuned); and the embeddings' norm left a LayerNorm, BERT's only
    plain one, which the row-wise tests tune (EmbedLayerNorm, which takes it by default, has no tuning)."""
    tmp = tmp_path_factory.mktemp("tune")
    fused = graph_rewrites.optimize(str(bert_export), disable=["pack_qkv", "embed_layer_norm"])
    onnx.save(fused, tmp / "bert.opt.onnx")
    return tmp / "bert.opt.onnx"


def test_packed_attention_is_tuned(bert_export, tmp_path):
    """The default fusion packs Q/K/V: its PackedMultiHeadAttention nodes are problems with the unpacked op's
    keys (head dim, alignment, S, B * N) from the packed shapes, their candidates run (under the
    interpreter here), and a tuned config becomes a spec of the packed kernel."""
    fused = tmp_path / "packed.onnx"
    onnx.save(graph_rewrites.optimize(str(bert_export)), fused)
    out = tune.tune(fused, [(1, 16)], out=tmp_path / "t.json", device="cpu", arch=90, max_candidates=2,
                    budget_min=5, timer=scripted([1.0, 0.5]), ops=("PackedMultiHeadAttention",), log=lambda s: None)
    (entry,) = json.loads(out.read_text())["entries"]
    assert entry["op"] == "PackedMultiHeadAttention" and entry["problem"]["nodes"] == 2
    assert entry["keys"] == [[32, 32], [1, 1], [9, 16], [2, 2]] and not entry["builtin"]
    op = BY_NAME["PackedMultiHeadAttention"]
    spec = op.tuning.spec("float", tuple(map(tuple, entry["keys"])), entry["config"])
    assert spec.constexprs["PACKED"] is True and spec.constexprs["BLOCK_M"] == entry["config"]["BLOCK_M"]


def scripted(times):
    """A timer that runs the kernel (the runner must work) and returns the next scripted time."""
    it = iter(times)

    def timer(fn):
        fn()
        return next(it)
    return timer


@pytest.fixture(scope="module")
def table(fused_bert):
    # 1x16 (aligned, Sq bucket 9..16, B * N = 2): the third candidate is 2x faster; 2x9 (unaligned, B * N = 4):
    # 2% is noise
    out = tune.tune(fused_bert, [(1, 16), (2, 9)], device="cpu", arch=90, max_candidates=3, budget_min=5,
                    timer=scripted([1.0, 0.99, 0.5, 1.0, 0.98, 1.2]), ops=("MultiHeadAttention",),
                    log=lambda s: None)
    return out


def test_table_entries(table, fused_bert):
    assert table == fused_bert.with_name("bert.opt.tuning.json")  # beside the model
    data = json.loads(table.read_text())
    assert data["format"] == tuning.FORMAT and data["arch"] == 90 and data["problems"] == 2
    fast, noise = data["entries"]
    want = MHA_TUNING.candidates("float", (32, 1, 16, 2), 90)
    assert fast["op"] == "MultiHeadAttention" and fast["type"] == "float"
    assert fast["keys"] == [[32, 32], [1, 1], [9, 16], [2, 2]] and fast["problem"]["seen_at"] == ["shape 1x16"]
    assert fast["config"] == want[2] and not fast["builtin"] and fast["ms"] == 0.5 and fast["builtin_ms"] == 1.0
    assert fast["problem"]["nodes"] == 2 and fast["timed"] == 3  # both layers meet it; three configs ran
    assert noise["keys"] == [[32, 32], [0, 1], [9, 16], [3, 4]] and noise["builtin"]
    assert noise["config"] == MHA_TUNING.candidates("float", (32, 0, 9, 4), 90)[0]
    _, entries = tuning.load(table)
    assert [e.builtin for e in entries] == [False, True]


def test_screening_picks_finalists_and_the_final_decides(fused_bert, tmp_path):
    """With a screen, every candidate gets a short timing, the built-in config and the FINALISTS fastest by
    it a long one, and the long timings choose: here the screen's favourite (candidate 2) loses the final
    to candidate 4, and candidate 3, slow in the screen, is never timed again."""
    assert tune.FINALISTS == 4
    final_runs = []

    def final(fn):
        fn()
        final_runs.append(1)
        return [1.0, 0.8, 0.6, 0.9, 0.95][len(final_runs) - 1]  # built-in, then candidates 2, 4, 5, 1

    out = tune.tune(fused_bert, [(1, 16)], out=tmp_path / "t.json", device="cpu", arch=90, max_candidates=6,
                    timer=final, screen=scripted([1.0, 0.9, 0.5, 0.95, 0.6, 0.7]), ops=("MultiHeadAttention",),
                    log=lambda s: None)
    (entry,) = json.loads(out.read_text())["entries"]
    assert entry["timed"] == 6 and entry["finalists"] == 5 and len(final_runs) == 5
    assert entry["config"] == MHA_TUNING.candidates("float", (32, 1, 16, 2), 90)[4]
    assert entry["ms"] == 0.6 and entry["builtin_ms"] == 1.0 and not entry["builtin"]


def test_budget_spent_keeps_builtin(fused_bert, tmp_path):
    out = tune.tune(fused_bert, [(1, 16)], out=tmp_path / "t.json", device="cpu", arch=90, budget_min=1e-9,
                    timer=scripted([]), ops=("MultiHeadAttention",), log=lambda s: None)
    data = json.loads(out.read_text())
    assert data["entries"] == [] and data["not_tuned"] == 1


def test_a_failing_candidate_is_skipped_with_the_reason(fused_bert, tmp_path):
    def timer(fn):
        if not hasattr(timer, "n"):
            timer.n = 0
        timer.n += 1
        if timer.n == 2:
            raise RuntimeError("out of resources: shared memory, Required: 300000")
        return 1.0 / timer.n

    out = tune.tune(fused_bert, [(1, 16)], out=tmp_path / "t.json", device="cpu", arch=90, max_candidates=3,
                    timer=timer, ops=("MultiHeadAttention",), log=lambda s: None)
    (entry,) = json.loads(out.read_text())["entries"]
    assert entry["timed"] == 2 and "out of resources" in entry["skipped"][0]["reason"]
    assert entry["config"] == MHA_TUNING.candidates("float", (32, 1, 16, 2), 90)[2]


def test_a_model_without_tunable_nodes_is_refused(tmp_path):
    src = models.export(models.build("bert-tiny"), tmp_path / "bert.onnx")  # not optimized
    with pytest.raises(ValueError, match="run `ort-triton optimize` on it first"):
        tune.tune(src, [(1, 8)], device="cpu", arch=90, log=lambda s: None)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update(format="x"), "is not an ort_triton tuning table"),
    (lambda t: t["entries"][0].update(op="BiasGelu"), "op 'BiasGelu' is not tunable"),
    (lambda t: t["entries"][0].update(keys=[[32, 32]]), "keys must be 4 ranges"),
    (lambda t: t["entries"][0].update(type="int8"), "has no element type 'int8'"),
    (lambda t: t["entries"][0]["config"].pop("BLOCK_N"), "does not make a MultiHeadAttention kernel"),
])
def test_bad_tables_are_refused(table, tmp_path, edit, message):
    data = json.loads(table.read_text())
    edit(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(tuning.TuningError, match=message):
        tuning.load(bad)
    res = run_cli("build", "--arch", "90", "--tuning", bad, "-o", tmp_path / "lib", check=False)
    assert res.returncode == 2 and message.split("'")[0] in res.stderr and not (tmp_path / "lib").exists()


def _plan(lib, q_shape, arch):
    b, sq, hidden = q_shape
    shapes = [q_shape, q_shape, q_shape, [b, sq], [hidden], [hidden]]
    msg = ctypes.create_string_buffer(1024)
    rc = lib.ort_triton_plan_attrs(
        b"MultiHeadAttention", FLOAT, arch, 6, (ctypes.c_int * 6)(*[1] * 6), (ctypes.c_int * 6)(*map(len, shapes)),
        (ctypes.c_int64 * sum(map(len, shapes)))(*[d for s in shapes for d in s]), 1, 2,
        (ctypes.c_double * 2)(2, 0.17), msg, len(msg))
    assert rc == 0, msg.value
    return dict(kv.split("=") for kv in msg.value.decode().split())


def test_build_with_the_table_dispatches_the_tuned_spec(table, tmp_path):
    """Built for sm_80 and sm_90 (the sm_80 kernels are cached by tests/aot's default-arch build in CI): the
    tuned spec is compiled for sm_90 only and comes first; the planner takes it for 1x16 on sm_90, the
    built-in spec on sm_80 and for shapes outside its bucket."""
    res = run_cli("build", "--arch", "80,90", "--tuning", table, "-o", tmp_path, timeout=1800)
    assert "1 tuned spec(s) of 2 entries" in res.stdout, res.stdout
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["tuning"]["tuned_specs"] == 1
    lib = ctypes.CDLL(str(tmp_path / "libort_triton.so"))
    lib.ort_triton_plan_attrs.argtypes = [
        ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_int,
        ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, ctypes.c_size_t]
    lib.ort_triton_op_name.restype = ctypes.c_char_p
    op = next(i for i in range(lib.ort_triton_num_ops())
              if lib.ort_triton_op_name(i) == b"MultiHeadAttention" and lib.ort_triton_op_type(i) == FLOAT)
    info = ctypes.create_string_buffer(512)
    assert lib.ort_triton_spec_info(op, 0, info, 512) == 0
    assert info.value.decode().endswith("keys=32:32,1:1,9:16,2:2 archs=90")

    tuned = _plan(lib, [1, 16, 64], 90)
    assert tuned["spec"] == "0" and tuned["arch"] == "90"
    cfg = MHA_TUNING.candidates("float", (32, 1, 16, 2), 90)[2]
    assert int(tuned["block"]) == 32 * cfg["num_warps"]
    assert int(tuned["grid"].split(",")[0]) == -(-16 // cfg["BLOCK_M"]) * 1 * 2  # its BLOCK_M sets the grid
    on_80 = _plan(lib, [1, 16, 64], 80)
    assert on_80["spec"] != "0" and on_80["arch"] == "80"
    # the next Sq bucket; unaligned (its entry kept the built-in); batch 2 (the next B * N bucket)
    for other in ([1, 32, 64], [2, 9, 64], [2, 16, 64]):
        assert _plan(lib, other, 90)["spec"] != "0"


def test_cli_says_what_is_missing(fused_bert, tmp_path):
    res = run_cli("tune", fused_bert, check=False)
    assert res.returncode == 2 and "give the shapes to tune for" in res.stderr
    res = run_cli("tune", tmp_path / "none.onnx", "--shapes", "1x8", check=False)
    assert res.returncode == 2 and "no such file" in res.stderr
    res = run_cli("tune", fused_bert, "--shapes", "1x8", check=False, env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 2 and "tuning times kernels on a GPU" in res.stderr
    assert not list(fused_bert.parent.glob("*.tuning.json.*"))  # no partial table left behind


# ---- row-wise ops: LayerNorm and AddLayerNorm, by exact H and power-of-two row bucket --------------------
def _alternating(fn):
    """A timer that runs the kernel and makes every second candidate (the first after the built-in) 2x
    faster than the built-in."""
    fn()
    _alternating.n = getattr(_alternating, "n", 0) + 1
    return 0.5 if _alternating.n % 2 == 0 else 1.0


@pytest.fixture(scope="module")
def norm_table(fused_bert, tmp_path_factory):
    _alternating.n = 0
    return tune.tune(fused_bert, [(1, 16), (4, 16)], out=tmp_path_factory.mktemp("norm") / "t.json", device="cpu",
                     arch=90, max_candidates=2, timer=_alternating, ops=("LayerNorm", "AddLayerNorm"),
                     log=lambda s: None)


def test_norm_problems_are_bucketed_by_rows(norm_table):
    """16 and 64 rows of the same H are two problems per op form (rows buckets 9..16 and 33..64); each entry
    holds the second candidate, which the runner launched (under the interpreter) before it was timed."""
    data = json.loads(norm_table.read_text())
    entries = data["entries"]
    assert {e["op"] for e in entries} == {"LayerNorm", "AddLayerNorm"}
    assert sorted({tuple(e["keys"][4]) for e in entries}) == [(9, 16), (33, 64)]  # the rows key
    for e in entries:
        h = e["keys"][3][0]
        assert e["keys"][3] == [h, h] and e["problem"]["shapes"][0][-1] == h
        assert not e["builtin"] and e["timed"] == 2
        op = BY_NAME[e["op"]]
        assert e["config"] == op.tuning.candidates("float", tuple(e["problem"]["keys"]), 90)[1]
    # post-LN BERT's next residual is Y, so no AddLayerNorm there keeps its sum (the store_sum key is 0)
    assert {e["keys"][1][0] for e in entries if e["op"] == "AddLayerNorm"} == {0}


def test_build_dispatches_the_tuned_norm_by_rows(norm_table, tmp_path):
    """The tuned LayerNorm spec (one row bucket, exact H) comes first and is taken only inside its bucket."""
    run_cli("build", "--arch", "90", "--tuning", norm_table, "-o", tmp_path)
    lib = ctypes.CDLL(str(tmp_path / "libort_triton.so"))
    lib.ort_triton_plan.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int),
                                    ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    (entry,) = [e for e in json.loads(norm_table.read_text())["entries"]
                if e["op"] == "LayerNorm" and e["keys"][4] == [9, 16]]
    h = entry["keys"][3][0]

    def plan(rows, hidden=h):
        msg = ctypes.create_string_buffer(512)
        rc = lib.ort_triton_plan(b"LayerNorm", FLOAT, 90, 3, (ctypes.c_int * 3)(1, 1, 1), (ctypes.c_int * 3)(2, 1, 1),
                                 (ctypes.c_int64 * 4)(rows, hidden, hidden, hidden), 1, msg, 512)
        assert rc == 0, msg.value
        return dict(kv.split("=") for kv in msg.value.decode().split())

    tuned = plan(16)
    tuned_specs = sum(1 for e in json.loads(norm_table.read_text())["entries"] if e["op"] == "LayerNorm")
    assert int(tuned["spec"]) < tuned_specs and int(tuned["block"]) == 32 * entry["config"]["num_warps"]
    assert int(tuned["grid"].split(",")[0]) == -(-16 // entry["config"]["ROWS"])
    for rows, hidden in ((17, h), (8, h), (16, h + 16)):  # another row bucket; another H
        assert int(plan(rows, hidden)["spec"]) >= tuned_specs


def _bf16_layer_norm_model(path):
    """x [b, s, 64] bfloat16 -> our LayerNorm (bf16, its function body: LayerNormalization, which ORT CPU
    runs in bf16) -> y bfloat16."""
    from onnx import TensorProto, helper, numpy_helper

    from ort_triton.contract import DOMAIN
    from ort_triton.ops.layer_norm import LAYER_NORM

    h = 64
    vec = lambda name: numpy_helper.from_array(np.linspace(0.5, 1.5, h).astype(np.float32), name)
    graph = helper.make_graph(
        [helper.make_node("Cast", ["gamma32"], ["gamma"], to=TensorProto.BFLOAT16),
         helper.make_node("Cast", ["beta32"], ["beta"], to=TensorProto.BFLOAT16),
         helper.make_node("LayerNorm", ["x", "gamma", "beta"], ["y"], domain=DOMAIN, name="ln", epsilon=1e-5)],
        "bf16", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["b", "s", h])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["b", "s", h])], [vec("gamma32"), vec("beta32")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)],
                              functions=[LAYER_NORM.function_proto(18)], ir_version=9)
    onnx.save(model, path)
    return path


def test_a_bfloat16_model_tunes(tmp_path):
    """bf16 inputs and the nodes' bf16 inputs go through OrtValues (numpy has no bfloat16, run() takes and
    gives none): the problem is a bfloat16 one and its runner launches the bf16 kernel."""
    model = _bf16_layer_norm_model(tmp_path / "bf16.onnx")
    out = tune.tune(model, [(2, 8)], device="cpu", arch=90, max_candidates=2, timer=scripted([1.0, 0.5]),
                    log=lambda s: None)
    (entry,) = json.loads(out.read_text())["entries"]
    assert entry["type"] == "bfloat16" and entry["problem"]["shapes"][0] == [2, 8, 64]
    assert entry["keys"] == [[1, 1], [0, 0], [1, 1], [64, 64], [9, 16]] and not entry["builtin"]


def test_compare_runs_a_bfloat16_model(tmp_path):
    """`ort-triton compare` with bfloat16 inputs and outputs: the model against itself passes (dtype column
    bfloat16), and against a copy whose gamma is changed fails."""
    model = _bf16_layer_norm_model(tmp_path / "bf16.onnx")
    res = run_cli("compare", model, model, "--inputs", "2x8")
    assert "PASSED: 1/1" in res.stdout and "bfloat16" in res.stdout
    other = onnx.load(model)
    other.graph.initializer[0].float_data[:] = []
    other.graph.initializer[0].raw_data = (np.ones(64, np.float32) * 3).tobytes()
    onnx.save(other, tmp_path / "other.onnx")
    res = run_cli("compare", model, tmp_path / "other.onnx", "--inputs", "2x8", check=False)
    assert res.returncode == 1 and "FAILED" in res.stdout


def test_two_tables_agree_within_noise(table, tmp_path):
    """agreement(): the same table agrees with itself; a second run that picked another config at the same
    time agrees (within noise), one whose pick is 10% slower does not."""
    rows, summary = tuning.agreement(table, table, tune.NOISE)
    assert all(r["same_config"] and r["agree"] for r in rows) and summary.startswith(f"{len(rows)}/{len(rows)}")
    data = json.loads(table.read_text())
    fast = data["entries"][0]
    other = next(c for c in MHA_TUNING.candidates("float", tuple(fast["problem"]["keys"]), 90)
                 if c != fast["config"])
    for ms, agree in ((fast["ms"] * 1.01, True), (fast["ms"] * 1.10, False)):
        data["entries"][0] = dict(fast, config=other, ms=ms)
        second = tmp_path / "second.json"
        second.write_text(json.dumps(data))
        rows, _ = tuning.agreement(table, second, tune.NOISE)
        (row,) = [r for r in rows if r["keys"] == fast["keys"]]
        assert not row["same_config"] and row["agree"] == agree


def test_linear_tunes_the_rows_it_runs(tmp_path):
    """A float16 Linear node met at 1 row (decode) and at 32 (cuBLAS runs there): one problem, the one-row one,
    whose entry is the scripted fastest candidate; the 32-row shape gives none (its keys are None)."""
    from onnx import TensorProto, helper

    from ort_triton.contract import DOMAIN
    from ort_triton.ops.linear import LINEAR

    k, n = 64, 40
    wt = np.random.default_rng(0).normal(size=(n, k)).astype(np.float16)
    graph = helper.make_graph(
        [helper.make_node("Linear", ["x", "wt"], ["y"], domain=DOMAIN)], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["b", "s", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["b", "s", n])],
        [onnx.numpy_helper.from_array(wt, "wt")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)],
                              functions=[LINEAR.function_proto(18)], ir_version=9)
    onnx.save(model, tmp_path / "linear.onnx")
    out = tune.tune(tmp_path / "linear.onnx", [(1, 1), (4, 8)], device="cpu", arch=90, max_candidates=3,
                    timer=scripted([1.0, 2.0, 0.5]), log=lambda s: None)
    (entry,) = json.loads(out.read_text())["entries"]
    assert entry["op"] == "Linear" and entry["keys"] == [[1, 1], [64, 4096], [64, 64], [40, 40]]
    assert not entry["builtin"] and entry["config"] == BY_NAME["Linear"].tuning.candidates("float16",
                                                                                         (1, 64, 64, 40), 90)[2]
    assert entry["problem"]["seen_at"] == ["shape 1x1"]
