"""Packed attention (Q bias staged through Y) against unpacked MultiHeadAttention at BERT-base shapes on the
GPU (Triton JIT, CUDA-graph replays), us. Prints one JSON line per shape. The first run of this script
(bench/results/session7/packed_attention_micro.jsonl) also timed the per-key form of the Q bias that the
kernel's docstring rejects."""
import json

import torch
import triton.testing

from ort_triton.kernels.attention import attention, packed_attention

HEADS, D = 12, 64


def time_shape(b: int, s: int) -> dict:
    h = HEADS * D
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(b, s, 3 * h, device="cuda", generator=g).half()
    bias = torch.randn(3 * h, device="cuda", generator=g).half()
    kb = torch.zeros(b, s, device="cuda", dtype=torch.half)
    q, k, v = (t.contiguous() for t in qkv.split(h, -1))
    y = torch.empty(b, s, h, device="cuda", dtype=torch.half)
    runs = {"unpacked": lambda: attention(q, k, v, kb, HEADS, 0.125, v_bias=bias[2 * h:], out=y),
            "packed": lambda: packed_attention(qkv, kb, bias, HEADS, 0.125, out=y)}
    row = {"shape": f"{b}x{s}"}
    for name, fn in runs.items():
        fn()
        row[name] = round(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3, 2)
    row["packed_over_unpacked"] = round(row["unpacked"] / row["packed"], 3)
    return row


for shape in ((1, 128), (8, 128), (32, 128), (1, 512), (8, 512), (32, 512), (8, 2048)):
    print(json.dumps(time_shape(*shape)), flush=True)
