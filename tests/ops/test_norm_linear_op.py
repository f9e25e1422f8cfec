"""AddRMSNormLinear and AddRMSNormSwiGLU (ort_triton/ops/norm_linear.py): the kernel's three modes against the float64
reference under the interpreter on CPU (poisoned outputs; K a multiple of BLOCK_K and not, N not a multiple of
BLOCK_N, 1 to 16 rows fused and more in steps), the function bodies at every opset, the native planner (one fused
launch, or the norm, cuBLAS and the SwiGLU product; the refusals), and on the GPU both paths through ORT's CUDA EP,
CUDA-graph capture included."""

import os
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ort_triton.contract import DOMAIN
from ort_triton.kernels.norm_linear import norm_linear
from ort_triton.ops.norm_linear import (
    ADD_RMS_NORM_LINEAR,
    ADD_RMS_NORM_SWIGLU,
    BLOCK_M,
    CONFIGS,
    MASKED_BLOCK_K,
    STEPS_BLOCK_N,
    reference_add_rms_norm_linear,
    reference_add_rms_norm_swiglu,
)
from tests.native_hooks import FLOAT, load, plan_attrs, plan_fields

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
OPS = {False: ADD_RMS_NORM_LINEAR, True: ADD_RMS_NORM_SWIGLU}


def _err(got, want):
    return np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)


def _inputs(lead, k, n, swiglu, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen, dtype=torch.float64) * scale).to(dtype)  # noqa: E731
    x, skip = r(*lead, k), r(*lead, k)
    gamma = (1 + 0.1 * torch.randn(k, generator=gen, dtype=torch.float64)).to(dtype)
    weights = [r(n, k, scale=k ** -0.5) for _ in range(1 + swiglu)]
    return x, skip, gamma, weights


def _reference(x, skip, gamma, weights, eps):
    f = lambda t: t.double().cpu().numpy()  # noqa: E731
    ref = reference_add_rms_norm_swiglu if len(weights) == 2 else reference_add_rms_norm_linear
    return ref(f(x), f(skip), f(gamma), *map(f, weights), epsilon=eps)


def _rounded_reference(x, skip, gamma, weights, eps):
    """Y in float64 with the op's roundings to the element type: the sum, the norm, each product before SwiGLU
    (what the unfused graph rounds). Three bf16 roundings in a row stray ~2% from the exact value (float64
    throughout); against this the kernel differs by its last rounding and the order of its sums."""
    t = x.dtype
    r = lambda v: v.to(t).double()  # noqa: E731
    s = r(x.double().cpu() + skip.double().cpu())
    n = r(s / torch.sqrt((s * s).mean(-1, keepdim=True) + eps) * gamma.double().cpu())
    g = n @ weights[0].double().cpu().T
    if len(weights) == 1:
        return g.numpy()
    g, u = r(g), r(n @ weights[1].double().cpu().T)
    return (g / (1 + torch.exp(-g)) * u).numpy()


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("swiglu", [False, True], ids=["linear", "swiglu"])
@pytest.mark.parametrize("lead, k, n, block_n, block_k, fused", [
    ((1, 1), 64, 32, 32, 32, True),        # one row, every tile full
    ((3,), 100, 37, 16, 32, True),         # K and N past whole blocks (masked K tail, clamped weight rows)
    ((2, 8), 48, 70, 64, 16, True),        # 16 rows, the fused kernel's most
    ((1,), 16, 5, 16, 16, True),           # N smaller than a block
    ((17,), 80, 33, 32, 32, False),        # the steps: 17 rows, partial row and column tiles
    ((2, 20), 96, 64, 64, 64, False),
    ((1,), 64, 48, 16, 64, False),         # the steps at one row (a shape no fused spec serves)
], ids=str)
def test_kernel_matches_reference(dtype, swiglu, lead, k, n, block_n, block_k, fused):
    x, skip, gamma, weights = _inputs(lead, k, n, swiglu, dtype, seed=k * 100 + n)
    x, skip, gamma, weights = x.to(DEVICE), skip.to(DEVICE), gamma.to(DEVICE), [w.to(DEVICE) for w in weights]
    y = torch.full((*lead, n), float("nan"), dtype=dtype, device=DEVICE)
    s = torch.full((*lead, k), float("nan"), dtype=dtype, device=DEVICE)
    # ROW_BLOCK 32: the one-row prologue crosses chunks (a masked tail at K = 100)
    norm_linear(x, skip, gamma, weights[0], weights[1] if swiglu else None, 1e-5, True, out=y, sum_out=s,
                block_n=block_n, block_k=block_k, row_block=32, fused=fused)
    want_y, want_s = _reference(x, skip, gamma, weights, 1e-5)
    got_y, got_s = y.double().cpu().numpy(), s.double().cpu().numpy()
    assert np.isfinite(got_y).all() and np.isfinite(got_s).all(), "unwritten outputs"
    assert _err(got_s, want_s) < TOL[dtype]
    assert _err(got_y, _rounded_reference(x, skip, gamma, weights, 1e-5)) < TOL[dtype]
    assert _err(got_y, want_y) < 3 * TOL[dtype]  # the op means the maths: exact but for the roundings


