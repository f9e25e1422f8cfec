"""AddRMSNormSwiGLU's steps at prefill, one by one, against the launches the unfused graph makes (GPU).

Session 27 (H100): with `add_rms_norm_swiglu` on, Llama-1B's prefill ran 0.953x at 1x512 and 0.968x at 8x512, about
6 us a layer at 512 rows. Beyond 16 rows the op runs steps (ort_triton/native/norm_linear.c); the graph it replaces
ran AddRMSNorm, two MatMuls and SiluMul. Each step against its counterpart, fp16, K = 2048, N = 8192 (Llama-1B):

    norm     MODE 1 (a row a program, the steps spec's 4 warps)  vs  rms_norm_fwd at the library's launch config
    gemm     cuBLAS with the weight stored [N, K] (ours: TN)      vs  stored [K, N] (ORT's MatMul: NN), each x2
    product  MODE 2 in flat blocks of 16 x BLOCK_N (the spec: 64)  vs  silu_mul_fwd (4 x 1024 tiles)

Each of ours also "AOT-like": compiled as the library's spec is (M, N, MODE, store_sum not specialised), which the
JIT would otherwise do unasked and so hide what the library runs.

Each also at other launch shapes (--warps, --block-n) so the fix can be picked from the same run. Timing:
triton.testing.do_bench_cudagraph (median of CUDA-graph replays); the GEMMs read two distinct 33 MB weights as the
model does. Bytes and % of --ceiling-gbs (copy ceiling; H200 4080, H100 ~3000) for the memory-bound steps.

    python scripts/swiglu_steps_micro.py [--rows 512,4096] [--json OUT.jsonl]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ort_triton.kernels.norm_linear import norm_linear_fwd  # noqa: E402
from ort_triton.kernels.rms_norm import rms_norm_fwd  # noqa: E402
from ort_triton.kernels.swiglu import silu_mul_fwd  # noqa: E402
from ort_triton.ops import norm_linear as nl  # noqa: E402
from ort_triton.ops.rms_norm import BLOCKS, launch_config  # noqa: E402

# The kernel as the AOT steps spec compiles it: the JIT specialises an int argument equal to 1 or divisible by 16
# unasked, the library's spec only K (declared divisible by 16 where K % 16 == 0) and nothing else (M, N, MODE and
# store_sum are plain runtime ints). Session 28's model profile had the steps far slower than the JIT's here.
AOT_LIKE = triton.jit(do_not_specialize=["M", "N", "store_sum", "MODE"])(norm_linear_fwd.fn)


def _steps(kernel, x, r, g, wt, wt2, y, s, nb, gb, ub, m, n, k, mode, grid, block_n, warps):
    kernel[grid](x, r, g, wt, wt2, y, s, nb, gb, ub, m, n, k, 1e-6, 1, mode, FUSED=0, SWIGLU=1, EVEN_K=0,
                 BLOCK_M=nl.BLOCK_M, BLOCK_N=block_n, BLOCK_K=nl.STEPS_BLOCK_K, ROW_BLOCK=nl.ROW_BLOCK,
                 num_warps=warps, num_stages=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="512,4096")
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--warps", default="4,8", help="MODE 1 warps to try")
    p.add_argument("--block-n", default="64,256,1024", help="MODE 2 tile widths to try")
    p.add_argument("--ceiling-gbs", type=float, default=4080.0)
    p.add_argument("--json")
    a = p.parse_args()
    torch.manual_seed(0)
    dev, t = "cuda", torch.float16
    k, n = a.k, a.n
    wt, wt2 = (torch.randn(n, k, device=dev, dtype=t) / k ** 0.5 for _ in range(2))
    w, w2 = wt.t().contiguous(), wt2.t().contiguous()  # [K, N]: ORT's MatMul's layout
    gamma = torch.rand(k, device=dev, dtype=t) + 0.5
    rows_out = []

    def row(step, variant, m, fn, nbytes=None):
        fn()
        torch.cuda.synchronize()
        us = do_bench_cudagraph(fn, rep=200) * 1e3
        r = {"step": step, "variant": variant, "rows": m, "k": k, "n": n, "us": round(us, 2)}
        if nbytes:
            r["pct_ceiling"] = round(100 * nbytes / us / 1e3 / a.ceiling_gbs, 1)
        rows_out.append(r)
        extra = f"  {r['pct_ceiling']:5.1f}%" if nbytes else ""
        print(f"{step:8s} {variant:28s} rows {m:5d}  {us:8.2f} us{extra}", flush=True)
        return r

    def at_rows(m):
        x, r = (torch.randn(m, k, device=dev, dtype=t) for _ in range(2))
        nb, s, nb2 = (torch.empty(m, k, device=dev, dtype=t) for _ in range(3))
        gb, ub = x @ w, x @ w2
        y, y2 = torch.empty(m, n, device=dev, dtype=t), torch.empty(m, n, device=dev, dtype=t)
        e = x.element_size()

        def steps(mode, grid, block_n, warps, kernel=norm_linear_fwd):
            _steps(kernel, x, r, gamma, wt, wt2, y, s, nb, gb, ub, m, n, k, mode, grid, block_n, warps)

        norm_bytes = 4 * m * k * e  # x, r in; n, sum out
        block = next(b for b in BLOCKS if b >= k)
        rows_per, warps = launch_config(block, True, True, n_rows=m)  # the library's AddRMSNorm (with the sum)
        row("norm", f"rms_norm_fwd {rows_per}x{warps}w", m, lambda: rms_norm_fwd[(triton.cdiv(m, rows_per),)](
            x, r, gamma, nb2, s, m, k, 1e-6, HAS_RES=True, STORE_SUM=True, BLOCK_H=block, ROWS=rows_per,
            num_warps=warps), norm_bytes)
        for wn in (int(v) for v in a.warps.split(",")):
            row("norm", f"MODE 1 {wn}w", m, lambda wn=wn: steps(1, (m,), 64, wn), norm_bytes)
        row("norm", "MODE 1 4w AOT-like", m, lambda: steps(1, (m,), 64, 4, AOT_LIKE), norm_bytes)
        torch.testing.assert_close(nb2, nb, rtol=1e-2, atol=1e-2)  # the same maths and rounding
        gemm_flops = 2 * 2 * m * k * n
        for name, wa, wb in (("TN: x @ WT^T (ours)", wt.t(), wt2.t()), ("NN: x @ W (ORT's MatMul)", w, w2)):
            got = row("gemm", name, m, lambda wa=wa, wb=wb: (torch.mm(nb, wa, out=gb), torch.mm(nb, wb, out=ub)))
            got["tflops"] = round(gemm_flops / got["us"] / 1e6, 1)
        prod_bytes = 3 * m * n * e
        row("product", "silu_mul_fwd 4x1024 4w", m, lambda: silu_mul_fwd[(triton.cdiv(m, 4), triton.cdiv(n, 1024))](
            gb, ub, y2, m, n, BLOCK_I=1024, ROWS=4, num_warps=4), prod_bytes)
        variants = [(int(v), norm_linear_fwd, "") for v in a.block_n.split(",")]
        for bn, kernel, tag in variants + [(nl.STEPS_BLOCK_N, AOT_LIKE, " AOT-like")]:
            grid = (triton.cdiv(m * n, nl.BLOCK_M * bn),)  # flat blocks of BLOCK_M x bn elements, as the planner
            y.fill_(float("nan"))
            row("product", f"MODE 2 16x{bn} 4w{tag}", m, lambda bn=bn, grid=grid, kernel=kernel: steps(
                2, grid, bn, 4, kernel), prod_bytes)
            torch.testing.assert_close(y, y2, rtol=1e-2, atol=1e-2)

    for m in (int(v) for v in a.rows.split(",")):
        at_rows(m)
    if a.json:
        Path(a.json).write_text("".join(json.dumps(r) + "\n" for r in rows_out))


if __name__ == "__main__":
    main()
