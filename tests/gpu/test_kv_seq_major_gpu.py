"""On the GPU: a tiny decoder fused with its cache sequence first (`optimize --kv-cache seq-major`) on ORT's CUDA EP
with the library, against the original on ORT CPU (fp32), at a left-padded prefill, a decode step and a chunk over a
past; then greedy decoding with each present bound over its past (examples/generate.py's IO-binding loop on device
buffers), the same tokens as the original's."""

import numpy as np
import onnxruntime as ort
import pytest

import graph_rewrites
from ort_triton import decoders
from ort_triton.ops.kv_layout import TO_SEQ
from ort_triton.runtime import launch_count, make_session

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name, enable", [("llama-tiny", None), ("qwen3-tiny", None), ("gpt2-tiny", ["qkv_cache"])])
def test_seq_major_decoder_on_cuda(gpu_library, tmp_path, name, enable):
    from examples.generate import greedy_io_binding

    model = decoders.build(name)
    path = decoders.export(model, tmp_path / "m.onnx", exporter="dynamo")
    optimized, rep = graph_rewrites.optimize(str(path), report=True, kv_cache="seq-major", enable=enable)
    layers = decoders.cache_spec(model)[0]
    assert f"--kv-cache seq-major: {layers} layer(s) relaid" in " ".join(rep.notes), rep.notes
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ours = make_session(optimized, providers=[("CUDAExecutionProvider", {"use_tf32": "0"})], library=gpu_library)
    pasts = decoders.input_names(model)[2:]
    presents = decoders.output_names(model)[1:]
    for batch, seq, past, pad in ((3, 9, 0, 4), (3, 1, 20, 6), (2, 5, 11, 3)):
        feeds = decoders.sample_inputs(model, batch, seq, past, seed=seq, left_pad=pad)
        before = launch_count(gpu_library)
        got = ours.run(None, {k: np.ascontiguousarray(v.transpose(TO_SEQ)) if k in pasts else v
                              for k, v in feeds.items()})
        assert launch_count(gpu_library) - before >= 2 * layers  # the cache ops and the attentions: kernels
        want = ref.run(None, feeds)
        for out, g, w in zip(ours.get_outputs(), got, want):
            w = w.transpose(TO_SEQ) if out.name in presents else w
            assert g.shape == w.shape and np.isfinite(g).all(), out.name
            assert np.abs(g - w).max() / np.abs(w).max() < 1e-4, out.name
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 6))
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    tokens = greedy_io_binding(ours, model.config, ids, 12, mask, device="cuda")  # layout: the metadata
    np.testing.assert_array_equal(tokens, decoders.greedy(ref, model.config, ids, 12, mask))
