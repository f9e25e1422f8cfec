"""Rotary (ort_triton/ops/rotary.py): the kernel against the float64 reference under the interpreter on CPU
(poisoned outputs, odd sequence lengths and head counts, both pairings, partial rotary, cos/sin per
channel or per pair, rank 3 or 4, broadcast over batch and sequence), the reference against HF's and
ONNX's own definitions, the function body against the reference at every opset, and the native planner
through the library's test hook."""

import os
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ort_triton.contract import DOMAIN
from ort_triton.kernels.rotary import rotary
from ort_triton.ops.rotary import BLOCK_DS, ROTARY, TRANSPOSE_ROTARY, block_s, half_split, reference_rotary
from tests.native_hooks import first_spec, load, plan_attrs

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}

# (B, N, S, D, R, per_pair, cos_rank, cos_batch, cos_seq): R = 0 means D
CASES = [
    (2, 3, 7, 32, 0, False, 4, 1, 7),      # Llama's layout: [1, 1, S, D] per channel
    (2, 4, 13, 64, 0, False, 4, 2, 13),    # per batch row (positions from the mask)
    (1, 2, 5, 80, 0, True, 3, 1, 5),       # ONNX RotaryEmbedding's [B, S, D/2] caches
    (3, 2, 1, 128, 0, False, 4, 3, 1),     # decode: S = 1
    (2, 3, 9, 32, 16, False, 4, 2, 9),     # partial (Phi): 16 of 32 channels
    (2, 1, 6, 40, 24, True, 3, 2, 6),      # partial, per pair, D not a power of two
    (1, 2, 11, 256, 0, False, 3, 1, 1),    # D = 256 (the largest block); one cos row for every position
    (2, 2, 3, 6, 4, False, 4, 1, 3),       # tiny, D % 16 != 0, partial
    (2, 3, 21, 64, 0, True, 3, 2, 21),     # per pair at D = BLOCK_D: the half-split spec (not interleaved)
]


def _inputs(case, dtype, seed):
    b, n, s, d, r, per_pair, rank, cb, cs = case
    r = r or d
    gen = torch.Generator().manual_seed(seed)
    w = r // 2 if per_pair else r
    cos_shape = (cb, 1, cs, w) if rank == 4 else (cb, cs, w)
    x = torch.randn(b, n, s, d, generator=gen, dtype=torch.float64)
    cos, sin = (torch.randn(cos_shape, generator=gen, dtype=torch.float64) for _ in range(2))
    return [t.to(dtype).to(DEVICE) for t in (x, cos, sin)]


@pytest.mark.parametrize("x_bsnd", [False, True], ids=["Rotary", "TransposeRotary"])
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case, interleaved, dtype, x_bsnd):
    """x_bsnd: the kernel reads X as [B, S, N, D] (TransposeRotary), its output is [B, N, S, D] all the same."""
    x, cos, sin = _inputs(case, dtype, sum(case))
    out = torch.full_like(x, float("nan"))
    given = x.transpose(1, 2).contiguous() if x_bsnd else x
    y = rotary(given, cos, sin, interleaved, case[4], out=out, x_bsnd=x_bsnd).double().cpu().numpy()
    (want,) = reference_rotary(*(t.double().cpu().numpy() for t in (x, cos, sin)), interleaved, case[4])
    assert np.isfinite(y).all(), "unwritten elements"
    err = np.abs(y - want).max() / np.abs(want).max()
    assert err < TOL[dtype], err
    if case[4]:  # the channels past R are copied, bit for bit
        np.testing.assert_array_equal(y[..., case[4]:], x[..., case[4]:].double().cpu().numpy())


def test_bad_shapes_are_a_clear_error():
    x = torch.zeros(1, 2, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="even rotary_dim"):
        rotary(x, torch.zeros(1, 3, 7, device=DEVICE), torch.zeros(1, 3, 7, device=DEVICE), 0, 7)
    with pytest.raises(ValueError, match="cos must be"):
        rotary(x, torch.zeros(1, 3, 6, device=DEVICE), torch.zeros(1, 3, 6, device=DEVICE))


