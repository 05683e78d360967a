"""The tuner's trials as Ray tasks across a cluster (`python -m cluster.tune --ray [ADDRESS]`).

Each trial is a task of one CPU running the same `Problem.trial` a local worker runs, spread
over the nodes with CPUs free. The problem (its trace above all) goes into the object store
once; a worker process keeps the last problem it read, so a node fetches it once and a worker
deserializes it once. Our code travels with the tasks (runtime_env py_modules), so the nodes
need Ray and our dependencies, not our package. A task lost with its worker or node (not one
whose trial raised) runs again elsewhere, up to RETRIES times; `rerun` counts them and
`nodes` how many trials each node ran.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

import cluster
import engine
from cluster.tune.problem import Job, Problem

RETRIES = 3  # runs of one job lost to a failed worker or node, beyond its first

# A task lost to its worker's or node's failure, not to its own error (RayTaskError).
LOST = (
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.LocalRayletDiedError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.OutOfMemoryError,
)

_cached: dict[str, Problem] = {}  # a Ray worker's last problem, by its object's id


@ray.remote(num_cpus=1, max_retries=0, scheduling_strategy="SPREAD")
def _trial(problem: list[ray.ObjectRef], job: Job) -> tuple[str, dict[str, Any]]:
    # NOTE: the ref arrives inside a list so Ray does not fetch and deserialize the problem
    # for every task; this worker reads it once.
    key = problem[0].hex()
    if key not in _cached:
        _cached.clear()
        _cached[key] = ray.get(problem[0])
    return ray.get_runtime_context().get_node_id(), _cached[key].trial(*job)


def _code() -> dict[str, Any]:
    """The runtime_env that ships our packages the trial imports (cluster, engine)."""
    folders = [str(Path(p.__file__).parent) for p in (cluster, engine)]
    return {"py_modules": folders, "excludes": ["__pycache__", "*.so", "*.o", "*.pyc"]}


class RayPool:
    """Trials as Ray tasks on the cluster at `address` (None: the one RAY_ADDRESS or `ray
    start` on this machine names, else a new local one); at most `limit` in flight (None: as
    many as the cluster schedules)."""

    def __init__(self, address: str | None = None, limit: int | None = None) -> None:
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=address, runtime_env=_code(), log_to_driver=False)
        self.limit = limit
        self.rerun = 0
        self.nodes: Counter[str] = Counter()
        self._sent: tuple[Problem, ray.ObjectRef] | None = None  # the problem in the store
        self._pending: dict[ray.ObjectRef, int] = {}

    def run(self, problem: Problem, jobs: list[Job]) -> Iterator[tuple[int, dict[str, Any]]]:
        if self._sent is None or self._sent[0] is not problem:
            self._sent = (problem, ray.put(problem))
        ref = [self._sent[1]]
        queue = deque(range(len(jobs)))
        runs = Counter[int]()

        def submit() -> None:
            while queue and (self.limit is None or len(self._pending) < self.limit):
                index = queue.popleft()
                runs[index] += 1
                self._pending[_trial.remote(ref, jobs[index])] = index

        submit()
        while self._pending:
            (ready,), _ = ray.wait(list(self._pending), num_returns=1)
            index = self._pending.pop(ready)
            try:
                node, trial = ray.get(ready)
            except LOST:
                if runs[index] > RETRIES:
                    raise
                self.rerun += 1
                queue.appendleft(index)
            else:
                self.nodes[node] += 1
                yield index, trial
            submit()

    def close(self) -> None:
        for ref in self._pending:
            ray.cancel(ref, force=True)
        self._pending.clear()
        self._sent = None

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self._started_ray:
            ray.shutdown()
