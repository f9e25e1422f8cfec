"""The main job on the embedded default: a BERT built from a transformers config (random weights, nothing
downloaded), exported by both torch exporters, optimized, and checked against the original on ORT."""

from __future__ import annotations

import pathlib
import tempfile

from rich.console import Console
from rich.table import Table

from . import models
from .compare import diff, random_inputs

RTOL = {"cpu": 1e-5, "cuda": 1e-4}  # CUDA: TF32-free fp32 GEMMs still reorder sums


def run(con: Console, model_name: str = "bert-tiny", out_dir: str | None = None, device: str = "cpu") -> int:
    import onnxruntime as ort

    import graph_rewrites

    from .cli import op_table, rule_table, save_atomic
    from .runtime import make_session

    work = pathlib.Path(out_dir) if out_dir else pathlib.Path(tempfile.mkdtemp(prefix="ort_triton_demo_"))
    work.mkdir(parents=True, exist_ok=True)
    model = models.build(model_name)
    results = Table(title=f"accuracy ({device}, optimized vs original on ORT CPU, fp32)", title_justify="left")
    for col in ("export", "output", "max abs", "rel", "result"):
        results.add_column(col)
    failed = False
    for exporter in models.EXPORTERS:
        src = models.export(model, work / f"{model_name}.{exporter}.onnx", exporter=exporter)
        dst = src.with_suffix(".opt.onnx")
        optimized, report = graph_rewrites.optimize(str(src), report=True)
        save_atomic(optimized, dst)
        con.print(op_table(report.ops_before, report.ops_after, f"{exporter}: {src.name} -> {dst.name}"))
        con.print(rule_table(report, verbose=False))
        reference = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
        providers = ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        candidate = make_session(dst, providers=providers)
        feeds = random_inputs(reference, batch=2, seq=13, vocab=model.config.vocab_size)
        names = [o.name for o in reference.get_outputs()]
        for name, a, b in zip(names, reference.run(None, feeds), candidate.run(None, feeds)):
            d = diff(name, a, b, RTOL[device])
            failed |= not d.ok
            results.add_row(exporter, name, f"{d.max_abs:.2e}", f"{d.rel:.2e}",
                            "[green]PASSED[/]" if d.ok else "[red]FAILED[/]")
    con.print(results)
    con.print(f"models in {work}")
    con.print("[red]FAILED[/]" if failed else "[green]PASSED[/]")
    return 1 if failed else 0
