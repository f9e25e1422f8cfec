"""The tuner's screening round on the GPU without a model: BERT-base's packed attention (8x512) and
AddLayerNorm (16384 x 768) problems tuned twice, after a pass that only compiles the candidates: once timing
every candidate long (screen=None), once screening first (ort_triton/tune.py). One JSON line per problem
with the seconds each took and the config each chose.

    python scripts/tune_screen_check.py
"""
import json
import time

import torch

from ort_triton import tune
from ort_triton.ops import BY_NAME

HIDDEN, HEADS = 768, 12
PROBLEMS = [("PackedMultiHeadAttention", [[8, 512, 3 * HIDDEN], [8, 512], [3 * HIDDEN]],
             {"num_heads": HEADS, "scale": 0.125}),
            ("AddLayerNorm", [[16384, HIDDEN], [16384, HIDDEN], [HIDDEN], [HIDDEN], [HIDDEN]], {"epsilon": 1e-12})]


def _compile_only(fn) -> float:
    fn()  # Triton's JIT compiles here; the two timed passes then time kernels, not compiles
    return 1.0


def main() -> None:
    arch = 10 * torch.cuda.get_device_capability()[0] + torch.cuda.get_device_capability()[1]
    for op, shapes, attrs in PROBLEMS:
        tuning = BY_NAME[op].tuning
        keys = tuning.keys("float16", shapes, attrs)
        p = tune.Problem(op, "float16", keys, tuning.bucket(keys), shapes, attrs)
        row = {"op": op, "shapes": shapes[0]}
        tune.tune_problem(p, arch, "cuda", time.monotonic() + 600, _compile_only)
        for name, screen in (("long_only", None), ("screened", tune._gpu_screen)):
            t0 = time.monotonic()
            e = tune.tune_problem(p, arch, "cuda", time.monotonic() + 600, tune._gpu_timer, screen=screen)
            row[name] = dict(seconds=round(time.monotonic() - t0, 2), timed=e["timed"], finalists=e["finalists"],
                             config=e["config"], builtin=e["builtin"], ms=round(e["ms"], 5),
                             builtin_ms=round(e["builtin_ms"], 5))
        row["same_choice"] = row["long_only"]["config"] == row["screened"]["config"]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
