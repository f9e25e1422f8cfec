"""Compile `ort-triton tune`'s candidate configs ahead of the timing, in parallel over the CPU cores.

A candidate's first launch JIT-compiles its kernel (seconds each); done serially in the timing loop, that
ate the budget (Llama, 1.5 min: 2 of 26 problems timed). Here spawned workers build each candidate's runner
and launch it once, which writes the kernel to Triton's on-disk cache (TRITON_CACHE_DIR, else
~/.triton/cache: the workers inherit the parent's environment), so the timing loop's first launch of the
same config at the same shapes is a disk hit. A config that fails in a worker is reported with the reason
and the timing loop skips it. The phase stops submitting at the deadline; what it did not reach compiles
lazily, as before.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import multiprocessing
import statistics
import time


@dataclasses.dataclass(frozen=True)
class Job:
    """One (problem, candidate) to compile, in plain data: it is pickled to a spawned worker, which finds the
    op's contract by name."""

    problem: int  # index into the tuner's problems
    candidate: int  # index into that problem's candidates (0: the built-in config)
    op: str
    type: str
    shapes: list
    attrs: dict
    keys: tuple
    config: dict
    device: str


@dataclasses.dataclass(frozen=True)
class Outcome:
    error: str | None  # why the config failed to compile or launch; None: it did both
    trusted: bool  # the failure is the config's own: the worker's CUDA context still works after it
    seconds: float  # the compile and launch, without the worker's imports


@dataclasses.dataclass
class Ahead:
    failed: dict  # (problem, candidate) -> reason, for the timing loop to skip
    compiled: int
    submitted: int
    seconds: float
    workers: int
    broken: str | None = None  # the pool died (a worker crashed): the rest compile lazily


def _context_ok(device: str) -> bool:
    """Whether the worker can still launch: a launch that faults leaves its CUDA context broken, and every
    later job in that worker would then fail for a reason that is not its config's."""
    if device != "cuda":
        return True
    import torch

    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001  (any error here means the context is gone)
        return False


def compile_one(job: Job) -> Outcome:
    """In a worker: the candidate's runner, launched once (and synchronized, so a launch error shows here)."""
    import torch

    from . import ops
    from .tune import _short

    tuning = ops.BY_NAME[job.op].tuning
    t0 = time.monotonic()
    try:
        run = tuning.runner(job.type, job.shapes, job.attrs, job.keys, job.config, job.device)
        run()
        if job.device == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (reported with the reason; the timing loop skips the config)
        return Outcome(_short(e), _context_ok(job.device), time.monotonic() - t0)
    return Outcome(None, True, time.monotonic() - t0)


def compile_ahead(jobs: list[Job], workers: int, deadline: float, *, executor=None, compile_fn=compile_one,
                  clock=time.monotonic) -> Ahead:
    """Run compile_fn on every job in a pool of min(workers, len(jobs)) spawned processes (or `executor`,
    which the caller owns), in order, at most one job per worker in flight: so the deadline check happens at
    each submission and nothing queued runs past it. A job is submitted only while one started now would
    end before the deadline (the median compile so far); the workers finish the jobs they hold."""
    t0 = clock()
    n = max(1, min(workers, len(jobs)))
    # spawned, not forked: no CUDA context or Triton state of the parent crosses into a worker
    pool = executor or cf.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))
    pending, running = collections.deque(jobs), {}
    durations, failed, compiled, submitted, broken = [], {}, 0, 0, None

    def in_time() -> bool:  # a job started now ends (at the typical compile time so far) before the deadline
        return clock() + (statistics.median(durations) if durations else 0.0) < deadline

    try:
        while pending or running:
            while pending and len(running) < n and in_time():
                job = pending.popleft()
                try:
                    running[pool.submit(compile_fn, job)] = job
                except cf.BrokenExecutor as e:
                    broken = broken or str(e) or type(e).__name__
                    pending.clear()
                    break
                submitted += 1
            if not running:
                break
            done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                job = running.pop(fut)
                try:
                    outcome = fut.result()
                except cf.BrokenExecutor as e:  # a worker died (segfault, out of memory): stop, compile lazily
                    broken = broken or str(e) or type(e).__name__
                    pending.clear()
                    continue
                durations.append(outcome.seconds)
                if outcome.error is None:
                    compiled += 1
                elif outcome.trusted:
                    failed[(job.problem, job.candidate)] = outcome.error
                # an untrusted failure (the worker's context broke) is left for the timing loop to retry
    finally:
        if executor is None:
            pool.shutdown(wait=True, cancel_futures=True)
    return Ahead(failed, compiled, submitted, clock() - t0, n, broken)
