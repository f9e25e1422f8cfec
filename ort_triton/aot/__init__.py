"""Ahead-of-time build: op contracts -> Triton cubins -> generated C tables -> libort_triton.so."""
