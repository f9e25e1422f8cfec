"""Print LN_CANDIDATES (scripts/gpu_env.sh) for issue 2's variant check: three launch tables that keep every
(ROWS, num_warps) of the built-in table at the residual modes and add the kernel's variants to them:
  evict    the row streams loaded evict_first, the [H] vectors evict_last;
  loop     a looping grid of 132 SMs x the programs of that size one SM holds (2048 threads, 32 programs);
  both     the two together.

    LN_CANDIDATES="$(python scripts/ln_variant_tables.py)" STEPS=ln bash scripts/gpu_session12.sh
"""

import json

from ort_triton.ops.layer_norm import FEW_ROWS, launch_config

WIDTHS = (768, 1024, 4096, 8192)
SMS = 132  # H100 / H200 SXM


def programs(warps: int) -> int:
    return SMS * min(32, 2048 // (32 * warps))


def table(evict: int, loop: int) -> dict:
    out = {}
    for w in WIDTHS:
        entries = {}
        for mode, store_sum in (("residual", False), ("residual+sum", True)):
            for prefix, n_rows in (("", None), ("few:", FEW_ROWS)):
                rows, warps = launch_config(w, True, store_sum, n_rows=n_rows)
                entries[prefix + mode] = [rows, warps, evict, programs(warps) if loop else 0]
        out[str(w)] = entries
    return out


if __name__ == "__main__":
    print(";".join(f"{name}={json.dumps(table(e, lp), separators=(',', ':'))}"
                   for name, e, lp in (("evict", 1, 0), ("loop", 0, 1), ("both", 1, 1))))
