"""The decoder benchmark on its CPU path (the GPU run is scripts/gpu_bench_decoder.sh): every runtime that can
run here gives a row per shape with times and the step's counts, each runtime's last-token logits are
compared with the float32 module's, and a runtime that cannot run (CUDA graphs on the CPU) or a shape longer
than the model's positions is a skipped row with the reason."""

import re

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
    fused = decoder.ALL["ort_triton"]().key()
    assert any(n.endswith(".default.onnx") for n in made) and f"llama-tiny.float32.{fused}.onnx.done" in made
    second = decoder.bench("llama-tiny", [(1, 7)], [], ["ort_stock", "ort_triton"], **args)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == made  # nothing written again
    assert [r["status"] for r in second] == ["ok", "ok"]
    assert second[1]["info"] == first[1]["info"] and "rms_norm" in second[1]["info"]


def test_the_fused_model_is_keyed_by_its_rules(monkeypatch):
    """Another rule set (a default turned on or off since the work directory was filled, an ablation's twin)
    names another fused model, so a kept work directory never hands back a model fused by other rules."""
    import dataclasses

    from graph_rewrites import registry

    ours, twin = decoder.ALL["ort_triton"](), decoder.ALL["ort_triton_no_qkvc_static"]()
    assert ours.key().startswith("ort_triton-") and twin.key().startswith("ort_triton_no_qkvc-")
    before = ours.key()
    assert before == decoder.ALL["ort_triton_cuda_graph"]().key()  # one model for every runtime of one rule set
    monkeypatch.setattr(registry, "RULES", tuple(dataclasses.replace(r, default=False) if r.name == "qkv_cache"
                                                 else r for r in registry.RULES))
    assert ours.key() != before


def test_plus_rule_names_a_twin_with_the_rules_put_in():
    """BASE+RULE+RULE: an ort_triton runtime with rules that are off by default put in, on a fused model of its own
    (its key differs from the base's and names the rules); anything else is refused, naming what is known."""
    base = decoder.ALL["ort_triton_cuda_graph"]()
    twin = decoder.runtime("ort_triton_cuda_graph+add_rms_norm_swiglu+linear")
    assert twin.name == "ort_triton_cuda_graph+add_rms_norm_swiglu+linear" and twin.cuda_graph
    assert twin.enable == ("add_rms_norm_swiglu", "linear")
    assert twin.key().startswith("ort_triton+add_rms_norm_swiglu+linear-") and twin.key() != base.key()
    assert type(decoder.runtime("ort_triton_cuda_graph")) is type(base)
    # -RULE leaves a rule that is on out (an ablation), beside +RULE
    ablation = decoder.runtime("ort_triton_cuda_graph-causal_attention+gelu_mul")
    assert ablation.disable == ("causal_attention",) and ablation.enable == ("gelu_mul",) and ablation.cuda_graph
    assert ablation.key().startswith("ort_triton-causal_attention+gelu_mul-")
    assert ablation.key() not in (base.key(), decoder.runtime("ort_triton_cuda_graph+gelu_mul").key())
    for name, message in (("nope", "unknown runtime 'nope'"), ("ort_triton+nope", "unknown rule(s) ['nope']"),
                          ("ort_triton-nope", "unknown rule(s) ['nope']"),
                          ("ort_stock+linear", "after an ort_triton runtime")):
        with pytest.raises(ValueError, match=re.escape(message)):
            decoder.runtime(name)


def test_ort_runtimes_on_the_per_shape_model(tmp_path):
    """ORT's own runtimes on the model specialised per shape (what lets ORT capture its CUDA graphs on the cache
    exports): the opset-23 export (ONNX Attention, RMSNormalization, RotaryEmbedding) specialised for a prefill and
    a decode shape gives the float32 module's logits, and the CUDA-graph twin is a skipped row on the CPU."""
    rows = decoder.bench("llama-tiny", [(2, 9)], [(1, 20)], ["ort_opset23_static", "ort_opset23_static_cuda_graph"],
                         dtype="float32", device="cpu", warmup=1, iters=2, log=lambda s: None, work=tmp_path)
    by = {(r["runtime"], r["phase"]): r for r in rows}
    for phase in ("prefill", "decode"):
        r = by[("ort_opset23_static", phase)]
        assert r["status"] == "ok" and r["rel_diff_last_logits"] < 1e-5 and r["top1_agreement"] == 1.0, r
        assert r["export"]["opset"] == 23
        skipped = by[("ort_opset23_static_cuda_graph", phase)]
        assert skipped["status"] == "skipped" and "CUDA graphs need --device cuda" in skipped["error"]
    made = sorted(p.name for p in tmp_path.glob("*_static.*.onnx"))
    assert made == ["llama-tiny.float32.opset23_static.1x1x21.onnx", "llama-tiny.float32.opset23_static.2x9x9.onnx"]


