"""Rows of `ort-triton bench` -> speedups, JSON, CSV, a PNG plot and a table (printed, and saved as markdown).

    python -m ort_triton.bench.report RESULTS.json [MORE.json ...] [--out DIR]

merges result files (same seeded inputs, other processes), recomputes the speedups, redraws the plot
(e.g. where the GPU machine had no matplotlib) and prints the table (and writes it as DIR/<stem>.md).

Speedups, per (model, export, dtype, device, batch, seq), from p50 latencies:
  speedup_vs_ort_stock  = p50(ort_stock) / p50(row)
  speedup_vs_best_peer  = p50(best peer) / p50(row), best peer = the fastest runtime that is not ort_triton's
                          (runtimes.OURS); the peer itself scores 1.0. None where the reference has no result.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import pathlib
import textwrap

from rich import box
from rich.console import Console
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
    for a in (ax, *([ax2] if ax2 is not None else [])):
        a.set_yscale("log")
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
    rect = (0, 0.02 * (text.count("\n") + 1) if text else 0, 1, 1)
    fig.tight_layout(rect=rect)
    ok = [r for r in rows if r["status"] == "ok"]
    # speedups sit within a decade or two of 1x: more of its minor ticks are worth a label
    _label_log_axis(ax, [r["p50_ms"] for r in ok], "", ((2, 5), ()))
    if ax2 is not None:
        _label_log_axis(ax2, [r["speedup_vs_ort_stock"] for r in ok if r["speedup_vs_ort_stock"]], "x",
                        ((1.5, 2, 3, 5, 7.5), (2, 5), ()))
    fig.tight_layout(rect=rect)  # again: the labels' widths have changed
    return fig


def _label_log_axis(a, values: list[float], unit: str, choices: tuple[tuple[float, ...], ...]) -> None:
    """Label a log y axis at 10^k and at 10^k times each of `subs`, the first of `choices` (densest first)
    whose labels stay a line and a half apart at this axis' height, and move its limits out to the labelled
    ticks just beyond the data: a point past the last label cannot be read (0.7 ms under a lowest label of
    "1"), and matplotlib's own limits stop wherever the data does."""
    from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter

    if not values:
        return
    lo, hi = min(values), max(values)
    label_px = a.yaxis.get_majorticklabels()[0].get_fontsize() * a.figure.dpi / 72
    for subs in choices:
        marks = [s * 10.0 ** k for k in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
                 for s in (1, *subs)]
        bottom, top = max(m for m in marks if m <= lo), min(m for m in marks if m >= hi)
        limits = min(bottom, lo / _EDGE), max(top, hi * _EDGE)
        shown = [m for m in marks if bottom <= m <= top]
        px_per_decade = a.get_window_extent().height / math.log10(limits[1] / limits[0])
        closest = min((math.log10(b / m) for m, b in zip(shown, shown[1:])), default=math.inf)
        if closest * px_per_decade >= 1.5 * label_px:
            break
    a.set_ylim(*limits)
    a.yaxis.set_major_locator(LogLocator())
    a.yaxis.set_major_formatter(StrMethodFormatter("{x:g}" + unit))
    a.yaxis.set_minor_locator(LogLocator(subs=subs or "auto"))  # no labels: the grid's lines only
    a.yaxis.set_minor_formatter(StrMethodFormatter("{x:g}" + unit) if subs else NullFormatter())


_EDGE = 1.05  # room for half a marker between a point and the axis' edge (a factor: the axis is log)


def save(rows: list[dict], out_dir, plot_png: bool = True, log=print) -> list[pathlib.Path]:
    """JSON, CSV and the table as markdown (and the PNG) as OUT_DIR/<model>-<dtype>-<device>.*; returns the
    paths written."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = out / stem(rows)
    paths = [base.with_suffix(".json"), base.with_suffix(".csv"), base.with_suffix(".md")]
    write_json(rows, paths[0])
    write_csv(rows, paths[1])
    # the table the bench prints lives only in a terminal or a log otherwise; a results folder (and a
    # README or review quoting it) wants it as a file, next to the numbers it came from
    paths[2].write_text(markdown(rows))
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


def table(rows: list[dict], as_markdown: bool = False) -> Table:
    """One line per (shape, runtime); what each runtime did, or why it has no number, is in notes().
    as_markdown: a pipe table, without the rules between shapes (markdown has none) and with the fastest
    p50 in **bold** (plain text loses the terminal's bold)."""
    r0 = rows[0]
    t = Table(title=f"{r0['model']} {r0['dtype']} on {r0['gpu'] or 'CPU'} (p50 fastest per shape in bold)",
              title_justify="left", box=box.MARKDOWN if as_markdown else box.HEAVY_HEAD)
    for col in ("shape", "runtime", "p50 ms", "p90 ms", "p99 ms", "seq/s", "mem MB", "vs ort_stock",
                "vs best peer", "max abs err"):
        t.add_column(col, justify="left" if col in ("shape", "runtime") else "right", no_wrap=True)
    order = _runtimes(rows)
    for i, shape in enumerate(_shapes(rows)):
        members = sorted((r for r in rows if (r["batch"], r["seq"]) == shape), key=lambda r: order.index(r["runtime"]))
        fastest = min((r["p50_ms"] for r in members if r["status"] == "ok"), default=None)
        if i and not as_markdown:
            t.add_section()
        for r in members:
            if r["status"] != "ok":
                t.add_row(f"{shape[0]}x{shape[1]}", r["runtime"], r["status"], *[""] * 7, style="dim")
                continue
            speedups = [_num(r[k], ".2f") + "x" * (r[k] is not None)
                        for k in ("speedup_vs_ort_stock", "speedup_vs_best_peer")]
            p50 = f"{r['p50_ms']:.3f}"
            if as_markdown and r["p50_ms"] == fastest:
                p50 = f"**{p50}**"
            t.add_row(f"{shape[0]}x{shape[1]}", r["runtime"],
                      Text(p50, style="bold" if r["p50_ms"] == fastest else ""),
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


def markdown(rows: list[dict]) -> str:
    """What print_table prints, as markdown: the title, the table (as_markdown) and the notes as a list."""
    console = Console(file=io.StringIO(), width=10_000, color_system=None)  # wide: no row wraps or is cut
    console.print(table(rows, as_markdown=True))
    lines = [line.rstrip() for line in console.file.getvalue().strip().splitlines()]
    return "\n".join([*lines, "", *(f"- {line}" for line in notes(rows))]) + "\n"


def main(argv=None) -> None:
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
