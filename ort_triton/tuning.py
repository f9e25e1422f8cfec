"""Tuning tables: what `ort-triton tune` measured, and what `ort-triton build --tuning TABLE` compiles.

A table is JSON:

    {"format": "ort_triton.tuning/1", "gpu": "NVIDIA H200", "arch": 90, "triton": "3.6.0", "model": "...",
     "entries": [{"op": "CausalAttention", "type": "float16", "arch": 90,
                  "keys": [[64, 64], [4097, 8192]],          # the bucket: a range per dispatch key
                  "config": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
                  "builtin": false,                          # true: the built-in config won (nothing to build)
                  "ms": 0.21, "builtin_ms": 0.25, "problem": {...}, "timed": 36, "skipped": [...]}]}

The build puts each entry that beat the built-in config ahead of the op's built-in specs, compiled for the
entry's arch only; the native dispatch takes the first spec whose key ranges hold a node's keys and that has
an image for the GPU (ot_find_spec), so a tuned bucket wins on its GPU and every other shape and GPU keeps the
built-in specs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tempfile

from . import ops as ops_mod
from .contract import ELEMENT_TYPES, OpContract, Spec

FORMAT = "ort_triton.tuning/1"


class TuningError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Entry:
    op: str
    type: str
    arch: int
    keys: tuple[tuple[int, int], ...]
    config: dict
    builtin: bool = False

    def spec(self) -> Spec:
        contract = ops_mod.BY_NAME[self.op]
        return contract.tuning.spec(self.type, self.keys, self.config)


def _entry(raw: dict, where: str) -> Entry:
    try:
        op, type_name, arch = raw["op"], raw["type"], int(raw["arch"])
        keys = tuple((int(lo), int(hi)) for lo, hi in raw["keys"])
        config = {k: int(v) for k, v in raw["config"].items()}
        builtin = bool(raw.get("builtin", False))
    except (KeyError, TypeError, ValueError) as e:
        raise TuningError(f"{where}: an entry needs op, type, arch, keys [[lo, hi], ...] and config "
                          f"{{name: int}} ({type(e).__name__}: {e})") from None
    contract: OpContract | None = ops_mod.BY_NAME.get(op)
    if contract is None or contract.tuning is None:
        tunable = sorted(o.name for o in ops_mod.ALL_OPS if o.tuning)
        raise TuningError(f"{where}: op {op!r} is not tunable; tunable ops: {', '.join(tunable)}")
    if type_name not in contract.types:
        raise TuningError(f"{where}: {op} has no element type {type_name!r} (it has {', '.join(contract.types)})")
    if contract.tuning.upgrade:
        keys = contract.tuning.upgrade(keys)
    if len(keys) != len(contract.kernel.dispatch_keys) or any(lo > hi for lo, hi in keys):
        raise TuningError(f"{where}: keys must be {len(contract.kernel.dispatch_keys)} ranges [lo, hi] with lo <= hi "
                          f"({', '.join(contract.kernel.dispatch_keys)}), got {list(keys)}")
    entry = Entry(op, type_name, arch, keys, config, builtin)
    try:
        spec = entry.spec()
    except (KeyError, ValueError) as e:
        raise TuningError(f"{where}: config {config} does not make a {op} kernel: {e}") from None
    if arch < spec.min_arch:
        raise TuningError(f"{where}: config {config} makes a {op} kernel for sm_{spec.min_arch} on, not sm_{arch}")
    return entry


def load(path) -> tuple[dict, list[Entry]]:
    """(the table's header fields, its entries), checked: an unknown op, type, key count or config is an
    error that names the entry."""
    table = _read(path)
    entries = [_entry(raw, f"{path}: entry {i}") for i, raw in enumerate(table.get("entries", []))]
    return {k: v for k, v in table.items() if k != "entries"}, entries


def _read(path) -> dict:
    """The table's JSON, checked to be one."""
    path = pathlib.Path(path)
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        raise TuningError(f"tuning table {path} does not exist; make one with: ort-triton tune MODEL.onnx") from None
    except (OSError, json.JSONDecodeError) as e:
        raise TuningError(f"tuning table {path} is not readable JSON: {e}") from None
    if not isinstance(table, dict) or table.get("format") != FORMAT:
        raise TuningError(f"{path} is not an ort_triton tuning table (format {FORMAT!r}); make one with "
                          "ort-triton tune")
    return table


def save(path, header: dict, entries: list[dict]) -> pathlib.Path:
    """Written atomically (a tune cut short leaves the previous table, or none)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as fh:
        json.dump({"format": FORMAT, **header, "entries": entries}, fh, indent=1)
        fh.write("\n")
    os.replace(tmp, path)
    return path


def tuned_specs(entries: list[Entry], op: OpContract, type_name: str, archs) -> list[tuple[Spec, int]]:
    """(spec, arch) for each entry of op/type that beat the built-in config on an arch being built, in table
    order; the build compiles each for its arch only and puts them ahead of the built-in specs."""
    if type_name not in ELEMENT_TYPES:
        raise TuningError(f"unknown element type {type_name!r}")
    return [(e.spec(), e.arch) for e in entries
            if e.op == op.name and e.type == type_name and e.arch in archs and not e.builtin]


def agreement(a, b, noise: float) -> tuple[list[dict], str]:
    """Two tables of the same model and GPU (paths), bucket by bucket: the same config, or two configs whose
    times (each run's own measure of its pick) are within `noise` of each other: what "the same answer
    when run twice on an idle GPU" means. Returns the rows and a one-line summary."""
    def by_bucket(path):  # bucket -> (the checked entry, the time of its pick)
        raws = _read(path).get("entries", [])
        entries = (_entry(raw, f"{path}: entry {i}") for i, raw in enumerate(raws))
        return {(e.op, e.type, e.arch, e.keys): (e, float(raw["ms"])) for e, raw in zip(entries, raws)}

    ea, eb = by_bucket(a), by_bucket(b)
    rows = []
    for key in sorted(set(ea) & set(eb), key=str):
        (entry_a, ms_a), (entry_b, ms_b) = ea[key], eb[key]
        same = entry_a.config == entry_b.config
        close = abs(ms_a - ms_b) <= noise * max(ms_a, ms_b)
        rows.append(dict(op=key[0], type=key[1], keys=[list(k) for k in key[3]], same_config=same, ms_a=ms_a,
                         ms_b=ms_b, agree=same or close))
    only = len(set(ea) ^ set(eb))
    summary = (f"{sum(r['agree'] for r in rows)}/{len(rows)} buckets agree ({sum(r['same_config'] for r in rows)} "
               f"with the same config, the rest within {noise:.0%})" + (f"; {only} in one table only" if only else ""))
    return rows, summary