# ---- the reference is HF's and ONNX's definition -------------------------------------------------------------

def test_reference_is_hf_apply_rotary_pos_emb():
    """W = R: HF Llama's q * cos + rotate_half(q) * sin on the Unsqueezed [B, 1, S, D] cos, exactly."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rng = np.random.default_rng(0)
    q, k = (rng.normal(size=(2, 3, 5, 16)) for _ in range(2))
    cos, sin = (rng.normal(size=(2, 5, 16)) for _ in range(2))
    hq, hk = apply_rotary_pos_emb(*map(torch.from_numpy, (q, k, cos, sin)))  # unsqueezes axis 1 itself
    np.testing.assert_allclose(reference_rotary(q, cos, sin)[0], hq.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(reference_rotary(k, cos[:, None], sin[:, None])[0], hk.numpy(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary_dim", [0, 4])
def test_reference_is_onnx_rotary_embedding(interleaved, rotary_dim):
    """W = R/2: ONNX RotaryEmbedding's definition (onnx.reference), both pairings, partial too."""
    from onnx.reference.ops.op_rotary_embedding import rotary_embedding

    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 3, 5, 8))
    cos, sin = (rng.normal(size=(2, 5, (rotary_dim or 8) // 2)) for _ in range(2))
    want = rotary_embedding(x, cos, sin, interleaved=interleaved, rotary_embedding_dim=rotary_dim)
    np.testing.assert_allclose(reference_rotary(x, cos, sin, interleaved, rotary_dim)[0], want, rtol=0, atol=1e-12)


# ---- the function body ----------------------------------------------------------------------------------------

def _body_model(opset, x, cos, sin, op=ROTARY, **attrs):
    node = helper.make_node(op.name, ["x", "cos", "sin"], ["y"], domain=DOMAIN, **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, a.shape)
                                            for n, a in (("x", x), ("cos", cos), ("sin", sin))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [x.shape[i] for i in (
                                  (0, 2, 1, 3) if op is TRANSPOSE_ROTARY else (0, 1, 2, 3))])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)],
                             functions=[op.function_proto(opset)], ir_version=10)


@pytest.mark.parametrize("opset", [15, 17, 20, 23])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("case", CASES[:6], ids=str)
def test_body_equals_reference(case, interleaved, opset):
    x, cos, sin = (t.float().cpu().numpy() for t in _inputs(case, torch.float32, opset))
    m = _body_model(opset, x, cos, sin, interleaved=interleaved, rotary_dim=case[4])
    onnx.checker.check_model(m)
    (y,) = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "cos": cos, "sin": sin})
    (want,) = ROTARY.reference(x, cos, sin, interleaved=interleaved, rotary_dim=case[4])
    assert np.abs(y - want).max() / np.abs(want).max() < 1e-6


@pytest.mark.parametrize("opset", [15, 23])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("case", CASES[:6], ids=str)
def test_transpose_rotary_body_equals_reference(case, interleaved, opset):
    """TransposeRotary's body: the head Transpose, then Rotary's nodes; the reference transposes X first."""
    x, cos, sin = (t.float().cpu().numpy() for t in _inputs(case, torch.float32, opset))
    xs = np.ascontiguousarray(x.transpose(0, 2, 1, 3))  # [B, S, N, D], as the projection's Reshape leaves it
    m = _body_model(opset, xs, cos, sin, op=TRANSPOSE_ROTARY, interleaved=interleaved, rotary_dim=case[4])
    onnx.checker.check_model(m)
    (y,) = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": xs, "cos": cos, "sin": sin})
    (want,) = TRANSPOSE_ROTARY.reference(xs, cos, sin, interleaved=interleaved, rotary_dim=case[4])
    np.testing.assert_allclose(want, reference_rotary(x, cos, sin, interleaved, case[4])[0], rtol=0, atol=0)
    assert y.shape == x.shape and np.abs(y - want).max() / np.abs(want).max() < 1e-6


