"""bench/profile.py's idle_gaps: the GPU's idle time inside a call, by the kernels around each gap, on spans made up
here (CUPTI needs a GPU)."""

import pytest

from ort_triton.bench.profile import idle_gaps


def _calls(n_calls: int, kernels: list[tuple[str, float, float]], host_gap: float = 500.0):
    """n_calls copies of one call's kernels, each (name, idle before it, duration), the calls host_gap apart."""
    spans, t = [], 0.0
    for _ in range(n_calls):
        t += host_gap
        for name, before, dur in kernels:
            t += before
            spans.append((t, t + dur, name))
            t += dur
    return spans


def test_gaps_inside_a_call_are_summed_per_call_and_named_by_their_kernels():
    call = [("norm", 0.0, 3.0), ("gemm", 2.0, 20.0), ("gemm", 0.0, 20.0), ("product", 7.0, 5.0)]
    gaps = idle_gaps(_calls(5, call)[::-1], 5)  # any order: sorted by start
    assert gaps == {"norm -> gemm": pytest.approx(2.0), "gemm -> product": pytest.approx(7.0)}
    assert sum(gaps.values()) == pytest.approx(9.0)  # the host's 500 us between calls is not the GPU's idle time


def test_no_call_boundary_no_report():
    spans = _calls(3, [("a", 1.0, 1.0), ("b", 4.0, 1.0)])
    assert idle_gaps(spans[:-1], 3) == {}  # 5 kernels in 3 calls: where one call ends is not known
    assert idle_gaps([], 3) == {}
