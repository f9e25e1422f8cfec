"""Rows of `ort-triton bench` -> speedups, JSON, CSV, a PNG plot and a table.

    python -m ort_triton.bench.report RESULTS.json [MORE.json ...] [--out DIR]

merges result files (same seeded inputs, other processes), recomputes the speedups, redraws the plot
(e.g. where the GPU machine had no matplotlib) and prints the table.

Speedups, per (model, export, dtype, device, batch, seq), from p50 latencies:
  speedup_vs_ort_stock  = p50(ort_stock) / p50(row)
  speedup_vs_best_peer  = p50(best peer) / p50(row), best peer = the fastest runtime that is not ort_triton's
                          (runtimes.OURS); the peer itself scores 1.0. None where the reference has no result.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import textwrap

from rich.table import Table
from rich.text import Text

from .runtimes import OURS, RUNTIMES

# CSV column order; the JSON has the same keys. Other tools read these names: keep them stable.
FIELDS = ("model", "export", "dtype", "device", "batch", "seq", "runtime", "status", "error", "p50_ms", "p90_ms",
          "p99_ms", "throughput_seq_s", "peak_mem_mb", "mem_method", "speedup_vs_ort_stock", "best_peer",
          "speedup_vs_best_peer", "max_abs_err", "mean_abs_err", "rel_err", "reference", "info", "warmup", "iters",
          "gpu", "versions", "command")


def _group(row: dict) -> tuple:
    return (row["model"], json.dumps(row["export"], sort_keys=True), row["dtype"], row["device"], row["batch"],
            row["seq"])


def add_speedups(rows: list[dict]) -> list[dict]:
    """Fill speedup_vs_ort_stock, best_peer and speedup_vs_best_peer in place (and return the rows)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(_group(row), []).append(row)
    for members in groups.values():
        ok = [r for r in members if r["status"] == "ok"]
        stock = next((r["p50_ms"] for r in ok if r["runtime"] == "ort_stock"), None)
        peers = [r for r in ok if r["runtime"] not in OURS]
        best = min(peers, key=lambda r: r["p50_ms"], default=None)
        for r in members:
            fine = r["status"] == "ok"
            r["speedup_vs_ort_stock"] = stock / r["p50_ms"] if fine and stock else None
            r["best_peer"] = best["runtime"] if best else None
            r["speedup_vs_best_peer"] = best["p50_ms"] / r["p50_ms"] if fine and best else None
    return rows


def stem(rows: list[dict]) -> str:
    r = rows[0]
    return f"{r['model']}-{r['dtype']}-{r['device']}"


def write_json(rows: list[dict], path: pathlib.Path) -> None:
    path.write_text(json.dumps(rows, indent=1) + "\n")


def write_csv(rows: list[dict], path: pathlib.Path) -> None:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:  # dict fields (export, versions) as JSON in one cell
            w.writerow({k: json.dumps(v, sort_keys=True) if isinstance(v, dict) else v for k, v in r.items()})


def _shapes(rows) -> list[tuple[int, int]]:
    return list(dict.fromkeys((r["batch"], r["seq"]) for r in rows))


def _runtimes(rows) -> list[str]:
    """In the registry's order (peers and ours side by side the same way in every plot and table)."""
    names = list(dict.fromkeys(r["runtime"] for r in rows))
    order = list(RUNTIMES)
    return sorted(names, key=lambda n: order.index(n) if n in order else len(order))


def _no_result_note(rows, name) -> str | None:
    """Why a runtime has no point at some shapes: one note per distinct reason."""
    bad = [r for r in rows if r["runtime"] == name and r["status"] != "ok"]
    if not bad:
        return None
    if len(bad) == sum(r["runtime"] == name for r in rows):
        return f"{name}: {bad[0]['status']}: {bad[0]['error']}"
    return f"{name} at " + ", ".join(f"{r['batch']}x{r['seq']}" for r in bad) + f": {bad[0]['error']}"


MARKERS = "osD^vPX*<>"


def plot(rows: list[dict], path: pathlib.Path) -> None:
    fig = figure(rows)
    import matplotlib.pyplot as plt  # after figure() has chosen the Agg backend

    fig.savefig(path)
    plt.close(fig)


