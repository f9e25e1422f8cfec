"""The cache ops' kernels with the cache sequence first (ops/kv_layout.py): QKVRotaryCache, QKVNormRotaryCache and
QKVCache against their float64 references with seq_major = 1, poisoned outputs, and with present bound over its past
(one buffer of [P + S, B, Nkv, D] for both: the new rows written after the past, nothing copied). Interpreter on CPU,
natively on the GPU."""

import os
import re

import numpy as np
import pytest
import torch

from ort_triton.kernels.qkv_rotary_cache import _copy_bits, _grid, qkv_cache, qkv_rotary_cache
from ort_triton.ops.kv_layout import TO_SEQ
from ort_triton.ops.qkv_cache import reference_qkv_cache
from ort_triton.ops.qkv_rotary_cache import (
    BLOCK_C,
    COPY_PROGRAMS,
    reference_qkv_norm_rotary_cache,
    reference_qkv_rotary_cache,
)
from tests.ops.test_qkv_rotary_cache_kernel import check_outputs

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
# (B, S, Nq, Nkv, D, P)
CASES = [
    (2, 5, 4, 2, 32, 3),    # prefill over a short past, GQA 2:1
    (1, 1, 8, 2, 64, 70),   # decode; the past 70 x 2 x 64 elements: three copy blocks
    (3, 1, 4, 1, 64, 9),    # MQA, batch 3
    (2, 7, 2, 2, 80, 0),    # prefill, no past: no copy programs
    (2, 0, 4, 2, 32, 5),    # no new rows: present is the past
]
OPS = ["rotary", "norm", "bias"]


def _inputs(case, dtype, op):
    b, s, nq, nkv, d, p = case
    gen = torch.Generator().manual_seed(sum(case))
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    qkv, pk, pv = rnd(b, s, (nq + 2 * nkv) * d), rnd(p, b, nkv, d), rnd(p, b, nkv, d)
    if op == "bias":
        return qkv, rnd((nq + 2 * nkv) * d), pk, pv
    cos, sin = rnd(1, 1, s, d), rnd(1, 1, s, d)
    gammas = (1 + 0.3 * rnd(2, d).double()).to(dtype) if op == "norm" else None
    return qkv, cos, sin, pk, pv, gammas


def _run(op, ins, out):
    if op == "bias":
        return qkv_cache(*ins, out=out, seq_major=1)
    qkv, cos, sin, pk, pv, gammas = ins
    extra = dict(q_gamma=gammas[0], k_gamma=gammas[1], epsilon=1e-5) if gammas is not None else {}
    return qkv_rotary_cache(qkv, cos, sin, pk, pv, out=out, seq_major=1, **extra)


