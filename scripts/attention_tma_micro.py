"""Would TMA help the attention kernel on Hopper? The library's packed kernel (kernels/attention.py, pointer
loads through cp.async) against a variant that moves K and V tiles with TMA descriptors made on the device,
BERT-base heads (12 x 64), packed Q/K/V, fp16, Triton JIT, CUDA-graph replays, median us; one JSON line per
shape. The variant takes whole key blocks only (S a multiple of BLOCK_N), which every shape here is.

    python scripts/attention_tma_micro.py
"""
import json

import torch
import triton
import triton.language as tl
import triton.testing

from ort_triton.kernels.attention import packed_attention

HEADS, D = 12, 64


@triton.jit
def tma_attention_fwd(QKV, KB, BQ, BV, Y, B, N, S, scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(S, BLOCK_M)
    bn = pid // num_m
    m_blk = pid - bn * num_m
    b = bn // N
    n = bn % N
    hidden = N * HEAD_DIM
    stride = 3 * hidden
    kvd = tl.make_tensor_descriptor(QKV, shape=[B * S, stride], strides=[stride, 1],
                                    block_shape=[BLOCK_N, HEAD_DIM])
    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (b * S + offs_m).to(tl.int64)[:, None]
    q_ok = (offs_m < S)[:, None]
    q = tl.load(QKV + q_rows * stride + n * HEAD_DIM + offs_d[None, :], mask=q_ok, other=0.0)
    bq = tl.load(BQ + n * HEAD_DIM + offs_d).to(tl.float32)
    y_ptrs = Y + q_rows * hidden + n * HEAD_DIM + offs_d[None, :]
    tl.store(y_ptrs, (q.to(tl.float32) + bq[None, :]).to(Y.dtype.element_ty), mask=q_ok)
    tl.debug_barrier()
    q = tl.load(y_ptrs, mask=q_ok, other=0.0)
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    row0 = b * S
    for start in tl.range(0, S, BLOCK_N):
        k = kvd.load([row0 + start, hidden + n * HEAD_DIM])
        v = kvd.load([row0 + start, 2 * hidden + n * HEAD_DIM])
        kb = tl.load(KB + b * S + start + tl.arange(0, BLOCK_N)).to(tl.float32)
        kb = tl.where(kb == float("-inf"), kb, tl.maximum(kb, -1e38)) * 1.4426950408889634
        s = tl.dot(q, tl.trans(k)) * qk_scale + kb[None, :]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.float16), v, acc * alpha[:, None])
        m_i = m_new
    bv = tl.load(BV + n * HEAD_DIM + offs_d).to(tl.float32)
    y = tl.where((l_i > 0.0)[:, None], acc / l_i[:, None] + bv[None, :], 0.0)
    tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=q_ok)


def time_shape(bsz: int, s: int) -> dict:
    h = HEADS * D
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(bsz, s, 3 * h, device="cuda", generator=g).half()
    bias = torch.randn(3 * h, device="cuda", generator=g).half()
    kb = torch.zeros(bsz, s, device="cuda", dtype=torch.half)
    kb[:, s - s // 4:] = float("-inf")
    y = torch.empty(bsz, s, h, device="cuda", dtype=torch.half)
    ref = packed_attention(qkv, kb, bias, HEADS, 0.125).float()

    def library():
        packed_attention(qkv, kb, bias, HEADS, 0.125, out=y)

    row = {"shape": f"{bsz}x{s}", "library": triton.testing.do_bench_cudagraph(library, rep=50, return_mode="median")
           * 1e3}
    for bm, bn, w, st in ((128, 64, 4, 3), (128, 64, 4, 2), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3),
                          (64, 64, 4, 3), (128, 32, 4, 3)):
        if s % bn:
            continue

        def fn(bm=bm, bn=bn, w=w, st=st):
            tma_attention_fwd[(triton.cdiv(s, bm) * bsz * HEADS,)](
                qkv, kb, bias, bias[2 * h:], y, bsz, HEADS, s, 0.125, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn,
                num_warps=w, num_stages=st)
        name = f"tma {bm}x{bn}/w{w}/s{st}"
        try:
            y.fill_(float("nan"))
            fn()
            err = (y.float() - ref).abs().max().item()
            if not err < 1e-2:
                row[name] = f"wrong ({err})"
                continue
            row[name] = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
        except Exception as exc:  # out of resources: say so, go on
            row[name] = f"{type(exc).__name__}: {str(exc)[:100]}"
    times = {k: v for k, v in row.items() if k.startswith("tma") and isinstance(v, float)}
    if times:
        best = min(times, key=times.get)
        row["best"], row["library_over_best"] = best, row["library"] / times[best]
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}


def main() -> None:
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    for bsz, s in ((32, 128), (8, 512), (32, 512), (8, 2048)):
        print(json.dumps(time_shape(bsz, s)), flush=True)


if __name__ == "__main__":
    main()
