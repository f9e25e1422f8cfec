"""LayerNorm and AddLayerNorm: layer normalisation over the last axis, optionally after a residual add.

    s    = (x + bias) + skip                         (AddLayerNorm only; also returned as `sum` if asked)
    mean = sum(s) / H
    var  = sum((s - mean)^2) / H                     (two-pass in registers: no cancellation)
    y    = (s - mean) * rsqrt(var + epsilon) * gamma + beta

One program normalises ROWS rows held in registers; reductions are in fp32 whatever the element type (the
kernel: ort_triton/kernels/layer_norm.py). A row is one power-of-two block of BLOCK_H >= H columns, the
tail masked, or, for H = 3 * 2^k in THIRDS (768: BERT-base, GPT-2; 1536; 3072), three full blocks of
H / 3 (CHUNKS = 3): a 1024-wide block would leave a quarter of its lanes idle at H = 768. The op is
memory-bound (2-4 tensors of rows x H elements move), so blocks are sized to keep ~4096 elements per
program in flight, and rows whose start is 16-byte aligned (H % 16 == 0) get a specialisation that lets
Triton emit 16-byte vector loads.
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
from onnx import helper

from ..contract import IO, Attr, Kernel, OpContract, Spec, Tuning, attr_ref
from .tune_space import layout_width, random_inputs, row_spec, row_specs, row_tuning

MAX_HIDDEN = 16384
BLOCKS = (256, 1024, 2048, 4096, 8192, 16384)
THIRDS = (768, 1536, 3072)  # hidden sizes laid out as three full blocks of H / 3


def block_layout(h: int) -> dict:
    """One power-of-two block of BLOCKS that holds h, the tail masked."""
    return {"BLOCK_H": next(b for b in BLOCKS if b >= h), "CHUNKS": 1}


def layout(h: int) -> dict:
    """The layout constexprs for hidden size h: three blocks of h / 3 for h in THIRDS, else one block."""
    return {"BLOCK_H": h // 3, "CHUNKS": 3} if h in THIRDS else block_layout(h)


KERNEL = Kernel(
    module="ort_triton.kernels.layer_norm",
    fn_name="layer_norm_fwd",
    signature={
        "X": "*{T}", "R": "*{T}", "C": "*{T}", "W": "*{T}", "B": "*{T}", "Y": "*{T}", "S": "*{T}",
        "n_rows": "i32", "H": "i32", "eps": "fp32",
    },
    native_plan="ot_layer_norm_plan",
    native_params="ot_layer_norm_params",
    dispatch_keys=("has_beta", "store_sum", "h_div16", "H", "rows"),  # rows: only tuned specs narrow it
    # (H: the THIRDS sizes have specs of their own, ahead of the block that would hold them)
)


# (ROWS, num_warps) per (block width, mode), from sweeps on the H200 (fp16): the kernel alone
# (`python -m ort_triton.bench.layer_norm_sweep`, bench/results/layer_norm_sweep_h200.json), and for
# 4096/8192 candidate tables built as libraries and timed side by side in ORT chains (LN_CANDIDATES in
# scripts/gpu_check.sh; bench/results/layer_norm_h200_candidates.json), which decided. Few warps and 16-64
# elements per thread keep more rows in flight than wide programs (H=8192 plain: 1x4 beats 1x16 by 1.37x).
# With a residual at H=8192, 1x4 held X, skip and bias at 64 elements a thread each and ptxas issued the
# skip's loads a few at a time (SASS); 2x8 shares the [H] vectors between two rows: 0.93x -> 1.05-1.09x
# ORT. With the sum at 1024 (H=768, 1024), 1x2 beat 1x4 at 4096 x 768 by 5% (0.945x -> 0.995x ORT) and
# was within 2% elsewhere (layer_norm_h200_candidates_768.json). 256/2048/16384 are interpolated.
# Session 10 (bench/results/session10/): the THIRDS sizes from the kernel-alone sweep and three candidate
# tables in the chains (three sessions a variant); 1536/3072 ran 1.01-1.13x ORT with (1, 1)/(1, 2) against
# 0.86-1.04x for the first guesses. With the sum at H=8192, 1x8 beat 1x4 by 8% at 4096 rows in the chain
# (0.90x -> 0.98x ORT) and by 12% alone at 65536 rows. At H=768 one warp a program wins, but how many rows
# it takes depends on the row count: 2 rows at 4096 (AddLayerNorm 1.02x ORT, 0.96x with 1 row), 1 row at
# 65536 (0.99x, 0.965x with 2): _LAUNCH_FEW holds the configs for row counts up to FEW_ROWS.
# Session 12 (bench/results/session12/): a third field 1 sets the kernel's eviction hints (EVICT). In the
# chains they helped one cell, 4096 x 4096 AddLayerNorm (30.1 against 32.8 us, ORT 34.1), and cost 1-6%
# at the others; a looping grid (a program per SM slot, each taking every n-th row block) cost 2-30% at
# every residual cell and was dropped.
_LAUNCH = {  # width (a block, or an H in THIRDS): (plain, residual, residual+sum)
    256: ((8, 2), (8, 4), (8, 4)),
    768: ((2, 1), (1, 1), (1, 1)),
    1024: ((2, 2), (2, 4), (1, 2)),
    1536: ((1, 2), (1, 1), (1, 1)),
    2048: ((1, 2), (1, 4), (1, 4)),
    3072: ((2, 4), (1, 2), (1, 2)),
    4096: ((2, 4), (2, 16), (2, 16)),
    8192: ((1, 4), (2, 8), (1, 8)),
    16384: ((1, 8), (1, 16), (1, 16)),
}
FEW_ROWS = 16384  # row counts up to here take _LAUNCH_FEW's config where it has one
_LAUNCH_FEW = {
    768: ((2, 1), (2, 1), (2, 1)),
    4096: ((2, 4), (2, 16, 1), (2, 16)),
}
_MODES = ("plain", "residual", "residual+sum")


LAUNCH_ENV = "ORT_TRITON_LAYER_NORM_LAUNCH"


def _launch_tables() -> tuple[dict, dict]:
    """(_LAUNCH, _LAUNCH_FEW), with entries replaced from $ORT_TRITON_LAYER_NORM_LAUNCH when set: JSON such
    as {"8192": {"residual": [4, 16], "few:residual": [2, 8]}} ("few:" sets the entry for up to FEW_ROWS
    rows). A tuning hook: the benchmark builds one library per candidate table and times them side by side
    (scripts/gpu_env.sh, LN_CANDIDATES)."""
    text = os.environ.get(LAUNCH_ENV)
    if not text:
        return _LAUNCH, _LAUNCH_FEW
    many = {k: list(v) for k, v in _LAUNCH.items()}
    few = {k: list(v) for k, v in _LAUNCH_FEW.items()}
    try:
        for width, entries in json.loads(text).items():
            # the all-rows entries first: a few-rows entry new to this width starts as a copy of them
            for mode, entry in sorted(entries.items(), key=lambda kv: kv[0].startswith("few:")):
                if len(entry) not in (2, 3):
                    raise ValueError(f"{entry}: give [ROWS, warps] or [ROWS, warps, evict]")
                w = int(width)
                row = few.setdefault(w, list(many[w])) if mode.startswith("few:") else many[w]
                row[_MODES.index(mode.removeprefix("few:"))] = tuple(int(v) for v in entry)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{LAUNCH_ENV}={text!r}: expected JSON like {{\"8192\": {{\"residual\": [4, 16]}}}} "
                         f"with widths {sorted(_LAUNCH)} and modes {_MODES}, each also as few:MODE, and an "
                         f"entry [ROWS, warps] or [ROWS, warps, evict] ({e})") from e
    return many, few


def _entry(width: int, has_res: bool = False, store_sum: bool = False, n_rows: int | None = None) -> tuple[int, ...]:
    """The launch table's entry: (ROWS, num_warps) or (ROWS, num_warps, EVICT)."""
    many, few = _launch_tables()
    table = few if n_rows is not None and n_rows <= FEW_ROWS and width in few else many
    return tuple(table[width][(1 + int(store_sum)) if has_res else 0])


