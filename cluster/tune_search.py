"""The tuner's search: settings simulated on a trace in worker processes, in two rounds.

Round one samples the grid at random (all of it when the budget covers it); round two
spends the rest of the budget on the grid neighbours of the settings on the Pareto front
of replica-hours against SLO attainment, where a better setting is most likely to be.
Every finished trial is appended to a JSONL file as it lands, so an interrupted search
(Ctrl-C) keeps what it found; the caller reports on those trials.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster.cluster_sim import ClusterSimulator
from cluster.request_records import Slo
from cluster.tune_space import Setting, Space
from cluster.workload import SimRequest
from engine.runner.cost_model import CostParams, GpuSpec, ModelSpec

# Summary figures a trial keeps (cluster_sim.ClusterSimResult.summary).
KEPT = (
    "replica_hours",
    "mean_replicas",
    "max_replicas",
    "sla_attainment",
    "ttft_attainment",
    "itl_attainment",
    "e2e_attainment",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "e2e_p50_s",
    "e2e_p99_s",
    "finished",
    "requests",
    "scale_ups",
    "scale_downs",
)


@dataclass(frozen=True)
class Problem:
    """What every trial shares: the trace, the replica's model and GPU, and the SLO."""

    trace: list[SimRequest]
    model: ModelSpec
    gpu: GpuSpec
    cost: CostParams
    slo: Slo

    def simulate(self, setting: Setting):
        return ClusterSimulator(setting.fleet(self.model, self.gpu, self.cost, self.slo)).run(
            self.trace
        )

    def trial(self, setting: Setting) -> dict[str, Any]:
        started = time.perf_counter()
        summary = self.simulate(setting).summary()
        out = {k: summary[k] for k in KEPT}
        return {"setting": asdict(setting), **out, "wall_s": time.perf_counter() - started}


_problem: Problem | None = None  # a worker process's copy, sent once


def _init_worker(problem: Problem) -> None:
    global _problem
    _problem = problem
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle


def _run_trial(setting: Setting) -> dict[str, Any]:
    assert _problem is not None
    return _problem.trial(setting)


def _key(setting: dict[str, Any]) -> str:
    return json.dumps(setting, sort_keys=True)


def pareto_front(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trials no other beats on both replica-hours (fewer) and attainment (more),
    cheapest first."""
    front: list[dict[str, Any]] = []
    best = -1.0
    for t in sorted(trials, key=lambda t: (t["replica_hours"], -t["sla_attainment"])):
        if t["sla_attainment"] > best:
            front.append(t)
            best = t["sla_attainment"]
    return front


def search(
    problem: Problem,
    space: Space,
    trials: int,
    results: Path,
    workers: int,
    seed: int = 0,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[list[dict[str, Any]], bool]:
    """Run up to `trials` settings; returns the finished trials and whether the search ran
    to its end (False: interrupted). Each trial is appended to `results` as it finishes."""
    rng = random.Random(seed)
    done: list[dict[str, Any]] = []
    seen: set[tuple[int, ...]] = set()
    point_of: dict[str, tuple[int, ...]] = {}
    # The whole grid when the budget covers it, else six tenths of the budget at random.
    first = space.sample(space.size if trials >= space.size else max(1, round(trials * 0.6)), rng)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text("")
    context = multiprocessing.get_context("spawn")
    pool = context.Pool(workers, _init_worker, (problem,)) if workers > 1 else None
    try:
        for batch in (first, None):
            if batch is None:  # round two: around the front found so far
                front = [point_of[_key(t["setting"])] for t in pareto_front(done)]
                around = [n for p in front for n in space.neighbours(p) if n not in seen]
                batch = list(dict.fromkeys(around))
                rng.shuffle(batch)
                batch = batch[: trials - len(seen)]
            seen.update(batch)
            settings = [space.setting(p) for p in batch]
            point_of.update((_key(asdict(st)), p) for st, p in zip(settings, batch, strict=True))
            outcomes = (
                pool.imap_unordered(_run_trial, settings)
                if pool is not None
                else map(problem.trial, settings)
            )
            for trial in outcomes:
                done.append(trial)
                with results.open("a") as f:
                    f.write(json.dumps(trial) + "\n")
                if progress is not None:
                    progress(trial)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {len(done)} trials kept in {results}", file=sys.stderr)
        return done, False
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return done, True
