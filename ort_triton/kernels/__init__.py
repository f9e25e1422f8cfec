"""Triton kernels (need triton): imported by the AOT build, tests and GPU checks, never when serving."""
