"""ort_triton.Session on its CPU path: requests padded up to a bucket give the unpadded model's outputs,
a request no bucket holds is a clear error, and many threads on one session give the serial results.
(The CUDA-graph path is tests/gpu/test_session_cuda_graph.py.)"""

import concurrent.futures

import numpy as np
import onnxruntime as ort
import pytest

import graph_rewrites
from ort_triton import models
from ort_triton.compare import random_inputs
from ort_triton.session import Session

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    path = models.export(models.build("bert-tiny"), tmp_path_factory.mktemp("s") / "bert.onnx")
    fused = graph_rewrites.optimize(str(path))
    return fused, ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def session(bert):
    return Session(bert[0], buckets=[(1, 16), (4, 32)], providers=["CPUExecutionProvider"])


def _rel(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize("batch, seq", [(1, 16), (1, 9), (3, 20), (4, 32), (2, 16)])
def test_padded_requests_match_the_dynamic_model(bert, session, batch, seq):
    feeds = random_inputs(bert[1], batch, seq, 512, seed=batch * seq)
    (want,) = bert[1].run(None, feeds)
    (got,) = session.run(feeds)
    assert got.shape == want.shape
    assert _rel(got, want) < 1e-5


def test_no_graphs_on_cpu_is_said(session):
    assert session.fallback_reason == "no CUDA graphs on CPUExecutionProvider"
    assert not session.cuda_graph


def test_a_request_too_large_is_a_clear_error(bert, session):
    feeds = random_inputs(bert[1], 5, 8, 512, seed=1)
    with pytest.raises(ValueError, match="no bucket holds inputs of shapes"):
        session.run(feeds)
    with pytest.raises(ValueError, match="missing input"):
        session.run({"input_ids": feeds["input_ids"]})


def test_bucket_shorthand_needs_matching_ranks(bert):
    with pytest.raises(ValueError, match="shorthand for inputs of rank 3"):
        Session(bert[0], buckets=[(1, 16, 2)], providers=["CPUExecutionProvider"])


def test_threads_on_one_session_match_serial_runs(bert, session):
    shapes = [(1, 16), (3, 20), (4, 32), (2, 11)] * 4
    feeds = [random_inputs(bert[1], b, s, 512, seed=i) for i, (b, s) in enumerate(shapes)]
    serial = [session.run(f)[0] for f in feeds]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        threaded = list(pool.map(lambda f: session.run(f)[0], feeds))
    for a, b in zip(serial, threaded):
        np.testing.assert_array_equal(a, b)


def test_a_large_model_goes_through_files(bert, monkeypatch):
    """Past protobuf's 2 GiB a bucket's model cannot be passed as bytes: it is saved with external data
    (forced here for a small model)."""
    import ort_triton.session as session_module

    monkeypatch.setattr(session_module, "_INLINE_LIMIT", 0)
    sess = Session(bert[0], buckets=[(2, 16)], providers=["CPUExecutionProvider"])
    assert any(p.suffix == ".data" for p in __import__("pathlib").Path(sess._tmp.name).iterdir())
    feeds = random_inputs(bert[1], 2, 12, 512, seed=9)
    assert _rel(sess.run(feeds)[0], bert[1].run(None, feeds)[0]) < 1e-5
