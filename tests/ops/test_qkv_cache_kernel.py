"""QKVCache (ort_triton/ops/qkv_cache.py): the kernel (QKVRotaryCache's body, rotary off, bias on) against the
float64 reference under the interpreter on CPU (poisoned outputs; prefill, decode, an empty cache, no new rows,
MHA, GQA and MQA, head dims 6 to 256, more rows than one tile, a past longer than one copy block), the bias
added in fp32 and rounded once (bit for bit), the reference against its definition, the native planner
through the library's test hook, no register spills, and on the GPU the op through ORT's CUDA EP (tests/gpu
runs, marked gpu)."""

import os
import re

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from ort_triton.contract import DOMAIN
from ort_triton.kernels.qkv_rotary_cache import qkv_cache
from ort_triton.ops.qkv_cache import QKV_CACHE, reference_qkv_cache
from ort_triton.ops.rotary import BLOCK_DS
from tests.native_hooks import load, plan_attrs
from tests.ops.test_qkv_rotary_cache_kernel import check_outputs, check_plan
from tests.ops.test_rotary_kernel import kernel_stacks

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
ONNX_TYPES = {"float": (TensorProto.FLOAT, torch.float32), "float16": (TensorProto.FLOAT16, torch.float16),
              "bfloat16": (TensorProto.BFLOAT16, torch.bfloat16)}

# (B, S, Nq, Nkv, D, P)
CASES = [
    (1, 1, 12, 12, 64, 70),   # GPT-2 small's decode step (MHA); past 70 x 64 = 4480 elements: two copy blocks
    (2, 5, 4, 4, 32, 3),      # a chunk over a past
    (2, 7, 4, 2, 80, 0),      # GQA prefill with an empty cache; D = 80 (BLOCK_D 128, a partial block)
    (2, 3, 2, 1, 40, 6),      # D = 40: rows not 16 elements apart (the planner's unaligned spec)
    (3, 1, 4, 1, 64, 9),      # MQA decode
    (2, 0, 4, 2, 32, 5),      # no new rows: present is the past
    (1, 3, 3, 1, 6, 2),       # tiny head dim
    (1, 40, 2, 1, 32, 4),     # more rows than one tile (BLOCK_S 32 at D = 32)
    (1, 2, 2, 2, 256, 17),    # D = 256, the largest block
]


def _inputs(case, dtype, seed, zero_bias=False):
    b, s, nq, nkv, d, p = case
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    bias = rnd((nq + 2 * nkv) * d)
    return [rnd(b, s, (nq + 2 * nkv) * d), torch.zeros_like(bias) if zero_bias else bias, rnd(b, nkv, p, d),
            rnd(b, nkv, p, d)]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case, dtype):
    ins = _inputs(case, dtype, sum(case))
    b, s, nq, nkv, d, p = case
    out = tuple(torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
                for shape in ((b, nq, s, d), (b, nkv, p + s, d), (b, nkv, p + s, d)))
    got = qkv_cache(*ins, out=out)
    assert all(g is o for g, o in zip(got, out))
    want = reference_qkv_cache(*(t.double().cpu().numpy() for t in ins))
    check_outputs(got, want, TOL[dtype])
    # the past is a copy, bit for bit; the new rows the sum in fp32, rounded once to the type
    for g, past in ((got[1], ins[2]), (got[2], ins[3])):
        assert torch.equal(g[:, :, :p].cpu(), past.cpu())
    # rounded to nearest even, as the GPU's cvt.rn (and the interpreter, tests/triton_interpreter_fixes.py)
    summed = (ins[0].float() + ins[1].float()).to(dtype).reshape(b, s, nq + 2 * nkv, d).transpose(1, 2).cpu()
    assert torch.equal(got[0].cpu(), summed[:, :nq])
    assert torch.equal(got[1][:, :, p:].cpu(), summed[:, nq:nq + nkv])
    assert torch.equal(got[2][:, :, p:].cpu(), summed[:, nq + nkv:])


