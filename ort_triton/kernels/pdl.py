"""Programmatic dependent launch (PDL) inside a kernel: the kernels whose contract says `pdl` (contract.Kernel.pdl).

A decode step with CUDA graphs is a chain of ~100-200 kernels of a few microseconds each. Launched with
programmatic stream serialization (the native launcher does with ORT_TRITON_PDL=1, for images built with PDL = 1:
sm_90 on), a kernel may start while the one before it finishes. It must then wait (griddepcontrol.wait: the earlier
kernel complete, its writes visible) before it reads what that kernel writes and before it writes what that kernel
may still read (ORT reuses buffers). Launched the plain way, the wait returns at once. The launch_dependents right
after lets the next kernel start as this one's programs run: its programs take free slots and wait in turn.

Session 22 (scripts/pdl_micro.py, H100): 0.4-0.5 us saved between two kernels of ours; none after an ORT or
cuBLAS kernel, which do not trigger.
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
