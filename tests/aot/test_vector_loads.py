"""AddRMSNormSwiGLU's steps (its prefill path) load and store 16-byte vectors in the library as they do under the JIT.

An AOT spec knows an int argument's divisibility only if it declares it, where the JIT specialises it unasked; a load
whose mask is `offs < bound`, the bound of unknown divisibility, is a 2-byte scalar. Session 27's steps spec declared
nothing and all its 96 loads were scalar (kernels/norm_linear.py says how the kernel avoids it now). Counted in the
SASS of the compiled spec (tests/ptxas_report.py); no GPU needed."""

import pytest

from tests.ptxas_report import compile_rows

pytest.importorskip("triton")

SCRIPT = r"""
import json, pathlib, sys
from ort_triton.ops.norm_linear import ADD_RMS_NORM_SWIGLU as op
from tests.ptxas_report import spec_memory_ops
arch, out = int(sys.argv[1]), pathlib.Path(sys.argv[2])
specs = op.specializations("float16")
rows = [dict(spec=i, declared="K" in s.divisible_by_16, ops=spec_memory_ops(op, "float16", i, s, arch, out))
        for i, s in enumerate(specs) if s.keys[0] == (0, 0)]
print(json.dumps(rows))
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
def test_swiglu_steps_move_vectors(arch, tmp_path):
    rows = compile_rows(SCRIPT, arch, tmp_path)
    aligned = [r for r in rows if r["declared"]]
    assert len(aligned) == 1, rows  # the steps spec for K % 16 == 0
    ops = aligned[0]["ops"]
    # 4 warps, ROW_BLOCK 2048: 16 elements a thread, two 128-bit loads an array. MODE 1's rstd pass loads X and R
    # (4) and stores the sum (2); its normalising pass loads X, R and gamma (6) and stores NB (2); MODE 2's whole
    # blocks (8 elements a thread) load G and U (2) and store Y (1).
    assert ops.get("LDG.E.128", 0) >= 12 and ops.get("STG.E.128", 0) >= 5, ops
    # scalars only in MODE 2's last, masked block: 8 elements a thread of G and U, 8 of Y
    assert ops.get("LDG.E.U16", 0) <= 16 and ops.get("STG.E.U16", 0) <= 8, ops


ROTARY_SCRIPT = r"""
import json, pathlib, sys
from ort_triton.ops.qkv_rotary_cache import QKV_NORM_ROTARY_CACHE, QKV_ROTARY_CACHE
from ort_triton.ops.rotary import ROTARY
from tests.ptxas_report import spec_memory_ops
arch, out = int(sys.argv[1]), pathlib.Path(sys.argv[2])
rows = []
for op in (ROTARY, QKV_ROTARY_CACHE, QKV_NORM_ROTARY_CACHE):
    for i, s in enumerate(op.specializations("float16")):
        if s.constexprs["BLOCK_D"] in (64, 128) and s.keys[1] == (1, 1):  # Llama's and Qwen3's head dims, aligned
            rows.append(dict(op=op.name, spec=i, half=s.constexprs["HALF_SPLIT"],
                             ops=spec_memory_ops(op, "float16", i, s, arch, out)))
print(json.dumps(rows))
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90])
def test_rotary_half_split_moves_vectors(arch, tmp_path):
    """The rotary family's half-split specs (kernels/rotary.py rope_halves) load and store nothing narrower than 64
    bits (4 warps, HALF_TILE 1024 elements a program: 4 fp16 of each half a thread; 2048: 128 bits), where the
    aligned rope_rows specs load the partner and cos/sin as 2-byte scalars (session 28: 24 of ~25 loads).
    QKVNormRotaryCache's gammas are [D] vectors broadcast over the rows (none narrow at D = 64 and 128)."""
    rows = compile_rows(ROTARY_SCRIPT, arch, tmp_path)
    assert {(r["op"], r["half"]) for r in rows} == {(op, h) for op in ("Rotary", "QKVRotaryCache",
                                                                       "QKVNormRotaryCache") for h in (0, 1)}, rows
    for r in rows:
        narrow = {k: v for k, v in r["ops"].items() if k.endswith(("U16", ".E"))}
        if r["half"]:
            assert not narrow and r["ops"].get("LDG.E.64", 0) + r["ops"].get("LDG.E.128", 0) >= 6, r
        else:  # what the half split replaces, so this test fails if rope_rows ever vectorises (then drop the split)
            assert sum(narrow.values()) >= 16, r
