"""A tuning table that sets how CausalAttention's split decode merges its chunks for every decode bucket that
splits: in a second launch (--merge two, FUSED_MERGE=0) or in the chunks' own (--merge fused, the built-in default
since session 19), with the built-in tiles otherwise. `ort-triton build --tuning` of the two-launch table gives a
library that differs from the default one in that alone, so the two time the fused merge end to end (bench.ab with
ORT_TRITON_TUNED_LIBRARY; scripts/gpu_session18.sh, step fm_ab).

    python scripts/fused_merge_table.py OUT.json [--merge two|fused] [--arch 90] [--head-dims 64] [--types float16]
"""
import argparse

from ort_triton import tuning
from ort_triton.contract import ANY
from ort_triton.ops.causal_attention import DECODE_ROWS, DECODE_WIDE, SPLIT_TARGET, block_config


def entries(arch: int, head_dims, types, fused: bool) -> list[dict]:
    """Per head dim and type: decode rows, B * Nkv below DECODE_WIDE (the narrow spec) and from it up to the split
    target (the wide one; past it nothing splits), any cache length."""
    out = []
    for type_name in types:
        for d in head_dims:
            for lo, hi in ((0, DECODE_WIDE - 1), (DECODE_WIDE, SPLIT_TARGET - 1)):
                cfg = {k: v for k, v in block_config(d, type_name, DECODE_ROWS, lo).items() if k != "BLOCK_D"}
                out.append({"op": "CausalAttention", "type": type_name, "arch": arch, "builtin": False,
                            "keys": [[d, d], [0, DECODE_ROWS], [lo, hi], [0, ANY]],
                            "config": dict(cfg, FUSED_MERGE=int(fused))})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--merge", choices=("two", "fused"), default="two")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--head-dims", default="64")
    ap.add_argument("--types", default="float16")
    args = ap.parse_args()
    rows = entries(args.arch, [int(d) for d in args.head_dims.split(",")], args.types.split(","), args.merge == "fused")
    model = f"merge: {args.merge} on every split decode bucket"
    path = tuning.save(args.out, {"arch": args.arch, "model": model}, rows)
    tuning.load(path)  # what the build will read: checked here
    print(f"wrote {path}: {len(rows)} entries")


if __name__ == "__main__":
    main()
