"""The bench as a Python API and as a stable interface: `ort_triton.bench(...)` callable however the package
was imported, the runtime names other tools read, TensorRT's missing-runtime reason on a CUDA machine
without it, and the plot without an empty panel."""

import importlib.util

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ort_triton.bench import report, runtimes

# the names; the JSON rows, CSVs and plots already committed use them
STABLE_RUNTIMES = ("ort_stock", "ort_stock_cuda_graph", "ort_optimizer", "onnxscript_fusions", "ort_triton",
                   "ort_triton_cuda_graph", "torch_eager", "torch_compile", "torch_compile_cuda_graph", "tensorrt")


def _ln_model(path):
    h = 32
    g = helper.make_graph([helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", h])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", h])],
                          [numpy_helper.from_array(np.linspace(0.5, 1.5, h, dtype=np.float32), "g"),
                           numpy_helper.from_array(np.linspace(-1, 1, h, dtype=np.float32), "b")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    return path


def test_ort_triton_bench_is_callable_after_its_package_is_imported(tmp_path):
    import ort_triton
    import ort_triton.bench.harness  # binds ort_triton.bench to the package, over the lazy function

    src = _ln_model(tmp_path / "ln.onnx")
    logged = []
    rows = ort_triton.bench(src, shapes=[(2, 8)], runtimes=["ort_stock", "ort_triton", "tensorrt"], device="cpu",
                            warmup=0, iters=2, log=logged.append)
    assert [(r["runtime"], r["status"]) for r in rows] == [("ort_stock", "ok"), ("ort_triton", "ok"),
                                                           ("tensorrt", "skipped")]
    assert rows[1]["max_abs_err"] < 1e-5 and rows[1]["reference"] == "onnxruntime CPU fp32"
    assert any(line.startswith("tensorrt: skipped:") for line in logged)


def test_runtime_names_are_stable():
    assert set(STABLE_RUNTIMES) <= set(runtimes.RUNTIMES)
    assert set(STABLE_RUNTIMES) <= set(runtimes.DEFAULT_RUNTIMES)


def test_tensorrt_says_why_it_is_missing_on_cuda(tmp_path, monkeypatch):
    model = runtimes.BenchModel("m", tmp_path / "m.onnx", "float16", "cuda", {}, tmp_path)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorrt" else
                        find_spec(name, *a))
    monkeypatch.setattr(runtimes.TensorRT, "_via_ort", staticmethod(lambda: False))
    reason = runtimes.TensorRT().available(model)
    assert reason.startswith("no TensorRT: ORT's TensorRT EP is ") and reason.endswith("no tensorrt Python package")


def _row(runtime, batch, p50, status="ok"):
    return dict(model="m", export={"exporter": "dynamo", "opset": 20}, dtype="float16", device="cuda", batch=batch,
                seq=128, runtime=runtime, status=status, error=None if status == "ok" else "why", p50_ms=p50,
                gpu="GPU", versions={"onnxruntime": "1", "torch": "2"}, iters=10)


def test_plot_has_a_speedup_panel_only_with_ort_stock():
    ours = [_row("ort_triton", 1, 1.0), _row("ort_triton_cuda_graph", 1, 0.5), _row("ort_triton", 8, 4.0),
            _row("ort_triton_cuda_graph", 8, 3.0)]
    fig = report.figure(report.add_speedups(ours))
    assert len(fig.axes) == 1  # no ort_stock: no empty speedup axes
    assert fig.axes[0].get_ylabel() == "p50 latency (ms, log scale)" and fig.axes[0].get_yscale() == "log"
    assert fig.axes[0].get_xlabel() == "shape (batch x sequence length)"
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["1x128", "8x128"]
    fig = report.figure(report.add_speedups([*ours, _row("ort_stock", 1, 2.0), _row("ort_stock", 8, 6.0)]))
    assert len(fig.axes) == 2 and fig.axes[1].get_ylabel() == "speedup over ort_stock (log scale)"
    assert {t.get_text() for t in fig.axes[0].get_legend().get_texts()} == {"ort_stock", "ort_triton",
                                                                            "ort_triton_cuda_graph"}
