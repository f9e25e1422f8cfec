"""Linear: a MatMul by a constant weight, the weight stored transposed.

    Y[..., N] = X[..., K] @ W,   W = WT^T,   WT [N, K] (K contiguous)

Why: a decode step at batch 1 multiplies one row by every weight of the model, and cuBLAS's GEMV reads them at
46-70% of the GPU's bandwidth at Llama-1B's shapes (scripts/decode_linear_micro.py, scripts/gemv_sweep.py).
Held transposed, a weight's rows are what one output column needs, contiguous, so a GEMV program streams whole
rows with no partial sums to combine (ort_triton/kernels/gemv.py). The rewrite (graph_rewrites/linear.py)
stores the constant so; a tied LM head (MatMul(x, Transpose(E))) already is.

Dispatch (ort_triton/native/linear.c): up to 16 rows of X (the product of its leading dims: a decode step) -> the
Triton kernel with the spec the shape's keys pick, the register GEMV or the tl.dot "skinny" product
(ort_triton/kernels/gemv.py); more rows, or a shape no spec serves -> cuBLAS on ORT's handle for the node's stream
(the TN GEMM, fp32 accumulation), the GEMM ORT's MatMul runs.

Dispatch keys: ROWS, K_ALIGN (the largest power of two dividing K, at most 4096: a spec whose BLOCK_K divides K
loads unmasked), K, N. Rounding: one, of the fp32 sum, to the element type (as cuBLAS).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..contract import ANY, IO, Kernel, OpContract, Spec, Tuning
from .tune_space import random_inputs, row_count

KERNEL = Kernel(
    module="ort_triton.kernels.gemv",
    fn_name="gemv_fwd",
    signature={"X": "*{T}", "WT": "*{T}", "Y": "*{T}", "M": "i32", "N": "i32", "K": "i32"},
    native_plan="ot_linear_plan",
    native_params="ot_linear_params",
    dispatch_keys=("rows", "k_align", "k", "n"),
    pdl=True,
)

K_ALIGN_CAP = 4096  # planner_util.c's ot_k_align() stops here (ops/norm_linear.py's K_ALIGN key too)
BLOCK_M = 16  # the skinny product's rows (the MMA's smallest N): up to 16 rows run a kernel of ours

# (dot, most rows, k range, n range, BLOCK_N, BLOCK_K, num_stages), num_warps 4: first fit wins; a shape outside
# every range runs cuBLAS. Each gets an unmasked spec (K a multiple of BLOCK_K) and after it, for the same ranges, a
# masked one (the GEMV's BLOCK_K = MASKED_BLOCK_K). From scripts/gemv_chain_sweep.py (session 24, H200: chains of
# distinct weights, each read from HBM as in a model), against cuBLAS as ORT's MatMul runs it:
# - the register GEMV, one row, K long against N: Llama-1B's o 1.14x, down 1.11x, GPT-2's mlp.c_proj 1.95x; and
#   GPT-2's other projections (session 23, H100: 1.24-1.69x, 1.081x on its decode step);
# - the skinny product everywhere else up to 16 rows: Llama's packed Q/K/V 1.03x, gate or up 1.11x, lm_head 1.03x;
#   at 16 rows 1.01-1.19x (down 1.02x).
CONFIGS = (
    (False, 1, (1, 1024), (1, 4096), 2, 1024, 1),
    (False, 1, (1, 8192), (1, 2048), 2, 1024, 1),
    (True, BLOCK_M, (1, ANY), (1, 4096), 32, 256, 4),
    (True, BLOCK_M, (1, ANY), (4097, ANY), 64, 128, 4),
)
MASKED_BLOCK_K = 256  # the register GEMV's masked specs (the skinny ones keep theirs: a masked tile is a tile)
FP32_BLOCK_K = 64  # the skinny product's fp32 tiles: twice the bytes, and sm_80-89's shared memory
PRE_HOPPER_STAGES = 2  # sm_80-89: 100-164 KB of shared memory, not Hopper's 228


def _block_k(type_name: str, dot: bool, block_k: int, even: bool) -> int:
    """The BLOCK_K a config compiles with: the GEMV's masked specs take MASKED_BLOCK_K, fp32 tiles FP32_BLOCK_K."""
    if not even and not dot:
        return MASKED_BLOCK_K
    return min(block_k, FP32_BLOCK_K) if dot and type_name == "float" else block_k


def _spec(keys, dot: bool, block_n: int, block_k: int, stages: int, even: bool, warps: int = 4) -> Spec:
    return Spec(constexprs={"BLOCK_N": block_n, "BLOCK_K": block_k, "EVEN_K": int(even), "DOT": int(dot),
                            "BLOCK_M": BLOCK_M},
                num_warps=warps, num_stages=stages, pre_hopper=(warps, min(stages, PRE_HOPPER_STAGES)), keys=keys,
                consts=(block_n, block_k, BLOCK_M if dot else 1),  # the planner's CONST_MAX_ROWS: what it computes
                divisible_by_16=("X", "WT", "Y") + (("K",) if even else ()))


def _specs(type_name: str) -> list[Spec]:
    def spec(dot, rows, k_range, n_range, block_n, block_k, stages, even):
        block_k = _block_k(type_name, dot, block_k, even)
        return _spec(((1, rows), (block_k if even else 1, K_ALIGN_CAP), k_range, n_range), dot, block_n, block_k,
                     stages, even)

    # each config's unmasked spec, then its masked one: the first config that fits serves, masked or not
    return [spec(*c, even) for c in CONFIGS for even in (True, False)]


