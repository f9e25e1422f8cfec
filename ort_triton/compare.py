"""Compare two sets of model outputs: per output the max and mean absolute error and the error relative to
the reference's largest magnitude (what fp32 tolerances in this project mean by 'rel err')."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class OutputDiff:
    name: str
    shape: tuple
    dtype: str
    max_abs: float
    mean_abs: float
    rel: float  # max |a - b| / max |a|
    ok: bool


def diff(name: str, ref: np.ndarray, out: np.ndarray, rtol: float) -> OutputDiff:
    ref64, out64 = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    if ref64.shape != out64.shape:
        return OutputDiff(name, out64.shape, str(out.dtype), float("inf"), float("inf"), float("inf"), False)
    err = np.abs(ref64 - out64)
    scale = float(np.max(np.abs(ref64))) if ref64.size else 0.0
    finite = bool(np.all(np.isfinite(out64) == np.isfinite(ref64)))
    max_abs = float(err.max()) if err.size else 0.0
    rel = max_abs / scale if scale else max_abs
    return OutputDiff(name, ref64.shape, str(out.dtype), max_abs, float(err.mean()) if err.size else 0.0, rel,
                      finite and rel <= rtol)


def random_inputs(session, batch: int, seq: int, vocab: int, seed: int = 0) -> dict:
    """Inputs for an encoder session, by name: token ids, a padded attention mask (the last row padded
    from seq // 2 on), or, for float inputs such as pixel_values, normal noise of the input's static shape
    with the batch dimension set."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for inp in session.get_inputs():
        if "float" in inp.type:
            shape = [batch] + [d if isinstance(d, int) else seq for d in inp.shape[1:]]
            feeds[inp.name] = rng.normal(size=shape).astype(np.float16 if "float16" in inp.type else np.float32)
        elif "mask" in inp.name:
            m = np.ones((batch, seq), np.int64)
            m[-1, seq // 2:] = 0
            feeds[inp.name] = m
        else:
            feeds[inp.name] = rng.integers(0, vocab, (batch, seq), dtype=np.int64)
    return feeds
