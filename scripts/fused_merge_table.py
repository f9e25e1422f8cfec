"""A tuning table that sets how CausalAttention's split decode merges its chunks, for every decode bucket: in a
second launch (--merge two, FUSED_MERGE=0) or in the chunks' own (--merge fused, the built-in default since
session 19), and optionally the split target (--split-target N for every bucket), the built-in tiles otherwise.
`ort-triton build --tuning` of it gives a library that differs from the default one in that alone, so bench.ab
times the two end to end (ORT_TRITON_TUNED_LIBRARY; scripts/gpu_session18.sh, step fm_ab).
`--merge two --split-target 128` is the decode of session 18's library: two launches, and no split from 128
programs on.

    python scripts/fused_merge_table.py OUT.json [--merge two|fused] [--split-target N] [--arch 90]
        [--head-dims 64] [--types float16]
"""
import argparse

from ort_triton import tuning
from ort_triton.contract import ANY
from ort_triton.ops.causal_attention import DECODE_ROWS, DECODE_WIDE, block_config


def entries(arch: int, head_dims, types, fused: bool, split_target: int | None = None) -> list[dict]:
    """Per head dim and type: decode rows, B * Nkv below DECODE_WIDE (the narrow spec) and from it on (the wide
    one), any cache length."""
    out = []
    for type_name in types:
        for d in head_dims:
            for lo, hi in ((0, DECODE_WIDE - 1), (DECODE_WIDE, ANY)):
                cfg = {k: v for k, v in block_config(d, type_name, DECODE_ROWS, lo).items() if k != "BLOCK_D"}
                cfg.update({} if split_target is None else dict(SPLIT_TARGET=split_target))
                out.append({"op": "CausalAttention", "type": type_name, "arch": arch, "builtin": False,
                            "keys": [[d, d], [0, DECODE_ROWS], [lo, hi], [0, ANY]],
                            "config": dict(cfg, FUSED_MERGE=int(fused))})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--merge", choices=("two", "fused"), default="two")
    ap.add_argument("--split-target", type=int, default=None, help="every bucket's SPLIT_TARGET (0: no split)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--head-dims", default="64")
    ap.add_argument("--types", default="float16")
    args = ap.parse_args()
    rows = entries(args.arch, [int(d) for d in args.head_dims.split(",")], args.types.split(","), args.merge == "fused",
                   args.split_target)
    model = f"decode: merge {args.merge}, split target {'built-in' if args.split_target is None else args.split_target}"
    path = tuning.save(args.out, {"arch": args.arch, "model": model}, rows)
    tuning.load(path)  # what the build will read: checked here
    print(f"wrote {path}: {len(rows)} entries")


if __name__ == "__main__":
    main()