def _reference(op, ins):
    a = lambda t: t.double().cpu().numpy()
    if op == "bias":
        return reference_qkv_cache(*map(a, ins), seq_major=1)
    qkv, cos, sin, pk, pv, gammas = ins
    if gammas is not None:
        return reference_qkv_norm_rotary_cache(*map(a, (qkv, cos, sin, pk, pv)), a(gammas[0]), a(gammas[1]),
                                               epsilon=1e-5, seq_major=1)
    return reference_qkv_rotary_cache(*map(a, (qkv, cos, sin, pk, pv)), seq_major=1)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_seq_major_matches_reference(case, op, dtype):
    """Present in a buffer of its own: the past copied (bit for bit), the new rows after it."""
    b, s, nq, nkv, d, p = case
    ins = _inputs(case, dtype, op)
    poison = lambda *shape: torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    out = (poison(b, nq, s, d), poison(p + s, b, nkv, d), poison(p + s, b, nkv, d))
    got = _run(op, ins, out)
    check_outputs(got, _reference(op, ins), TOL[dtype])
    pk, pv = (ins[2], ins[3]) if op == "bias" else (ins[3], ins[4])
    assert torch.equal(got[1][:p].cpu(), pk.cpu()) and torch.equal(got[2][:p].cpu(), pv.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_present_bound_over_its_past(case, op, dtype):
    """One buffer per cache tensor, longer than the context (as a caller allocates it): past its first P rows,
    present its first P + S; the kernel writes the S new rows and leaves the past and the rows beyond alone."""
    b, s, nq, nkv, d, p = case
    ins = list(_inputs(case, dtype, op))
    at = 2 if op == "bias" else 3
    bufs = []
    for i in (at, at + 1):  # the past in the buffer's first rows, NaN after them
        buf = torch.full((p + s + 3, b, nkv, d), float("nan"), dtype=dtype, device=DEVICE)
        buf[:p] = ins[i]
        bufs.append(buf)
    want = _reference(op, ins)
    ins[at], ins[at + 1] = bufs[0][:p], bufs[1][:p]
    if p:  # (an empty past has no data pointer to share; it has nothing to copy either)
        assert _copy_bits(ins[at], ins[at + 1], bufs[0][:p + s], bufs[1][:p + s], 1) == 0
    q = torch.full((b, nq, s, d), float("nan"), dtype=dtype, device=DEVICE)
    got = _run(op, ins, (q, bufs[0][:p + s], bufs[1][:p + s]))
    check_outputs(got, want, TOL[dtype])
    for buf in bufs:
        assert torch.isnan(buf[p + s:]).all()


def test_copy_programs_are_bounded():
    """Sequence first, a past of any length is copied by at most COPY_PROGRAMS programs a tensor (each taking every
    n-th block), heads first by one program a block of each (b, kv head) slab, as before."""
    b, nq, nkv, d, p = 16, 32, 8, 64, 4096
    n_new = _grid(nq, nkv, d, b, 1, p, seq_major=1)[2]
    assert _grid(nq, nkv, d, b, 1, p, seq_major=1)[3] == n_new + 2 * COPY_PROGRAMS
    assert _grid(nq, nkv, d, b, 1, p)[3] == n_new + 2 * b * nkv * p * d // BLOCK_C
    assert _grid(nq, nkv, d, 1, 1, 3, seq_major=1)[3] == _grid(nq, nkv, d, 1, 1, 0)[3] + 2


def test_reference_is_the_heads_first_one_relaid():
    rng = np.random.default_rng(0)
    qkv, bias, pk, pv = rng.normal(size=(2, 3, 48)), rng.normal(size=48), rng.normal(size=(2, 2, 4, 8)), \
        rng.normal(size=(2, 2, 4, 8))
    heads = reference_qkv_cache(qkv, bias, pk, pv)
    seq = reference_qkv_cache(qkv, bias, pk.transpose(TO_SEQ), pv.transpose(TO_SEQ), seq_major=1)
    np.testing.assert_array_equal(seq[0], heads[0])
    for s, h in zip(seq[1:], heads[1:]):
        np.testing.assert_array_equal(s, h.transpose(TO_SEQ))


# ---- the native planner (the library's test hook) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def lib(native_library):
    from tests.native_hooks import load

    return load(native_library)


@pytest.mark.parametrize("op, attrs, extra", [("QKVRotaryCache", (0, 0, 1), 2),
                                              ("QKVNormRotaryCache", (0, 0, 1e-6, 1), 4), ("QKVCache", (1,), 0)])
@pytest.mark.parametrize("qkv, past", [
    ((1, 1, 3072), (1024, 1, 8, 64)),      # Llama-1B decode: 1024 x 8 x 64 elements, 128 blocks a tensor
    ((16, 1, 3072), (4096, 16, 8, 64)),    # 16 x 4096: 8192 blocks a tensor, COPY_PROGRAMS programs
    ((8, 512, 3072), (0, 8, 8, 64)),       # prefill, empty cache: no copy programs
])
def test_plan_seq_major(lib, op, attrs, extra, qkv, past):
    from tests.native_hooks import plan_attrs

    b, s, width = qkv
    p, _, nkv, d = past
    cos = (1, 1, s, d)
    if op == "QKVCache":
        shapes = [qkv, (width,), past, past]
    else:
        shapes = [qkv, cos, cos, past, past] + [(d,), (d,)] * (op == "QKVNormRotaryCache")
    rc, msg = plan_attrs(lib, op, shapes, 3, attrs)
    assert rc == 0, msg
    half = op != "QKVCache"
    nq = width // d - 2 * nkv
    n_new = _grid(nq, nkv, d, b, s, p, half, seq_major=1)[2]
    grid = int(re.search(r"grid=(\d+),", msg).group(1))
    assert grid == n_new + 2 * min(-(-p * b * nkv * d // BLOCK_C), COPY_PROGRAMS), msg
    alias = re.search(r"alias_grid=(\d+)", msg)  # bound over its past, only the new rows' programs launch
    assert (int(alias.group(1)) if alias else None) == (n_new if p else None), msg
    flat = msg.replace(" ", "")
    for i, shape in enumerate(((b, nq, s, d), (p + s, b, nkv, d), (p + s, b, nkv, d))):
        assert f"out{i}=[{','.join(map(str, shape))}]" in flat, msg


@pytest.mark.parametrize("shapes, attrs, match", [
    ([(1, 1, 3072), (1, 1, 1, 64), (1, 1, 1, 64), (4, 1, 8, 64), (4, 1, 8, 64)], (0, 0, 2), "seq_major is 2"),
    ([(2, 1, 3072), (1, 1, 1, 64), (1, 1, 1, 64), (4, 1, 8, 64), (4, 1, 8, 64)], (0, 0, 1),
     r"\[P, B, kv_num_heads, head_dim\] \(seq_major\) with B = 2"),
    ([(1, 1, 3072), (1, 1, 1, 64), (1, 1, 1, 64), (1, 8, 4, 64), (1, 8, 4, 64)], (0, 0, 1), "head_dim"),
])
def test_plan_seq_major_refusals(lib, shapes, attrs, match):
    from tests.native_hooks import plan_attrs

    rc, msg = plan_attrs(lib, "QKVRotaryCache", shapes, 3, attrs)
    assert rc != 0 and re.search(match, msg), msg


# ---- CausalAttention reading a sequence-first cache --------------------------------------------------------------
SMALL = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4)
SPLIT = dict(SMALL, SPLIT_TARGET=1 << 20, SPLIT_MIN_KEYS=16, FUSED_MERGE=0)
FUSED = dict(SPLIT, FUSED_MERGE=1)


@pytest.mark.parametrize("config", [SMALL, SPLIT, FUSED, None], ids=["one-pass", "split", "fused-merge", "built-in"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("b, nq, nkv, s, t, d", [
    (2, 4, 2, 6, 13, 32),    # a chunk of prompt over a short past, GQA 2:1, a padded key
    (3, 8, 2, 1, 70, 64),    # decode, batch 3: rows 3 x 2 x 64 elements apart
    (1, 4, 1, 1, 45, 80),    # MQA, head dim 80 (lanes masked)
    (2, 2, 2, 33, 33, 32),   # prefill, no past
])
def test_causal_attention_seq_major(b, nq, nkv, s, t, d, dtype, config):
    """The kernel over K, V [T, B, Nkv, D] gives the float64 reference's Y, and the heads-first kernel's bits."""
    from ort_triton.kernels.causal_attention import causal_attention
    from ort_triton.ops.causal_attention import reference_causal_attention

    gen = torch.Generator().manual_seed(b * 1000 + t)
    r = lambda *shape: torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    q, k, v = r(b, nq, s, d), r(b, nkv, t, d), r(b, nkv, t, d)
    kb = torch.zeros(b, t, dtype=dtype, device=DEVICE)
    kb[-1, 0] = float("-inf")
    ks, vs = k.permute(TO_SEQ).contiguous(), v.permute(TO_SEQ).contiguous()
    poison = lambda: torch.full((b, s, nq * d), float("nan"), dtype=dtype, device=DEVICE)
    got = causal_attention(q, ks, vs, kb, d**-0.5, out=poison(), config=config, seq_major=1)
    heads = causal_attention(q, k, v, kb, d**-0.5, out=poison(), config=config)
    f = lambda x: x.double().cpu().numpy()
    (want,) = reference_causal_attention(f(q), f(ks), f(vs), f(kb), d**-0.5, seq_major=1)
    g = f(got)
    assert np.isfinite(g).all()
    assert np.abs(g - want).max() / np.abs(want).max() < TOL[dtype]
    assert torch.equal(got, heads)  # the same keys in the same order: the same sums


@pytest.mark.parametrize("layout, match", [(1, "seq_major is 2"), (0, r"agree in batch \(dim 1 of K")])
def test_causal_attention_plan_seq_major(lib, layout, match):
    """Sequence first the planner reads T, B and Nkv from dims 0, 1 and 2, and picks a KV_SEQ_MAJOR spec."""
    from ort_triton.ops.causal_attention import CAUSAL_ATTENTION
    from tests.native_hooks import first_spec, plan_attrs

    shapes = [(16, 32, 1, 64), (4097, 16, 8, 64), (4097, 16, 8, 64), (16, 4097)]  # Llama-1B decode, 16 x 4096
    rc, msg = plan_attrs(lib, "CausalAttention", shapes, 1, (0.125, 0, 1))
    assert rc == 0, msg
    index = int(re.search(r"spec=(\d+)", msg).group(1))
    assert index == first_spec(CAUSAL_ATTENTION, (64, 4, 128, 4097, 1)), msg
    assert CAUSAL_ATTENTION.specializations("float16")[index].constexprs["KV_SEQ_MAJOR"] == 1
    assert "out0=[16,1,2048]" in msg.replace(" ", ""), msg
    bad = [(16, 32, 1, 64), (16, 8, 4097, 64), (16, 8, 4097, 64), (16, 4097)]  # heads first, told sequence first
    rc, msg = plan_attrs(lib, "CausalAttention", bad if layout == 0 else shapes, 1, (0.125, 0, 1 if layout == 0 else 2))
    assert rc != 0 and re.search(match, msg), msg
