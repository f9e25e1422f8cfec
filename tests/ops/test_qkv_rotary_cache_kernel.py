"""QKVRotaryCache and QKVNormRotaryCache (ort_triton/ops/qkv_rotary_cache.py): the kernel against the float64
reference under the interpreter on CPU, with the head norms and without (poisoned outputs; prefill, decode, an
empty cache, no new rows, GQA and MQA, odd head dims, partial rotary, both pairings, cos/sin per channel or per
pair, broadcast or per batch row, a past longer than one copy block), the references against their definitions by
Rotary's and RMSNorm's, the native planner through the library's test hook, no register spills, and on the GPU the
op through ORT's CUDA EP (tests/gpu runs, marked gpu)."""

import os
import re

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from ort_triton.contract import DOMAIN
from ort_triton.kernels.qkv_rotary_cache import qkv_rotary_cache
from ort_triton.ops.qkv_rotary_cache import (
    BLOCK_C,
    QKV_NORM_ROTARY_CACHE,
    QKV_ROTARY_CACHE,
    reference_qkv_norm_rotary_cache,
    reference_qkv_rotary_cache,
)
from ort_triton.ops.rms_norm import reference_rms_norm
from ort_triton.ops.rotary import BLOCK_DS, block_s, half_split, reference_rotary
from tests.native_hooks import first_spec, load, plan_attrs

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
ONNX_TYPES = {"float": (TensorProto.FLOAT, torch.float32), "float16": (TensorProto.FLOAT16, torch.float16),
              "bfloat16": (TensorProto.BFLOAT16, torch.bfloat16)}

# (B, S, Nq, Nkv, D, P, R, per_pair, cos_rank, cos_batch, cos_seq): R = 0 means D
CASES = [
    (2, 5, 4, 2, 32, 3, 0, False, 4, 1, 5),      # Llama's layout: cos [1, 1, S, D], GQA 2:1
    (1, 1, 8, 2, 64, 70, 0, False, 4, 1, 1),     # decode; past 70 x 64 = 4480 elements: two copy blocks
    (3, 1, 4, 1, 64, 9, 0, False, 4, 3, 1),      # MQA, positions per batch row
    (2, 7, 2, 2, 80, 0, 0, True, 3, 2, 7),       # prefill with an empty cache; ONNX's [B, S, D/2] caches
    (2, 3, 4, 2, 32, 4, 16, False, 4, 2, 3),     # partial rotary (Phi): 16 of 32 channels
    (1, 2, 3, 1, 6, 2, 4, True, 3, 1, 1),        # tiny head dim, partial, per pair, one cos row
    (2, 0, 4, 2, 32, 5, 0, False, 4, 1, 1),      # no new rows: present is the past
    (1, 3, 2, 1, 256, 17, 0, False, 4, 1, 3),    # D = 256, the largest block
    (2, 19, 3, 1, 128, 2, 0, True, 3, 2, 19),    # per pair at D = BLOCK_D (the half-split spec's second cos half)
]


def _inputs(case, dtype, seed, norm=False):
    """QKV, cos, sin, past_key, past_value (and with norm the two gammas, [D] each, around 1)."""
    b, s, nq, nkv, d, p, r, per_pair, rank, cb, cs = case
    r = r or d
    gen = torch.Generator().manual_seed(seed)
    w = r // 2 if per_pair else r
    cos_shape = (cb, 1, cs, w) if rank == 4 else (cb, cs, w)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    ins = [rnd(b, s, (nq + 2 * nkv) * d), rnd(*cos_shape), rnd(*cos_shape), rnd(b, nkv, p, d), rnd(b, nkv, p, d)]
    return ins + [(1 + 0.3 * rnd(d).double()).to(dtype) for _ in range(2 if norm else 0)]


EPS = 1e-5


def _run_and_reference(ins, interleaved, rotary_dim, out=None):
    """The kernel's outputs and the float64 reference's: QKVNormRotaryCache's when ins has the two gammas."""
    arrays = [t.double().cpu().numpy() for t in ins]
    if len(ins) == 7:
        got = qkv_rotary_cache(*ins[:5], interleaved, rotary_dim, out=out, q_gamma=ins[5], k_gamma=ins[6],
                               epsilon=EPS)
        return got, reference_qkv_norm_rotary_cache(*arrays, interleaved, rotary_dim, EPS)
    return qkv_rotary_cache(*ins, interleaved, rotary_dim, out=out), reference_qkv_rotary_cache(*arrays, interleaved,
                                                                                                rotary_dim)