def test_body_sin_is_reshaped_by_its_own_shape():
    """cos [B, 1, 1, R] and sin [1, 1, B, R] hold as many elements (here B = S) and both broadcast against X:
    the body must not read sin in cos's layout."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 2, 3, 8)).astype(np.float32)
    cos, sin = rng.normal(size=(3, 1, 1, 8)).astype(np.float32), rng.normal(size=(1, 1, 3, 8)).astype(np.float32)
    m = _body_model(17, x, cos, sin, interleaved=0, rotary_dim=0)  # nodes list every attribute (contract.node)
    (y,) = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "cos": cos, "sin": sin})
    rot = np.concatenate([-x[..., 4:], x[..., :4]], axis=-1)
    np.testing.assert_allclose(y, x * cos + rot * sin, rtol=1e-6, atol=1e-6)


# ---- the native planner (ort_triton/native/rotary.c), no GPU needed --------------------------------------------

@pytest.fixture
def lib(native_library):
    return load(native_library)


def plan(lib, shapes, interleaved=0, rotary_dim=0, op=b"Rotary"):
    return plan_attrs(lib, op.decode(), shapes, 1, (interleaved, rotary_dim))


@pytest.mark.parametrize("x, cos, r, interleaved, aligned", [
    ((2, 4, 13, 64), (1, 1, 13, 64), 0, 0, 1),     # half-split spec
    ((2, 4, 13, 64), (1, 1, 13, 64), 0, 1, 1),     # interleaved: the aligned spec
    ((2, 4, 13, 64), (2, 13, 32), 0, 0, 1),        # per pair: W = 32
    ((1, 32, 2048, 128), (1, 2048, 64), 0, 0, 1),
    ((2, 4, 1, 80), (2, 1, 1, 40), 0, 0, 0),       # W = 40: not a multiple of 16
    ((2, 4, 1, 48), (2, 1, 1, 48), 0, 0, 1),       # D = 48 < BLOCK_D: the aligned spec
    ((2, 4, 7, 32), (2, 1, 7, 16), 16, 0, 1),      # partial, per channel
    ((2, 4, 7, 256), (1, 1, 1, 256), 0, 0, 1),
    ((1, 1, 3, 6), (1, 3, 4), 4, 0, 0),
])
def test_plan_grid_and_spec(lib, x, cos, r, interleaved, aligned):
    """The grid, and the spec the planner picks: the one the keys (D, aligned, half_split) select in the contract,
    half-split exactly where the JIT entry's half_split says (the two choose alike)."""
    rc, msg = plan(lib, [x, cos, cos], interleaved=interleaved, rotary_dim=r)
    assert rc == 0, msg
    grid = [int(v) for v in re.search(r"grid=(\d+),(\d+),(\d+)", msg).groups()]
    bd = next(b for b in BLOCK_DS if x[3] <= b)
    d, rd = x[3], r or x[3]
    half = half_split(d, rd, cos[-1], interleaved)
    assert grid == [-(-x[2] // block_s(bd, half)), x[1], x[0]]
    index = int(re.search(r"spec=(\d+)", msg).group(1))
    assert index == first_spec(ROTARY, (d, aligned, int(not interleaved and rd == d))), msg
    spec = ROTARY.specializations("float16")[index]
    assert spec.constexprs["HALF_SPLIT"] == half and spec.consts[0] == block_s(bd, half), (spec, msg)
    assert spec.keys[1] == ((1, 1) if aligned else (0, 1)), spec


@pytest.mark.parametrize("x, cos", [((2, 13, 4, 64), (1, 1, 13, 64)), ((3, 1, 32, 128), (3, 1, 1, 128))])
def test_transpose_rotary_plan_reads_bsnd(lib, x, cos):
    """X [B, S, N, D]: the grid and the output are over [B, N, S, D]."""
    rc, msg = plan(lib, [x, cos, cos], op=b"TransposeRotary")
    assert rc == 0, msg
    grid = [int(v) for v in re.search(r"grid=(\d+),(\d+),(\d+)", msg).groups()]
    bd = next(b for b in BLOCK_DS if x[3] <= b)
    assert grid == [-(-x[1] // block_s(bd, half_split(x[3], x[3], cos[-1], 0))), x[2], x[0]], msg
    assert f"out0=[{x[0]},{x[2]},{x[1]},{x[3]}]" in msg.replace(" ", ""), msg
    rc, msg = plan(lib, [x[:3], cos, cos], op=b"TransposeRotary")
    assert rc != 0 and "[B, S, num_heads, head_dim]" in msg and msg.startswith("ort_triton TransposeRotary"), msg
    rc, msg = plan(lib, [x, (1, 1, x[2], x[3]), (1, 1, x[2], x[3])], op=b"TransposeRotary")  # cos over N, not S
    assert (rc != 0) == (x[1] != x[2] and x[2] != 1), msg


@pytest.mark.parametrize("shapes, attrs, match", [
    ([(2, 13, 64), (1, 13, 64), (1, 13, 64)], {}, r"input X has shape \[2,13,64\]; it must have rank 4"),
    ([(2, 4, 13, 64), (1, 4, 13, 64), (1, 4, 13, 64)], {}, r"input cos has shape \[1,4,13,64\]"),
    ([(2, 4, 13, 64), (1, 1, 13, 64), (1, 13, 64)], {}, "input sin has shape .* they must be equal"),
    ([(2, 4, 13, 64), (3, 13, 64), (3, 13, 64)], {}, "batch must be 1 or B"),
    ([(2, 4, 13, 64), (2, 12, 64), (2, 12, 64)], {}, "sequence 1 or S"),
    ([(2, 4, 13, 64), (2, 13, 48), (2, 13, 48)], {}, "last dim rotary_dim or rotary_dim / 2"),
    ([(2, 4, 13, 64), (2, 13, 31), (2, 13, 31)], {"rotary_dim": 31}, "rotary_dim 31 must be even"),
    ([(2, 4, 13, 64), (2, 13, 64), (2, 13, 64)], {"rotary_dim": 66}, "rotary_dim 66 must be even and in 2..head_dim"),
    ([(2, 4, 13, 64), (2, 13, 64), (2, 13, 64)], {"interleaved": 2}, "interleaved=2 must be 0 or 1"),
    ([(2, 4, 13, 320), (2, 13, 320), (2, 13, 320)], {}, "head_dim 320 .* not supported; .* up to 256"),
])
def test_plan_refusals_name_the_input(lib, shapes, attrs, match):
    rc, msg = plan(lib, shapes, **attrs)
    assert rc != 0 and re.search(match, msg), msg
    assert msg.startswith("ort_triton Rotary")


# ---- no register spills (ptxas' report from the cubins; no GPU needed) -------------------------------------------

SPILL_SCRIPT = r"""
import json, pathlib, re, subprocess, sys
import triton
from ort_triton.aot.compile import Job, compile_job
from ort_triton.ops import BY_NAME
op, arch, out = BY_NAME[sys.argv[1]], int(sys.argv[2]), pathlib.Path(sys.argv[3])
tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
rows = []
for t in op.types:
    for i, spec in enumerate(op.specializations(t)):
        c = compile_job(Job(op, t, i, spec, arch), out)
        usage = subprocess.run([str(tool), "-res-usage", str(c.cubin)], capture_output=True, text=True,
                               check=True).stdout
        rows.append(dict(type=t, spec=i, stack=int(re.search(r"STACK:(\d+)", usage).group(1))))
print(json.dumps(rows))
"""


def kernel_stacks(op_name, arch, tmp_path):
    """[{type, spec, stack}] for every spec of op_name compiled for arch, in a subprocess (the tests'
    TRITON_INTERPRET=1 would hand the compiler an interpreted kernel)."""
    import json
    import pathlib
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = pathlib.Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", SPILL_SCRIPT, op_name, str(arch), str(tmp_path)], capture_output=True,
                         text=True, env=env, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.splitlines()[-1])


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("op_name, n_specs", [("Rotary", 3 * len(BLOCK_DS)), ("TransposeRotary", 3 * len(BLOCK_DS)),
                                              ("QKVRotaryCache", 3 * len(BLOCK_DS)),
                                              ("QKVNormRotaryCache", 3 * len(BLOCK_DS)), ("SiluMul", 2)])
def test_no_spills(op_name, n_specs, arch, tmp_path):
    """Every spec of Rotary, TransposeRotary, QKVRotaryCache, QKVNormRotaryCache and SiluMul
    (tests/ops/test_swiglu_kernel.py and test_qkv_rotary_cache_kernel.py defer to this one), all types."""
    rows = kernel_stacks(op_name, arch, tmp_path)
    assert len(rows) == 3 * n_specs
    assert all(r["stack"] == 0 for r in rows), [r for r in rows if r["stack"]]


# ---- on the GPU: the op through ORT's CUDA EP and the library (the planner's params, in the kernel's order) ----

ONNX_TYPES = {"float": (TensorProto.FLOAT, torch.float32), "float16": (TensorProto.FLOAT16, torch.float16),
              "bfloat16": (TensorProto.BFLOAT16, torch.bfloat16)}


def _typed_op_model(op, shapes, type_name, **attrs):
    """A node of op on element type type_name between fp32 Casts (numpy feeds), with its function body."""
    t = ONNX_TYPES[type_name][0]
    names = [i.name for i in op.inputs]
    nodes = [helper.make_node("Cast", [f"{n}32"], [n], to=t) for n in names]
    nodes += [helper.make_node(op.name, names, ["y"], domain=DOMAIN, **attrs),
              helper.make_node("Cast", ["y"], ["y32"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, op.name, [helper.make_tensor_value_info(f"{n}32", TensorProto.FLOAT, s)
                                               for n, s in zip(names, shapes)],
                              [helper.make_tensor_value_info("y32", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                             functions=[op.function_proto(17)], ir_version=10)


def run_on_cuda(gpu_library, model, feeds):
    from ort_triton.runtime import launch_count, make_session

    sess = make_session(model, providers=["CUDAExecutionProvider"], library=gpu_library)
    before = launch_count(gpu_library)
    (y,) = sess.run(None, feeds)
    assert launch_count(gpu_library) == before + 1, "the Triton kernel did not run"
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("op", [ROTARY, TRANSPOSE_ROTARY], ids=lambda o: o.name)
@pytest.mark.parametrize("type_name", list(ONNX_TYPES))
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("case", CASES + [(4, 32, 1024, 128, 0, True, 3, 4, 1024)], ids=str)
def test_cuda_ep_runs_the_kernel(gpu_library, case, interleaved, type_name, op):
    """TransposeRotary gets X as [B, S, N, D] and must give the same [B, N, S, D] output."""
    torch_dtype = ONNX_TYPES[type_name][1]
    x, cos, sin = (t.to(torch_dtype).float().cpu().numpy() for t in _inputs(case, torch.float32, sum(case)))
    given = np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if op is TRANSPOSE_ROTARY else x
    model = _typed_op_model(op, [given.shape, cos.shape, sin.shape], type_name, interleaved=interleaved,
                            rotary_dim=case[4])
    y = run_on_cuda(gpu_library, model, {"X32": given, "cos32": cos, "sin32": sin})
    assert y.shape == x.shape
    (want,) = reference_rotary(x, cos, sin, interleaved, case[4])
    assert np.abs(y - want).max() / np.abs(want).max() < TOL[torch_dtype]
