"""The decoder benchmark on its CPU path (the GPU run is scripts/gpu_bench_decoder.sh): every runtime that can
run here gives a row per shape with times and the step's counts, each runtime's last-token logits are
compared with the float32 module's, and a runtime that cannot run (CUDA graphs on the CPU) or a shape longer
than the model's positions is a skipped row with the reason."""

import pytest

from ort_triton.bench import decoder

pytestmark = pytest.mark.slow


def test_decoder_bench_cpu_rows():
    # llama-tiny has 256 positions: a decode step over 256 past positions needs 257
    rows = decoder.bench("llama-tiny", [(2, 9)], [(1, 20), (1, 256)],
                         ["ort_stock", "ort_triton", "ort_opset23_cuda_graph", "ort_triton_static", "torch_eager"],
                         dtype="float32", device="cpu", warmup=1, iters=3, log=lambda s: None)
    too_long = [r for r in rows if r["past"] == 256]
    assert len(too_long) == 5 and all(r["status"] == "skipped" for r in too_long)
    assert all("257 positions > the model's 256" in r["error"] for r in too_long
               if r["runtime"] != "ort_opset23_cuda_graph")  # that one is skipped for its own reason
    rows = [r for r in rows if r["past"] != 256]
    by = {(r["runtime"], r["phase"]): r for r in rows}
    assert len(rows) == 10
    for rt in ("ort_stock", "ort_triton", "ort_triton_static", "torch_eager"):
        pre, dec = by[(rt, "prefill")], by[(rt, "decode")]
        assert pre["status"] == dec["status"] == "ok", (pre, dec)
        assert (pre["batch"], pre["seq"], pre["past"]) == (2, 9, 0)
        assert (dec["batch"], dec["seq"], dec["past"]) == (1, 1, 20)
        assert 0 < pre["p50_ms"] <= pre["p90_ms"] <= pre["p99_ms"]
        assert pre["tflop_s"] > 0 and 0 < dec["ceiling_fraction"] < 1 and dec["bytes_min"] > 0
        for r in (pre, dec):  # the float32 reference: every runtime here runs in float32 too
            assert r["diff_against"] == "torch_float32" and r["rel_diff_last_logits"] < 1e-5, r
            assert r["max_abs_diff_last_logits"] > 0 or rt == "torch_eager"
            assert r["top1_agreement"] == 1.0
    assert "rms_norm" in by[("ort_triton", "prefill")]["info"]
    skipped = by[("ort_opset23_cuda_graph", "decode")]
    assert skipped["status"] == "skipped" and "CUDA graphs need --device cuda" in skipped["error"]


def test_a_work_directory_is_reused(tmp_path):
    """--work keeps the exports and fused models: a second run reuses them (same rows, same fusion info)."""
    args = dict(dtype="float32", device="cpu", warmup=1, iters=2, log=lambda s: None, work=tmp_path)
    first = decoder.bench("llama-tiny", [(1, 7)], [], ["ort_stock", "ort_triton"], **args)
    made = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert any(n.endswith(".default.onnx") for n in made) and any(n.endswith(".ort_triton.onnx.done") for n in made)
    second = decoder.bench("llama-tiny", [(1, 7)], [], ["ort_stock", "ort_triton"], **args)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == made  # nothing written again
    assert [r["status"] for r in second] == ["ok", "ok"]
    assert second[1]["info"] == first[1]["info"] and "rms_norm" in second[1]["info"]
