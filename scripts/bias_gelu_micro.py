"""What bounds BiasGelu at BERT-base's FFN shape (16384 x 3072 fp16, 201 MB moved: 49 us at 4.08 TB/s)?
Triton JIT, CUDA-graph replays, median us, one JSON line per variant:
- the library's kernel (kernels/bias_gelu.py) as built;
- the same tile with no activation (bias add only): the memory floor of this tile;
- the same tile with GELU's erf from libdevice's erff (the library's form before session 8), and from a
  5-term rational approximation (one exp, one reciprocal; abs error 1.5e-7, so it loses the negative tail);
- a few other tiles (ROWS, BLOCK_H, num_warps) with the library's gelu (through erfc since session 8).
bench/results/session8/bias_gelu_micro_libdevice_erff.jsonl is a run where the library still used erff
(its "erff" rows are the library's gelu then); bias_gelu_micro_erfc.jsonl one after the change.

    python scripts/bias_gelu_micro.py
"""
import json

import torch
import triton
import triton.language as tl
import triton.testing

from ort_triton.kernels.bias_gelu import bias_gelu, gelu


@triton.jit
def _erf_rational(x):
    # Abramowitz & Stegun 7.1.26: |error| <= 1.5e-7 on erf
    a = tl.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    r = 1.0 - poly * tl.exp(-a * a)
    return tl.where(x < 0, -r, r)


@triton.jit
def variant_fwd(X, B, Y, n_rows, H, ACT: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    s = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    s += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACT == 1:
        s = 0.5 * s * (1.0 + tl.math.erf(s * 0.7071067811865476))
    elif ACT == 3:
        s = gelu(s, False)
    elif ACT == 2:
        s = 0.5 * s * (1.0 + _erf_rational(s * 0.7071067811865476))
    tl.store(Y + offs, s.to(Y.dtype.element_ty), mask=mask)


def main() -> None:
    m, h = 16384, 3072
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(m, h, device="cuda", generator=g) * 3).half()
    b = torch.randn(h, device="cuda", generator=g).half()
    y = torch.empty_like(x)
    ref = torch.nn.functional.gelu(x.double() + b.double())
    floor_us = 2 * x.numel() * 2 / 4.08e12 * 1e6

    def run(act, rows, block_h, warps):
        grid = (triton.cdiv(m, rows), triton.cdiv(h, block_h))
        return lambda: variant_fwd[grid](x, b, y, m, h, ACT=act, BLOCK_H=block_h, ROWS=rows, num_warps=warps)

    cases = [("library", lambda: bias_gelu(x, b, out=y), True)]
    cases += [(f"bias_only r{r} h{bh} w{w}", run(0, r, bh, w), False) for r, bh, w in ((4, 1024, 4), (8, 1024, 8))]
    cases += [(f"erff r{r} h{bh} w{w}", run(1, r, bh, w), True) for r, bh, w in ((4, 1024, 4),)]
    cases += [(f"library gelu r{r} h{bh} w{w}", run(3, r, bh, w), True)
              for r, bh, w in ((4, 1024, 4), (2, 1024, 4), (8, 1024, 8), (4, 512, 4), (16, 256, 8), (4, 1024, 8))]
    cases += [(f"rational r{r} h{bh} w{w}", run(2, r, bh, w), True) for r, bh, w in ((4, 1024, 4), (8, 1024, 8))]
    for name, fn, check in cases:
        y.fill_(float("nan"))
        fn()
        err = (y.double() - ref).abs().max().item() if check else None
        us = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
        print(json.dumps({"variant": name, "us": round(us, 2), "floor_us": round(floor_us, 2),
                          "fraction_of_floor": round(floor_us / us, 3), "max_abs_err": err}), flush=True)


if __name__ == "__main__":
    main()