def test_ort_optimizer_on_the_per_shape_model():
    """GPT-2 through ORT's transformers optimizer, specialised per shape: its contrib ops' output shapes come
    from ORT's symbolic shape inference, so no Shape node is left, and the logits stay the module's."""
    rows = decoder.bench("gpt2-tiny", [(2, 9)], [(1, 20)], ["ort_optimizer_static"], dtype="float32", device="cpu",
                         warmup=1, iters=2, log=lambda s: None)
    assert len(rows) == 2
    for r in rows:
        assert r["status"] == "ok" and r["rel_diff_last_logits"] < 1e-5 and r["top1_agreement"] == 1.0, r
        assert "SkipLayerNormalization" in r["info"] and r["export"]["exporter"] == "torchscript"


def test_a_per_shape_model_references_the_weights_file(tmp_path):
    """A model whose weights are in a data file (a 1B model's 2.2 GB) is specialised without copying them: the
    per-shape file references the same data file, stays small, and runs to the same logits."""
    import numpy as np
    import onnx_ir as ir

    m = decoder.Model("llama-tiny", "float32", "cpu", tmp_path)
    external = tmp_path / "external.onnx"
    ir.save(ir.load(str(m.export("default"))), str(external), external_data="external.onnx.data")

    class OnTheExternalFile(decoder.ALL["ort_opset23_static"]):
        def model_file(self, m):
            return external

    rt = OnTheExternalFile()
    rt.start(m)
    feeds = m.feeds("decode", 1, 20)
    logits = rt.runner(m, feeds).logits()
    import onnx

    def weights(path):  # initializer name -> its data file, "" when inline
        model = onnx.load(str(path), load_external_data=False)
        return {t.name: next((e.value for e in t.external_data if e.key == "location"), "")
                for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and t.ByteSize() > 1024
                or t.data_location == onnx.TensorProto.EXTERNAL}

    source = weights(external)
    assert len(source) > 10 and set(source.values()) == {"external.onnx.data"}
    specialised = weights(tmp_path / "external_static.1x1x21.onnx")
    assert specialised and set(specialised.values()) == {"external.onnx.data"}  # no weight inline
    assert set(specialised) <= set(source)
    assert sorted(p.name for p in tmp_path.glob("*.data")) == ["external.onnx.data"]  # no copy of the weights
    plain = decoder.ALL["ort_stock"]()
    plain.start(m)
    np.testing.assert_allclose(logits, plain.runner(m, feeds).logits(), rtol=1e-5, atol=1e-5)


def test_decode_counts_the_cache_copy_apart():
    """A decode row's least bytes (weights, the cache the attention reads, the new rows) and, apart, the Concat
    cache's copy of the past into present: Llama-1B's shape at 16 x 1024 in fp16 by hand."""
    from types import SimpleNamespace

    m = SimpleNamespace(dtype="float16", layers=16, kv_heads=8, head_dim=64, step_weight_elems=1_000_000,
                        config=SimpleNamespace(hidden_size=2048))
    r = decoder._counts(m, "decode", 16, 1024, ms=2.0)
    cache = 2 * 16 * 16 * 8 * 1024 * 64 * 2  # K and V, every layer, 2 bytes an element: 1.07 GB
    least = 1_000_000 * 2 + cache + 16 * 2048 * 2
    assert r["bytes_min"] == least and r["bytes_cache_copy"] == 2 * cache
    assert r["ceiling_fraction"] == pytest.approx(least / 2e-3 / 4080e9)
    assert r["ceiling_fraction_with_copy"] == pytest.approx((least + 2 * cache) / 2e-3 / 4080e9)


def test_seq_major_runtime_gives_the_same_logits():
    """ort_triton_seq_static (the cache sequence first, each present bound over its past) on CPU through the function
    bodies: the float32 reference's logits at prefill and decode, and the same as ort_triton_static's."""
    rows = decoder.bench("llama-tiny", [(2, 9)], [(2, 20)], ["ort_triton_static", "ort_triton_seq_static"],
                         dtype="float32", device="cpu", warmup=1, iters=2, log=lambda s: None)
    by = {(r["runtime"], r["phase"]): r for r in rows}
    for phase in ("prefill", "decode"):
        seq, heads = by[("ort_triton_seq_static", phase)], by[("ort_triton_static", phase)]
        assert seq["status"] == "ok", seq
        assert seq["rel_diff_last_logits"] < 1e-5 and seq["top1_agreement"] == 1.0, seq
        assert abs(seq["max_abs_diff_last_logits"] - heads["max_abs_diff_last_logits"]) < 1e-5
    assert decoder.runtime("ort_triton_seq_cuda_graph").kv_cache == "seq-major"
    assert decoder.runtime("ort_triton_seq_static").key() != decoder.runtime("ort_triton_static").key()
