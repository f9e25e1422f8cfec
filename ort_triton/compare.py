"""Compare two sets of model outputs, and two models on the same inputs (`ort-triton compare`).

Per output: max, mean and p99 absolute error, and the error relative to the reference's largest
magnitude, max |a - b| / max |a| (what the project's tolerances mean by 'rel err'). An output passes when
max |a - b| <= atol + rtol * max |a| and NaN/Inf stand in the same places.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

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
    p99_abs: float = 0.0
    note: str = ""


def diff(name: str, ref: np.ndarray, out: np.ndarray, rtol: float, atol: float = 0.0) -> OutputDiff:
    ref64, out64 = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    if ref64.shape != out64.shape:
        inf = float("inf")
        return OutputDiff(name, out64.shape, str(out.dtype), inf, inf, inf, False, inf,
                          f"shape {list(out64.shape)} != reference {list(ref64.shape)}")
    same_nonfinite = bool(np.array_equal(np.isnan(ref64), np.isnan(out64))
                          and np.array_equal(np.where(np.isinf(ref64), ref64, 0), np.where(np.isinf(out64), out64, 0)))
    finite = np.isfinite(ref64) & np.isfinite(out64)
    err = np.abs(ref64 - out64)[finite]
    scale = float(np.max(np.abs(ref64[finite]))) if err.size else 0.0
    max_abs = float(err.max()) if err.size else 0.0
    rel = max_abs / scale if scale else max_abs
    ok = same_nonfinite and max_abs <= atol + rtol * scale
    return OutputDiff(name, ref64.shape, str(out.dtype), max_abs, float(err.mean()) if err.size else 0.0, rel, ok,
                      float(np.percentile(err, 99)) if err.size else 0.0,
                      "" if same_nonfinite else "NaN/Inf in different places")


def _bfloat16():
    import ml_dtypes  # onnx's own dependency

    return np.dtype(ml_dtypes.bfloat16)


def ort_feeds(feeds: dict) -> dict:
    """numpy feeds -> OrtValues, bfloat16 ones (ml_dtypes arrays, which ORT's run() refuses) by their bits."""
    import onnxruntime as ort
    from onnx import TensorProto

    return {k: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(v).view(np.uint16),
                                                               TensorProto.BFLOAT16)
            if v.dtype == _bfloat16() else ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v))
            for k, v in feeds.items()}


def run_session(session, feeds: dict) -> list[np.ndarray]:
    """session.run for any float type: feeds and outputs go through OrtValues, so bfloat16 inputs and outputs
    work (numpy has no bfloat16; they come back as ml_dtypes.bfloat16 arrays, which np.float64 converts)."""
    import ctypes

    outputs = []
    for v in session.run_with_ort_values(None, ort_feeds(feeds)):
        if v.data_type() == "tensor(bfloat16)":  # a CPU tensor (run() outputs): read its bits
            shape = tuple(v.shape())
            n = int(np.prod(shape)) if shape else 1
            bits = np.frombuffer((ctypes.c_uint16 * n).from_address(v.data_ptr()), np.uint16) if n else \
                np.zeros(0, np.uint16)
            outputs.append(bits.copy().reshape(shape).view(_bfloat16()))
        else:
            outputs.append(v.numpy())
    return outputs


def random_normal(rng, shape, ort_type: str) -> np.ndarray:
    """Normal noise in the input's float type ('tensor(float16)', 'tensor(bfloat16)', else float32)."""
    dtype = {"tensor(float16)": np.float16, "tensor(bfloat16)": _bfloat16()}.get(ort_type, np.float32)
    return rng.normal(size=shape).astype(dtype)


def _dim(dim, axis: int, batch: int, seq: int, past: int) -> int:
    """A symbolic dim's size by its name: a sum or a total (a decoder's mask and presents, 'past + seq') past + seq,
    a past (its cache inputs) past, a batch batch, a sequence seq; any other name (torch.export's s53) or none by
    its place: the first dim batch, the others seq."""
    name = str(dim or "").lower()
    if "+" in name or "total" in name:
        return past + seq
    if "past" in name or "cache" in name:
        return past
    if "batch" in name:
        return batch
    if "seq" in name or "len" in name:
        return seq
    return batch if axis == 0 else seq