def launch_config(width: int, has_res: bool = False, store_sum: bool = False,
                  n_rows: int | None = None) -> tuple[int, int]:
    """(ROWS, num_warps) for a layout's width (a block, or an H in THIRDS), mode and row count (None: any,
    the config of the open-ended row range)."""
    return _entry(width, has_res, store_sum, n_rows)[:2]


def launch_evict(width: int, has_res: bool = False, store_sum: bool = False, n_rows: int | None = None) -> int:
    """The kernel's EVICT for the same entry (its third field, 0 when it has two): 1 loads the row streams
    evict_first and the [H] vectors evict_last."""
    e = _entry(width, has_res, store_sum, n_rows)
    return e[2] if len(e) == 3 else 0


def _spec(has_res: bool, keys: tuple[tuple[int, int], ...], rows: int, warps: int, evict: int = 0) -> Spec:
    """The spec for the key ranges ((has_beta), then tune_space.row_spec's)."""
    return row_spec(keys, 1, has_res=has_res, layout=layout, rows=rows, warps=warps,
                    pointers=("X", "R", "C", "W", "B", "Y", "S"), constexprs={"EVICT": evict})


def _specs(has_res: bool) -> list[Spec]:
    # has_beta is always 1 (beta is a required input); _entry gives _spec the whole entry, EVICT included
    return row_specs(((1, 1),), has_res, BLOCKS, _entry, _spec, exact=THIRDS, row_split=FEW_ROWS)


# ---- tuning (ort-triton tune): (ROWS, num_warps) per exact H and power-of-two row bucket --------------
def _tune_run(has_res: bool):
    def run(type_name, shapes, attrs, store_sum, config, device):
        from ..kernels.layer_norm import layer_norm

        x_shape, h = shapes[0], shapes[0][-1]
        if has_res:
            _, (x, skip, bias, gamma, beta) = random_inputs(type_name, [x_shape, x_shape, [h], [h], [h]], device, 5)
        else:
            _, (x, gamma, beta) = random_inputs(type_name, [x_shape, [h], [h]], device, 3)
            skip = bias = None
        y, s = x.new_empty(x.shape), (x.new_empty(x.shape) if store_sum else None)
        eps = float(attrs.get("epsilon", 1e-5))
        return lambda: layer_norm(x, gamma, beta, skip, eps, store_sum, bias=bias, out=y, sum_out=s, config=config)
    return run


