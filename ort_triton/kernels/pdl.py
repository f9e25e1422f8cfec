"""Programmatic dependent launch (PDL) inside a kernel: the kernels whose contract says `pdl` (contract.Kernel.pdl).

A decode step with CUDA graphs is a chain of ~100-200 kernels of a few microseconds each. Launched with
programmatic stream serialization (the native launcher does with ORT_TRITON_PDL=1, for images built with PDL = 1:
sm_90 on), a kernel may start while the one before it finishes. It must then wait (griddepcontrol.wait: the earlier
kernel complete, its writes visible) before it reads what that kernel writes and before it writes what that kernel
may still read (ORT reuses buffers). Launched the plain way, the wait returns at once. The launch_dependents right
after lets the next kernel start as this one's programs run: its programs take free slots and wait in turn.

Session 22 (scripts/pdl_micro.py, H100): 0.4-0.5 us saved between two kernels of ours; none after an ORT or
cuBLAS kernel, which do not trigger. The same micro put the constant (gamma) before the wait for 0.07-0.14 us more.
A decode product's constant is its weight, and its first bytes are the kernel's ramp: `prefetch_rows` asks L2 for
them before the wait, so they arrive while the kernel before runs.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Call before the first load or store of anything another kernel writes or reads (constants may come first)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_rows(row_ptrs, K, PREFETCH_K: tl.constexpr, PDL: tl.constexpr):
    """With PDL: ask L2 for the first PREFETCH_K elements of each row at row_ptrs ([R, 1] pointers to rows of K
    elements), one request every 32 elements (64 bytes at 16 bits: every 128-byte line at least once), not waiting
    for them. Only for constants (weights): nothing an earlier kernel writes."""
    if PDL:
        offs = tl.minimum(tl.arange(0, PREFETCH_K // 32) * 32, K - 1)  # clamped: a valid element of the row
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [row_ptrs + offs[None, :]],
                                  dtype=tl.int32, is_pure=False, pack=1)
