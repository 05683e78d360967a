"""The tuner's search: settings simulated on a trace, in a pool of workers (this process,
local processes, or Ray tasks across a cluster: cluster/tune/trial_pool.py, ray_pool.py).

Where the budget covers the grid, every setting runs on the whole trace. Else six tenths of
the budget go to successive halving: settings run first on the trace's day played three
times faster (every third request at a third of its time, the fleet's delays a third too;
each such run counts a third of a whole one), and the best third of them by Pareto rank of
replica-hours against SLO attainment then run on the whole trace. The rest of the budget
goes to the grid neighbours of the settings on the Pareto front, where a better setting is
most likely to be (then to settings not yet run). Every whole-trace trial is appended to a
JSONL file as it lands, so an interrupted search (Ctrl-C) keeps what it found; the caller
reports on those trials. Each round's trials are taken in the order they were asked for,
whatever order they land in, so the same seed and budget choose the same settings in any pool.
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cluster.tune.problem import Problem
from cluster.tune.space import Space
from cluster.tune.trial_pool import LocalPool, TrialPool

# Successive halving: the best third of each rung goes on, the last rung on the whole trace.
# A day played nine times faster ranked a diurnal trace's settings unlike the whole day.
ETA = 3
RUNG_SHARES = (1 / ETA,)  # the share of the trace's requests in each rung before the last
SCREENED = 0.6  # the share of the budget successive halving spends


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
    results: Path | None,
    pool: TrialPool | None = None,
    seed: int = 0,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[list[dict[str, Any]], bool]:
    """Spend a budget of `trials` whole-trace runs in `pool` (None: this process); returns
    the whole-trace trials and whether the search ran to its end (False: interrupted). Each
    is appended to `results` as it lands (None: none kept but those returned); `progress`
    sees every run as it lands, a share of the trace's too (`fraction`). The pool stays
    open: its owner closes it."""
    pool = pool if pool is not None else LocalPool(1)
    rng = random.Random(seed)
    done: list[dict[str, Any]] = []
    landing: list[tuple[int, dict[str, Any]]] = []  # the round in flight, as it lands
    seen: set[tuple[int, ...]] = set()
    point_of: dict[str, tuple[int, ...]] = {}
    if results is not None:
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text("")

    def run(points: list[tuple[int, ...]], fraction: float) -> list[dict[str, Any]]:
        seen.update(points)
        settings = [space.setting(p) for p in points]
        point_of.update((_key(asdict(st)), p) for st, p in zip(settings, points, strict=True))
        landing.clear()
        for index, trial in pool.run(problem, [(st, fraction) for st in settings]):
            landing.append((index, trial))
            if fraction == 1.0 and results is not None:
                with results.open("a") as f:
                    f.write(json.dumps(trial) + "\n")
            if progress is not None:
                progress(trial)
        landed = [trial for _, trial in sorted(landing, key=lambda it: it[0])]
        landing.clear()
        if fraction == 1.0:
            done.extend(landed)
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
        pool.close()
        done.extend(trial for _, trial in landing if "fraction" not in trial)
        print(f"\ninterrupted: {len(done)} trials kept in {results}", file=sys.stderr)
        return done, False
    return done, True
