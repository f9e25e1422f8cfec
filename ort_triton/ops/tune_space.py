"""Shared pieces of the ops' `Tuning` (ort_triton/contract.py): the tile grid the tuner searches and the
random inputs its timing runs on."""

from __future__ import annotations

from ..contract import ANY, Spec, Tuning, pow2_bucket


def tile_candidates(builtin: dict, block_ms, block_ns, warps=(4, 8), stages=(2, 3)) -> list[dict]:
    """The built-in config first, then every (BLOCK_M, BLOCK_N, num_warps, num_stages) of the grid but it."""
    grid = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st)
            for m in block_ms for n in block_ns for w in warps for st in stages]
    return [builtin] + [c for c in grid if c != builtin]


def random_inputs(type_name: str, shapes: list, device: str, n_random: int = 3):
    """(the dtype, the first n_random inputs normal in it, then a zero tensor per remaining shape): timing
    inputs, seeded, made once per candidate so its launch does nothing but the kernel."""
    import torch

    dtype = {"float": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[type_name]
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = [torch.randn(sh, generator=gen, device=device).to(dtype) for sh in shapes[:n_random]]
    tensors += [torch.zeros(sh, device=device, dtype=dtype) for sh in shapes[n_random:]]
    return dtype, tensors


# ---- row-wise ops (LayerNorm, RMSNorm and their residual forms) --------------------------------------
# One program normalises ROWS rows of BLOCK_H columns in registers: the config is (ROWS, num_warps). Few
# warps with many rows in flight, or wide programs over one row, win at different row counts and widths
# (bench/results: layer_norm_sweep_h200.json), so the tuner times both directions around the built-in.
ROW_COUNTS = (1, 2, 4, 8)
ROW_WARPS = (1, 2, 4, 8, 16)
ROW_MAX_ELEMENTS = 32768  # ROWS * BLOCK_H held in registers: past this the kernel spills


def pow2_layout(blocks):
    """The layout of a row-wise op with no layouts of its own: H in the smallest block that holds it."""
    return lambda h: {"BLOCK_H": next(b for b in blocks if b >= h)}


def layout_width(layout: dict) -> int:
    """The columns a layout covers (BLOCK_H x CHUNKS): the key of an op's launch table."""
    return layout["BLOCK_H"] * layout.get("CHUNKS", 1)


def row_spec(keys, at: int, *, has_res: bool, layout, rows: int, warps: int, pointers: tuple[str, ...],
             constexprs: dict | None = None) -> Spec:
    """The spec of a row-wise op for its key ranges: the op's own exact keys, then from index `at`
    (store_sum), (h_div16 lo, 1), (H lo, hi), (rows lo, hi). layout(H hi) gives the layout constexprs
    (BLOCK_H, and CHUNKS where the op has them); h_div16 lo = 1 promises 16-byte aligned rows (H divisible
    by 16, besides the pointers). `constexprs`: the op's own, besides these."""
    store_sum, aligned = keys[at][0], keys[at + 1][0]
    lay = layout(keys[at + 2][1])
    return Spec(constexprs={"HAS_RES": int(has_res), "STORE_SUM": store_sum, **lay, "ROWS": rows, **(constexprs or {})},
                num_warps=warps, keys=tuple(keys), consts=(lay["BLOCK_H"], rows),
                divisible_by_16=pointers + (("H",) if aligned else ()))


def row_specs(prefix: tuple, has_res: bool, blocks, launch_config, make_spec, exact=(), row_split=None) -> list[Spec]:
    """The built-in specs of a row-wise op: per alignment and store_sum, first one per H in `exact` (sizes
    with a layout of their own, all multiples of 16), then one per block size over the H range it covers,
    every row count; or, where launch_config gives row counts up to `row_split` a config of their own, one
    spec for those and one for the rest. Exact and aligned specs first: the native planner takes the first
    spec whose keys all fit. prefix: the op's exact key ranges ahead of store_sum; launch_config(width,
    has_res, store_sum, n_rows=None) -> (ROWS, num_warps, ...), width a block or an exact H; make_spec(has_res,
    keys, ROWS, num_warps, ...) -> Spec (the op's further launch fields, if any, passed on)."""
    specs, block_ranges = [], list(zip((1, *(b + 1 for b in blocks[:-1])), blocks))
    for aligned in (1, 0):
        for store_sum in ((0, 1) if has_res else (0,)):
            for lo, hi in [(h, h) for h in exact if aligned] + block_ranges:
                many = launch_config(hi, has_res, bool(store_sum))
                few = launch_config(hi, has_res, bool(store_sum), n_rows=row_split) if row_split else many
                by_rows = [((0, ANY), many)] if few == many else [((0, row_split), few), ((row_split + 1, ANY), many)]
                for row_range, config in by_rows:
                    keys = (*prefix, (store_sum, store_sum), (aligned, 1), (lo, hi), row_range)
                    specs.append(make_spec(has_res, keys, *config))
    return specs


def row_candidates(builtin: tuple[int, int], block_h: int) -> list[dict]:
    """The built-in (ROWS, num_warps) first, then every pair of the grid that fits in registers."""
    first = dict(ROWS=builtin[0], num_warps=builtin[1])
    grid = [dict(ROWS=r, num_warps=w) for r in ROW_COUNTS for w in ROW_WARPS if r * block_h <= ROW_MAX_ELEMENTS]
    return [first] + [c for c in grid if c != first]


def row_count(shape) -> int:
    """Rows of a [..., H] tensor."""
    n = 1
    for d in shape[:-1]:
        n *= int(d)
    return n


def row_tuning(*, prefix: tuple[int, ...], has_res: bool, layout, launch_config, make_spec, run) -> Tuning:
    """The Tuning of a row-wise op whose dispatch keys are `prefix` (exact, LayerNorm's has_beta), then
    store_sum, h_div16, H and rows: a bucket is one exact H and a power-of-two row range.
    layout(H) -> the layout constexprs; make_spec(has_res, bucket, ROWS, num_warps) -> Spec; run(type, shapes,
    attrs, store_sum, (ROWS, num_warps), device) -> the launch."""
    at = len(prefix)  # where store_sum sits

    def keys(type_name, shapes, attrs, n_outputs=1):
        h = int(shapes[0][-1])
        return (*prefix, int(has_res and n_outputs == 2), int(h % 16 == 0), h, row_count(shapes[0]))

    def bucket(k):
        exact = tuple((v, v) for v in k[:at])
        return (*exact, (k[at], k[at]), (k[at + 1], 1), (k[at + 2], k[at + 2]), pow2_bucket(k[at + 3]))

    def candidates(type_name, k, arch):
        width = layout_width(layout(k[at + 2]))
        return row_candidates(launch_config(width, has_res, bool(k[at]), n_rows=k[at + 3]), width)

    def spec(type_name, b, config):
        return make_spec(has_res, b, config["ROWS"], config["num_warps"])

    def runner(type_name, shapes, attrs, k, config, device):
        return run(type_name, shapes, attrs, bool(k[at]), (config["ROWS"], config["num_warps"]), device)

    return Tuning(keys=keys, bucket=bucket, candidates=candidates, spec=spec, runner=runner)
