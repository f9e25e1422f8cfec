"""Compile the warp-specialised attention specs (kernels/attention.py `_attention_ws`) for sm_90 through the AOT
path, no GPU needed, and print per spec what ptxas and Triton made of it: the warps the launch runs (3 warp groups
when the pass split the program), shared memory, Triton's global scratch a program, registers and spills.
Whether Triton's warp-specialisation pass took a kernel shows here first: a spec it rejects fails to compile.

    python scripts/ws_attention_compile.py [--json OUT.jsonl]
"""
import argparse
import json
import pathlib
import re
import subprocess
import tempfile

import triton

from ort_triton.aot.compile import Job, compile_job
from ort_triton.ops import BY_NAME
from ort_triton.ops.attention import WS_ARCH, ws_supported

CUOBJDUMP = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write one JSON line per spec here")
    args = ap.parse_args()
    from ort_triton.ops.attention import require_ws

    try:  # the kernel is experimental: its first launch on the H200 did not return
        require_ws()
    except ValueError as e:
        ap.error(str(e))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for op_name in ("MultiHeadAttention", "PackedMultiHeadAttention"):
            op = BY_NAME[op_name]
            packed = op_name.startswith("Packed")
            for type_name in ("float16", "bfloat16"):
                for d in (32, 64, 128):
                    keys = (d, 1, 2048, 96)  # an aligned bucket: WS candidates are offered there only
                    for cfg in op.tuning.candidates(type_name, keys, WS_ARCH):
                        if not cfg.get("WS"):
                            continue
                        spec = op.tuning.spec(type_name, op.tuning.bucket(keys), cfg)
                        row = dict(op=op_name, type=type_name, head_dim=d, **cfg,
                                   offered=ws_supported(d, type_name, WS_ARCH, packed))
                        try:
                            c = compile_job(Job(op, type_name, 0, spec, WS_ARCH), pathlib.Path(tmp))
                        except Exception as e:  # the pass's failures end in a PassManager error
                            row["error"] = str(e).strip().splitlines()[-1][:200]
                        else:
                            usage = subprocess.run([str(CUOBJDUMP), "-res-usage", str(c.cubin)], capture_output=True,
                                                   text=True, check=True).stdout
                            row.update(warps=c.num_warps, shared=c.shared, global_scratch=c.global_scratch,
                                       registers=int(re.search(r"REG:(\d+)", usage).group(1)),
                                       stack=int(re.search(r"STACK:(\d+)", usage).group(1)))
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    if args.json:
        pathlib.Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
