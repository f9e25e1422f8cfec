"""On the GPU: CausalAttention's fused merge (FUSED_MERGE, one launch for a split decode, the last chunk of each row
tile merging by a ticket counter) through ORT's CUDA EP, from a library whose tuning entries pick it, against the
float64 reference: decode shapes of several row-tile and chunk counts in one session, one after another and
repeated (the counters must come back to 0 after every launch), threads on one session (ORT may run them on
other streams: the node keeps counters per stream), and a CUDA graph (the counters made at the first run, the
captured launch using them)."""

import concurrent.futures
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from ort_triton import tuning
from ort_triton.ops.causal_attention import reference_causal_attention
from ort_triton.runtime import launch_count, make_session, register
from tests import native_hooks
from tests.conftest import run_cli
from tests.gpu.test_causal_attention_gpu import DTYPES, _inputs, _node_model

pytestmark = pytest.mark.gpu
# (B, Nq, Nkv, T): Llama-1B's heads at batch 1 and 4, GPT-2's, MQA; each splits the cache (B * Nkv < 128 programs)
SHAPES = [(1, 32, 8, 1024), (4, 32, 8, 777), (1, 12, 12, 2000), (2, 8, 1, 4096)]
BUCKET = [[64, 64], [1, 16], [0, 127], [257, 8192]]  # head dim 64, decode rows, programs, keys
CONFIG = dict(BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=2, SPLIT_TARGET=128, FUSED_MERGE=1)


def _arch():
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


@pytest.fixture(scope="module")
def fused_library(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fused")
    arch = _arch()
    entries = [{"op": "CausalAttention", "type": t, "arch": arch, "builtin": False, "keys": BUCKET,
                "config": dict(CONFIG, BLOCK_N=32) if t == "float" else CONFIG} for t in DTYPES]
    table = tmp / "fused.tuning.json"
    table.write_text(json.dumps({"format": tuning.FORMAT, "arch": arch, "entries": entries}))
    run_cli("build", "--arch", str(arch), "--tuning", table, "-o", tmp / "lib", timeout=1800)
    return tmp / "lib" / "libort_triton.so"


def _feeds(type_name, b, nq, nkv, t, seed):
    q, k, v, kb = _inputs(b, nq, nkv, 1, t, 64, DTYPES[type_name][1], [0, t // 3, 5, 0][:b], seed=seed)
    return (q, k, v, kb), {n + "32": x.float().numpy() for n, x in zip(["Q", "K", "V", "key_bias"], (q, k, v, kb))}


def _check(got, tensors, type_name):
    (want,) = reference_causal_attention(*(x.double().numpy() for x in tensors), 0.125, 0)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() / np.abs(want).max() < DTYPES[type_name][2]


@pytest.mark.parametrize("type_name", list(DTYPES))
def test_decode_shapes_one_after_another(fused_library, type_name):
    lib = native_hooks.load(fused_library)
    elem = {"float": native_hooks.FLOAT, "float16": native_hooks.FLOAT16, "bfloat16": native_hooks.BFLOAT16}[type_name]
    sess = make_session(_node_model(type_name, 0, 0.125), providers=["CUDAExecutionProvider"], library=fused_library)
    for _ in range(3):  # repeated: each launch must leave the counters at 0
        for i, (b, nq, nkv, t) in enumerate(SHAPES):
            rc, msg = native_hooks.plan_attrs(lib, "CausalAttention", [[b, nq, 1, 64], [b, nkv, t, 64], [b, nkv, t, 64],
                                                                        [b, t]], 1, [0.125, 0], elem, _arch())
            assert rc == 0 and "merge_counters" in msg, msg
            tensors, feeds = _feeds(type_name, b, nq, nkv, t, seed=i)
            before = launch_count(fused_library)
            (got,) = sess.run(None, feeds)
            assert launch_count(fused_library) == before + 1
            _check(got, tensors, type_name)


def test_threads_on_one_session_match_serial_runs(fused_library):
    sess = make_session(_node_model("float16", 0, 0.125), providers=["CUDAExecutionProvider"], library=fused_library)
    feeds = [_feeds("float16", *SHAPES[i % len(SHAPES)], seed=i)[1] for i in range(8)]
    serial = [sess.run(None, f)[0] for f in feeds]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for got, want in zip(pool.map(lambda f: sess.run(None, f)[0], feeds * 4), serial * 4):
            np.testing.assert_array_equal(got, want)


def test_cuda_graph_replays_the_fused_launch(fused_library):
    """ORT's CUDA graph over the node (static shapes, IO binding): the first run makes the counters, the captured
    launch uses them, and replays over new inputs match the reference."""
    b, nq, nkv, t = SHAPES[0]
    so = ort.SessionOptions()
    register(so, fused_library)
    model = _node_model("float16", 0, 0.125)
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
    tensors, feeds = _feeds("float16", b, nq, nkv, t, seed=0)
    inputs = {n: ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0) for n, x in feeds.items()}
    out = ort.OrtValue.ortvalue_from_shape_and_type([b, 1, nq * 64], np.float32, "cuda", 0)
    binding = sess.io_binding()
    for n, x in inputs.items():
        binding.bind_ortvalue_input(n, x)
    binding.bind_ortvalue_output("y32", out)
    for seed in range(4):  # the first runs capture, the rest replay
        tensors, feeds = _feeds("float16", b, nq, nkv, t, seed=seed)
        for n, x in feeds.items():
            inputs[n].update_inplace(x)
        sess.run_with_iobinding(binding)
        _check(out.numpy(), tensors, "float16")
