"""ort_triton.Session on the CUDA EP: the static-shape buckets capture CUDA graphs (no fallback), replays
pick up new inputs, results match ORT CPU on the dynamic model, threads on one session match serial runs;
and after ORT's partitioning every node of a specialised model is on the CUDA EP (ORT accepts capture)."""

import concurrent.futures

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

import graph_rewrites
from graph_rewrites.static_shapes import specialize
from ort_triton import models
from ort_triton.compare import random_inputs
from ort_triton.runtime import launch_count
from ort_triton.session import Session

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    src = models.export(models.build("bert-tiny"), tmp_path_factory.mktemp("g") / "bert.onnx")
    fused = graph_rewrites.optimize(str(src))
    return src, fused, ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])


def test_buckets_capture_and_match_cpu(bert, gpu_library):
    src, fused, cpu = bert
    sess = Session(fused, buckets=[(1, 16), (4, 32)], library=gpu_library, device_id=0)
    assert sess.fallback_reason is None and sess.cuda_graph
    before = launch_count(gpu_library)
    for i, (b, s) in enumerate([(1, 16), (1, 16), (3, 20), (4, 32), (1, 7)]):
        feeds = random_inputs(cpu, b, s, 512, seed=i)
        (want,) = cpu.run(None, feeds)
        (got,) = sess.run(feeds)
        assert got.shape == want.shape
        assert np.abs(got - want).max() / np.abs(want).max() < 2e-3  # fp32 on the GPU (TF32 GEMMs)
    assert launch_count(gpu_library) > before  # our kernels ran (at least in the capturing run)

    feeds = [random_inputs(cpu, 3, 20, 512, seed=100 + i) for i in range(8)]
    serial = [sess.run(f)[0] for f in feeds]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for got, want in zip(pool.map(lambda f: sess.run(f)[0], feeds * 4), serial * 4):
            np.testing.assert_array_equal(got, want)


def _captures(path, library) -> str | None:
    """None when ORT accepts CUDA-graph capture for the model (it refuses, at session creation, any model with
    a node outside the CUDA EP: "cannot use the graph capture feature ... not been partitioned to the
    CUDAExecutionProvider", seen on the decoder exports), else ORT's message."""
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library))
    try:
        sess = ort.InferenceSession(str(path), so, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
    except Exception as e:  # noqa: BLE001
        return str(e)
    return None if sess.get_providers()[0] == "CUDAExecutionProvider" else "not on CUDA"


@pytest.mark.parametrize("exporter", models.EXPORTERS)
def test_specialised_model_runs_every_node_on_cuda(gpu_library, tmp_path, exporter):
    """After ORT's partitioning no node of the specialised model is on the CPU: ORT accepts capture."""
    src = models.export(models.build("bert-tiny"), tmp_path / "bert.onnx", exporter=exporter)
    model = ir.serde.deserialize_model(graph_rewrites.optimize(str(src)))
    assert specialize(model, {"input_ids": [1, 16], "attention_mask": [1, 16]}) == []
    static = tmp_path / "static.onnx"
    static.write_bytes(ir.serde.serialize_model(model).SerializeToString())
    assert _captures(static, gpu_library) is None
