"""Write BERT-base's fp16 export, fused, to the path given (the export the bench makes: models.build is
seeded), unless it is there already. The GPU scripts tune this model.

    python3 scripts/fused_bert_fp16.py build/tune_work/bert-base.fp16.opt.onnx
"""
import copy
import pathlib
import sys

import onnx

import graph_rewrites
from ort_triton import models

out = pathlib.Path(sys.argv[1])
if not out.exists():
    out.parent.mkdir(parents=True, exist_ok=True)
    src = models.export(copy.deepcopy(models.build("bert-base")).half(), out.with_name("bert-base.fp16.onnx"))
    onnx.save(graph_rewrites.optimize(str(src)), str(out))
