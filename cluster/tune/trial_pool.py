"""Where the tuner's trials run: in this process, or in local worker processes.

A pool runs jobs (a Setting and the share of the trace to run it on) of one Problem and yields
(the job's index, its trial) as each lands, in any order; the search puts them back in job
order, so where they ran never changes what it decides. cluster/tune/ray_pool.py runs them
across a Ray cluster.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Iterator
from typing import Any, Protocol

from cluster.tune.problem import Job, Problem


class TrialPool(Protocol):
    def run(self, problem: Problem, jobs: list[Job]) -> Iterator[tuple[int, dict[str, Any]]]:
        """Run every job of `problem`; yields (index in `jobs`, trial) as each lands. The
        problem is sent to the workers once however many runs share it. Raises what a trial
        raises (a KeyboardInterrupt leaves the jobs still running to `close`)."""
        ...

    def close(self) -> None:
        """Stop every job still running and release the workers."""
        ...


_problem: Problem | None = None  # a worker process's copy, sent once


def _init_worker(problem: Problem) -> None:
    global _problem
    _problem = problem
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle


def _run_job(indexed: tuple[int, Job]) -> tuple[int, dict[str, Any]]:
    assert _problem is not None
    index, job = indexed
    return index, _problem.trial(*job)


class LocalPool:
    """`workers` processes on this machine (spawned, so a trial shares nothing with this
    process); one worker runs the trials here, one after another."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: Any = None
        self._sent: Problem | None = None

    def run(self, problem: Problem, jobs: list[Job]) -> Iterator[tuple[int, dict[str, Any]]]:
        if self.workers <= 1:
            for index, job in enumerate(jobs):
                yield index, problem.trial(*job)
            return
        if self._sent is not problem:  # a new problem: new workers with their own copy
            self.close()
            context = multiprocessing.get_context("spawn")
            self._pool = context.Pool(self.workers, _init_worker, (problem,))
            self._sent = problem
        yield from self._pool.imap_unordered(_run_job, list(enumerate(jobs)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
        self._pool, self._sent = None, None

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
