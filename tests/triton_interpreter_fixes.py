"""Fixes for Triton 3.6's interpreter, which the CPU tests run the kernels under (tests/conftest.py
applies them when it sets TRITON_INTERPRET=1). Compiled kernels never see these gaps."""

import triton.language as tl


def fix_interpreter() -> None:
    """Three gaps of Triton 3.6's interpreter (TRITON_INTERPRET=1, the CPU tests) that the kernels hit;
    compiled kernels never see them:
    - `range(0, SKV, ...)` over a runtime int calls int() on a 1-element array, which numpy >= 2.4
      refuses (triton-lang/triton#9171; fixed upstream the same way, by taking the one element);
    - tl.dot on bfloat16 multiplies the raw uint16 bit patterns the interpreter stores bf16 as
      (triton-lang/triton#11584); widen them to fp32 first, which is exact and what the tensor cores
      compute (exact products, fp32 sums);
    - fp32 -> bfloat16 truncates (its cast passes no rounding mode to the bit-level conversion), where the GPU
      rounds to nearest even: a chain of three bf16 roundings (AddRMSNormSwiGLU) drifted 2% low. Rounded here
      as the GPU does: add 0x7FFF plus the lowest kept bit, keep the high 16 bits (NaN stays NaN)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_ort_triton_fixed", False):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def rounded_cast(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast_impl(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, np.float32).view(np.uint32)
        kept = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(src.data)
        kept[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # a quiet NaN, whatever the low bits held
        return interpreter.TensorHandle(kept, tl.bfloat16)

    interpreter.InterpreterBuilder.cast_impl = rounded_cast
    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.create_dot = lambda self, a, b, *rest: create_dot(self, widen(a), widen(b), *rest)
    interpreter._ort_triton_fixed = True
