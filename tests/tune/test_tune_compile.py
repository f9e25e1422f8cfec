"""Compiling the tuner's candidates ahead (ort_triton/tune_compile.py), without a GPU: the pool is a
synchronous fake or, once, a real spawned pool running the interpreter; the clock is scripted, so the
deadline check is exact. On the GPU the same path is checked by timing a model (the lead's run)."""

import concurrent.futures as cf
import json
import time

import onnx
import pytest

from ort_triton import tune, tune_compile
from ort_triton.ops import LAYER_NORM
from ort_triton.tune_compile import Ahead, Job, Outcome
from tests.conftest import layer_norm_node_model, run_cli

SHAPES = [[2, 8, 64], [64], [64]]  # 16 rows of 64: candidates are (ROWS, num_warps) pairs, the built-in first
ATTRS = {"epsilon": 1e-5}


def problem(shapes=SHAPES) -> tune.Problem:
    keys = LAYER_NORM.tuning.keys("float", shapes, ATTRS, 1)
    return tune.Problem("LayerNorm", "float", keys, LAYER_NORM.tuning.bucket(keys), shapes, ATTRS)


def jobs(n: int) -> list[Job]:
    p = problem()
    return [Job(0, i, p.op, p.type, p.shapes, p.attrs, p.keys, cfg, "cuda")
            for i, cfg in enumerate(tune.candidates_of(p, 90, n))]


class Inline(cf.Executor):
    """An executor that runs each job at submit: the order of submissions and results is the test's."""

    def __init__(self):
        self.ran = []

    def submit(self, fn, /, *args, **kwargs):
        fut = cf.Future()
        self.ran.append(args[0])
        fut.set_result(fn(*args, **kwargs))
        return fut


def clock(*times):
    it = iter(times)
    return lambda: next(it)


def test_failures_are_recorded_only_when_the_worker_still_works():
    outcomes = {1: Outcome("OutOfResources: shared memory", True, 2.0), 2: Outcome("CUDA error", False, 2.0)}
    ahead = tune_compile.compile_ahead(jobs(4), 8, float("inf"), executor=Inline(),
                                       compile_fn=lambda j: outcomes.get(j.candidate, Outcome(None, True, 2.0)))
    # a failure after which the worker's CUDA context is broken is not the config's: the timing loop retries it
    assert ahead.failed == {(0, 1): "OutOfResources: shared memory"}
    assert (ahead.compiled, ahead.submitted, ahead.workers) == (2, 4, 4)  # no more workers than jobs


def test_the_deadline_stops_submission():
    """One worker, compiles of 3 s, deadline 8: the first job goes at t=1 (no compile measured yet, only the
    deadline counts), the second at t=4 (it ends at 7); at t=6 one would end at 9, past the deadline, so the
    rest are left to the timing loop."""
    pool = Inline()
    ahead = tune_compile.compile_ahead(jobs(5), 1, 8.0, executor=pool, compile_fn=lambda j: Outcome(None, True, 3.0),
                                       clock=clock(0.0, 1.0, 4.0, 6.0, 7.0))
    assert [j.candidate for j in pool.ran] == [0, 1]
    assert (ahead.compiled, ahead.submitted, ahead.seconds) == (2, 2, 7.0)


def test_a_dead_pool_leaves_the_rest_to_the_timing_loop():
    class Broken(Inline):
        def submit(self, fn, /, *args, **kwargs):
            if len(self.ran) == 2:
                raise cf.BrokenExecutor("a worker died")
            return super().submit(fn, *args, **kwargs)

    ahead = tune_compile.compile_ahead(jobs(4), 1, float("inf"), executor=Broken(),
                                       compile_fn=lambda j: Outcome(None, True, 1.0))
    assert (ahead.compiled, ahead.submitted, ahead.broken) == (2, 2, "a worker died")


def test_the_phase_is_skipped_on_the_cpu_and_with_one_worker():
    def never(*args):
        raise AssertionError("compiled ahead")

    for device, workers in (("cpu", 16), ("cuda", 1), ("cuda", 0)):
        failed, seconds = tune.compile_phase([problem()], 90, device, float("inf"), workers, compiler=never)
        assert failed == [{}] and seconds == 0.0


