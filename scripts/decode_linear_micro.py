"""A decode layer's projections as Triton GEMVs with the RMSNorm and the SwiGLU fused in, against the library's
path today (our AddRMSNorm kernel, cuBLAS through torch.matmul as ORT's MatMul runs it, our SiluMul), on the GPU.

Issue 5: a Llama-1B decode step at batch 1 is ~1.2 ms, of which the cuBLAS GEMVs take ~770 us and the rest is
some 150 small kernels of 2-8 us each. This measures, before any op is built, what one layer's four projection
launches would cost if each read its weight once and did its neighbours' elementwise work on the way:

    qkv  = AddRMSNorm(a, b) @ Wqkv           -> dec_linear(NORM, HAS_RES): the sum and rstd per program
    o    = attn @ Wo                         -> dec_linear
    h    = SiLU(n @ Wg) * (n @ Wu), n = AddRMSNorm(o, sum)   -> dec_linear(NORM, HAS_RES, SWIGLU)
    down = h @ Wd                            -> dec_linear

The weights are held transposed, WT = W^T [N, K] (K contiguous; a rewrite can store a constant weight so), so
a program streams BLOCK_N whole rows of K elements. Each program recomputes the row's sum of squares (K
elements from L2) instead of a separate norm launch; program 0 writes the residual sum. With PDL the first
weight tile is loaded before `griddepcontrol.wait`, so a kernel's start overlaps the one before it.

Rounding follows the unfused graph: s = T(a + b), n = T(s * rstd * gamma), g and u rounded to T before the
SiLU, y = T(silu(g) * u).

    python scripts/decode_linear_micro.py [--rows 1,16] [--layers 8] [--json OUT.jsonl]
    TRITON_INTERPRET=1 python scripts/decode_linear_micro.py --check-cpu     (the maths on small shapes)

Timing: triton.testing.do_bench_cudagraph (median of CUDA-graph replays). Bytes: the weights (what dominates at
M <= 16). % of 4.08 TB/s (the H200's copy ceiling; an H100 reads ~3.0 TB/s).
"""

import argparse
import functools
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

CEILING_GBS = 4080.0
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 2048, 32, 8, 64, 8192  # Llama-1B
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tests.triton_interpreter_fixes import fix_interpreter

    fix_interpreter()

    def gdc_wait():  # the interpreter has no griddepcontrol; PDL is a GPU-only mode
        pass

    def gdc_launch_dependents():
        pass
else:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _x_tile(A, B, G, rows, row_ok, ks, k_ok, K, rstd, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    offs = rows[:, None] * K + ks[None, :]
    m = row_ok[:, None] & k_ok[None, :]
    x = tl.load(A + offs, mask=m, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(B + offs, mask=m, other=0.0).to(tl.float32)).to(A.dtype.element_ty)
    if NORM:
        g = tl.load(G + ks, mask=k_ok, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * rstd[:, None] * g[None, :]).to(A.dtype.element_ty)
    return x


@triton.jit
def dec_linear(A, B, G, WT, Y, S, M, N, K, eps,
               NORM: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, PDL: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_rows = WT + cols.to(tl.int64)[:, None] * K  # gate rows; with SWIGLU the up rows are N rows further
    # the first weight tile does not depend on the kernel before: load it before waiting on it
    k_ok = ks < K
    w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
    if SWIGLU:
        wu = tl.load(w_rows + N * K + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0,
                     eviction_policy="evict_first")
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM:  # sum of squares of s = T(a + b), over K elements of L2-resident activations
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k in range(0, K, BLOCK_K):
            kk = k + ks
            kok = kk < K
            offs = rows[:, None] * K + kk[None, :]
            m = row_ok[:, None] & kok[None, :]
            s = tl.load(A + offs, mask=m, other=0.0)
            if HAS_RES:
                s = (s.to(tl.float32) + tl.load(B + offs, mask=m, other=0.0).to(tl.float32)).to(A.dtype.element_ty)
                if pid == 0:
                    tl.store(S + offs, s, mask=m)
            sf = s.to(tl.float32)
            ss += tl.sum(sf * sf, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        if SWIGLU:
            acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if SWIGLU:
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + ks
        # the next tile in flight while this one is used (one tile of register prefetch)
        nk = kk + BLOCK_K
        nmask = col_ok[:, None] & (nk < K)[None, :]
        w_next = tl.load(w_rows + nk[None, :], mask=nmask, other=0.0, eviction_policy="evict_first")
        if SWIGLU:
            wu_next = tl.load(w_rows + N * K + nk[None, :], mask=nmask, other=0.0, eviction_policy="evict_first")
        x = _x_tile(A, B, G, rows, row_ok, kk, kk < K, K, rstd, NORM, HAS_RES)
        if BLOCK_M == 1:  # one row: multiply the tile by the broadcast row, sum over K once at the end
            xf = x.to(tl.float32)  # [1, BLOCK_K]
            acc += w.to(tl.float32) * xf
            if SWIGLU:
                acc_u += wu.to(tl.float32) * xf
        else:
            acc = tl.dot(x, tl.trans(w), acc)
            if SWIGLU:
                acc_u = tl.dot(x, tl.trans(wu), acc_u)
        w = w_next
        if SWIGLU:
            wu = wu_next
    if BLOCK_M == 1:
        y = tl.sum(acc, axis=1)[None, :]
        if SWIGLU:
            yu = tl.sum(acc_u, axis=1)[None, :]
    else:
        y = acc
        if SWIGLU:
            yu = acc_u
    if SWIGLU:
        g = y.to(Y.dtype.element_ty).to(tl.float32)
        u = yu.to(Y.dtype.element_ty).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + rows[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def linear(a, wt, *, b=None, gamma=None, swiglu=False, eps=1e-6, cfg=(16, 256, 4, 1), pdl=False, y=None, s=None):
    """y = [SiLU-gated] (a [+ b], normalised when gamma is given) @ wt^T; returns y, or (y, sum) with b."""
    m, k = a.shape
    n = wt.shape[0] // (2 if swiglu else 1)
    block_n, block_k, warps, stages = cfg
    block_m = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    y = torch.empty(m, n, device=a.device, dtype=a.dtype) if y is None else y
    if b is not None and s is None:
        s = torch.empty_like(a)
    kwargs = {"launch_pdl": True} if pdl else {}
    dec_linear[(triton.cdiv(n, block_n),)](
        a, b if b is not None else a, gamma if gamma is not None else a, wt, y, s if s is not None else y,
        m, n, k, eps, NORM=gamma is not None, HAS_RES=b is not None, SWIGLU=swiglu, PDL=pdl,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages, **kwargs)
    return (y, s) if b is not None else y


def reference(a, wt, *, b=None, gamma=None, swiglu=False, eps=1e-6):
    """The unfused graph in fp32 with the graph's roundings to the element type."""
    t = a.dtype
    x = a.float()
    s = None
    if b is not None:
        s = (x + b.float()).to(t)
        x = s.float()
    if gamma is not None:
        x = (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * gamma.float()).to(t).float()
    out = x @ wt.float().T
    if swiglu:
        n = wt.shape[0] // 2
        g, u = out[:, :n].to(t).float(), out[:, n:].to(t).float()
        out = g * torch.sigmoid(g) * u
    return out.to(t), s


def check_cpu():
    """The kernel's maths under the interpreter against the fp32 reference, odd shapes, poisoned outputs."""
    torch.manual_seed(0)
    cases = [(1, 64, 48, 16, 32), (3, 96, 40, 16, 32), (1, 100, 24, 8, 64), (16, 64, 32, 16, 32), (5, 48, 20, 16, 16)]
    for (m, k, n, bn, bk), norm, res, swiglu in itertools.product(cases, (False, True), (False, True), (False, True)):
        if res and not norm:
            continue
        a = torch.randn(m, k, dtype=torch.float16)
        b = torch.randn(m, k, dtype=torch.float16) if res else None
        gamma = torch.rand(k, dtype=torch.float16) + 0.5 if norm else None
        wt = (torch.randn(n * (2 if swiglu else 1), k) / k ** 0.5).to(torch.float16)
        y = torch.full((m, n), float("nan"), dtype=torch.float16)
        s = torch.full((m, k), float("nan"), dtype=torch.float16) if res else None
        got = linear(a, wt, b=b, gamma=gamma, swiglu=swiglu, cfg=(bn, bk, 4, 1), y=y, s=s)
        want, want_s = reference(a, wt, b=b, gamma=gamma, swiglu=swiglu)
        got_y = got[0] if res else got
        err = ((got_y.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err < 1e-2, (m, k, n, norm, res, swiglu, err)
        if res:
            assert torch.equal(got[1], want_s), (m, k, n, "sum")
        print(f"ok M={m} K={k} N={n} norm={norm} res={res} swiglu={swiglu} rel err {err:.1e}")


def bench(fn, rep):
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3  # us


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16")
    p.add_argument("--layers", type=int, default=8, help="layers of distinct weights in the chain (defeats L2)")
    p.add_argument("--rep", type=int, default=30, help="ms of replays per timing")
    p.add_argument("--check-cpu", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.check_cpu:
        return check_cpu()
    out = open(args.json, "w") if args.json else None

    def emit(row):
        if row["kind"] != "cfg":
            print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    dev, t = "cuda", torch.float16
    torch.manual_seed(0)
    L = args.layers
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=t)  # noqa: E731
    # per layer: W [K, N] as ORT's MatMul holds it, and WT [N, K] for ours (gate and up stacked)
    layers = []
    for _ in range(L):
        w = {"qkv": rnd(HIDDEN, QKV) / HIDDEN ** 0.5, "o": rnd(HIDDEN, HIDDEN) / HIDDEN ** 0.5,
             "gate": rnd(HIDDEN, INTER) / HIDDEN ** 0.5, "up": rnd(HIDDEN, INTER) / HIDDEN ** 0.5,
             "down": rnd(INTER, HIDDEN) / INTER ** 0.5}
        w["qkv_t"], w["o_t"], w["down_t"] = (w[n].T.contiguous() for n in ("qkv", "o", "down"))
        w["gu_t"] = torch.cat([w["gate"].T, w["up"].T]).contiguous()
        w["g1"], w["g2"] = torch.rand(HIDDEN, device=dev, dtype=t) + 0.5, torch.rand(HIDDEN, device=dev, dtype=t) + 0.5
        layers.append(w)
    layer_bytes = 2 * (HIDDEN * QKV + HIDDEN * HIDDEN + 3 * HIDDEN * INTER)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731

    for m in ints(args.rows):
        measure(m, layers, layer_bytes, args.rep, emit)


def measure(m, layers, layer_bytes, rep, emit):
    """One batch size: each fused projection against the library's kernels for the same work (its best
    config), then L layers of each path chained in one CUDA graph."""
    from ort_triton.kernels.rms_norm import rms_norm
    from ort_triton.kernels.swiglu import silu_mul

    dev, t = "cuda", torch.float16
    L = len(layers)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=t)  # noqa: E731
    a, b, attn = rnd(m, HIDDEN), rnd(m, HIDDEN), rnd(m, HIDDEN)
    w0 = layers[0]
    # each fused projection alone: its configs against the library's kernels for the same work
    problems = {
        "qkv": (dict(wt=w0["qkv_t"], b=b, gamma=w0["g1"]),
                lambda: torch.matmul(rms_norm(a, w0["g1"], skip=b, store_sum=True)[0], w0["qkv"])),
        "o": (dict(wt=w0["o_t"]), lambda: torch.matmul(attn, w0["o"])),
        "gate_up": (dict(wt=w0["gu_t"], b=b, gamma=w0["g2"], swiglu=True),
                    lambda: silu_mul(*(lambda n: (torch.matmul(n, w0["gate"]), torch.matmul(n, w0["up"])))(
                        rms_norm(a, w0["g2"], skip=b, store_sum=True)[0]))),
        "down": (None, None),
    }
    h = rnd(m, INTER)
    problems["down"] = (dict(wt=w0["down_t"]), lambda: torch.matmul(h, w0["down"]))
    best = {}
    for name, (kw, lib) in problems.items():
        x = h if name == "down" else (attn if name == "o" else a)
        want, _ = reference(x, **kw)
        lib_us = bench(lib, rep)
        n_out = kw["wt"].shape[0]
        wbytes = 2 * n_out * kw["wt"].shape[1]
        if m == 1:
            space = itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048), (2, 4, 8), (1, 2))
        else:
            space = itertools.product((16, 32), (128, 256, 512), (4, 8), (1, 3))
        for cfg in space:
            bn, bk, warps, stages = cfg
            if bn * bk > 16384 or (m == 1 and bn * bk * (2 if kw.get("swiglu") else 1) > 1024 * warps):
                continue  # the [BLOCK_N, BLOCK_K] fp32 accumulators must stay in registers (<= 32 a thread)
            try:
                got = linear(x, **kw, cfg=cfg)
                got = got[0] if isinstance(got, tuple) else got
                err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                if not err < 1e-2:
                    raise AssertionError(f"rel err {err:.2e}")
                us = bench(functools.partial(linear, x, **kw, cfg=cfg), rep)
            except Exception as e:  # a config that does not compile or fit: say so, go on
                emit(dict(kind="config_failed", op=name, M=m, cfg=cfg, error=str(e)[:200]))
                continue
            if name not in best or us < best[name][0]:
                best[name] = (us, cfg)
        us, cfg = best[name]
        emit(dict(kind="op", op=name, M=m, lib_us=lib_us, fused_us=us, cfg=cfg, speedup=lib_us / us,
                  fused_pct=wbytes / us / 1e3 / CEILING_GBS * 100,
                  lib_pct=wbytes / lib_us / 1e3 / CEILING_GBS * 100))

    # whole layers in a chain over L layers of distinct weights
    o_out, hbuf = rnd(m, HIDDEN), rnd(m, INTER)

    def lib_chain():
        for w in layers:
            n, s1 = rms_norm(a, w["g1"], skip=b, store_sum=True)
            torch.matmul(n, w["qkv"])
            o = torch.matmul(attn, w["o"])
            n2, _ = rms_norm(o, w["g2"], skip=s1, store_sum=True)
            hh = silu_mul(torch.matmul(n2, w["gate"]), torch.matmul(n2, w["up"]))
            torch.matmul(hh, w["down"])

    def fused_chain(pdl, cublas_down=False):
        for w in layers:
            _, s1 = linear(a, w["qkv_t"], b=b, gamma=w["g1"], cfg=best["qkv"][1], pdl=pdl)
            linear(attn, w["o_t"], cfg=best["o"][1], pdl=pdl, y=o_out)
            linear(o_out, w["gu_t"], b=s1, gamma=w["g2"], swiglu=True, cfg=best["gate_up"][1], pdl=pdl, y=hbuf)
            if cublas_down:
                torch.matmul(hbuf, w["down"])
            else:
                linear(hbuf, w["down_t"], cfg=best["down"][1], pdl=pdl)

    lib_us = bench(lib_chain, rep) / L
    fused_us = bench(functools.partial(fused_chain, False), rep) / L
    pdl_us = bench(functools.partial(fused_chain, True), rep) / L
    mixed_us = bench(functools.partial(fused_chain, False, True), rep) / L
    emit(dict(kind="layer", M=m, layers=L, lib_us=lib_us, fused_us=fused_us, fused_pdl_us=pdl_us,
              fused_cublas_down_us=mixed_us, speedup_cublas_down=lib_us / mixed_us,
              speedup=lib_us / fused_us, speedup_pdl=lib_us / pdl_us,
              lib_pct=layer_bytes / lib_us / 1e3 / CEILING_GBS * 100,
              fused_pdl_pct=layer_bytes / pdl_us / 1e3 / CEILING_GBS * 100,
              device=torch.cuda.get_device_name()))


if __name__ == "__main__":
    sys.exit(main())