def random_inputs(session, batch: int, seq: int, vocab: int | dict, seed: int = 0, past: int | None = None) -> dict:
    """Inputs for a session, by name. Static dims are kept; symbolic ones are sized by their names (`_dim`: a
    decoder's cache inputs get `past` positions, seq when None, its mask past + seq). Integer inputs named like a
    mask get ones with the last row padded from its middle on; other integer inputs ids below `vocab` (per input
    name when a dict, else 2); float inputs (pixel_values, hidden states, a KV cache) normal noise."""
    rng = np.random.default_rng(seed)
    past = seq if past is None else past
    feeds = {}
    for inp in session.get_inputs():
        shape = [d if isinstance(d, int) else _dim(d, i, batch, seq, past) for i, d in enumerate(inp.shape)]
        if "float" in inp.type:
            feeds[inp.name] = random_normal(rng, shape, inp.type)
        elif "mask" in inp.name:
            m = np.ones(shape, np.int64)
            if m.ndim == 2:
                m[-1, m.shape[1] // 2:] = 0
            feeds[inp.name] = m
        else:
            high = vocab.get(inp.name, 2) if isinstance(vocab, dict) else vocab
            feeds[inp.name] = rng.integers(0, high, shape, dtype=np.int64)
    return feeds


def index_ranges(model) -> dict[str, int]:
    """For integer graph inputs that index a table (Gather on an initializer: token ids, position ids),
    the table's length: random ids must stay below it."""
    inits = {t.name: t.dims[0] for t in model.graph.initializer if t.dims}
    ranges = {}
    for node in model.graph.node:
        lookups = []
        if node.op_type == "Gather" and len(node.input) == 2:
            lookups = [(node.input[0], node.input[1])]
        elif node.op_type == "EmbedLayerNorm" and node.domain == "ai.ort_triton":  # ids 0-2 index tables 3-5
            lookups = list(zip(node.input[3:6], node.input[:3]))
        for table, ids in lookups:
            if table in inits:
                ranges[ids] = min(ranges.get(ids, inits[table]), inits[table])
    return ranges


def compare_models(a, b, *, device: str = "cpu", batch: int = 2, seq: int = 16, past: int | None = None,
                   rtol: float = 1e-4, atol: float = 0.0, feeds: dict | None = None,
                   seed: int = 0) -> tuple[list[OutputDiff], dict]:
    """Run model a (the reference) and b on the same inputs: given ones, else random (token ids below each table's
    length, a padded attention mask, normal floats, a decoder's cache of `past` positions, seq when None). Returns
    the per-output diffs and the inputs used (in a's layout). `device` "cuda" runs both on the CUDA EP, b with the
    ort_triton library. a and b are onnx.ModelProto or paths; ORT reads a path itself, with its external data, at
    any size. A KV cache one model lays out sequence first (`ort-triton optimize --kv-cache seq-major`, named in
    its metadata) is fed and read back transposed, so either layout compares against either."""
    import onnx

    from .ops.kv_layout import TO_HEADS, TO_SEQ, session_seq_major_names
    from .runtime import inference_session, make_session

    providers = ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    path_a = isinstance(a, (str, os.PathLike))
    ref = inference_session(os.fspath(a) if path_a else a, providers=providers)
    cand = make_session(pathlib.Path(b) if isinstance(b, (str, os.PathLike)) else b, providers=providers)
    if feeds is None:
        graph_a = onnx.load(os.fspath(a), load_external_data=False) if path_a else a  # dims are enough
        feeds = random_inputs(ref, batch, seq, index_ranges(graph_a), seed, past)
    names = [o.name for o in ref.get_outputs()]
    if names != [o.name for o in cand.get_outputs()]:
        raise ValueError(f"the models' outputs differ: {names} vs {[o.name for o in cand.get_outputs()]}")
    seq_a, seq_b = session_seq_major_names(ref), session_seq_major_names(cand)

    def relaid(arrays: dict, names_from: set, names_to: set) -> dict:  # a cache tensor from one layout to the other
        perm = {n: TO_HEADS for n in names_from - names_to} | {n: TO_SEQ for n in names_to - names_from}
        return {k: np.ascontiguousarray(v.transpose(perm[k])) if k in perm else v for k, v in arrays.items()}

    out_a = dict(zip(names, run_session(ref, feeds)))
    out_b = relaid(dict(zip(names, run_session(cand, relaid(feeds, seq_a, seq_b)))), seq_b, seq_a)
    return [diff(n, out_a[n], out_b[n], rtol, atol) for n in names], feeds
