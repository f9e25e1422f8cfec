"""Linear (ort_triton/ops/linear.py): the one-row register GEMV and the 1-16-row skinny product against the float64
reference under the interpreter on CPU (poisoned outputs; K a multiple of BLOCK_K and not, N not a multiple of
BLOCK_N), the function body at every opset, the native planner (ours up to 16 rows, the first config that fits;
cuBLAS beyond; the refusals), and on the GPU every path through ORT's CUDA EP, CUDA-graph capture included."""

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ort_triton.contract import DOMAIN
from ort_triton.kernels.gemv import gemv
from ort_triton.ops.linear import (
    BLOCK_M,
    CONFIGS,
    LINEAR,
    MASKED_BLOCK_K,
    SHARED_BYTES,
    TUNING,
    k_align,
    reference_linear,
)
from tests.native_hooks import FLOAT, FLOAT16, load, plan_attrs, plan_fields

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def _err(got, want):
    return np.abs(got - want).max() / np.abs(want).max()


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("n, k, block_n, block_k", [(1, 1, 1, 16), (5, 37, 2, 16), (9, 64, 4, 32), (3, 64, 8, 64),
                                                    (17, 100, 2, 32), (6, 96, 4, 32), (33, 2048, 2, 1024)], ids=str)
def test_gemv_matches_reference(dtype, n, k, block_n, block_k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(1, k, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    wt = torch.randn(n, k, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    y = torch.full((n,), float("nan"), dtype=dtype, device=DEVICE)
    gemv(x, wt, y, block_n=block_n, block_k=block_k)
    (want,) = reference_linear(x.double().cpu().numpy(), wt.double().cpu().numpy())
    got = y.double().cpu().numpy()
    assert np.isfinite(got).all(), "unwritten outputs"
    assert _err(got, want.reshape(-1)) < TOL[dtype]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("m, n, k, block_n, block_k, stages", [
    (1, 1, 1, 16, 16, 1), (1, 37, 100, 16, 32, 2), (2, 33, 64, 32, 32, 3), (5, 70, 96, 32, 64, 2),
    (16, 64, 256, 32, 64, 3), (9, 17, 33, 16, 16, 1), (3, 40, 512, 16, 128, 4)], ids=str)
def test_skinny_matches_reference(dtype, m, n, k, block_n, block_k, stages):
    """The tl.dot family: 1-16 rows (padded to 16 inside), N past the last program's columns, K masked or not."""
    gen = torch.Generator().manual_seed(m * 100000 + n * 1000 + k)
    x = torch.randn(m, k, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    wt = torch.randn(n, k, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    y = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    gemv(x, wt, y, block_n=block_n, block_k=block_k, num_stages=stages, dot=True)
    (want,) = reference_linear(x.double().cpu().numpy(), wt.double().cpu().numpy())
    got = y.double().cpu().numpy()
    assert np.isfinite(got).all(), "unwritten outputs"
    assert _err(got, want) < TOL[dtype]


def test_gemv_rejects_a_mismatched_row():
    with pytest.raises(ValueError, match="9 elements; one row"):
        gemv(torch.zeros(1, 8, device=DEVICE), torch.zeros(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="up to 16 rows"):
        gemv(torch.zeros(17, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE), dot=True)


@pytest.mark.parametrize("opset", [15, 17, 20, 23])
def test_body_equals_reference(opset):
    rng = np.random.default_rng(opset)
    x, wt = rng.normal(size=(2, 3, 24)).astype(np.float32), rng.normal(size=(40, 24)).astype(np.float32)
    node = helper.make_node("Linear", ["x", "wt"], ["y"], domain=DOMAIN)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, (2, 3, 40))],
                              [onnx.numpy_helper.from_array(wt, "wt")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)],
                          functions=[LINEAR.function_proto(opset)], ir_version=10)
    onnx.checker.check_model(m, full_check=True)
    (y,) = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert _err(y, reference_linear(x, wt)[0]) < 1e-6


# ---- the native planner (ort_triton/native/linear.c), no GPU needed --------------------------------------------

@pytest.fixture
def lib(native_library):
    return load(native_library)


def _first_fit(rows, k, n):
    """CONFIGS' first entry whose ranges hold the shape: (dot, BLOCK_N, unmasked BLOCK_K)."""
    return next((dot, bn, bk) for dot, most, (k0, k1), (n0, n1), bn, bk, _ in CONFIGS
                if rows <= most and k0 <= k <= k1 and n0 <= n <= n1)


@pytest.mark.parametrize("x, n", [
    ((1, 1, 2048), 2048), ((1, 768), 3072), ((2048,), 8), ((1, 1, 100), 7), ((1, 3072), 768), ((1, 8192), 2048),
    # one row by a wide weight (Llama-1B's qkv, gate, lm_head), 2-16 rows by any: the skinny product
    ((1, 1, 2048), 3072), ((1, 2048), 8192), ((1, 2048), 32000), ((1, 2, 2048), 3072), ((16, 1, 64), 8),
    ((3, 5, 7), 9), ((4, 8192), 2048), ((1, 9000), 5000)])
def test_up_to_16_rows_run_ours(lib, x, n):
    f = plan_fields(lib, "Linear", [x, (n, x[-1])], 1, [])
    k, rows = x[-1], int(np.prod(x[:-1]))
    spec = LINEAR.specializations("float16")[int(f["spec"])]
    block_n, block_k, most_rows = spec.consts
    assert most_rows == (BLOCK_M if spec.constexprs["DOT"] else 1)
    assert f["kernel"].startswith("gemv_fwd")
    assert int(f["grid"].split(",")[0]) == -(-n // block_n)
    dot, want_block_n, unmasked = _first_fit(rows, k, n)
    assert (spec.constexprs["DOT"], block_n) == (int(dot), want_block_n)
    # unmasked only where BLOCK_K divides K, else the masked spec of the same ranges
    assert spec.constexprs["EVEN_K"] == int(k % unmasked == 0)
    assert block_k == (unmasked if k % unmasked == 0 or dot else MASKED_BLOCK_K)
    assert f["out0"] == "[" + ",".join(map(str, (*x[:-1], n))) + "]"


@pytest.mark.parametrize("x, n", [((17, 2048), 3072), ((1, 17, 64), 8), ((3, 6, 7), 9), ((64, 1, 2048), 2048)])
def test_more_rows_run_cublas(lib, x, n):
    f = plan_fields(lib, "Linear", [x, (n, x[-1])], 1, [])
    rows = int(np.prod(x[:-1]))
    # column-major Y^T [N, rows] = WT^T... : the TN GEMM over the weight as stored
    assert (f["kernel"], f["m"], f["n"], f["k"], f["trans"], f["ld"]) == (
        "cublasGemmEx", str(n), str(rows), str(x[-1]), "10", f"{x[-1]},{x[-1]},{n}")
    assert f["out0"] == "[" + ",".join(map(str, (*x[:-1], n))) + "]"


def test_empty_rows_plan_no_work(lib):
    f = plan_fields(lib, "Linear", [(0, 5, 64), (8, 64)], 1, [])
    assert f["grid"].split(",")[0] == "0" and f["out0"] == "[0,5,8]"


@pytest.mark.parametrize("shapes, match", [
    ([(1, 64), (8, 63)], r"input WT has shape \[8,63\] and input X has shape \[1,64\]; WT must be \[N, K\] "
                         r"with K = 64"),
    ([(1, 64), (8, 4, 64)], r"WT.*rank"),
    ([(1, 0), (8, 0)], "H must be 1.."),
])
def test_plan_refusals_name_the_input(lib, shapes, match):
    rc, msg = plan_attrs(lib, "Linear", shapes, 1, [])
    assert rc != 0 and "Linear" in msg and __import__("re").search(match, msg), msg


def test_every_config_range_is_served(lib):
    """CONFIGS' first fit: the specs' key ranges as built, each config unmasked then masked; any K, N up to 16
    rows."""
    specs = LINEAR.specializations("float16")
    assert len(specs) == 2 * len(CONFIGS)
    assert [s.constexprs["EVEN_K"] for s in specs] == [1, 0] * len(CONFIGS)
    assert all(s.constexprs["BLOCK_M"] == BLOCK_M and s.keys[0][0] == 1 for s in specs)
    for rows, k, n in ((1, 1, 1), (16, 1, 1), (16, 100003, 70001), (1, 65536, 3)):
        assert _first_fit(rows, k, n)


# ---- on the GPU, through ORT's CUDA EP -----------------------------------------------------------------------

def _typed_model(x_shape, n, type_name, wt):
    t = {"float": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}[type_name]
    nodes = [helper.make_node("Cast", ["x32"], ["x"], to=t), helper.make_node("Cast", ["wt32"], ["wt"], to=t),
             helper.make_node("Linear", ["x", "wt"], ["y"], domain=DOMAIN),
             helper.make_node("Cast", ["y"], ["y32"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x32", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y32", TensorProto.FLOAT, (*x_shape[:-1], n))],
                              [onnx.numpy_helper.from_array(wt, "wt32")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                             functions=[LINEAR.function_proto(17)], ir_version=10)


@pytest.mark.gpu
@pytest.mark.parametrize("type_name, torch_dtype", [("float", torch.float32), ("float16", torch.float16),
                                                    ("bfloat16", torch.bfloat16)])
@pytest.mark.parametrize("x_shape, n", [((1, 1, 2048), 3072), ((1, 8192), 2048), ((1, 1, 100), 37), ((1, 768), 50264),
                                        ((2, 1, 2048), 2048), ((16, 2048), 8192), ((3, 100), 37), ((4, 7, 96), 33),
                                        ((1, 1), 1)], ids=str)
def test_cuda_ep_runs_linear(gpu_library, x_shape, n, type_name, torch_dtype):
    """One row runs the GEMV or the skinny product, 2-16 rows the skinny product, more rows cuBLAS on ORT's handle;
    each counts as one run of ours."""
    from ort_triton.runtime import launch_count, make_session

    rng = np.random.default_rng(n + x_shape[-1])
    to = lambda a: torch.from_numpy(a).to(torch_dtype).float().numpy()  # noqa: E731  (the values the op sees)
    x = to(rng.normal(size=x_shape).astype(np.float32))
    wt = to((rng.normal(size=(n, x_shape[-1])) / np.sqrt(x_shape[-1])).astype(np.float32))
    sess = make_session(_typed_model(x_shape, n, type_name, wt), providers=["CUDAExecutionProvider"],
                        library=gpu_library)
    before = launch_count(gpu_library)
    (y,) = sess.run(None, {"x32": x})
    assert launch_count(gpu_library) == before + 1, "Linear did not run through the library"
    assert _err(y, reference_linear(x, wt)[0]) < TOL[torch_dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_cuda_graph_captures_every_path(gpu_library, rows):
    """ORT's CUDA graph captures the GEMV, the skinny product and the cuBLAS GEMM alike, and replays give fresh
    inputs' results."""
    from ort_triton.runtime import make_session

    rng = np.random.default_rng(rows)
    k, n = 256, 96
    wt = (rng.normal(size=(n, k)) / 16).astype(np.float32)
    model = _typed_model((rows, k), n, "float16", wt)
    so = ort.SessionOptions()
    sess = make_session(model, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})],
                        session_options=so, library=gpu_library)
    x_dev = ort.OrtValue.ortvalue_from_numpy(np.zeros((rows, k), np.float32), "cuda", 0)
    y_dev = ort.OrtValue.ortvalue_from_shape_and_type((rows, n), np.float32, "cuda", 0)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x32", x_dev)
    binding.bind_ortvalue_output("y32", y_dev)
    for step in range(3):  # the first run captures, the others replay
        x = torch.from_numpy(rng.normal(size=(rows, k)).astype(np.float32)).half().float().numpy()
        x_dev.update_inplace(x)
        sess.run_with_iobinding(binding)
        want = reference_linear(x, torch.from_numpy(wt).half().float().numpy())[0]
        assert _err(y_dev.numpy(), want) < 1e-2, step


def test_fp32_plan(lib):
    assert plan_fields(lib, "Linear", [(1, 64), (8, 64)], 1, [], elem_type=FLOAT)["kernel"].startswith("gemv_fwd")
    assert plan_fields(lib, "Linear", [(17, 64), (8, 64)], 1, [], elem_type=FLOAT16)["kernel"] == "cublasGemmEx"
    spec = LINEAR.specializations("float")[int(plan_fields(lib, "Linear", [(2, 64), (8, 64)], 1, [],
                                                           elem_type=FLOAT)["spec"])]
    assert spec.constexprs["DOT"] == 1 and spec.consts[1] == 64  # fp32 tiles: half the bytes of K


# ---- tuning (ort-triton tune): keys as the planner's, the built-in config first, candidates that run -----------

def test_tune_keys_are_the_planners():
    """K_ALIGN as planner_util.c's ot_k_align; past 16 rows cuBLAS runs, so nothing to tune (None)."""
    assert [k_align(k) for k in (1, 7, 100, 768, 2048, 3072, 8192, 65536)] == [1, 1, 4, 256, 2048, 1024, 4096, 4096]
    assert TUNING.keys("float16", [[1, 1, 2048], [3072, 2048]], {}, 1) == (1, 2048, 2048, 3072)
    assert TUNING.keys("float16", [[4, 4, 768], [2304, 768]], {}, 1) == (16, 256, 768, 2304)
    assert TUNING.keys("float16", [[17, 2048], [3072, 2048]], {}, 1) is None
    assert TUNING.bucket((1, 2048, 2048, 3072)) == ((1, 1), (2048, 4096), (2048, 2048), (3072, 3072))
    assert TUNING.bucket((5, 4, 100, 7)) == ((2, 16), (4, 4096), (100, 100), (7, 7))


@pytest.mark.parametrize("type_name", ["float16", "float"])
@pytest.mark.parametrize("x, n", [((1, 2048), 3072), ((1, 2048), 2048), ((1, 8192), 2048), ((1, 768), 50264),
                                  ((1, 100), 7), ((16, 2048), 8192), ((3, 96), 40)])
def test_the_builtin_candidate_is_what_the_library_runs(lib, type_name, x, n):
    """The first candidate is the spec the planner picks (the test library is sm_90's; the same spec list serves
    every arch, sm_80-89 with its pre-Hopper launch)."""
    elem = FLOAT if type_name == "float" else FLOAT16
    spec = LINEAR.specializations(type_name)[int(plan_fields(lib, "Linear", [x, (n, x[-1])], 1, [], elem_type=elem)
                                                 ["spec"])]
    keys = TUNING.keys(type_name, [list(x), [n, x[-1]]], {}, 1)
    for arch in (80, 90):
        builtin = TUNING.candidates(type_name, keys, arch)[0]
        assert {k: builtin[k] for k in ("DOT", "BLOCK_N", "BLOCK_K")} == {k: spec.constexprs[k] for k in builtin
                                                                          if k in spec.constexprs}
        assert (builtin["num_warps"], builtin["num_stages"]) == spec.launch(arch)
        tuned = TUNING.spec(type_name, TUNING.bucket(keys), builtin)  # the spec a table entry of it would build
        assert tuned.constexprs == spec.constexprs and tuned.launch(arch) == spec.launch(arch)


def test_candidates_fit_and_run():
    """Every candidate fits the arch's shared memory, is distinct, and (a few, under the interpreter on CPU) runs."""
    keys = (1, 32, 96, 40)
    for arch in (80, 90):
        configs = TUNING.candidates("float16", keys, arch)
        assert len(configs) == len({tuple(sorted(c.items())) for c in configs}) > 20
        assert all(c["num_stages"] * (c["BLOCK_N"] + BLOCK_M) * c["BLOCK_K"] * 2 <= SHARED_BYTES[arch >= 90]
                   for c in configs if c["DOT"])
    assert not any(c["DOT"] == 0 for c in TUNING.candidates("float16", (3, 32, 96, 40), 90))  # the GEMV: one row
    if DEVICE == "cpu":
        configs = TUNING.candidates("float16", keys, 90)
        for config in (configs[0], next(c for c in configs if c["DOT"] == 0), configs[-1]):
            TUNING.runner("float16", [[1, 96], [40, 96]], {}, keys, config, "cpu")()


@pytest.mark.slow
def test_a_tuned_entry_is_built_and_dispatched(tmp_path):
    """A table entry for Llama-1B's packed Q/K/V at one row builds into a spec ahead of the built-ins (sm_90 only),
    which the planner picks for that shape on sm_90 and not on sm_80 nor for another N."""
    import json

    from ort_triton import tuning
    from tests import native_hooks
    from tests.conftest import run_cli

    config = {"DOT": 1, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 5}
    # a hand-edited entry whose ROWS range passes what the GEMV computes (one row): the planner holds it to one
    gemv = {"DOT": 0, "BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 8, "num_stages": 1}
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"format": tuning.FORMAT, "arch": 90, "entries": [
        {"op": "Linear", "type": "float16", "arch": 90, "builtin": False, "config": config,
         "keys": [list(r) for r in TUNING.bucket((1, 2048, 2048, 3072))]},
        {"op": "Linear", "type": "float16", "arch": 90, "builtin": False, "config": gemv,
         "keys": [[1, 64], [2048, 4096], [2048, 2048], [1024, 1024]]}]}))
    res = run_cli("build", "--arch", "80,90", "--tuning", table, "-o", tmp_path / "lib", timeout=1800)
    assert "2 tuned spec(s) of 2 entries" in res.stdout, res.stdout
    tuned_lib = native_hooks.load(tmp_path / "lib" / "libort_triton.so")

    def plan(rows, n, arch=90):
        return plan_fields(tuned_lib, "Linear", [(rows, 2048), (n, 2048)], 1, [], arch=arch)

    assert plan(1, 3072)["spec"] == "0" and plan(1, 3072)["grid"].startswith("48,")
    assert plan(1, 3072, 80)["spec"] != "0" and plan(1, 2048)["spec"] != "0"
    assert plan(1, 1024)["spec"] == "1" and plan(4, 1024)["kernel"] == "cublasGemmEx"
