"""The tuner's speed in each pool: `python -m loadtests.bench_tune --ray [--duration 3600]`.

One search, the whole grid of STATIC_SPACE's 24 settings on a diurnal trace (so every pool
runs the same trials), in replica-hours simulated per minute of wall time: local processes
(1 and 2), Ray tasks on a local single-node Ray (1 and 2 in flight), and Ray tasks on a
3-node local cluster (ray.cluster_utils: a head without CPUs and two workers of one CPU
each, so every trial runs on a worker node). Each Ray figure against the local pool of as
many workers, measured in the same run; the trials of every pool must equal the first's.
Ray's start is not counted (a cluster is up before a search); worker processes' start is,
in both kinds of pool.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cluster.request_records import Slo
from cluster.tune.problem import Problem
from cluster.tune.search import search
from cluster.tune.space import Space
from cluster.tune.trial_pool import LocalPool, TrialPool
from cluster.workload import named_workload
from engine.runner.cost_model import GPUS, MODELS, CostParams

SPACE = {
    "max_num_seqs": [16, 32, 64, 128, 256, 512],
    "max_num_batched_tokens": [1024, 2048, 4096, 8192],
}


def _timed(problem: Problem, pool: TrialPool, out: Path) -> tuple[float, list[dict[str, Any]]]:
    space = Space.of(SPACE)
    started = time.perf_counter()
    trials, _ = search(problem, space, space.size, out, pool)
    return time.perf_counter() - started, trials


def _figures(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in t.items() if k != "wall_s"} for t in trials]


def run(duration_s: float, rate: float, out: Path) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    from cluster.tune.ray_pool import RayPool

    trace = named_workload("diurnal", rate, duration_s, seed=0)
    problem = Problem(
        trace, MODELS["Llama-2-7B"], GPUS["A100-80GB"], CostParams(), Slo(ttft_s=2.0, itl_s=0.1)
    )
    rows: list[dict[str, Any]] = []
    first: list[dict[str, Any]] | None = None

    def measure(kind: str, workers: int, pool: TrialPool, nodes: Callable[[], int]) -> None:
        nonlocal first
        wall, trials = _timed(problem, pool, out / "trials.jsonl")
        hours = sum(t["replica_hours"] for t in trials)
        first = first or _figures(trials)
        rows.append(
            {
                "pool": kind,
                "workers": workers,
                "nodes": nodes(),
                "wall_s": wall,
                "replica_hours_per_min": hours / wall * 60,
                "same_trials": _figures(trials) == first,
            }
        )
        print(f"{kind} x{workers}: {wall:.1f} s", file=sys.stderr)

    for workers in (1, 2):
        with LocalPool(workers) as pool:
            measure("local", workers, pool, lambda: 1)
    ray.init(address="local", num_cpus=2, object_store_memory=256 << 20, log_to_driver=False)
    try:
        for workers in (1, 2):
            with RayPool(limit=workers) as pool:
                measure("ray, 1 node", workers, pool, lambda p=pool: len(p.nodes))
    finally:
        ray.shutdown()
    store = 256 << 20
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": store}
    )
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, object_store_memory=store)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        with RayPool() as pool:
            measure("ray, 3 nodes", 2, pool, lambda p=pool: len(p.nodes))
    finally:
        ray.shutdown()
        cluster.shutdown()
    local = {r["workers"]: r["replica_hours_per_min"] for r in rows if r["pool"] == "local"}
    for r in rows:
        r["vs_local"] = r["replica_hours_per_min"] / local[r["workers"]]
    return {
        "trace": f"diurnal at {rate:g} req/s for {duration_s:g} s ({len(trace)} requests)",
        "settings": Space.of(SPACE).size,
        "cpus": os.cpu_count(),
        "rows": rows,
    }


def write_report(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# The tuner's speed: local processes against Ray tasks",
        "",
        f"{result['settings']} settings, each on {result['trace']}; Llama-2-7B on A100-80GB; "
        f"this host has {result['cpus']} CPUs.",
        "",
        "| pool | workers | nodes that ran trials | wall (s) | replica-hours/min | vs local "
        "| same trials |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['pool']} | {r['workers']} | {r['nodes']} | {r['wall_s']:.1f} "
            f"| {r['replica_hours_per_min']:.0f} | {r['vs_local']:.2f}x "
            f"| {'yes' if r['same_trials'] else 'NO'} |"
        )
    (out / "pools.md").write_text("\n".join(lines) + "\n")
    (out / "pools.json").write_text(json.dumps(result, indent=1) + "\n")