def _tuned_spec(has_res: bool, bucket: tuple[tuple[int, int], ...], rows: int, warps: int) -> Spec:
    """A tuned (ROWS, num_warps) keeps the table's EVICT for its bucket, as the tuner timed it (the kernel's
    entry point takes launch_evict at the node's row count; a power-of-two row bucket never straddles
    FEW_ROWS)."""
    (store_sum, _), _, (h, _), (_, rows_hi) = bucket[1:]
    evict = launch_evict(layout_width(layout(h)), has_res, bool(store_sum), n_rows=rows_hi)
    return _spec(has_res, bucket, rows, warps, evict)


def _tuning(has_res: bool) -> Tuning:
    return row_tuning(prefix=(1,), has_res=has_res, layout=layout, launch_config=launch_config,
                      make_spec=_tuned_spec, run=_tune_run(has_res))  # prefix: has_beta, always 1 (required)


# ---- references (float64 numpy) ---------------------------------------------------------------------
def reference_layer_norm(x, gamma, beta, epsilon=1e-5):
    s = np.asarray(x, np.float64)
    mean = s.mean(-1, keepdims=True)
    var = ((s - mean) ** 2).mean(-1, keepdims=True)
    return ((s - mean) / np.sqrt(var + epsilon) * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64),)


def reference_add_layer_norm(x, skip, bias, gamma, beta, epsilon=1e-5):
    s = np.asarray(x, np.float64) + np.asarray(bias, np.float64) + np.asarray(skip, np.float64)
    return reference_layer_norm(s, gamma, beta, epsilon)[0], s


# ---- function bodies -------------------------------------------------------------------------------
def _ln_nodes(x: str, opset: int) -> list[onnx.NodeProto]:
    """Y = LayerNormalization(x, gamma, beta) over the last axis, written for `opset`: the op itself from
    17, its definition before (ReduceMean takes axes as an attribute until 18, so 15-16 are the same)."""
    n = helper.make_node
    if opset >= 17:
        node = n("LayerNormalization", [x, "gamma", "beta"], ["Y"], axis=-1)
        node.attribute.append(attr_ref("epsilon", onnx.AttributeProto.FLOAT))
        return [node]
    eps = n("Constant", [], ["eps_f"])
    eps.attribute.append(attr_ref("epsilon", onnx.AttributeProto.FLOAT, name="value_float"))
    return [
        eps, n("CastLike", ["eps_f", x], ["eps"]),
        n("ReduceMean", [x], ["mean"], axes=[-1]), n("Sub", [x, "mean"], ["d"]), n("Mul", ["d", "d"], ["dd"]),
        n("ReduceMean", ["dd"], ["var"], axes=[-1]), n("Add", ["var", "eps"], ["ve"]), n("Sqrt", ["ve"], ["std"]),
        n("Div", ["d", "std"], ["normed"]), n("Mul", ["normed", "gamma"], ["scaled"]),
        n("Add", ["scaled", "beta"], ["Y"]),
    ]


_EPS = Attr("epsilon", "float", 1e-5, "added to the variance before the square root")
_TYPES = ("float", "float16", "bfloat16")

LAYER_NORM = OpContract(
    name="LayerNorm",
    doc="Y = LayerNormalization(X, gamma, beta) over the last axis.",
    inputs=(IO("X", "[..., H]"), IO("gamma", "[H]"), IO("beta", "[H]")),
    outputs=(IO("Y", "[..., H]"),),
    attrs=(_EPS,),
    types=_TYPES,
    body=lambda opset: _ln_nodes("X", opset),
    reference=reference_layer_norm,
    kernel=KERNEL,
    specializations=lambda _t: _specs(has_res=False),
    tuning=_tuning(has_res=False),
)

ADD_LAYER_NORM = OpContract(
    name="AddLayerNorm",
    doc="sum = (X + bias) + skip; Y = LayerNormalization(sum, gamma, beta) over the last axis.",
    inputs=(IO("X", "[..., H]"), IO("skip", "same shape as X"), IO("bias", "[H], the producing MatMul's"),
            IO("gamma", "[H]"), IO("beta", "[H]")),
    outputs=(IO("Y", "[..., H]"), IO("sum", "X + skip, for a later residual", optional=True)),
    attrs=(_EPS,),
    types=_TYPES,
    body=lambda opset: [helper.make_node("Add", ["X", "bias"], ["xb"]),
                        helper.make_node("Add", ["xb", "skip"], ["sum"]), *_ln_nodes("sum", opset)],
    reference=reference_add_layer_norm,
    kernel=KERNEL,
    specializations=lambda _t: _specs(has_res=True),
    tuning=_tuning(has_res=True),
)
