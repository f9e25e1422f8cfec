"""ptxas' resource report and the SASS memory ops of AOT-compiled specs, for the no-spill tests
(tests/aot/test_register_budget.py, tests/ops/test_causal_attention_kernel.py) and the vector-load test
(tests/aot/test_vector_loads.py). Each test's script runs in a subprocess (compile_rows) without the tests'
TRITON_INTERPRET=1 (conftest), which would hand the build an interpreted kernel, and reads each spec's report through
spec_usage or spec_memory_ops; no GPU needed."""

import collections
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def compile_rows(script: str, *args) -> list[dict]:
    """Run `script` (Python that compiles specs and prints its rows as JSON on its last line) with `args` as argv."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, env=env,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.splitlines()[-1])


def _cuobjdump(op, type_name: str, index: int, spec, arch: int, out: pathlib.Path, flag: str):
    """Compile spec `index` of `op` for sm_`arch` into `out`; (the compiled spec, cuobjdump `flag`'s output)."""
    import triton

    from ort_triton.aot.compile import Job, compile_job

    c = compile_job(Job(op, type_name, index, spec, arch), out)
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return c, subprocess.run([str(tool), flag, str(c.cubin)], capture_output=True, text=True, check=True).stdout


def spec_usage(op, type_name: str, index: int, spec, arch: int, out: pathlib.Path) -> dict:
    """Inside compile_rows' script: compile spec `index` of `op` for sm_`arch` into `out`, and read its cubin's
    resource report (cuobjdump -res-usage): the spec, its type, the warps it compiled with, its stack (spill) bytes
    and the report's tail."""
    c, usage = _cuobjdump(op, type_name, index, spec, arch, out, "-res-usage")
    return dict(spec=index, type=type_name, warps=c.num_warps, stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
                usage=usage.strip()[-200:])


def spec_memory_ops(op, type_name: str, index: int, spec, arch: int, out: pathlib.Path) -> dict:
    """Inside compile_rows' script: compile spec `index` of `op` for sm_`arch` into `out` and count its SASS's global
    loads and stores by width (cuobjdump -sass): {"LDG.E.128": n, "LDG.E.U16": m, ...}. A 128-bit op moves 8 fp16
    elements, a U16 one: the kernel could not prove its addresses aligned or its mask constant over a vector."""
    _, sass = _cuobjdump(op, type_name, index, spec, arch, out, "-sass")
    return dict(collections.Counter(m.group(1) for m in re.finditer(r"\b((?:LDG|STG)\.E[\w.]*)", sass)))