@pytest.mark.parametrize("dtype", list(TOL))
def test_zero_bias_moves_the_bits(dtype):
    """A model without a bias gets a zero vector (graph_rewrites/common.py zero_vector): Q and present are
    QKV's own elements, moved."""
    case = (2, 3, 4, 2, 64, 5)
    ins = _inputs(case, dtype, 7, zero_bias=True)
    b, s, nq, nkv, d, p = case
    got = qkv_cache(*ins)
    heads = ins[0].reshape(b, s, nq + 2 * nkv, d).transpose(1, 2).cpu()
    assert torch.equal(got[0].cpu(), heads[:, :nq])
    assert torch.equal(got[1].cpu(), torch.cat([ins[2].cpu(), heads[:, nq:nq + nkv]], dim=2))
    assert torch.equal(got[2].cpu(), torch.cat([ins[3].cpu(), heads[:, nq + nkv:]], dim=2))


def test_reference_is_add_split_concat():
    """The reference by its definition: GPT-2's split_heads after the bias, the past in front."""
    rng = np.random.default_rng(3)
    b, s, nq, nkv, d, p = 2, 3, 4, 2, 8, 5
    qkv, bias = rng.normal(size=(b, s, (nq + 2 * nkv) * d)), rng.normal(size=(nq + 2 * nkv) * d)
    past_k, past_v = rng.normal(size=(2, b, nkv, p, d))
    x = qkv + bias
    q, k, v = (x[..., a:z].reshape(b, s, -1, d).transpose(0, 2, 1, 3)
               for a, z in ((0, nq * d), (nq * d, (nq + nkv) * d), ((nq + nkv) * d, None)))
    got = reference_qkv_cache(qkv, bias, past_k, past_v)
    np.testing.assert_array_equal(got[0], q)
    np.testing.assert_array_equal(got[1], np.concatenate([past_k, k], axis=2))
    np.testing.assert_array_equal(got[2], np.concatenate([past_v, v], axis=2))


