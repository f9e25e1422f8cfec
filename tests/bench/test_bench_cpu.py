"""`ort-triton bench` on the CPU (the GPU runtimes are skipped with a reason): the rows' schema, the files,
a failing runtime that does not stop the others, the CLI, and the speedups on rows made up here."""

import csv
import json

import pytest

from ort_triton import cli, models
from ort_triton.bench import harness, report, runtimes
from tests.conftest import run_cli

# the names other tools read (the list); report.FIELDS holds them all
REQUIRED = ("model", "export", "batch", "seq", "runtime", "p50_ms", "p90_ms", "p99_ms", "max_abs_err", "gpu",
            "versions")
SHAPES = [(1, 16), (2, 24)]


class Broken(runtimes.Runtime):
    name = "broken"

    def prepare(self, model, shape, inputs):
        raise RuntimeError("boom\nsecond line")


class BadRewrite(runtimes.OrtStock):
    name = "bad_rewrite"
    calls = 0

    def rewrite(self, model):
        BadRewrite.calls += 1
        raise ValueError("cannot")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    logged = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(runtimes.RUNTIMES, "broken", Broken)
        mp.setitem(runtimes.RUNTIMES, "bad_rewrite", BadRewrite)
        rows = harness.bench(hf_config="bert-tiny", shapes=SHAPES, device="cpu", warmup=1, iters=3, out_dir=out,
                             runtimes=["ort_stock", "broken", "ort_optimizer", "onnxscript_fusions", "ort_triton",
                                       "torch_eager", "tensorrt", "ort_stock_cuda_graph", "bad_rewrite",
                                       "ort_optimizer_same_export"],
                             log=logged.append)
    return rows, out, logged


def test_rows_have_the_schema_and_numbers(run):
    rows, _, _ = run
    assert len(rows) == len(SHAPES) * 10
    for r in rows:
        assert set(report.FIELDS) <= set(r) and set(REQUIRED) <= set(r)
        assert r["model"] == "bert-tiny" and r["gpu"] is None and r["device"] == "cpu"
        assert r["export"] == {"exporter": "dynamo", "opset": r["export"]["opset"], "attn_implementation": "sdpa"}
        assert r["versions"]["onnxruntime"] and r["versions"]["torch"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["runtime"] for r in ok} == {"ort_stock", "ort_optimizer", "onnxscript_fusions", "ort_triton",
                                          "torch_eager", "ort_optimizer_same_export"}
    for r in ok:
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
        assert r["throughput_seq_s"] == pytest.approx(r["batch"] / r["p50_ms"] * 1e3)
        assert r["reference"] == "torch fp32 (cpu)" and r["max_abs_err"] < 1e-4 and r["mean_abs_err"] >= 0
        assert r["peak_mem_mb"] is None  # measured on cuda only
        assert r["speedup_vs_ort_stock"] > 0 and r["best_peer"] not in runtimes.OURS
    info = {r["runtime"]: r["info"] for r in ok}
    assert "layer_norm" in info["ort_triton"]  # the rewrite happened: the CPU runs its function bodies
    assert "SkipLayerNormalization" in info["ort_optimizer"] and "eager-attention" in info["ort_optimizer"]
    assert "eager-attention" not in info["ort_optimizer_same_export"]  # the dynamo sdpa file as it is
    assert "skip_layer_normalization" in info["onnxscript_fusions"]


def test_missing_and_failing_runtimes_are_rows(run):
    rows, _, logged = run
    by = {(r["runtime"], r["batch"]): r for r in rows}
    for b, _ in SHAPES:
        assert by["tensorrt", b]["status"] == "skipped" and "TensorRT needs --device cuda" in by["tensorrt", b]["error"]
        assert by["ort_stock_cuda_graph", b]["status"] == "skipped"
        assert by["broken", b]["status"] == "failed" and by["broken", b]["error"] == "RuntimeError: boom"
        assert by["torch_eager", b]["status"] == "ok"  # after the broken one
        assert by["broken", b]["p50_ms"] is None and by["broken", b]["speedup_vs_ort_stock"] is None
        assert by["bad_rewrite", b]["error"] == "ValueError: cannot"
    assert BadRewrite.calls == 1  # a failed rewrite is not retried at every shape
    assert sum("tensorrt: skipped" in line for line in logged) == 1  # said once, not per shape
    assert any("broken" in line and "boom" in line for line in logged)
    notes = report.notes(rows)  # under the table: each reason once
    assert "tensorrt: skipped: TensorRT needs --device cuda" in notes and "broken: failed: RuntimeError: boom" in notes


