"""Many threads on one session, and two sessions, give the serial results bit for bit (the kernel is
deterministic: one program owns a row), and the module cache loads under contention."""

import concurrent.futures

import numpy as np
import pytest

import graph_rewrites
from ort_triton.runtime import make_session
from tests.norm_ort_cases import layer_norm_model

pytestmark = pytest.mark.gpu


def test_threads_and_sessions_match_serial_runs(gpu_library):
    model = graph_rewrites.optimize(layer_norm_model((64, 768), "float16", "residual+sum")[0])
    sessions = [make_session(model, providers=["CUDAExecutionProvider"], library=gpu_library) for _ in range(2)]
    rng = np.random.default_rng(0)
    feeds = [{"x32": rng.normal(size=(64, 768)).astype(np.float32),
              "r32": rng.normal(size=(64, 768)).astype(np.float32)} for _ in range(16)]
    serial = [sessions[0].run(None, f) for f in feeds]

    def work(i):
        return i, sessions[i % 2].run(None, feeds[i % len(feeds)])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for i, outs in pool.map(work, range(200)):
            for got, want in zip(outs, serial[i % len(feeds)]):
                np.testing.assert_array_equal(got, want)
