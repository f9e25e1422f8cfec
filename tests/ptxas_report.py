"""ptxas' resource report of AOT-compiled specs, for the no-spill tests (tests/aot/test_register_budget.py,
tests/ops/test_causal_attention_kernel.py). The compile runs in a subprocess without the tests' TRITON_INTERPRET=1
(conftest), which would hand the build an interpreted kernel; no GPU needed."""

import json
import os
import pathlib
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
