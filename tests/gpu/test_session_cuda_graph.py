"""ort_triton.Session on the CUDA EP: the static-shape buckets capture CUDA graphs (no fallback), replays
pick up new inputs, results match ORT CPU on the dynamic model, threads on one session match serial runs;
and after ORT's partitioning the specialised model has no Memcpy nodes where the dynamic export has some
(ORT logs the count; a subprocess captures ORT's log)."""

import concurrent.futures
import subprocess
import sys
import textwrap

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


_MEMCPY = textwrap.dedent("""
    import sys, onnxruntime as ort
    so = ort.SessionOptions(); so.log_severity_level = 1; so.register_custom_ops_library(sys.argv[2])
    ort.InferenceSession(sys.argv[1], so, providers=["CUDAExecutionProvider"])
""")


def _memcpy_log(path, library) -> str:
    res = subprocess.run([sys.executable, "-c", _MEMCPY, str(path), str(library)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    return [line for line in (res.stdout + res.stderr).splitlines() if "Memcpy nodes are added" in line]


def test_specialised_model_has_no_memcpy_after_partitioning(bert, gpu_library, tmp_path):
    src, fused, _ = bert
    static = tmp_path / "static.onnx"
    model = ir.serde.deserialize_model(fused)
    assert specialize(model, {"input_ids": [1, 16], "attention_mask": [1, 16]}) == []
    static.write_bytes(ir.serde.serialize_model(model).SerializeToString())
    # the export as it comes (shape subgraphs on the CPU: FACTS.md) against the fused, specialised model
    assert _memcpy_log(src, gpu_library), "expected ORT to report Memcpy nodes for the raw export"
    assert _memcpy_log(static, gpu_library) == []