@pytest.mark.parametrize("fused", [True, False])
def test_kernel_leaves_sum_alone_when_not_asked(fused):
    """store_sum 0: the S pointer is never written (the native params give Y there when the node has no sum)."""
    from ort_triton.kernels.norm_linear import norm_linear_fwd

    x, skip, gamma, (wt,) = (t.to(DEVICE) if isinstance(t, torch.Tensor) else [w.to(DEVICE) for w in t]
                             for t in _inputs((3,), 32, 16, False, torch.float32, seed=7))
    poison = torch.full((3, 32), 7.0, device=DEVICE)
    y, nb = torch.empty(3, 16, device=DEVICE), torch.empty(3, 32, device=DEVICE)
    args = dict(FUSED=int(fused), SWIGLU=False, EVEN_K=1, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, ROW_BLOCK=32,
                num_warps=4)
    norm_linear_fwd[(1,)](x, skip, gamma, wt, wt, y, poison, nb, y, y, 3, 16, 32, 1e-6, 0, 0 if fused else 1, **args)
    assert (poison == 7.0).all()


def test_kernel_entry_rejects_mismatched_weights():
    x, skip, gamma, (wt,) = _inputs((1,), 32, 8, False, torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"\[N, K\] with K = 32"):
        norm_linear(x, skip, gamma, wt[:, :16])
    with pytest.raises(ValueError, match="at most 16 rows"):
        norm_linear(torch.zeros(17, 32), torch.zeros(17, 32), gamma, wt, fused=True)


def _node_model(swiglu, lead, k, n, opset, weights, t=TensorProto.FLOAT, n_outputs=2):
    op = OPS[swiglu]
    names = ["wgt", "wut"] if swiglu else ["wt"]
    outs = ["y", "sum"][:n_outputs] + [""] * (2 - n_outputs)
    node = helper.make_node(op.name, ["x", "skip", "gamma", *names], outs, domain=DOMAIN, epsilon=1e-5)
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([node], "g", [vi("x", t, (*lead, k)), vi("skip", t, (*lead, k))],
                              [vi("y", t, (*lead, n)), vi("sum", t, (*lead, k))][:n_outputs],
                              [onnx.numpy_helper.from_array(a, nm) for a, nm in zip(weights, ["gamma", *names])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)],
                             functions=[op.function_proto(opset)], ir_version=10)


@pytest.mark.parametrize("swiglu", [False, True], ids=["linear", "swiglu"])
@pytest.mark.parametrize("opset", [15, 17, 18, 20, 23])
def test_body_equals_reference(swiglu, opset):
    rng = np.random.default_rng(opset + 10 * swiglu)
    lead, k, n = (2, 3), 24, 40
    x, skip = (rng.normal(size=(*lead, k)).astype(np.float32) for _ in range(2))
    gamma = (1 + 0.1 * rng.normal(size=k)).astype(np.float32)
    ws = [(rng.normal(size=(n, k)) / 5).astype(np.float32) for _ in range(1 + swiglu)]
    m = _node_model(swiglu, lead, k, n, opset, [gamma, *ws])
    onnx.checker.check_model(m, full_check=True)
    y, s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "skip": skip})
    want_y, want_s = OPS[swiglu].reference(x, skip, gamma, *ws, epsilon=1e-5)
    assert _err(s, want_s) < 1e-6 and _err(y, want_y) < 1e-5


