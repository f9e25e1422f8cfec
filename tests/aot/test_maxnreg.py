"""Spec.maxnreg: ptxas' register cap reaches the cubin and the compile cache. A capped decode spec of CausalAttention
(fp16, head dim 64, sm_90) compiles with at most that many registers a thread, the uncapped one with more, and the
two are cached apart. ptxas' resource report (cuobjdump -res-usage) is read from the cubins; no GPU needed. The
compile runs in a subprocess: the tests' TRITON_INTERPRET=1 (conftest) would hand the build an interpreted kernel."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import dataclasses, json, pathlib, re, subprocess, sys
import triton
from ort_triton.aot.compile import Job, compile_job
from ort_triton.ops import BY_NAME
out, cap = pathlib.Path(sys.argv[1]), int(sys.argv[2])
op = BY_NAME["CausalAttention"]
tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
i, spec = next((i, s) for i, s in enumerate(op.specializations("float16"))
               if s.constexprs["HEAD_DIM"] == 64 and s.constexprs["SPLIT_K"])
rows = {}
for name, s in (("default", spec), ("capped", dataclasses.replace(spec, maxnreg=cap))):
    job = Job(op, "float16", i, s, 90)
    c = compile_job(job, out)
    usage = subprocess.run([str(tool), "-res-usage", str(c.cubin)], capture_output=True, text=True, check=True).stdout
    rows[name] = dict(key=job.cache_key(), regs=int(re.search(r"REG:(\d+)", usage).group(1)))
print(json.dumps(rows))
"""


def test_register_cap_reaches_the_cubin(tmp_path):
    from ort_triton.contract import Spec

    assert Spec(constexprs={}, num_warps=4, keys=(), consts=()).maxnreg is None  # ptxas' choice by default
    cap = 128
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = pathlib.Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(cap)], capture_output=True, text=True,
                         env=env, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout.splitlines()[-1])
    assert rows["capped"]["regs"] <= cap < rows["default"]["regs"], rows
    assert rows["capped"]["key"] != rows["default"]["key"], rows


def test_a_config_names_the_cap():
    """CausalAttention's spec takes `maxnreg` from a config (a tuning table's, or a candidate's)."""
    from ort_triton.ops import causal_attention as ca

    keys = ((64, 64), (0, ca.DECODE_ROWS), (0, ca.ANY), (0, ca.ANY), (0, 0))
    cfg = ca.block_config(64, "float16", ca.DECODE_ROWS)
    assert ca._spec("float16", keys, cfg).maxnreg is None
    capped = ca._spec("float16", keys, dict(cfg, maxnreg=168))
    assert capped.maxnreg == 168 and dataclasses.replace(capped, maxnreg=None) == ca._spec("float16", keys, cfg)


def test_decode_candidates_carry_the_cap():
    """ort-triton tune times every decode candidate with and without DECODE_MAXNREG (the built-in first, uncapped);
    prefill candidates stay uncapped; every candidate makes a spec, each once."""
    from ort_triton.ops import causal_attention as ca

    decode = ca.TUNING.candidates("float16", (64, 4, 8, 4097), 90)
    assert "maxnreg" not in decode[0] and decode[0]["SPLIT_TARGET"] == ca.SPLIT_TARGET
    plain = [c for c in decode if not c.get("FUSED_MERGE")]  # the fused merge's: uncapped (its own test file)
    capped = [c for c in plain if c.get("maxnreg") == ca.DECODE_MAXNREG]
    assert len(capped) * 2 == len(plain)
    assert {tuple(sorted((k, v) for k, v in c.items() if k != "maxnreg")) for c in capped} == \
        {tuple(sorted(c.items())) for c in plain if "maxnreg" not in c}
    assert len({tuple(sorted(c.items())) for c in decode}) == len(decode)
    prefill = ca.TUNING.candidates("float16", (64, 512, 8, 512), 90)
    assert not any("maxnreg" in c for c in prefill)
    keys = ((64, 64), (0, ca.DECODE_ROWS), (0, ca.ANY), (0, ca.ANY), (0, 0))
    assert all(ca.TUNING.spec("float16", keys, c).maxnreg == c.get("maxnreg") for c in decode)
