"""bench.decoder_summary: the best runtime of each family per shape, and the ratios against ours."""

import json

from ort_triton.bench import decoder_summary


def row(runtime, ms, phase="decode", batch=1, n=1024, status="ok", **extra):
    shape = dict(seq=n, past=0) if phase == "prefill" else dict(seq=1, past=n)
    return dict(model="llama-1b", runtime=runtime, phase=phase, batch=batch, status=status, p50_ms=ms, **shape,
                **extra)


ROWS = [
    row("ort_stock", 8.0), row("ort_opset23_static_cuda_graph", 2.0), row("onnxscript_fusions", 1.0, status="error"),
    row("ort_triton_cuda_graph", 1.25, ceiling_fraction=0.42), row("ort_triton", 2.5),
    row("ort_triton_no_qrc_cuda_graph", 1.0),  # an ablation: not ours, not a peer
    row("torch_eager", 20.0), row("torch_compile_cuda_graph", 1.5),
    row("ort_stock", 30.0, phase="prefill", n=512), row("ort_triton_cuda_graph", 2.4, phase="prefill", n=512,
                                                        tflop_s=445.0),
]


def test_best_of_each_family_and_ratios():
    lines = decoder_summary.summarize(ROWS)
    assert [(x["phase"], x["n"]) for x in lines] == [("prefill", 512), ("decode", 1024)]
    dec = lines[1]
    assert dec["ours"] == dict(runtime="ort_triton_cuda_graph", p50_ms=1.25)
    assert dec["ort"]["runtime"] == "ort_opset23_static_cuda_graph"  # the failed onnxscript row is no result
    assert dec["torch"]["runtime"] == "torch_compile_cuda_graph"
    assert dec["vs_ort"] == 2.0 / 1.25 and dec["vs_torch"] == 1.5 / 1.25 and dec["ceiling_fraction"] == 0.42
    pre = lines[0]
    assert "torch" not in pre and "vs_torch" not in pre and pre["vs_ort"] == 30.0 / 2.4


def test_cli_merges_files(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(ROWS[:6]))
    b.write_text(json.dumps(ROWS[6:]))
    decoder_summary.main([str(a), str(b), "--markdown", str(tmp_path / "t.md")])
    out = capsys.readouterr().out
    assert out == (tmp_path / "t.md").read_text()
    assert "| llama-1b | decode 1x1024 | 1.250 | 2.000 (ort_opset23_static_cuda_graph) | 1.60x |" in out
    assert "| 1.500 (torch_compile_cuda_graph) | 1.20x | 42.0% |" in out
    assert "| llama-1b | prefill 1x512 | 2.400 | 30.000 (ort_stock) | 12.50x | - | - | 445 |" in out