# ---- the native planner (ort_triton/native/norm_linear.c), no GPU needed --------------------------------------

@pytest.fixture
def lib(native_library):
    return load(native_library)


def _shapes(lead, k, n, swiglu):
    return [(*lead, k), (*lead, k), (k,), *[(n, k)] * (1 + swiglu)]


def _config(swiglu, rows, k, n):
    """The CONFIGS entry that takes this shape fused, or None (the steps run)."""
    return next((c for c in CONFIGS[swiglu] if rows <= c[0] and c[1][0] <= k <= c[1][1] and c[2][0] <= n <= c[2][1]),
                None)


@pytest.mark.parametrize("swiglu", [False, True], ids=["linear", "swiglu"])
@pytest.mark.parametrize("lead, k, n", [((1, 1), 2048, 3072), ((1, 1), 2048, 8192), ((16, 1), 2048, 8192),
                                        ((4, 1), 100, 37), ((1,), 896, 4864), ((1,), 2048, 32000)], ids=str)
def test_decode_rows_run_the_fused_kernel(lib, swiglu, lead, k, n):
    """Up to the op's fused rows (AddRMSNormLinear 1, AddRMSNormSwiGLU 16) one launch; more rows take the steps."""
    op = OPS[swiglu]
    rc, msg = plan_attrs(lib, op.name, _shapes(lead, k, n, swiglu), 2, [1e-5])
    assert rc == 0, msg
    config = _config(swiglu, int(np.prod(lead)), k, n)
    if config is None:
        assert " then=cublasGemmEx" in msg, msg
        return
    f = dict(kv.split("=") for kv in msg.split())
    spec = op.specializations("float16")[int(f["spec"])]
    assert f["kernel"].startswith("norm_linear_fwd") and spec.keys[0] == (1, 1)
    assert spec.constexprs["SWIGLU"] == int(swiglu)
    block_n, block_k = spec.consts[1:]
    assert int(f["grid"].split(",")[0]) == -(-n // block_n)
    # unmasked where the config's BLOCK_K divides K; else a masked spec, at most MASKED_BLOCK_K wide
    assert spec.constexprs["EVEN_K"] == int(k % config[4] == 0) and block_n == config[3]
    assert block_k == (config[4] if k % config[4] == 0 else min(config[4], MASKED_BLOCK_K))
    assert "then" not in f and "scratch" not in f
    shape = lambda *d: "[" + ",".join(map(str, d)) + "]"  # noqa: E731
    assert f["out0"] == shape(*lead, n) and f["out1"] == shape(*lead, k)


def test_each_op_fuses_some_decode_shape():
    """The rows the configs promise are planned fused: SwiGLU at 16 rows, Linear at one."""
    assert _config(True, 16, 2048, 8192) and not _config(False, 2, 2048, 3072) and _config(False, 1, 2048, 3072)


@pytest.mark.parametrize("swiglu", [False, True], ids=["linear", "swiglu"])
@pytest.mark.parametrize("lead, k, n", [((1, 512), 2048, 3072), ((17,), 64, 48), ((1,), 8, 16), ((1,), 16384, 64)],
                         ids=str)
def test_more_rows_run_the_steps(lib, swiglu, lead, k, n):
    """The norm into the workspace, cuBLAS's TN GEMM per weight (into Y, or into the workspace for SwiGLU), and for
    SwiGLU the product on a second grid; each region 256-byte aligned."""
    op = OPS[swiglu]
    rc, msg = plan_attrs(lib, op.name, _shapes(lead, k, n, swiglu), 2, [1e-5])
    assert rc == 0, msg
    rows = int(np.prod(lead))
    spec = op.specializations("float16")[int(re.search(r" spec=(\d+)", msg)[1])]
    assert spec.keys[0] == (0, 0)
    # K % 16 == 0 takes the spec that declares it (MODE 1's rows load as 16-byte vectors), other K the general one
    assert ("K" in spec.divisible_by_16) == (k % 16 == 0) and spec.keys[1][0] == (16 if k % 16 == 0 else 1)
    assert re.search(rf" grid={rows},1,1 ", msg), msg  # MODE 1: a program a row
    gemms = re.findall(r" then=cublasGemmEx m=(\d+) n=(\d+) k=(\d+) trans=(\d+) ld=(\S+) ptrs=(\d+),(\d+),(\d+)", msg)
    n_in = len(op.inputs)
    ws = 16  # OT_PTR_WS: 2 * OT_MAX_IO
    if swiglu:
        assert gemms == [(str(n), str(rows), str(k), "10", f"{k},{k},{n}", "3", str(ws), str(ws + 1)),
                         (str(n), str(rows), str(k), "10", f"{k},{k},{n}", "4", str(ws), str(ws + 2))], msg
        assert f" grid2={-(-rows * n // (BLOCK_M * STEPS_BLOCK_N))},1,1" in msg  # flat blocks of [rows, N]
    else:
        assert gemms == [(str(n), str(rows), str(k), "10", f"{k},{k},{n}", "3", str(ws), str(n_in))], msg
        assert "grid2" not in msg
    align = lambda b: -(-b // 256) * 256  # noqa: E731
    want = align(rows * k * 2) + (2 * align(rows * n * 2) if swiglu else 0)
    assert f" scratch={want}" in msg


def test_fp32_fused_plan(lib):
    f = plan_fields(lib, "AddRMSNormSwiGLU", _shapes((1,), 64, 64, True), 2, [1e-5], elem_type=FLOAT)
    assert f["kernel"].startswith("norm_linear_fwd") and "then" not in f


def test_empty_rows_plan_no_work(lib):
    f = plan_fields(lib, "AddRMSNormLinear", _shapes((0, 5), 64, 8, False), 2, [1e-5])
    assert f["kernel"] == "none" and f["out0"] == "[0,5,8]" and f["out1"] == "[0,5,64]"


@pytest.mark.parametrize("op, shapes, match", [
    ("AddRMSNormLinear", [(1, 64), (1, 64), (64,), (8, 63)], r"input WT has shape \[8,63\]; it must be \[N, K\] "
                                                             r"with K = 64"),
    ("AddRMSNormLinear", [(1, 64), (2, 64), (64,), (8, 64)], r"input skip has shape \[2,64\] but input X"),
    ("AddRMSNormLinear", [(1, 64), (1, 64), (63,), (8, 64)], r"gamma"),
    ("AddRMSNormLinear", [(1, 64), (1, 64), (64,), (8, 4, 64)], r"WT.*rank"),
    ("AddRMSNormSwiGLU", [(1, 64), (1, 64), (64,), (8, 64), (9, 64)], r"input WUT has shape \[9,64\].*the shape of "
                                                                      r"the first weight"),
])
def test_plan_refusals_name_the_input(lib, op, shapes, match):
    rc, msg = plan_attrs(lib, op, shapes, 2, [1e-5])
    assert rc != 0 and op in msg and re.search(match, msg), msg


def test_specs_cover_every_shape():
    """Every type has the steps' specs (any K, N), after the fused ones: K % 16 == 0 declared, then any K; no shape
    lacks a kernel."""
    for op in OPS.values():
        for t in op.types:
            specs = op.specializations(t)
            assert all(s.keys[0] == (0, 0) for s in specs[-2:]) and all(s.keys[0] == (1, 1) for s in specs[:-2])
            assert specs[-2].keys[1][0] == 16 and "K" in specs[-2].divisible_by_16
            assert specs[-1].keys[1][0] == 1 and "K" not in specs[-1].divisible_by_16
            assert specs[-1].keys[2][1] >= 1 << 31 and specs[-1].keys[3][1] >= 1 << 31


# ---- on the GPU, through ORT's CUDA EP -----------------------------------------------------------------------

def _typed_model(swiglu, lead, k, n, type_name, weights, n_outputs=2):
    """The node between Casts: fp32 in and out, the op in type_name."""
    t = {"float": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}[type_name]
    op = OPS[swiglu]
    names = ["gamma", *(["wgt", "wut"] if swiglu else ["wt"])]
    cast = lambda a, b, to: helper.make_node("Cast", [a], [b], to=to)  # noqa: E731
    outs = ["y", "sum"][:n_outputs] + [""] * (2 - n_outputs)
    nodes = [cast("x32", "x", t), cast("skip32", "skip", t), *[cast(nm + "32", nm, t) for nm in names],
             helper.make_node(op.name, ["x", "skip", *names], outs, domain=DOMAIN, epsilon=1e-5),
             cast("y", "y32", TensorProto.FLOAT)]
    nodes += [cast("sum", "sum32", TensorProto.FLOAT)] if n_outputs == 2 else []
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, op.name, [vi("x32", TensorProto.FLOAT, (*lead, k)),
                                               vi("skip32", TensorProto.FLOAT, (*lead, k))],
                              [vi("y32", TensorProto.FLOAT, (*lead, n)), vi("sum32", TensorProto.FLOAT, (*lead, k))][
                                  :n_outputs],
                              [onnx.numpy_helper.from_array(a, nm + "32") for a, nm in zip(weights, names)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                             functions=[op.function_proto(17)], ir_version=10)


def _fp32_inputs(lead, k, n, swiglu, torch_dtype, seed):
    """Inputs as fp32 arrays holding values of torch_dtype (what the op sees after the Casts)."""
    x, skip, gamma, weights = _inputs(lead, k, n, swiglu, torch_dtype, seed)
    return [t.float().numpy() for t in (x, skip, gamma, *weights)]


@pytest.mark.gpu
@pytest.mark.parametrize("type_name, torch_dtype", [("float", torch.float32), ("float16", torch.float16),
                                                    ("bfloat16", torch.bfloat16)])
@pytest.mark.parametrize("swiglu", [False, True], ids=["linear", "swiglu"])
@pytest.mark.parametrize("lead, k, n", [((1, 1), 2048, 3072), ((1, 1), 2048, 8192), ((16, 1), 2048, 8192),
                                        ((3, 1), 100, 37), ((1, 40), 2048, 3072), ((2, 9), 96, 33),
                                        ((1, 1), 896, 1000)], ids=str)  # Qwen2-0.5B's K: masked tiles
def test_cuda_ep_runs_the_op(gpu_library, type_name, torch_dtype, swiglu, lead, k, n):
    """Up to 16 rows the fused kernel, beyond the steps with cuBLAS on ORT's handle; either counts as one run."""
    from ort_triton.runtime import launch_count, make_session

    x, skip, gamma, *ws = _fp32_inputs(lead, k, n, swiglu, torch_dtype, seed=k + n)
    sess = make_session(_typed_model(swiglu, lead, k, n, type_name, [gamma, *ws]),
                        providers=["CUDAExecutionProvider"], library=gpu_library)
    before = launch_count(gpu_library)
    y, s = sess.run(None, {"x32": x, "skip32": skip})
    assert launch_count(gpu_library) == before + 1, "the op did not run through the library"
    want_y, want_s = OPS[swiglu].reference(x, skip, gamma, *ws, epsilon=1e-5)
    assert _err(s, want_s) < TOL[torch_dtype] and _err(y, want_y) < TOL[torch_dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("swiglu", [False, True], ids=["linear", "swiglu"])
@pytest.mark.parametrize("rows", [1, 20])
def test_cuda_graph_captures_both_paths(gpu_library, swiglu, rows):
    """ORT's CUDA graph captures the fused launch and the steps (norm, cuBLAS, product) alike; replays give fresh
    inputs' results. The node has no sum output here (the params point S at Y and never write it)."""
    from ort_triton.runtime import make_session

    k, n = 256, 96
    _, _, gamma, *ws = _fp32_inputs((rows,), k, n, swiglu, torch.float16, seed=rows)
    sess = make_session(_typed_model(swiglu, (rows,), k, n, "float16", [gamma, *ws], n_outputs=1),
                        providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})], library=gpu_library)
    x_dev, skip_dev = (ort.OrtValue.ortvalue_from_numpy(np.zeros((rows, k), np.float32), "cuda", 0) for _ in range(2))
    y_dev = ort.OrtValue.ortvalue_from_shape_and_type((rows, n), np.float32, "cuda", 0)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x32", x_dev)
    binding.bind_ortvalue_input("skip32", skip_dev)
    binding.bind_ortvalue_output("y32", y_dev)
    for step in range(3):  # the first run captures, the others replay
        x, skip, *_ = _fp32_inputs((rows,), k, n, swiglu, torch.float16, seed=100 + step)
        x_dev.update_inplace(x)
        skip_dev.update_inplace(skip)
        sess.run_with_iobinding(binding)
        want, _ = OPS[swiglu].reference(x, skip, gamma, *ws, epsilon=1e-5)
        assert _err(y_dev.numpy(), want) < 1e-2, step

