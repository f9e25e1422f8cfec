"""CausalAttention's fused merge (PHASE 3, FUSED_MERGE configs): the chunks of a split cache and their merge in one
launch, the last chunk of each row tile to take its ticket merging, under Triton's interpreter on the CPU
(natively on a GPU). Its result must be the two launches' bit for bit (the same merge, in the same order, from
the same empty state), equal to the float64 reference, and the counters must be left at 0 for the next launch.
The interpreter runs programs one after another, so it checks the maths and the counter bookkeeping; the GPU
run of this file checks them with programs racing."""

import os
import pathlib
import re

import numpy as np
import pytest
import torch

from ort_triton.kernels.causal_attention import causal_attention, merge_counters
from ort_triton.ops.causal_attention import MERGE_COUNTERS, TUNING, reference_causal_attention, split_keys

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # conftest decides
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
SPLIT = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, SPLIT_TARGET=1 << 20, SPLIT_MIN_KEYS=16, FUSED_MERGE=0)  # chunks
# of 16 keys, merged in a second launch
F = lambda t: t.to(torch.float64).cpu().numpy()


def _case(b, nq, nkv, s, t, d, dtype, pads, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    kb = np.random.default_rng(seed).uniform(-0.5, 0.5, (b, t))
    for i, p in enumerate(pads):
        kb[i, :p] = -np.inf
    return r(b, nq, s, d), r(b, nkv, t, d), r(b, nkv, t, d), torch.from_numpy(kb).to(dtype).to(DEVICE)


def _run(q, k, v, kb, scale, masked_rows, config):
    b, nq, s, d = q.shape
    out = torch.full((b, s, nq * d), float("nan"), dtype=q.dtype, device=DEVICE)
    assert causal_attention(q, k, v, kb, scale, masked_rows, out=out, config=config) is out
    return F(out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masked_rows", [0, 1])
@pytest.mark.parametrize("nq, nkv, s, t", [(4, 1, 1, 17), (4, 2, 1, 70), (8, 8, 1, 100), (4, 1, 3, 45), (8, 2, 3, 64)])
def test_one_launch_equals_two(dtype, masked_rows, nq, nkv, s, t):
    """A tail chunk, chunks past a row's last key (S > 1), GQA and MQA; batch row 1 padded over its first 20 keys
    (its first chunk holds no key), row 2 throughout (every chunk empty: 0, or the mean of V)."""
    d = 32
    q, k, v, kb = _case(3, nq, nkv, s, t, d, dtype, [0, min(20, t - 1), t], seed=t + s)
    scale = 1.5 * d**-0.5
    fused = _run(q, k, v, kb, scale, masked_rows, dict(SPLIT, FUSED_MERGE=1))
    two = _run(q, k, v, kb, scale, masked_rows, SPLIT)
    assert np.array_equal(fused, two)
    (want,) = reference_causal_attention(F(q), F(k), F(v), F(kb), scale, masked_rows)
    assert np.isfinite(fused).all()
    assert np.abs(fused - want).max() / max(np.abs(want).max(), 1e-6) < TOL[dtype]
    programs = 3 * nkv * -(-(nq // nkv * s) // SPLIT["BLOCK_M"])
    assert split_keys(t, programs, 16, SPLIT["SPLIT_TARGET"], 16) == 16  # several chunks did merge
    assert not merge_counters(q.device, programs).any(), "the counters were not left at 0"


def test_counters_carry_over_between_launches():
    """Launches of other shapes, row-tile counts and chunk counts in a row over the one buffer: each one's result
    is its two-launch result (a counter left behind would make the wrong program merge, or none)."""
    for i, (b, nq, nkv, t) in enumerate([(2, 4, 2, 70), (1, 8, 8, 33), (3, 4, 1, 100), (2, 4, 2, 70)]):
        q, k, v, kb = _case(b, nq, nkv, 1, t, 32, torch.float32, [0] * b, seed=i)
        fused = _run(q, k, v, kb, 0.2, 0, dict(SPLIT, FUSED_MERGE=1))
        assert np.array_equal(fused, _run(q, k, v, kb, 0.2, 0, SPLIT))


def test_past_the_counters_two_launches_run(monkeypatch):
    """More row tiles than counters: the entry point runs the two launches, as the library's planner does, and
    leaves the counters alone (here 2 counters for 3 x 2 row tiles)."""
    import ort_triton.kernels.causal_attention as kernel

    q, k, v, kb = _case(3, 4, 2, 1, 70, 32, torch.float32, [0, 20, 0], seed=3)
    two = _run(q, k, v, kb, 0.2, 0, SPLIT)
    monkeypatch.setattr(kernel, "MERGE_COUNTERS", 2)
    phases, real = [], kernel.causal_attention_fwd

    class Spy:  # kernel[grid](*args): records each launch's PHASE (its 14th argument)
        def __getitem__(self, grid):
            return lambda *args, **kwargs: (phases.append(args[13]), real[grid](*args, **kwargs))[1]

    monkeypatch.setattr(kernel, "causal_attention_fwd", Spy())
    assert np.array_equal(_run(q, k, v, kb, 0.2, 0, dict(SPLIT, FUSED_MERGE=1)), two)
    assert phases == [1, 2]  # the chunks, then their merge: no PHASE 3


def test_the_decode_default_is_fused_and_the_tuner_times_both():
    """The built-in decode config merges in the chunks' launch; the tuner's first candidate is that config, and it
    also times the same tiles and split with the merge in a second launch."""
    from ort_triton.ops.causal_attention import block_config

    assert block_config(64, "float16", 4)["FUSED_MERGE"] == 1 and block_config(64, "float16", 512)["FUSED_MERGE"] == 0
    decode = TUNING.candidates("float16", (64, 4, 8, 1024), 90)
    assert decode[0]["FUSED_MERGE"] == 1 and decode[0]["SPLIT_TARGET"] > 0
    assert dict(decode[0], FUSED_MERGE=0) in decode


def test_more_row_tiles_than_counters_is_refused():
    q, k, v, kb = _case(1, 1, 1, 1, 40, 32, torch.float32, [0], seed=0)
    with pytest.raises(ValueError, match=f"more merge counters than {MERGE_COUNTERS}"):
        merge_counters(q.device, MERGE_COUNTERS + 1)


def test_the_native_library_keeps_as_many_counters():
    header = (pathlib.Path(__file__).parents[2] / "ort_triton" / "native" / "ot_table.h").read_text()
    assert int(re.search(r"#define OT_MERGE_COUNTERS (\d+)", header).group(1)) == MERGE_COUNTERS


def test_tuning_offers_it_for_split_decode_configs():
    decode = TUNING.candidates("float16", (64, 4, 8, 1024), 90)  # head dim, G * S rows, B * Nkv, T
    fused = [c for c in decode if c.get("FUSED_MERGE")]
    assert fused and all(c["SPLIT_TARGET"] > 0 and "maxnreg" not in c for c in fused)
    assert {tuple(sorted(dict(c, FUSED_MERGE=0).items())) for c in fused} <= {
        tuple(sorted(dict(c, FUSED_MERGE=0).items())) for c in decode if not c.get("FUSED_MERGE")}
    assert not any(c.get("FUSED_MERGE") for c in TUNING.candidates("float16", (64, 512, 8, 512), 90))  # prefill
