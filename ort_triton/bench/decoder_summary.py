"""bench.decoder rows -> one line per model and shape: ort_triton's best runtime against the best ORT runtime and
the best PyTorch runtime, with the ratios and the share of the ceiling.

    python -m ort_triton.bench.decoder_summary RESULTS.json [MORE.json ...] [--markdown OUT.md]

Rows from several files (calls of one device session, same seeded model and inputs) are merged. "Best" is the
lowest p50 among the runtimes that ran (status ok) at that shape: ORT is every runtime run by onnxruntime that
is not ours (stock, opset 23, its optimizer, onnxscript's fusions, with or without CUDA graphs), PyTorch every
torch_* runtime; ours are ort_triton's runtimes with the default library and every default rule (ablations and
tuned libraries are left out: they answer other questions).
"""

from __future__ import annotations

import argparse
import json
import pathlib

OURS = ("ort_triton", "ort_triton_static", "ort_triton_cuda_graph")


def family(runtime: str) -> str | None:
    if runtime in OURS:
        return "ours"
    if runtime.startswith("ort_triton"):
        return None  # an ablation or a tuned library
    if runtime.startswith(("ort_", "onnxscript")):
        return "ort"
    if runtime.startswith("torch_"):
        return "torch"
    return None


def _shape(r: dict) -> tuple:
    return r["model"], r["phase"], r["batch"], r["seq"] if r["phase"] == "prefill" else r["past"]


def summarize(rows: list[dict]) -> list[dict]:
    """One dict per (model, phase, batch, n): the best row of each family and the ratios."""
    best: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        fam = family(r["runtime"])
        if fam is None or r.get("status") != "ok":
            continue
        slot = best.setdefault(_shape(r), {})
        if fam not in slot or r["p50_ms"] < slot[fam]["p50_ms"]:
            slot[fam] = r
    out = []
    for key in sorted(best, key=lambda k: (k[0], k[1] != "prefill", k[2], k[3])):
        slot = best[key]
        line = dict(model=key[0], phase=key[1], batch=key[2], n=key[3])
        for fam in ("ours", "ort", "torch"):
            if fam in slot:
                line[fam] = dict(runtime=slot[fam]["runtime"], p50_ms=slot[fam]["p50_ms"])
        if "ours" in slot:
            o = slot["ours"]
            line["ceiling_fraction"] = o.get("ceiling_fraction")
            line["tflop_s"] = o.get("tflop_s")
            for fam in ("ort", "torch"):
                if fam in slot:
                    line[f"vs_{fam}"] = slot[fam]["p50_ms"] / o["p50_ms"]
        out.append(line)
    return out


def markdown(lines: list[dict]) -> str:
    head = ("| model | shape | ort_triton ms | best ORT ms (runtime) | vs ORT | best PyTorch ms (runtime) | vs PyTorch "
            "| ours: % of 4.08 TB/s or TFLOP/s |\n|---|---|---|---|---|---|---|---|")
    body = []
    for x in lines:
        cell = {f: f"{x[f]['p50_ms']:.3f} ({x[f]['runtime']})" if f in x else "-" for f in ("ort", "torch")}
        ratio = {f: f"{x[f'vs_{f}']:.2f}x" if f"vs_{f}" in x else "-" for f in ("ort", "torch")}
        extra = (f"{100 * x['ceiling_fraction']:.1f}%" if x.get("ceiling_fraction") is not None
                 else f"{x['tflop_s']:.0f}" if x.get("tflop_s") is not None else "-")
        ours = f"{x['ours']['p50_ms']:.3f}" if "ours" in x else "-"
        body.append(f"| {x['model']} | {x['phase']} {x['batch']}x{x['n']} | {ours} | {cell['ort']} | {ratio['ort']} "
                    f"| {cell['torch']} | {ratio['torch']} | {extra} |")
    return "\n".join([head, *body]) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="bench.decoder --json files")
    p.add_argument("--markdown", help="also write the table here")
    args = p.parse_args(argv)
    rows = [r for path in args.results for r in json.loads(pathlib.Path(path).read_text())]
    text = markdown(summarize(rows))
    print(text, end="")
    if args.markdown:
        pathlib.Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