def figure(rows: list[dict]):
    """Top: p50 latency against shape, one line per runtime, log y. Bottom: the same as speedup over
    ort_stock (on its own axis: a 10% gain is invisible on the latency axis), left out when no row has one
    (results without ort_stock: an empty panel only raises a question). A runtime and its CUDA-graph
    variant share a colour (the graph one dashed); ort_triton's lines are drawn thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, StrMethodFormatter

    shapes, names = _shapes(rows), _runtimes(rows)
    # colours by the registry's order, so a runtime has the same colour in every plot
    bases = list(dict.fromkeys(n.removesuffix("_cuda_graph") for n in [*RUNTIMES, *names]))
    colours = dict(zip(bases, plt.get_cmap("tab10").colors * 2))
    if any(r.get("speedup_vs_ort_stock") for r in rows):
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(12, 9), dpi=120, sharex=True, height_ratios=(3, 2))
    else:
        fig, ax = plt.subplots(1, 1, figsize=(12, 6), dpi=120)
        ax2 = None
    notes = []
    for i, name in enumerate(names):
        by_shape = {(r["batch"], r["seq"]): r for r in rows if r["runtime"] == name}
        ok = [by_shape.get(s) if by_shape.get(s, {}).get("status") == "ok" else None for s in shapes]
        if note := _no_result_note(rows, name):
            notes.append(note)
        if not any(ok):
            continue
        ours = name in OURS
        style = dict(marker=MARKERS[i % len(MARKERS)], markersize=8 if ours else 6, linewidth=3 if ours else 1.6,
                     linestyle="--" if name.endswith("_cuda_graph") else "-",
                     color=colours[name.removesuffix("_cuda_graph")], zorder=3 if ours else 2)
        ax.plot(range(len(shapes)), [r["p50_ms"] if r else float("nan") for r in ok], label=name, **style)
        if ax2 is not None:
            ax2.plot(range(len(shapes)), [r["speedup_vs_ort_stock"] or float("nan") if r else float("nan") for r in ok],
                     **style)
    r0, versions = rows[0], rows[0]["versions"]
    # speedups sit within a decade or two of 1x: label more of its minor ticks
    for a, unit, subs in ((ax, "", (2, 5)), *([(ax2, "x", (1.5, 2, 3, 5, 7.5))] if ax2 is not None else [])):
        a.set_yscale("log")
        a.yaxis.set_major_formatter(StrMethodFormatter("{x:g}" + unit))
        a.yaxis.set_minor_locator(LogLocator(subs=subs))
        a.yaxis.set_minor_formatter(StrMethodFormatter("{x:g}" + unit))
        a.grid(True, which="both", alpha=0.3)
        a.tick_params(labelsize=11)
    ax.set_ylabel("p50 latency (ms, log scale)", fontsize=12)
    ax.set_title(f"{r0['model']}, {r0['dtype']}, on {r0['gpu'] or 'CPU'}: one inference, lower is better\n"
                 f"export {r0['export'].get('exporter')} opset {r0['export'].get('opset')}, "
                 f"onnxruntime {versions.get('onnxruntime')}, torch {versions.get('torch')}, "
                 f"median of {r0['iters']} runs", fontsize=12)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=11, title="runtime", frameon=False)
    if ax2 is not None:
        ax2.axhline(1.0, color="grey", linewidth=1)
        ax2.set_ylabel("speedup over ort_stock (log scale)", fontsize=12)
    bottom = ax if ax2 is None else ax2
    bottom.set_xticks(range(len(shapes)), [f"{b}x{s}" for b, s in shapes])
    bottom.set_xlabel("shape (batch x sequence length)", fontsize=12)
    text = textwrap.fill(textwrap.shorten("no result: " + "; ".join(notes), 1000), 170) if notes else ""
    if text:
        fig.text(0.01, 0.01, text, fontsize=9, va="bottom")
    fig.tight_layout(rect=(0, 0.02 * (text.count("\n") + 1) if text else 0, 1, 1))
    return fig


def save(rows: list[dict], out_dir, plot_png: bool = True, log=print) -> list[pathlib.Path]:
    """JSON and CSV (and the PNG) as OUT_DIR/<model>-<dtype>-<device>.*; returns the paths written."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = out / stem(rows)
    paths = [base.with_suffix(".json"), base.with_suffix(".csv")]
    write_json(rows, paths[0])
    write_csv(rows, paths[1])
    if plot_png:
        try:
            plot(rows, base.with_suffix(".png"))
            paths.append(base.with_suffix(".png"))
        except ImportError:
            log(f"no PNG: matplotlib is not installed (pip install ort-triton[bench]); draw it elsewhere with "
                f"python -m ort_triton.bench.report {paths[0]}")
    return paths