# ---- tuning (ort-triton tune): the family and tile per exact K and N, one row or 2-16 ----------------------
def k_align(k: int) -> int:
    """The K_ALIGN key, as planner_util.c's ot_k_align computes it."""
    a = 1
    while a < K_ALIGN_CAP and k % (2 * a) == 0:
        a *= 2
    return a


def _tune_keys(_type_name, shapes, _attrs, _n_outputs=1):
    """Past BLOCK_M rows cuBLAS runs (None: nothing of ours to tune at these shapes)."""
    rows, k, n = row_count(shapes[0]), int(shapes[0][-1]), int(shapes[1][0])
    return (rows, k_align(k), k, n) if 1 <= rows <= BLOCK_M else None


def _tune_bucket(keys):
    rows, align, k, n = keys
    return ((1, 1) if rows == 1 else (2, BLOCK_M), (align, K_ALIGN_CAP), (k, k), (n, n))


def _first_fit(type_name: str, keys) -> dict:
    """The config the built-in specs give these keys (what the library runs)."""
    rows, _, k, n = keys
    for dot, most, (k0, k1), (n0, n1), block_n, block_k, stages in CONFIGS:
        if rows <= most and k0 <= k <= k1 and n0 <= n <= n1:
            block_k = _block_k(type_name, dot, block_k, k % block_k == 0)
            return {"DOT": int(dot), "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": stages}
    raise ValueError(f"Linear: no built-in config for rows={rows}, K={k}, N={n}")


SHARED_BYTES = {True: 220 * 1024, False: 160 * 1024}  # a candidate's pipelined tiles fit (sm_90, or before)


def _tune_candidates(type_name, keys, arch):
    """The built-in config first (its stages as the arch runs them), then at one row the register GEMV's tiles
    and warps, and the skinny product's tiles and stages whose shared memory fits the arch."""
    rows, _, k, _ = keys
    hopper = arch >= 90
    builtin = _first_fit(type_name, keys)
    if not hopper:
        builtin["num_stages"] = min(builtin["num_stages"], PRE_HOPPER_STAGES)
    elem = 4 if type_name == "float" else 2
    out = [builtin]
    if rows == 1:
        out += [{"DOT": 0, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": 1}
                for bn in (1, 2, 4) for bk in (256, 512, 1024, 2048) for w in (4, 8) if bk // 2 < max(k, 256)]
    for bn in (32, 64, 128):
        for bk in ((32, 64) if type_name == "float" else (64, 128, 256)):
            for stages in ((2, 3, 4, 5, 6) if hopper else (2, 3)):
                if stages * (bn + BLOCK_M) * bk * elem <= SHARED_BYTES[hopper]:
                    out.append({"DOT": 1, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 4, "num_stages": stages})
    return [c for i, c in enumerate(out) if c not in out[:i]]


def _tune_spec(_type_name, bucket, config):
    k = bucket[2][0]
    even = k % config["BLOCK_K"] == 0
    return _spec(bucket, bool(config["DOT"]), config["BLOCK_N"], config["BLOCK_K"], config["num_stages"], even,
                 config["num_warps"])


CHAIN_BYTES = 256 << 20  # a timed launch reads distinct weights past any L2 (50-60 MB), as a model's step does


def _tune_run(type_name, shapes, _attrs, keys, config, device):
    """One timed call: the product over enough distinct copies of the weight that each comes from memory, not
    L2 (session 24: a replayed weight stays in L2 and flatters whoever reads it best from there)."""
    from ..kernels.gemv import gemv

    rows, _, k, n = keys
    elem = 4 if type_name == "float" else 2
    copies = max(1, min(64, -(-CHAIN_BYTES // (n * k * elem)))) if device == "cuda" else 1
    _, (x, *weights) = random_inputs(type_name, [[rows, k]] + [[n, k]] * copies, device, 1 + copies)
    y = x.new_empty(rows, n)
    launch = dict(block_n=config["BLOCK_N"], block_k=config["BLOCK_K"], num_warps=config["num_warps"],
                  num_stages=config["num_stages"], dot=bool(config["DOT"]))
    return lambda: [gemv(x, w, y, **launch) for w in weights]


TUNING = Tuning(keys=_tune_keys, bucket=_tune_bucket, candidates=_tune_candidates, spec=_tune_spec, runner=_tune_run)


def reference_linear(x, wt):
    return (np.asarray(x, np.float64) @ np.asarray(wt, np.float64).T,)


def _body(_opset: int) -> list[onnx.NodeProto]:
    # MatMul by the transposed weight: ORT folds the Transpose of a constant when it inlines the body
    n = helper.make_node
    return [n("Transpose", ["WT"], ["W"], perm=[1, 0]), n("MatMul", ["X", "W"], ["Y"])]


LINEAR = OpContract(
    name="Linear",
    doc="Y = X @ WT^T: MatMul by a weight stored transposed (WT [N, K]); X [..., K], Y [..., N]",
    inputs=(IO("X", "[..., K]"), IO("WT", "[N, K], the weight transposed")),
    outputs=(IO("Y", "[..., N]"),),
    attrs=(),
    types=("float16", "bfloat16", "float"),
    body=_body,  # Transpose and MatMul: the same from opset 15 on
    reference=reference_linear,
    kernel=KERNEL,
    specializations=_specs,
    tuning=TUNING,
)
