"""No register spills in the attention specs BERT-sized models run (head dim 64), on Ampere and Hopper:
the Hopper-tuned 4 warps spill on sm_8x, so those archs compile with Spec.pre_hopper (ops/attention.py); and
the packed kernel, which stages q + bq through Y because holding it in registers spills (kernels/attention.py).
ptxas' resource report (cuobjdump -res-usage) is read from the cubins (tests/ptxas_report.py); no GPU needed."""

import pytest

from tests.ptxas_report import compile_rows

pytest.importorskip("triton")

SCRIPT = r"""
import json, pathlib, sys
from ort_triton.ops import BY_NAME
from tests.ptxas_report import spec_usage
arch, out, OP = int(sys.argv[1]), pathlib.Path(sys.argv[2]), BY_NAME[sys.argv[3]]
rows = [dict(spec_usage(OP, "float16", i, spec, arch, out), want_warps=spec.launch(arch)[0])
        for i, spec in enumerate(OP.specializations("float16")) if spec.constexprs["HEAD_DIM"] == 64]
print(json.dumps(rows))
"""


@pytest.mark.parametrize("op", ["MultiHeadAttention", "PackedMultiHeadAttention"])
@pytest.mark.parametrize("arch", [80, 90])
def test_head_dim_64_attention_does_not_spill(arch, op, tmp_path):
    rows = compile_rows(SCRIPT, arch, tmp_path, op)
    assert len(rows) == 2  # Sq, Skv multiples of 16, and any length
    for r in rows:
        assert r["stack"] == 0, f"spec {r['spec']} on sm_{arch} ({r['warps']} warps) spills: {r['usage']}"
        assert r["warps"] == r["want_warps"]


# ---- the decode products: every spec of Linear and AddRMSNorm(Linear|SwiGLU), every type. Their tiles are as wide
# as fits: at BLOCK_K 256 the masked fused spec spilled 264-344 bytes on sm_90, and the steps spec, which carried the
# fused product's code beside its own, 408-528 (session 27: ops/norm_linear.py MASKED_BLOCK_K, the kernel's FUSED).
_PRODUCTS_SCRIPT = r"""
import json, pathlib, sys
from ort_triton.ops import BY_NAME
from tests.ptxas_report import spec_usage
arch, out = int(sys.argv[1]), pathlib.Path(sys.argv[2])
rows = [dict(spec_usage(BY_NAME[name], t, i, spec, arch, out), op=name)
        for name in ("Linear", "AddRMSNormLinear", "AddRMSNormSwiGLU") for t in ("float16", "bfloat16", "float")
        for i, spec in enumerate(BY_NAME[name].specializations(t))]
print(json.dumps(rows))
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
def test_decode_product_specs_do_not_spill(arch, tmp_path):
    rows = compile_rows(_PRODUCTS_SCRIPT, arch, tmp_path)
    assert {r["op"] for r in rows} == {"Linear", "AddRMSNormLinear", "AddRMSNormSwiGLU"}
    spills = [f"{r['op']} {r['type']} spec {r['spec']}: {r['usage']}" for r in rows if r["stack"]]
    assert not spills, f"sm_{arch}: " + "; ".join(spills)