def test_bad_shapes_are_a_clear_error():
    z = lambda *shape: torch.zeros(*shape, device=DEVICE)
    with pytest.raises(ValueError, match=r"last dim 32 is not \(Nq \+ 2 \* 2\) \* 8"):
        qkv_cache(z(1, 2, 32), z(32), z(1, 2, 3, 8), z(1, 2, 3, 8))
    with pytest.raises(ValueError, match="past_key, past_value one"):
        qkv_cache(z(1, 2, 64), z(64), z(1, 2, 3, 8), z(1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"qkv_cache: bias must be \[64\]"):
        qkv_cache(z(1, 2, 64), z(1, 64), z(1, 2, 3, 8), z(1, 2, 3, 8))
    with pytest.raises(ValueError, match="past_key's batch 2 is not QKV's 1"):
        qkv_cache(z(1, 2, 64), z(64), z(2, 2, 3, 8), z(2, 2, 3, 8))


# ---- the native planner (ort_triton/native/qkv_rotary_cache.c, QKVCache's entry), no GPU needed ----------------

@pytest.fixture
def lib(native_library):
    return load(native_library)


def plan(lib, shapes):
    return plan_attrs(lib, "QKVCache", shapes, 3, ())


@pytest.mark.parametrize("qkv, past, aligned", [
    ((1, 1, 2304), (1, 12, 1024, 64), 1),     # GPT-2 small decode
    ((16, 1, 2304), (16, 12, 4096, 64), 1),
    ((8, 512, 2304), (8, 12, 0, 64), 1),      # prefill, empty cache
    ((2, 5, 480), (2, 2, 3, 80), 1),          # D = 80: BLOCK_D 128, aligned (80 = 5 x 16)
    ((2, 5, 240), (2, 2, 3, 40), 0),          # D = 40: the unaligned spec
    ((2, 0, 256), (2, 2, 7, 32), 1),          # no new rows
    ((3, 1, 384), (3, 1, 9, 64), 1),          # MQA
])
def test_plan_grid_spec_and_outputs(lib, qkv, past, aligned):
    rc, msg = plan(lib, [qkv, (qkv[2],), past, past])
    assert rc == 0, msg
    check_plan(msg, qkv, past, QKV_CACHE, (past[3], aligned))


@pytest.mark.parametrize("shapes, match", [
    ([(1, 2304), (2304,), (1, 12, 4, 64), (1, 12, 4, 64)], r"input QKV has shape \[1,2304\]"),
    ([(1, 1, 2304), (2304,), (2, 12, 4, 64), (2, 12, 4, 64)], r"input past_key .* with B = 1"),
    ([(1, 1, 2304), (2304,), (1, 12, 4, 64), (1, 12, 5, 64)], "past_value .* they must be equal"),
    ([(1, 1, 2300), (2300,), (1, 12, 4, 64), (1, 12, 4, 64)], r"last dim must be \(num_heads \+ 2"),
    ([(1, 1, 1536), (1536,), (1, 12, 4, 64), (1, 12, 4, 64)], "num_heads >= 1"),
    ([(1, 1, 2304), (768,), (1, 12, 4, 64), (1, 12, 4, 64)], r"input bias has shape \[768\]; it must be \[2304\]"),
    ([(1, 1, 2304), (1, 2304), (1, 12, 4, 64), (1, 12, 4, 64)], r"input bias has shape \[1,2304\]"),
    ([(1, 1, 1920), (1920,), (1, 1, 4, 320), (1, 1, 4, 320)], "head_dim 320 .* up to 256"),
])
def test_plan_refusals_name_the_input(lib, shapes, match):
    rc, msg = plan(lib, shapes)
    assert rc != 0 and re.search(match, msg), msg
    assert msg.startswith("ort_triton QKVCache"), msg


# ---- no register spills (ptxas' report from the cubins; no GPU needed) -------------------------------------------

@pytest.mark.parametrize("arch", [80, 90])
def test_no_spills(arch, tmp_path):
    """Every spec of QKVCache, all types (QKVRotaryCache's: tests/ops/test_rotary_kernel.py::test_no_spills)."""
    rows = kernel_stacks("QKVCache", arch, tmp_path)
    assert len(rows) == 3 * 2 * len(BLOCK_DS)
    assert all(r["stack"] == 0 for r in rows), [r for r in rows if r["stack"]]


# ---- on the GPU: the op through ORT's CUDA EP and the library ---------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("type_name", list(ONNX_TYPES))
@pytest.mark.parametrize("case", CASES + [(16, 1, 12, 12, 64, 1024), (8, 300, 12, 12, 64, 0)], ids=str)
def test_cuda_ep_runs_the_kernel(gpu_library, case, type_name):
    from ort_triton.runtime import launch_count, make_session

    t, torch_dtype = ONNX_TYPES[type_name]
    ins = [a.to(torch_dtype).float().cpu().numpy() for a in _inputs(case, torch.float32, sum(case))]
    names = [i.name for i in QKV_CACHE.inputs]
    outs = [o.name for o in QKV_CACHE.outputs]
    nodes = [helper.make_node("Cast", [f"{n}32"], [n], to=t) for n in names]
    nodes += [helper.make_node("QKVCache", names, outs, domain=DOMAIN)]
    nodes += [helper.make_node("Cast", [o], [f"{o}32"], to=TensorProto.FLOAT) for o in outs]
    graph = helper.make_graph(nodes, "qc", [helper.make_tensor_value_info(f"{n}32", TensorProto.FLOAT, a.shape)
                                            for n, a in zip(names, ins)],
                              [helper.make_tensor_value_info(f"{o}32", TensorProto.FLOAT, None) for o in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                              functions=[QKV_CACHE.function_proto(17)], ir_version=10)
    sess = make_session(model, providers=["CUDAExecutionProvider"], library=gpu_library)
    before = launch_count(gpu_library)
    got = sess.run(None, {f"{n}32": a for n, a in zip(names, ins)})
    assert launch_count(gpu_library) == before + (1 if case[1] or case[5] else 0), "the Triton kernel did not run"
    want = reference_qkv_cache(*ins)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        if w.size:
            assert np.abs(g - w).max() / np.abs(w).max() < TOL[torch_dtype]