def test_files_are_written(run):
    rows, out, _ = run
    stem = out / "bert-tiny-float32-cpu"
    assert json.loads(stem.with_suffix(".json").read_text()) == json.loads(json.dumps(rows))
    with stem.with_suffix(".csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert tuple(table[0]) == report.FIELDS and len(table) == len(rows)
    assert json.loads(table[0]["export"])["exporter"] == "dynamo"
    assert stem.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert stem.with_suffix(".md").read_text() == report.markdown(rows)  # the printed table, as a file


def test_report_merges_and_redraws(run, tmp_path, capsys):
    _, out, _ = run
    report.main([str(out / "bert-tiny-float32-cpu.json"), "--out", str(tmp_path)])
    assert (tmp_path / "bert-tiny-float32-cpu.png").is_file()
    assert "ort_triton" in capsys.readouterr().out


def test_cli_on_a_model_file(tmp_path):
    src = models.export(models.build("bert-tiny"), tmp_path / "tiny.onnx", exporter="torchscript")
    res = run_cli("bench", src, "--device", "cpu", "--runtimes", "ort_stock,ort_triton,tensorrt", "--shapes",
                  "1x16,2x16", "--warmup", "1", "--iters", "3", "--out", tmp_path / "out")
    assert "tiny float32 on CPU" in res.stdout and "TensorRT needs --device cuda" in res.stdout
    rows = json.loads((tmp_path / "out" / "tiny-float32-cpu.json").read_text())
    assert [r["status"] for r in rows] == ["ok", "ok", "skipped"] * 2
    assert rows[0]["export"]["exporter"].startswith("pytorch") and rows[0]["export"]["file"] == "tiny.onnx"
    assert rows[0]["reference"] == "onnxruntime CPU fp32" and rows[1]["max_abs_err"] < 1e-4
    assert rows[0]["command"].startswith("ort-triton bench") and "--iters=3" in rows[0]["command"]


@pytest.mark.parametrize("argv, expect", [
    ([], "give a MODEL.onnx or --hf-config"),
    (["--hf-config", "bert-tiny", "--shapes", "8x"], "bad shape '8x'"),
    (["--hf-config", "bert-tiny", "--runtimes", "ort_stock,nope"], "unknown runtime(s) nope"),
    (["--hf-config", "bert-tiny", "--shapes", "1x256"], "at most 128 positions"),
    (["--hf-config", "no-such-model"], "unknown --hf-config"),
])
def test_cli_usage_errors_exit_2(argv, expect, capsys):
    assert cli.main(["bench", "--device", "cpu", *argv]) == 2
    assert expect in capsys.readouterr().err


def _row(runtime, p50, batch=1, model="m", status="ok"):
    return dict(model=model, export={"exporter": "dynamo"}, dtype="float16", device="cuda", batch=batch, seq=16,
                runtime=runtime, status=status, p50_ms=p50 if status == "ok" else None)


def test_speedups_on_synthetic_rows():
    rows = [_row("ort_stock", 10.0), _row("ort_triton", 4.0), _row("ort_triton_cuda_graph", 2.0),
            _row("torch_eager", 5.0), _row("torch_compile", None, status="failed"),
            _row("ort_stock", None, batch=8, status="failed"), _row("ort_triton", 8.0, batch=8),
            _row("onnxscript_fusions", 16.0, batch=8),
            _row("ort_stock", 1.0, model="other"), _row("ort_triton", 2.0, model="other")]
    report.add_speedups(rows)
    got = {(r["model"], r["batch"], r["runtime"]): (r["speedup_vs_ort_stock"], r["best_peer"],
                                                      r["speedup_vs_best_peer"]) for r in rows}
    assert got["m", 1, "ort_stock"] == (1.0, "torch_eager", 0.5)
    assert got["m", 1, "ort_triton"] == (2.5, "torch_eager", 1.25)
    assert got["m", 1, "ort_triton_cuda_graph"] == (5.0, "torch_eager", 2.5)
    assert got["m", 1, "torch_eager"] == (2.0, "torch_eager", 1.0)
    assert got["m", 1, "torch_compile"] == (None, "torch_eager", None)
    assert got["m", 8, "ort_triton"] == (None, "onnxscript_fusions", 2.0)  # no ort_stock result at 8x16
    assert got["other", 1, "ort_triton"] == (0.5, "ort_stock", 0.5)  # another model is its own group


def test_parse_shapes():
    assert harness.parse_shapes("1x128, 8X512") == [(1, 128), (8, 512)]
    for bad in ("0x8", "8", "axb", ""):
        with pytest.raises(harness.BenchError):
            harness.parse_shapes(bad)