def _num(v, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def table(rows: list[dict]) -> Table:
    """One line per (shape, runtime); what each runtime did, or why it has no number, is in notes()."""
    r0 = rows[0]
    t = Table(title=f"{r0['model']} {r0['dtype']} on {r0['gpu'] or 'CPU'} (p50 fastest per shape in bold)",
              title_justify="left")
    for col in ("shape", "runtime", "p50 ms", "p90 ms", "p99 ms", "seq/s", "mem MB", "vs ort_stock",
                "vs best peer", "max abs err"):
        t.add_column(col, justify="left" if col in ("shape", "runtime") else "right", no_wrap=True)
    order = _runtimes(rows)
    for i, shape in enumerate(_shapes(rows)):
        members = sorted((r for r in rows if (r["batch"], r["seq"]) == shape), key=lambda r: order.index(r["runtime"]))
        fastest = min((r["p50_ms"] for r in members if r["status"] == "ok"), default=None)
        if i:
            t.add_section()
        for r in members:
            if r["status"] != "ok":
                t.add_row(f"{shape[0]}x{shape[1]}", r["runtime"], r["status"], *[""] * 7, style="dim")
                continue
            speedups = [_num(r[k], ".2f") + "x" * (r[k] is not None)
                        for k in ("speedup_vs_ort_stock", "speedup_vs_best_peer")]
            t.add_row(f"{shape[0]}x{shape[1]}", r["runtime"],
                      Text(f"{r['p50_ms']:.3f}", style="bold" if r["p50_ms"] == fastest else ""),
                      f"{r['p90_ms']:.3f}", f"{r['p99_ms']:.3f}", f"{r['throughput_seq_s']:.1f}",
                      _num(r["peak_mem_mb"], ".0f"), *speedups, _num(r["max_abs_err"], ".2e"))
    return t


def notes(rows: list[dict]) -> list[str]:
    """Per runtime, once: what it did (fusions, mode) and why it has no number where it has none, with the
    shapes it applies to when not all."""
    out = []
    for name in _runtimes(rows):
        mine = [r for r in rows if r["runtime"] == name]
        said: dict[str, list] = {}
        for r in mine:
            text = r["info"] if r["status"] == "ok" else f"{r['status']}: {r['error']}"
            if text:
                said.setdefault(text, []).append(f"{r['batch']}x{r['seq']}")
        for text, where in said.items():
            out.append(f"{name}: {text}" + ("" if len(where) == len(mine) else f" (at {', '.join(where)})"))
    return out


def print_table(rows: list[dict], console) -> None:
    if not console.is_terminal:  # a log file: the table needs more than the default 80 columns
        console.width = 160
    console.print(table(rows))
    for line in notes(rows):
        console.print(Text(line))


def main(argv=None) -> None:
    from rich.console import Console

    p = argparse.ArgumentParser(description="merge bench result JSONs, redraw the plot, print the table")
    p.add_argument("json", nargs="+")
    p.add_argument("--out", help="directory for the merged JSON/CSV/PNG (default: the first JSON's)")
    args = p.parse_args(argv)
    rows = [r for path in args.json for r in json.loads(pathlib.Path(path).read_text())]
    add_speedups(rows)
    for path in save(rows, args.out or pathlib.Path(args.json[0]).parent):
        print(f"wrote {path}")
    print_table(rows, Console(highlight=False))


if __name__ == "__main__":
    main()
