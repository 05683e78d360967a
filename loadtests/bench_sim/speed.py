"""How fast the simulator runs (`bench_sim speed`): simulated replica-hours per minute of wall
time, with the decode cohort (SimConfig.decode_cohort) and, as the baseline in the
same run, stepping every step; the two must agree on every request's finish time.

Two workloads: one replica at a steady Poisson rate (`--hours`, `--rate`), and the
autoscaling study's diurnal trace served by the queue-depth rule's default setting
(loadtests/bench_autoscale.py), the shape of a fleet a user tunes.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from cluster.cluster_sim import ClusterSimConfig, ClusterSimulator
from cluster.sim_config import SimConfig
from cluster.simulator import Simulator
from cluster.workload import CHAT_OUTPUT, CHAT_PROMPT, make_workload
from engine.runner.cost_model import GPUS, MODELS
from loadtests.bench_autoscale import SETTINGS, study_replica, study_trace

# One replica's capacity in the autoscaling study (A100-80GB, Llama-2-7B, max_num_seqs 128,
# >= 90% within TTFT 2 s and ITL 100 ms), as `bench_sim autoscale` measures it.
AUTOSCALE_CAPACITY_RPS = 13.0


def _timed(run) -> tuple[Any, float]:
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start


def _figures(result, wall: float, replica_hours: float) -> dict[str, Any]:
    s = result.summary()
    return {
        "wall_s": wall,
        "replica_hours": replica_hours,
        "replica_hours_per_minute": replica_hours / wall * 60.0,
        "finished": s["finished"],
        "steps": s.get("steps"),
        "cohort_steps": s.get("cohort_steps"),
    }


def _same(a, b) -> bool:
    key = lambda r: (r.first_token_s, r.finish_s, r.num_output)  # noqa: E731
    return {k: key(r) for k, r in a.records.items()} == {k: key(r) for k, r in b.records.items()}


def single_replica(hours: float, rate: float, reference: bool) -> dict[str, Any]:
    n = int(hours * 3600 * rate)
    config = SimConfig(MODELS["Llama-2-7B"], GPUS["H100-80GB"]).with_scheduler(max_num_seqs=256)
    trace = make_workload(n, rate, "poisson", CHAT_PROMPT, CHAT_OUTPUT, seed=0)
    fast, wall = _timed(lambda: Simulator(config).run(trace))
    out = {
        "workload": f"one H100-80GB replica of Llama-2-7B, {rate:g} requests/s, {n} requests",
        "requests": n,
        "simulated_s": fast.duration_s,
        "output_tok_s": fast.summary()["output_tok_s"],
        "cohort": _figures(fast, wall, fast.duration_s / 3600.0),
    }
    if reference:
        slow, wall = _timed(lambda: Simulator(replace(config, decode_cohort=False)).run(trace))
        out["stepping"] = _figures(slow, wall, slow.duration_s / 3600.0)
        out["equal"] = _same(fast, slow)
    return out


def autoscaled_fleet(duration_s: float, reference: bool) -> dict[str, Any]:
    replica = study_replica()
    trace, _ = study_trace(AUTOSCALE_CAPACITY_RPS, duration_s)
    rule = next(rule for name, rule, _ in SETTINGS if name == "rule: default")

    def run(cohort: bool):
        config = ClusterSimConfig(replace(replica, decode_cohort=cohort), rule, 1, 60.0)
        return ClusterSimulator(config).run(trace)

    fast, wall = _timed(lambda: run(True))
    hours = fast.summary()["replica_hours"]
    out = {
        "workload": f"autoscaling study: diurnal {len(trace)} requests over {duration_s:g} s, "
        "rule: default",
        "requests": len(trace),
        "cohort": _figures(fast, wall, hours),
    }
    if reference:
        slow, wall = _timed(lambda: run(False))
        out["stepping"] = _figures(slow, wall, slow.summary()["replica_hours"])
        out["equal"] = _same(fast, slow)
    return out


def run_speed(hours: float, rate: float, reference: bool = True) -> dict[str, Any]:
    runs = [single_replica(hours, rate, reference), autoscaled_fleet(1800.0 * hours, reference)]
    for r in runs:
        if reference:
            r["speedup"] = r["stepping"]["wall_s"] / r["cohort"]["wall_s"]
    first = runs[0]["cohort"]
    return {
        "replica_hours_per_minute": first["replica_hours_per_minute"],
        "wall_s": first["wall_s"],
        "workloads": runs,
    }


def describe(result: dict[str, Any]) -> str:
    lines = []
    for r in result["workloads"]:
        fast = r["cohort"]
        line = (
            f"{r['workload']}: {fast['replica_hours']:.2f} replica-hours in {fast['wall_s']:.1f} s "
            f"= {fast['replica_hours_per_minute']:.2f} replica-hours/min"
        )
        if fast["steps"] is not None:
            line += f" ({fast['cohort_steps']} of {fast['steps']} steps in runs)"
        if "stepping" in r:
            slow = r["stepping"]
            line += (
                f"; stepping {slow['wall_s']:.1f} s = {slow['replica_hours_per_minute']:.2f}/min, "
                f"{r['speedup']:.2f}x, results {'equal' if r['equal'] else 'DIFFERENT'}"
            )
        lines.append(line)
    return "\n".join(lines)
