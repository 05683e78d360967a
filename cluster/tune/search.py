"""The tuner's search: settings simulated on a trace in worker processes.

Where the budget covers the grid, every setting runs on the whole trace. Else six tenths of
the budget go to successive halving: settings run first on the trace's day played three
times faster (every third request at a third of its time, the fleet's delays a third too;
each such run counts a third of a whole one), and the best third of them by Pareto rank of
replica-hours against SLO attainment then run on the whole trace. The rest of the budget
goes to the grid neighbours of the settings on the Pareto front, where a better setting is
most likely to be (then to settings not yet run). Every whole-trace trial is appended to a
JSONL file as it lands, so an interrupted search (Ctrl-C) keeps what it found; the caller
reports on those trials.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from cluster.cluster_sim import ClusterSimulator
from cluster.request_records import Slo
from cluster.tune.space import Setting, Space
from cluster.workload import SimRequest
from engine.runner.cost_model import CostParams, GpuSpec, ModelSpec

# Successive halving: the best third of each rung goes on, the last rung on the whole trace.
# A day played nine times faster ranked a diurnal trace's settings unlike the whole day.
ETA = 3
RUNG_SHARES = (1 / ETA,)  # the share of the trace's requests in each rung before the last
SCREENED = 0.6  # the share of the budget successive halving spends

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

    def trial(self, setting: Setting, fraction: float = 1.0) -> dict[str, Any]:
        """The setting's figures on the trace; or, at `fraction` = 1/k, on the trace's day
        run k times faster: every k-th request, at 1/k of its time (the arrival rate and
        the traffic's shape kept), the fleet's delays at 1/k too."""
        started = time.perf_counter()
        problem, run = self, setting
        if fraction < 1.0:
            k = round(1 / fraction)
            trace = [replace(r, arrival_s=r.arrival_s / k) for r in self.trace[::k]]
            problem = replace(self, trace=trace)
            run = replace(
                setting,
                upscale_delay_s=setting.upscale_delay_s / k,
                downscale_delay_s=setting.downscale_delay_s / k,
                startup_delay_s=setting.startup_delay_s / k,
            )
        summary = problem.simulate(run).summary()
        out = {k: summary[k] for k in KEPT}
        out["wall_s"] = time.perf_counter() - started
        return {"setting": asdict(setting), **out} | (
            {"fraction": fraction} if fraction < 1 else {}
        )


_problem: Problem | None = None  # a worker process's copy, sent once


def _init_worker(problem: Problem) -> None:
    global _problem
    _problem = problem
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle


def _run_trial(job: tuple[Setting, float]) -> dict[str, Any]:
    assert _problem is not None
    return _problem.trial(*job)


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


def best_by_rank(trials: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The `n` best trials: the Pareto front, then the front of the rest, and so on (within
    a front, the cheapest first)."""
    chosen: list[dict[str, Any]] = []
    left = list(trials)
    while left and len(chosen) < n:
        front = pareto_front(left)
        chosen += front
        taken = {id(t) for t in front}
        left = [t for t in left if id(t) not in taken]
    return chosen[:n]


def plan(size: int, trials: int) -> list[tuple[int, float]]:
    """(settings, share of the trace) of each round of a search of a grid of `size` with a
    budget of `trials` whole-trace runs: the whole grid on the whole trace; or successive
    halving's rungs, then the round of the front's neighbours (and, where they are fewer,
    settings not yet run)."""
    if trials >= size:
        return [(size, 1.0)]
    shares = (*RUNG_SHARES, 1.0)
    per_screened = sum(share * ETA**-i for i, share in enumerate(shares))
    n = min(size, max(round(trials * SCREENED / per_screened), 1))
    rounds = []
    for share in shares:
        rounds.append((n, share))
        n = math.ceil(n / ETA)
    cost = sum(count * share for count, share in rounds)
    return [*rounds, (max(int(trials - cost + 1e-9), 0), 1.0)]


def search(
    problem: Problem,
    space: Space,
    trials: int,
    results: Path,
    workers: int,
    seed: int = 0,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[list[dict[str, Any]], bool]:
    """Spend a budget of `trials` whole-trace runs; returns the whole-trace trials and
    whether the search ran to its end (False: interrupted). Each is appended to `results`
    as it finishes; `progress` sees every run, a share of the trace's too (`fraction`)."""
    rng = random.Random(seed)
    done: list[dict[str, Any]] = []
    seen: set[tuple[int, ...]] = set()
    point_of: dict[str, tuple[int, ...]] = {}
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text("")
    context = multiprocessing.get_context("spawn")
    pool = context.Pool(workers, _init_worker, (problem,)) if workers > 1 else None

    def run(points: list[tuple[int, ...]], fraction: float) -> list[dict[str, Any]]:
        seen.update(points)
        settings = [space.setting(p) for p in points]
        point_of.update((_key(asdict(st)), p) for st, p in zip(settings, points, strict=True))
        jobs = [(st, fraction) for st in settings]
        outcomes = (
            pool.imap_unordered(_run_trial, jobs)
            if pool is not None
            else (problem.trial(*job) for job in jobs)
        )
        landed = []
        for trial in outcomes:
            landed.append(trial)
            if fraction == 1.0:
                done.append(trial)
                with results.open("a") as f:
                    f.write(json.dumps(trial) + "\n")
            if progress is not None:
                progress(trial)
        return landed

    try:
        rounds = plan(space.size, trials)
        if len(rounds) == 1:  # the whole grid
            run(space.points(), 1.0)
            return done, True
        *rungs, (extra, _) = rounds
        screened = space.sample(rungs[0][0], rng)
        for (_, fraction), (following, _) in zip(rungs, rungs[1:], strict=False):
            kept = best_by_rank(run(screened, fraction), following)
            screened = [point_of[_key(t["setting"])] for t in kept]
        run(screened, 1.0)
        front = [point_of[_key(t["setting"])] for t in pareto_front(done)]
        around = list(dict.fromkeys(n for p in front for n in space.neighbours(p) if n not in seen))
        rng.shuffle(around)
        if len(around) < extra:  # the budget's rest on settings not yet run
            around += space.sample(extra - len(around), rng, exclude=seen | set(around))
        run(around[:extra], 1.0)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {len(done)} trials kept in {results}", file=sys.stderr)
        return done, False
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return done, True
