"""The CausalAttention kernel under Triton's interpreter on the CPU (natively on a GPU), against the float64
reference.

Queries S in {1, 5, 17} over caches T in {S, S + 7, 40}, Nq/Nkv in {4/4, 4/2, 4/1} (rows of G heads packed
into one program), head dims 32 and 64 with small blocks (several key blocks, the causal diagonal, a
partial tail), every head dim with the library's own blocks, padded keys (left padding, so padded query
rows see no key at all) in both meanings of such rows, and the function body on ORT CPU against the same
reference. Outputs are poisoned with NaN before each run.
"""

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ort_triton.contract import DOMAIN
from ort_triton.kernels.causal_attention import causal_attention
from ort_triton.ops.causal_attention import (
    CAUSAL_ATTENTION,
    CAUSAL_HEAD_DIMS,
    DECODE_ROWS,
    block_config,
    merge_block,
    reference_causal_attention,
    split_keys,
)
from tests.ptxas_report import compile_rows

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # conftest decides
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
SMALL = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4)
F = lambda t: t.to(torch.float64).cpu().numpy()


def _inputs(b, nq, nkv, s, t, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(shape, generator=gen, dtype=torch.float64)
    return [x.to(dtype).to(DEVICE) for x in (r(b, nq, s, d), r(b, nkv, t, d), r(b, nkv, t, d))]


def _padding(b, t, dtype, low, pads, seed=0):
    """key_bias [B, T]: row i has pads[i] leading padded keys (left padding, as generation batches have),
    small random biases elsewhere."""
    rng = np.random.default_rng(seed)
    kb = rng.uniform(-0.5, 0.5, (b, t))
    for i, p in enumerate(pads):
        kb[i, :p] = low
    return torch.from_numpy(kb).to(dtype).to(DEVICE)


def _run(q, k, v, kb, scale, masked_rows=0, config=None):
    b, nq, s, d = q.shape
    out = torch.full((b, s, nq * d), float("nan"), dtype=q.dtype, device=DEVICE)
    y = causal_attention(q, k, v, kb, scale, masked_rows, out=out, config=config)
    assert y is out
    return F(y)


def _check(got, q, k, v, kb, scale, masked_rows, dtype):
    (want,) = reference_causal_attention(F(q), F(k), F(v), F(kb), scale, masked_rows)
    assert np.isfinite(got).all(), "unwritten (NaN) or non-finite elements"
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)
    assert err < TOL[dtype], f"rel err {err:.2e} > {TOL[dtype]:.0e}"
    return want


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nq, nkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("s, extra", [(1, 0), (1, 7), (1, 39), (5, 0), (5, 7), (5, 35), (17, 0), (17, 7), (17, 23)])
@pytest.mark.parametrize("d", [32, 64])
def test_causal_gqa_over_a_cache(dtype, nq, nkv, s, extra, d):
    """T = S + extra (extra = past length: 0, 7, and up to T = 40); blocks of 16 so that the full blocks,
    the diagonal and the key tail all run; the last batch row padded on its first 3 keys (-inf)."""
    t = s + extra
    q, k, v = _inputs(2, nq, nkv, s, t, d, dtype, seed=s * 100 + t + nkv)
    kb = _padding(2, t, dtype, float("-inf"), [0, min(3, t - 1)], seed=t)
    scale = 1.5 * d**-0.5  # sharp: the running max must be tracked across blocks
    _check(_run(q, k, v, kb, scale, 0, SMALL), q, k, v, kb, scale, 0, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", CAUSAL_HEAD_DIMS)
@pytest.mark.parametrize("nq, nkv, s, t", [(4, 1, 1, 21), (8, 2, 9, 9), (2, 2, 19, 40)])
def test_every_head_dim_with_the_library_blocks(dtype, d, nq, nkv, s, t):
    """block_config's tiles (decode for G * S <= 16, else the prefill ones)."""
    q, k, v = _inputs(2, nq, nkv, s, t, d, dtype, seed=d + s)
    kb = _padding(2, t, dtype, float("-inf"), [0, 2], seed=d)
    _check(_run(q, k, v, kb, d**-0.5), q, k, v, kb, d**-0.5, 0, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masked_rows", [0, 1])
@pytest.mark.parametrize("nq, nkv, s, t", [(4, 2, 17, 17), (4, 1, 5, 12), (4, 4, 1, 40), (4, 2, 17, 40)])
def test_fully_padded_query_rows(dtype, masked_rows, nq, nkv, s, t):
    """Left padding longer than the past: the first queries of a row see only padded keys (-inf). They
    are 0 (masked_rows 0, sdpa's graph) or the mean of V over all T keys (1, eager's graph). A row that is
    padding throughout, too."""
    d = 32
    q, k, v = _inputs(3, nq, nkv, s, t, d, dtype, seed=t + masked_rows)
    pads = [t - s + min(3, s - 1) + 1, 0, t]  # row 0: its first few queries see nothing; row 2: nothing at all
    kb = _padding(3, t, dtype, float("-inf"), pads, seed=s)
    got = _run(q, k, v, kb, d**-0.5, masked_rows, SMALL)
    _check(got, q, k, v, kb, d**-0.5, masked_rows, dtype)
    blind = got.reshape(3, s, nq, d)[0, : min(3, s - 1) + 1]  # row 0's queries that see no key
    if masked_rows == 0:
        assert (blind == 0).all() and (got[2] == 0).all()
    else:
        mean = np.repeat(F(v).mean(2), nq // nkv, axis=1)  # [B, Nq, D]
        assert np.abs(blind - mean[0][None]).max() < TOL[dtype] * np.abs(mean).max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finfo_min_padding_is_finite(dtype):
    """finfo.min as the bias (a finite fill, which the kernel saturates): rows with a kept key drop the
    padded ones exactly; a row that sees only finfo.min keys is uniform over them, as the reference."""
    nq, nkv, s, t, d = 4, 2, 6, 13, 32
    q, k, v = _inputs(2, nq, nkv, s, t, d, dtype, seed=5)
    kb = _padding(2, t, dtype, torch.finfo(dtype).min, [t - s + 3, 1], seed=2)
    _check(_run(q, k, v, kb, d**-0.5, 0, SMALL), q, k, v, kb, d**-0.5, 0, dtype)


# chunks of 16 keys: many chunks merge, in a second launch (the fused merge, one launch, must give the same bits:
# test_causal_attention_fused_merge.py)
SPLIT = dict(SMALL, SPLIT_TARGET=1 << 20, SPLIT_MIN_KEYS=16, FUSED_MERGE=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nq, nkv, s, t", [(4, 1, 1, 17), (4, 2, 1, 70), (8, 8, 1, 100), (4, 1, 3, 45),
                                           (4, 2, 4, 64)])
def test_split_cache_matches_one_pass(dtype, nq, nkv, s, t):
    """Decode split over the cache (flash-decoding: chunk states, then their merge), chunks of 16 keys: a
    tail chunk, chunks wholly past a row's last key (S > 1: the causal diagonal inside a chunk), the last
    batch row padded. Equal to the reference, and to the one-pass kernel within rounding."""
    d = 32
    q, k, v = _inputs(2, nq, nkv, s, t, d, dtype, seed=t + s)
    kb = _padding(2, t, dtype, float("-inf"), [0, min(20, t - 1)], seed=t)
    scale = 1.5 * d**-0.5
    got = _run(q, k, v, kb, scale, 0, SPLIT)
    _check(got, q, k, v, kb, scale, 0, dtype)
    one_pass = _run(q, k, v, kb, scale, 0, dict(SMALL, SPLIT_TARGET=0))
    assert np.abs(got - one_pass).max() <= 2 * TOL[dtype] * np.abs(one_pass).max()


@pytest.mark.parametrize("masked_rows", [0, 1])
def test_split_cache_rows_without_keys(masked_rows):
    """A batch row padded throughout and one whose first query sees only padding, split into chunks:
    0 or the mean of V, as in one pass (every chunk of such a row holds no key: m = -inf, l = 0)."""
    nq, nkv, s, t, d = 4, 2, 2, 50, 32
    q, k, v = _inputs(3, nq, nkv, s, t, d, torch.float32, seed=masked_rows)
    kb = _padding(3, t, torch.float32, float("-inf"), [t - s + 1, 0, t], seed=1)
    got = _run(q, k, v, kb, d**-0.5, masked_rows, SPLIT)
    _check(got, q, k, v, kb, d**-0.5, masked_rows, torch.float32)
    assert (got[2] == 0).all() if masked_rows == 0 else np.isfinite(got[2]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masked_rows", [0, 1])
@pytest.mark.parametrize("merge", [0, 2, 4, 8])
@pytest.mark.parametrize("nq, nkv, s, t", [(4, 2, 1, 64), (4, 1, 1, 70), (8, 2, 3, 64)])
def test_split_merge_in_blocks(dtype, masked_rows, merge, nq, nkv, s, t):
    """PHASE 2 merging MERGE_BLOCK chunks at a time (0: one after another) over 4 or 5 chunks of 16 keys:
    blocks smaller than the chunk count (several blocks, the last part empty at 5 chunks), equal, larger
    (chunks past n_split masked). GQA, MQA, and S = 3. Batch row 1 is padded over its first 40 keys, so its
    first two chunks hold no key (m = -inf), a whole first block of them at MERGE_BLOCK 2; row 2 is padded
    throughout: every chunk empty, the row 0 or the mean of V."""
    d = 32
    assert split_keys(t, nkv * 3, 16, SPLIT["SPLIT_TARGET"], SPLIT["SPLIT_MIN_KEYS"]) == 16  # 4 or 5 chunks
    q, k, v = _inputs(3, nq, nkv, s, t, d, dtype, seed=t + merge)
    kb = _padding(3, t, dtype, float("-inf"), [0, 40, t], seed=s)
    scale = 1.5 * d**-0.5
    got = _run(q, k, v, kb, scale, masked_rows, dict(SPLIT, MERGE_BLOCK=merge))
    _check(got, q, k, v, kb, scale, masked_rows, dtype)
    if masked_rows == 0:
        assert (got[2] == 0).all()
    else:
        mean = np.repeat(F(v).mean(2), nq // nkv, axis=1)[2]  # [Nq, D]
        assert np.abs(got[2].reshape(s, nq, d) - mean[None]).max() < TOL[dtype] * np.abs(mean).max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_library_blocks_split_past_the_merge_block(dtype, d):
    """The library's decode tiles and MERGE_BLOCK (block_config, merge_block) with chunks of one key block,
    11 of them: more than one merge block, the last partly masked; a padded batch row."""
    cfg = block_config(d, {torch.float32: "float"}.get(dtype, "float16"), 4)
    merge = merge_block(d, cfg["BLOCK_M"], cfg["num_warps"])
    t = 10 * cfg["BLOCK_N"] + 5
    assert 11 > merge and 11 % merge
    q, k, v = _inputs(2, 8, 2, 1, t, d, dtype, seed=d)
    kb = _padding(2, t, dtype, float("-inf"), [0, cfg["BLOCK_N"] + 3], seed=d)
    config = dict(SPLIT_TARGET=1 << 20, SPLIT_MIN_KEYS=cfg["BLOCK_N"])
    assert split_keys(t, 2 * 2, cfg["BLOCK_N"], 1 << 20, cfg["BLOCK_N"]) == cfg["BLOCK_N"]
    _check(_run(q, k, v, kb, d**-0.5, 0, config), q, k, v, kb, d**-0.5, 0, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_with_a_register_cap(dtype):
    """A config's maxnreg (ptxas' register cap, a decode tuning candidate) reaches the launch: the same result
    (on the GPU a capped build; under the interpreter the option is taken and the maths unchanged)."""
    from ort_triton.ops.causal_attention import DECODE_MAXNREG

    q, k, v = _inputs(2, 8, 2, 1, 300, 64, dtype, seed=7)
    kb = _padding(2, 300, dtype, float("-inf"), [0, 37], seed=7)
    config = dict(SPLIT_TARGET=1 << 20, SPLIT_MIN_KEYS=64, BLOCK_N=64, maxnreg=DECODE_MAXNREG, FUSED_MERGE=0)
    _check(_run(q, k, v, kb, 0.125, 0, config), q, k, v, kb, 0.125, 0, dtype)


def test_more_queries_than_one_block_of_heads():
    """G * S just above the decode threshold takes the prefill tiles; at the threshold the decode ones."""
    assert block_config(64, "float16", DECODE_ROWS)["BLOCK_M"] == 16
    assert block_config(64, "float16", DECODE_ROWS + 1)["BLOCK_M"] > 16
    for s in (4, 5):  # G = 4: 16 and 20 rows
        q, k, v = _inputs(1, 8, 2, s, 30, 64, torch.float32, seed=s)
        kb = torch.zeros(1, 30, device=DEVICE)
        _check(_run(q, k, v, kb, 0.125), q, k, v, kb, 0.125, 0, torch.float32)


def test_empty_batch_and_no_queries_launch_nothing():
    for b, s, t in ((0, 3, 5), (2, 0, 4)):
        q, k, v = _inputs(b, 4, 2, s, t, 32, torch.float32, seed=0)
        y = causal_attention(q, k, v, torch.zeros(b, t, device=DEVICE), 0.1)
        assert y.shape == (b, s, 4 * 32)


def test_bad_shapes_are_refused():
    q, k, v = _inputs(2, 4, 2, 5, 9, 32, torch.float32, seed=0)
    kb = torch.zeros(2, 9, device=DEVICE)
    with pytest.raises(ValueError, match="fewer than the S=5 queries"):
        causal_attention(q, k[:, :, :4], v[:, :, :4], kb[:, :4], 0.1)
    q3, k3, v3 = _inputs(2, 4, 3, 5, 9, 32, torch.float32, seed=0)
    with pytest.raises(ValueError, match="Nkv dividing Nq=4"):
        causal_attention(q3, k3, v3, kb, 0.1)
    q48, k48, v48 = _inputs(2, 4, 2, 5, 9, 48, torch.float32, seed=0)
    with pytest.raises(ValueError, match="head dim 48 not supported"):
        causal_attention(q48, k48, v48, kb, 0.1)
    with pytest.raises(ValueError, match="key_bias must be"):
        causal_attention(q, k, v, kb[:, :5], 0.1)


# ---- the function body on ORT CPU: the contract's meaning, against the same reference --------------
def _body_model(opset, b, nq, nkv, s, t, d, scale, masked_rows):
    names, shapes = ["Q", "K", "V", "key_bias"], [[b, nq, s, d], [b, nkv, t, d], [b, nkv, t, d], [b, t]]
    node = helper.make_node(CAUSAL_ATTENTION.name, names, ["Y"], domain=DOMAIN, scale=scale, masked_rows=masked_rows)
    g = helper.make_graph([node], "ca", [helper.make_tensor_value_info(n, TensorProto.FLOAT, sh)
                                          for n, sh in zip(names, shapes)],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [b, s, nq * d])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)],
                          functions=[CAUSAL_ATTENTION.function_proto(opset)], ir_version=9)
    onnx.checker.check_model(m)
    return m


@pytest.mark.parametrize("opset", [15, 16, 17, 18, 20, 23])
@pytest.mark.parametrize("masked_rows", [0, 1])
@pytest.mark.parametrize("nq, nkv, s, t", [(4, 4, 5, 5), (4, 2, 1, 12), (4, 1, 5, 12), (6, 2, 17, 40)])
def test_function_body_matches_the_reference(opset, masked_rows, nq, nkv, s, t):
    d, b = 32, 3
    rng = np.random.default_rng(t)
    q, k, v = rng.normal(size=(b, nq, s, d)), rng.normal(size=(b, nkv, t, d)), rng.normal(size=(b, nkv, t, d))
    kb = np.zeros((b, t))
    kb[0, : t - s + 2] = -np.inf  # its first two queries see nothing
    kb[1, :] = -np.inf
    kb[2, 1] = -3.0
    feeds = {n: a.astype(np.float32) for n, a in zip(["Q", "K", "V", "key_bias"], (q, k, v, kb))}
    sess = ort.InferenceSession(_body_model(opset, b, nq, nkv, s, t, d, 0.2, masked_rows).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, feeds)
    (want,) = reference_causal_attention(*feeds.values(), 0.2, masked_rows)
    assert got.shape == (b, s, nq * d) and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---- registers: no spills in the specs Llama-sized models run (head dims 64, 128) and in every decode spec (the
# blocked merge's chunk tile, ops/causal_attention.py merge_block), Ampere and Hopper ------------------------------
_SPILL_SCRIPT = r"""
import json, pathlib, sys
from ort_triton.ops import CAUSAL_ATTENTION as OP
from tests.ptxas_report import spec_usage
arch, out = int(sys.argv[1]), pathlib.Path(sys.argv[2])
rows = []
for t in ("float16", "bfloat16", "float"):
    for i, spec in enumerate(OP.specializations(t)):
        llama = t != "float" and spec.constexprs["HEAD_DIM"] in (64, 128, 256)  # and Gemma's
        if llama or spec.constexprs["SPLIT_K"]:
            rows.append(dict(spec_usage(OP, t, i, spec, arch, out), head_dim=spec.constexprs["HEAD_DIM"],
                             decode=spec.constexprs["SPLIT_K"], seq_major=spec.constexprs["KV_SEQ_MAJOR"]))
print(json.dumps(rows))
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
def test_llama_head_dims_do_not_spill(arch, tmp_path):
    """ptxas' resource report of the decode and prefill specs at head dims 64 and 128 (fp16, bf16) and of every
    decode spec (all types): no stack (tests/ptxas_report.py)."""
    rows = compile_rows(_SPILL_SCRIPT, arch, tmp_path)
    # per cache layout (heads first, sequence first): fp16, bf16: a decode spec per head dim (two at BLOCK_D 64: head
    # dims 40 and 64, below and from DECODE_WIDE programs) and the prefill ones at 64, 128, 256; fp32: the decode specs
    assert len(rows) == 2 * (2 * (len(CAUSAL_HEAD_DIMS) + 2 + 3) + len(CAUSAL_HEAD_DIMS))
    assert sum(r["seq_major"] for r in rows) == len(rows) // 2
    for r in rows:
        # the known spills (ops/causal_attention.py, _CONFIGS' comments): ptxas holds the fp16/bf16 decode spec at
        # head dim 64 to 168 registers on sm_90 once the merge is unrolled (any MERGE_BLOCK), 8 bytes over; fp32 at
        # head dim 256 spills at any tile, about 300 bytes at decode
        known = 8 if arch == 90 and r["decode"] and r["head_dim"] == 64 and r["type"] != "float" else 0
        # (336 sequence first on sm_80: the row stride is a runtime value there)
        known = 320 + 32 * r["seq_major"] if r["decode"] and r["head_dim"] == 256 and r["type"] == "float" else known
        assert r["stack"] <= known, f"{r['type']} spec {r['spec']} on sm_{arch} spills: {r['usage']}"
