"""Every AOT spec's global loads and stores by width, from the SASS of its cubin (no GPU needed).

A load is a 128-bit vector only where Triton proves the address aligned and the mask constant over the vector; an
AOT spec knows an int argument's divisibility only if it declares it (Spec.divisible_by_16), where the JIT
specialises it unasked. A spec that should stream its rows but shows mostly 2-byte loads (LDG.E.U16 for fp16) runs
slower in the library than the same kernel under the JIT: session 28 found AddRMSNormSwiGLU's steps so.

    python scripts/sass_memory_audit.py [--ops RMSNorm,Rotary] [--type float16] [--arch 90] [--json OUT]
"""

import argparse
import json
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)  # the build compiles the kernels, not the interpreter's stand-ins

from ort_triton.ops import ALL_OPS  # noqa: E402
from tests.ptxas_report import spec_memory_ops  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", help="comma-separated op names (default: all)")
    p.add_argument("--type", default="float16")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--json")
    a = p.parse_args()
    wanted = set(a.ops.split(",")) if a.ops else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="ort_triton_sass_") as out:
        for op in ALL_OPS:
            if wanted is not None and op.name not in wanted:
                continue
            for i, spec in enumerate(op.specializations(a.type)):
                ops = spec_memory_ops(op, a.type, i, spec, a.arch, pathlib.Path(out))
                narrow, total = sum(n for k, n in ops.items() if not k.endswith((".128", ".64"))), sum(ops.values())
                rows.append(dict(op=op.name, spec=i, keys=spec.keys, declared=spec.divisible_by_16, ops=ops,
                                 narrow=narrow, total=total))
                print(f"{op.name:22s} spec {i:3d}  {narrow:4d} of {total:4d} narrow  {ops}", flush=True)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
