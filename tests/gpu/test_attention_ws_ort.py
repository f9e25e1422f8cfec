"""On the GPU: the warp-specialised attention kernel (kernels/attention.py `_attention_ws`) through ORT's CUDA EP,
from a library built with a tuning table whose entries pick it (what `ort-triton tune` writes when it wins),
against the float64 reference: MultiHeadAttention and PackedMultiHeadAttention nodes, fp16 and bf16, padding
of both kinds with a fully masked row. The launch count proves the kernel ran; the plan hook proves it was
the WS spec (three warp groups a program, Triton's global scratch from ORT's arena). Needs Hopper."""

import json

import numpy as np
import pytest
import torch

from ort_triton import tuning
from ort_triton.ops.attention import WS_ENV, reference_attention, ws_enabled
from ort_triton.ops.packed_attention import reference_packed_attention
from ort_triton.runtime import launch_count, make_session
from tests import native_hooks
from tests.conftest import run_cli
from tests.gpu.test_attention_ort import TYPES, _key_bias, _model, _packed_model, _round

pytestmark = [pytest.mark.gpu,  # experimental (ops/attention.py `ws_enabled`): its first launch did not return
              pytest.mark.skipif(not ws_enabled(), reason=f"{WS_ENV} is not 1")]
WS = dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, WS=1)
CASES = [(4, 128, 12, 64), (2, 512, 12, 64), (2, 256, 8, 128), (3, 144, 4, 32)]  # B, S, N, D: S multiples of 16


@pytest.fixture(scope="module")
def ws_library(tmp_path_factory):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the warp-specialised kernel needs sm_90 or later")
    tmp = tmp_path_factory.mktemp("ws")
    entries = []
    for op in ("MultiHeadAttention", "PackedMultiHeadAttention"):
        for type_name in ("float16", "bfloat16"):
            for b, s, n, d in CASES:
                if op.startswith("Packed") and d == 128:
                    continue
                bn = b * n
                entries.append({"op": op, "type": type_name, "arch": 90, "builtin": False, "config": WS,
                                "keys": [[d, d], [1, 1], [s, s], [bn, bn]]})
    table = tmp / "ws.tuning.json"
    table.write_text(json.dumps({"format": tuning.FORMAT, "arch": 90, "entries": entries}))
    run_cli("build", "--arch", "90", "--tuning", table, "-o", tmp / "lib", timeout=1800)
    return tmp / "lib" / "libort_triton.so"


def _plan_block(lib_path, op, type_name, shapes, heads, d):
    elem = {"float16": native_hooks.FLOAT16, "bfloat16": native_hooks.BFLOAT16}[type_name]
    return native_hooks.plan_fields(native_hooks.load(lib_path), op, shapes, 1, [heads, d**-0.5], elem, 90)


@pytest.mark.parametrize("type_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("b, s, n, d", CASES, ids=str)
@pytest.mark.parametrize("low", ["finfo.min", "-inf"])
def test_multi_head_attention(ws_library, type_name, b, s, n, d, low):
    _, torch_dtype, tol = TYPES[type_name]
    hidden = n * d
    plan = _plan_block(ws_library, "MultiHeadAttention", type_name, [[b, s, hidden]] * 3 + [[b, s], [hidden], [hidden]],
                       n, d)
    assert plan["spec"] == "0" and plan["block"] == "384" and "triton_scratch" in plan
    rng = np.random.default_rng(s + d)
    q, k, v = (rng.normal(size=(b, s, hidden)).astype(np.float32) for _ in range(3))
    biases = [rng.normal(0, 0.5, hidden).astype(np.float32) for _ in range(2)]
    low_value = float(torch.finfo(torch_dtype).min) if low == "finfo.min" else float("-inf")
    kb, lengths = _key_bias(b, s, type_name, rng, low_value)
    sess = make_session(_model(type_name, b, s, s, hidden, n, d**-0.5), providers=["CUDAExecutionProvider"],
                        library=ws_library)
    before = launch_count(ws_library)
    (got,) = sess.run(None, {"q32": q, "k32": k, "v32": v, "key_bias32": kb, "k_bias32": biases[0],
                             "v_bias32": biases[1]})
    assert launch_count(ws_library) == before + 1, "the Triton kernel did not run"
    (want,) = reference_attention(*(_round(a, torch_dtype) for a in (q, k, v, kb, *biases)), n, d**-0.5)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() / max(np.abs(want).max(), 1e-6) < tol
    if low == "-inf" and lengths[-1] == 0:
        assert (got[-1] == 0).all()


@pytest.mark.parametrize("type_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("b, s, n, d", [c for c in CASES if c[3] != 128], ids=str)
def test_packed_multi_head_attention(ws_library, type_name, b, s, n, d):
    _, torch_dtype, tol = TYPES[type_name]
    hidden = n * d
    plan = _plan_block(ws_library, "PackedMultiHeadAttention", type_name, [[b, s, 3 * hidden], [b, s], [3 * hidden]],
                       n, d)
    assert plan["spec"] == "0" and plan["block"] == "384"
    rng = np.random.default_rng(s * 3 + d)
    qkv = rng.normal(size=(b, s, 3 * hidden)).astype(np.float32)
    bias = rng.normal(0, 0.5, 3 * hidden).astype(np.float32)
    kb, _ = _key_bias(b, s, type_name, rng, float(torch.finfo(torch_dtype).min))
    sess = make_session(_packed_model(type_name, b, s, hidden, n, d**-0.5), providers=["CUDAExecutionProvider"],
                        library=ws_library)
    before = launch_count(ws_library)
    (got,) = sess.run(None, {"qkv32": qkv, "key_bias32": kb, "bias32": bias})
    assert launch_count(ws_library) == before + 1, "the Triton kernel did not run"
    (want,) = reference_packed_attention(*(_round(a, torch_dtype) for a in (qkv, kb, bias)), n, d**-0.5)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() / max(np.abs(want).max(), 1e-6) < tol