def test_the_phase_compiles_what_the_timing_loop_times():
    """Every problem's candidates up to max_candidates, in plain data (they pickle); failures come back per
    problem, by candidate index; one log line says how many, how long, with how many workers."""
    problems = [problem(), problem([[4, 8, 64], [64], [64]])]
    seen, lines = [], []

    def compiler(js, workers, deadline):
        seen.extend(js)
        assert workers == 16 and deadline == float("inf")
        return Ahead({(1, 2): "OutOfResources"}, len(js) - 2, len(js) - 1, 4.25, 5)

    failed, seconds = tune.compile_phase(problems, 90, "cuda", float("inf"), 16, max_candidates=3,
                                         compiler=compiler, log=lines.append)
    assert [(j.problem, j.candidate) for j in seen] == [(p, c) for p in (0, 1) for c in range(3)]
    assert [j.config for j in seen[3:]] == tune.candidates_of(problems[1], 90, 3)
    assert all(j.device == "cuda" and j.shapes == problems[j.problem].shapes for j in seen)
    assert failed == [{}, {2: "OutOfResources"}] and seconds == 4.25
    assert lines == ["compiled 4 of 6 config(s) ahead in 4.2 s with 5 worker(s), 1 failed; "
                     "1 left to compile in the timing loop (budget)"]


def test_the_phase_gets_its_share_of_the_budget_left():
    """Timing needs budget too: the compile phase's deadline is COMPILE_SHARE of what is left."""
    got = []

    def compiler(js, workers, deadline):
        got.append(deadline - time.monotonic())
        return Ahead({}, len(js), len(js), 0.0, workers)

    tune.compile_phase([problem()], 90, "cuda", time.monotonic() + 100.0, 2, max_candidates=1, compiler=compiler,
                       log=lambda s: None)
    assert 100.0 * tune.COMPILE_SHARE - 1 < got[0] <= 100.0 * tune.COMPILE_SHARE


def test_a_config_failed_ahead_is_skipped_with_its_reason():
    """The timing loop does not launch a candidate that failed in a worker; the built-in one it launches
    anyway (a failing built-in config stays an error, with the parent's traceback)."""
    launched = []

    def timer(fn):
        fn()
        launched.append(len(launched))
        return 1.0

    e = tune.tune_problem(problem(), 90, "cpu", float("inf"), timer, max_candidates=3,
                          failed={0: "flaky", 1: "OutOfResources: shared memory"})
    cfgs = tune.candidates_of(problem(), 90, 3)
    assert e["timed"] == 2 and len(launched) == 2
    assert e["skipped"] == [dict(config=cfgs[1], reason="OutOfResources: shared memory")]


def test_tune_on_the_cpu_writes_compile_s(tmp_path):
    model = tmp_path / "ln.onnx"
    onnx.save(layer_norm_node_model(64), model)

    def never(*args):
        raise AssertionError("compiled ahead on the cpu")

    out = tune.tune(model, [(2, 8)], device="cpu", arch=90, max_candidates=2, workers=16, compiler=never,
                    timer=lambda fn: (fn(), 1.0)[1], log=lambda s: None)
    data = json.loads(out.read_text())
    assert data["compile_s"] == 0.0 and data["entries"][0]["timed"] == 2


@pytest.mark.slow
def test_a_spawned_pool_compiles_and_reports_a_bad_config():
    """The real pool (two spawned workers, Triton's interpreter: TRITON_INTERPRET is inherited): the jobs
    pickle, the worker finds the op by name and launches its runner; a config the kernel cannot take (ROWS
    not a power of two) comes back failed with the reason."""
    p = problem()
    good = [Job(0, i, p.op, p.type, p.shapes, p.attrs, p.keys, cfg, "cpu")
            for i, cfg in enumerate(tune.candidates_of(p, 90, 2))]
    bad = Job(0, 2, p.op, p.type, p.shapes, p.attrs, p.keys, {"ROWS": 3, "num_warps": 1}, "cpu")
    ahead = tune_compile.compile_ahead([*good, bad], 2, float("inf"))
    assert ahead.compiled == 2 and ahead.workers == 2 and list(ahead.failed) == [(0, 2)], ahead
    assert "range must be a power of 2" in ahead.failed[(0, 2)]


def test_cli_refuses_negative_compile_workers(tmp_path):
    res = run_cli("tune", tmp_path / "m.onnx", "--shapes", "1x8", "--compile-workers", "-1", check=False)
    assert res.returncode == 2 and "--compile-workers must be 0 or more" in res.stderr