def check_outputs(got, want, tol: float) -> None:
    """A cache op's Q, present_key and present_value (torch) against the float64 reference's (numpy): shapes, every
    element written (outputs start poisoned), error relative to the largest reference magnitude below tol."""
    for name, g, w in zip(("Q", "present_key", "present_value"), got, want):
        g = g.double().cpu().numpy()
        assert g.shape == w.shape, name
        assert np.isfinite(g).all(), f"{name}: unwritten elements"
        if w.size:
            assert np.abs(g - w).max() / max(np.abs(w).max(), 1e-30) < tol, name


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("norm", [False, True], ids=["rotary", "norm"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case, norm, interleaved, dtype):
    ins = _inputs(case, dtype, sum(case), norm)
    b, s, nq, nkv, d, p = case[:6]
    out = tuple(torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
                for shape in ((b, nq, s, d), (b, nkv, p + s, d), (b, nkv, p + s, d)))
    got, want = _run_and_reference(ins, interleaved, case[6], out)
    check_outputs(got, want, TOL[dtype])
    # the past and V are copies, bit for bit
    for g, past in ((got[1], ins[3]), (got[2], ins[4])):
        assert torch.equal(g[:, :, :p].cpu(), past.cpu())
    v = ins[0].reshape(b, s, nq + 2 * nkv, d)[:, :, nq + nkv:].transpose(1, 2)
    assert torch.equal(got[2][:, :, p:].cpu(), v.cpu())


def test_reference_is_rotary_then_concat():
    """The reference by its definition: Rotary's reference on q and k as heads, the past in front."""
    rng = np.random.default_rng(3)
    b, s, nq, nkv, d, p = 2, 3, 4, 2, 8, 5
    qkv, past_k, past_v = rng.normal(size=(b, s, (nq + 2 * nkv) * d)), *rng.normal(size=(2, b, nkv, p, d))
    cos, sin = rng.normal(size=(2, b, s, d))
    q, k, v = (qkv[..., a:z].reshape(b, s, -1, d).transpose(0, 2, 1, 3)
               for a, z in ((0, nq * d), (nq * d, (nq + nkv) * d), ((nq + nkv) * d, None)))
    got = reference_qkv_rotary_cache(qkv, cos, sin, past_k, past_v)
    np.testing.assert_array_equal(got[0], reference_rotary(q, cos, sin)[0])
    np.testing.assert_array_equal(got[1], np.concatenate([past_k, reference_rotary(k, cos, sin)[0]], axis=2))
    np.testing.assert_array_equal(got[2], np.concatenate([past_v, v], axis=2))


def test_norm_reference_is_rms_norm_then_rotary():
    """QKVNormRotaryCache's reference by its definition: each q and k head RMSNorm-ed over D, then QKVRotaryCache's
    reference on the normed heads packed back."""
    rng = np.random.default_rng(4)
    b, s, nq, nkv, d, p = 2, 3, 4, 2, 8, 5
    qkv, past_k, past_v = rng.normal(size=(b, s, (nq + 2 * nkv) * d)), *rng.normal(size=(2, b, nkv, p, d))
    cos, sin = rng.normal(size=(2, b, s, d))
    gq, gk = rng.normal(1, 0.3, (2, d))
    heads = qkv.reshape(b, s, nq + 2 * nkv, d).copy()
    heads[:, :, :nq] = reference_rms_norm(heads[:, :, :nq], gq, 1e-5)[0]
    heads[:, :, nq:nq + nkv] = reference_rms_norm(heads[:, :, nq:nq + nkv], gk, 1e-5)[0]
    got = reference_qkv_norm_rotary_cache(qkv, cos, sin, past_k, past_v, gq, gk, epsilon=1e-5)
    want = reference_qkv_rotary_cache(heads.reshape(qkv.shape), cos, sin, past_k, past_v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def test_bad_shapes_are_a_clear_error():
    z = lambda *shape: torch.zeros(*shape, device=DEVICE)
    with pytest.raises(ValueError, match=r"last dim 32 is not \(Nq \+ 2 \* 2\) \* 8"):
        qkv_rotary_cache(z(1, 2, 32), z(1, 2, 8), z(1, 2, 8), z(1, 2, 3, 8), z(1, 2, 3, 8))
    with pytest.raises(ValueError, match="past_key, past_value one"):
        qkv_rotary_cache(z(1, 2, 64), z(1, 2, 8), z(1, 2, 8), z(1, 2, 3, 8), z(1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"qkv_rotary_cache: cos must be \[1 or B, 1 or S, R or R/2\]"):
        qkv_rotary_cache(z(1, 2, 64), z(1, 3, 8), z(1, 3, 8), z(1, 2, 3, 8), z(1, 2, 3, 8))
    with pytest.raises(ValueError, match="both q_gamma and k_gamma"):
        qkv_rotary_cache(z(1, 2, 64), z(1, 2, 8), z(1, 2, 8), z(1, 2, 3, 8), z(1, 2, 3, 8), q_gamma=z(8))
    with pytest.raises(ValueError, match=r"gammas must be \[8\]"):
        qkv_rotary_cache(z(1, 2, 64), z(1, 2, 8), z(1, 2, 8), z(1, 2, 3, 8), z(1, 2, 3, 8), q_gamma=z(8), k_gamma=z(4))


# ---- the native planner (ort_triton/native/qkv_rotary_cache.c), no GPU needed ----------------------------------

@pytest.fixture
def lib(native_library):
    return load(native_library)


def plan(lib, shapes, interleaved=0, rotary_dim=0):
    return plan_attrs(lib, "QKVRotaryCache", shapes, 3, (interleaved, rotary_dim))


@pytest.mark.parametrize("qkv, cos, past, aligned", [
    ((1, 1, 3072), (1, 1, 1, 64), (1, 8, 1024, 64), 1),     # Llama-1B decode
    ((16, 1, 3072), (16, 1, 1, 64), (16, 8, 4096, 64), 1),
    ((8, 512, 3072), (1, 1, 512, 64), (8, 8, 0, 64), 1),    # prefill, empty cache
    ((2, 5, 480), (2, 5, 40), (2, 2, 3, 80), 0),            # D = 80, per pair: W = 40
    ((2, 0, 256), (1, 1, 1, 32), (2, 2, 7, 32), 1),          # no new rows
])
def test_plan_grid_spec_and_outputs(lib, qkv, cos, past, aligned):
    rc, msg = plan(lib, [qkv, cos, cos, past, past])
    assert rc == 0, msg
    check_plan(msg, qkv, past, QKV_ROTARY_CACHE, (past[3], aligned, 1), cos[-1])


def check_plan(msg: str, qkv, past, contract, keys, w=None) -> None:
    """The planner's grid (tiles of new rows, then copies of the past), spec and output shapes (QKVCache's too).
    The spec: the one the dispatch keys select in the contract, and for the rotary ops (w: the cos width; their
    launches here not interleaved, R = D) half-split exactly where the JIT entry's half_split says."""
    b, s, width = qkv
    nkv, p, d = past[1:]
    nq = width // d - 2 * nkv
    bd = next(x for x in BLOCK_DS if d <= x)
    half = 0 if w is None else half_split(d, d, w, 0)
    n_new = -(-s // block_s(bd, half)) * (nq + 2 * nkv) * b
    grid = [int(v) for v in re.search(r"grid=(\d+),(\d+),(\d+)", msg).groups()]
    assert grid == [n_new + 2 * b * nkv * -(-p * d // BLOCK_C), 1, 1], msg
    index = int(re.search(r"spec=(\d+)", msg).group(1))
    assert index == first_spec(contract, keys), msg
    if w is not None:
        spec = contract.specializations("float16")[index]
        assert spec.constexprs["HALF_SPLIT"] == half and spec.consts[0] == block_s(bd, half), (spec, msg)
    flat = msg.replace(" ", "")
    for i, shape in enumerate(((b, nq, s, d), (b, nkv, p + s, d), (b, nkv, p + s, d))):
        assert f"out{i}=[{','.join(map(str, shape))}]" in flat, msg


@pytest.mark.parametrize("shapes, attrs, match", [
    ([(1, 3072), (1, 1, 64), (1, 1, 64), (1, 8, 4, 64), (1, 8, 4, 64)], {}, r"input QKV has shape \[1,3072\]"),
    ([(1, 1, 3072), (1, 1, 64), (1, 1, 64), (2, 8, 4, 64), (2, 8, 4, 64)], {}, r"input past_key .* with B = 1"),
    ([(1, 1, 3072), (1, 1, 64), (1, 1, 64), (1, 8, 4, 64), (1, 8, 5, 64)], {}, "past_value .* they must be equal"),
    ([(1, 1, 3000), (1, 1, 64), (1, 1, 64), (1, 8, 4, 64), (1, 8, 4, 64)], {}, r"last dim must be \(num_heads \+ 2"),
    ([(1, 1, 1024), (1, 1, 64), (1, 1, 64), (1, 8, 4, 64), (1, 8, 4, 64)], {}, "num_heads >= 1"),
    ([(1, 1, 3072), (1, 2, 64), (1, 2, 64), (1, 8, 4, 64), (1, 8, 4, 64)], {}, "sequence 1 or S"),
    ([(1, 1, 3072), (1, 1, 64), (1, 1, 64), (1, 8, 4, 64), (1, 8, 4, 64)], {"rotary_dim": 66}, "rotary_dim 66"),
    ([(1, 1, 3072), (1, 1, 64), (1, 1, 64), (1, 8, 4, 64), (1, 8, 4, 64)], {"interleaved": 3}, "interleaved=3"),
    ([(1, 1, 1600), (1, 1, 320), (1, 1, 320), (1, 1, 4, 320), (1, 1, 4, 320)], {}, "head_dim 320 .* up to 256"),
])
def test_plan_refusals_name_the_input(lib, shapes, attrs, match):
    rc, msg = plan(lib, shapes, **attrs)
    assert rc != 0 and re.search(match, msg), msg
    assert msg.startswith("ort_triton QKVRotaryCache"), msg


@pytest.mark.parametrize("qkv, cos, past, aligned", [
    ((1, 1, 4096), (1, 1, 1, 128), (1, 8, 1024, 128), 1),   # Qwen3-0.6B decode: 16 q heads, 8 kv heads of 128
    ((4, 9, 480), (4, 9, 40), (4, 2, 3, 80), 0),             # D = 80, per pair
])
def test_norm_plan_grid_spec_and_outputs(lib, qkv, cos, past, aligned):
    d = past[3]
    rc, msg = plan_attrs(lib, "QKVNormRotaryCache", [qkv, cos, cos, past, past, (d,), (d,)], 3, (0, 0, 1e-6))
    assert rc == 0, msg
    check_plan(msg, qkv, past, QKV_NORM_ROTARY_CACHE, (d, aligned, 1), cos[-1])


@pytest.mark.parametrize("gammas, match", [
    ([(64,), (32,)], r"input k_gamma has shape \[32\]; it must be \[64\], head_dim \(dim 3 of input past_key\)"),
    ([(1, 64), (64,)], r"input q_gamma has shape \[1,64\]; it must be \[64\]"),
])
def test_norm_plan_refuses_a_gamma_not_head_dim(lib, gammas, match):
    shapes = [(1, 1, 3072), (1, 1, 1, 64), (1, 1, 1, 64), (1, 8, 4, 64), (1, 8, 4, 64), *gammas]
    rc, msg = plan_attrs(lib, "QKVNormRotaryCache", shapes, 3, (0, 0, 1e-6))
    assert rc != 0 and re.search(match, msg), msg


# (no register spills: tests/ops/test_rotary_kernel.py::test_no_spills covers QKVRotaryCache's specs)


# ---- on the GPU: the op through ORT's CUDA EP and the library ---------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("type_name", list(ONNX_TYPES))
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("norm", [False, True], ids=["rotary", "norm"])
@pytest.mark.parametrize("case", CASES + [(16, 1, 32, 8, 64, 1024, 0, False, 4, 16, 1),
                                          (2, 300, 32, 8, 64, 0, 0, False, 4, 1, 300)], ids=str)
def test_cuda_ep_runs_the_kernel(gpu_library, case, norm, interleaved, type_name):
    from ort_triton.runtime import launch_count, make_session

    t, torch_dtype = ONNX_TYPES[type_name]
    ins = [a.to(torch_dtype).float().cpu().numpy() for a in _inputs(case, torch.float32, sum(case), norm)]
    op = QKV_NORM_ROTARY_CACHE if norm else QKV_ROTARY_CACHE
    names = [i.name for i in op.inputs]
    outs = [o.name for o in op.outputs]
    nodes = [helper.make_node("Cast", [f"{n}32"], [n], to=t) for n in names]
    attrs = dict(interleaved=interleaved, rotary_dim=case[6], **({"epsilon": EPS} if norm else {}))
    nodes += [helper.make_node(op.name, names, outs, domain=DOMAIN, **attrs)]
    nodes += [helper.make_node("Cast", [o], [f"{o}32"], to=TensorProto.FLOAT) for o in outs]
    graph = helper.make_graph(nodes, "qrc", [helper.make_tensor_value_info(f"{n}32", TensorProto.FLOAT, a.shape)
                                             for n, a in zip(names, ins)],
                              [helper.make_tensor_value_info(f"{o}32", TensorProto.FLOAT, None) for o in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                              functions=[op.function_proto(17)], ir_version=10)
    sess = make_session(model, providers=["CUDAExecutionProvider"], library=gpu_library)
    before = launch_count(gpu_library)
    got = sess.run(None, {f"{n}32": a for n, a in zip(names, ins)})
    assert launch_count(gpu_library) == before + (1 if case[1] or case[5] else 0), "the Triton kernel did not run"
    want = op.reference(*ins, **attrs)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        if w.size:
            assert np.abs(g - w).max() / np.abs(w).max() < TOL[torch_dtype]
