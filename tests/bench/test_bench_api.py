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


def _labels(ax) -> list[tuple[float, object]]:
    """(value, text artist) of each y tick label drawn, major and minor: labelled and within the limits (the
    locators also hand out the ticks of the decades around them, which are not drawn)."""
    lo, hi = ax.get_ylim()
    texts = [t for t in ax.yaxis.get_ticklabels(which="both") if t.get_text() and t.get_visible()]
    labels = sorted((float(t.get_text().removesuffix("x").replace("\u2212", "-")), t) for t in texts)  # 1e−06
    return [(v, t) for v, t in labels if lo / 1.001 <= v <= hi * 1.001]


def test_plot_labels_a_tick_beyond_every_point_without_overlap():
    """Latencies from 0.6 to 3 ms: matplotlib's limits stop at the data, so with labels at 1, 2, 5 per decade the
    0.6 and 0.9 ms points sat under the lowest label ("1") and 3 ms over the highest ("2"). Each panel now
    has a labelled tick at or beyond its lowest and its highest point, and no two labels overlap."""
    rows = [_row("ort_stock", 1, 0.9), _row("ort_triton", 1, 0.6), _row("ort_stock", 8, 3.0),
            _row("ort_triton", 8, 1.5)]
    fig = report.figure(report.add_speedups(rows))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax, values in ((fig.axes[0], [0.6, 0.9, 1.5, 3.0]), (fig.axes[1], [1.0, 1.5, 2.0])):
        labels = _labels(ax)
        assert labels[0][0] <= min(values) and labels[-1][0] >= max(values), [v for v, _ in labels]
        boxes = [t.get_window_extent(renderer) for _, t in labels]
        assert all(a.y1 <= b.y0 for a, b in zip(boxes, boxes[1:])), [(b.y0, b.y1) for b in boxes]
    assert any(v < 1 for v, _ in _labels(fig.axes[0]))


def test_save_writes_the_printed_table_as_markdown(tmp_path):
    """The table `bench` prints is also a file, <stem>.md next to the JSON and CSV: the same title, cells and
    notes, as a markdown pipe table (the fastest p50 in ** **, a skipped runtime's reason in the notes)."""
    def full(runtime, batch, p50, status="ok"):
        ok = status == "ok"
        return {**_row(runtime, batch, p50 if ok else None, status), "p90_ms": p50 * 1.1 if ok else None,
                "p99_ms": p50 * 1.2 if ok else None, "throughput_seq_s": batch / p50 * 1e3 if ok else None,
                "peak_mem_mb": None, "max_abs_err": 1e-3 if ok else None, "info": "fused 3" if ok else None}

    rows = report.add_speedups([full("ort_stock", 1, 2.0), full("ort_triton", 1, 0.5),
                                full("tensorrt", 1, 0, "skipped"), full("ort_stock", 8, 6.0),
                                full("ort_triton", 8, 3.0), full("tensorrt", 8, 0, "skipped")])
    paths = report.save(rows, tmp_path, plot_png=False)
    md = tmp_path / "m-float16-cuda.md"
    assert md in paths and md.read_text() == report.markdown(rows)
    lines = md.read_text().splitlines()
    assert lines[0] == "m float16 on GPU (p50 fastest per shape in bold)"
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 2 + len(rows) and all(line.endswith("|") and line.count("|") == 11 for line in table)
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    assert cells[0][:3] == ["shape", "runtime", "p50 ms"] and set(cells[1][0]) == {"-"}
    assert [c[:4] for c in cells[2:]] == [
        ["1x128", "ort_stock", "2.000", "2.200"], ["1x128", "ort_triton", "**0.500**", "0.550"],
        ["1x128", "tensorrt", "skipped", ""], ["8x128", "ort_stock", "6.000", "6.600"],
        ["8x128", "ort_triton", "**3.000**", "3.300"], ["8x128", "tensorrt", "skipped", ""]]
    assert cells[3][7] == "4.00x"  # vs ort_stock, as printed
    assert "- tensorrt: skipped: why" in lines and "- ort_triton: fused 3" in lines
