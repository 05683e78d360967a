"""Migration on drain in the simulator (issue 59, item 5): the autoscaling study's day
(loadtests/bench_autoscale.py: a diurnal trace from 0.3x to 2.5x of one replica's capacity
and a burst, the default rule) with the replicas a scale-down removes either finishing their
streams (Serve's graceful drain) or moving them with their KV to the others
(`ClusterSimConfig.migration`, 50 GB/s and 2 ms a sequence), on chat and on long outputs
(1,000-2,000 tokens, as reasoning models write): replica-hours, replica-time spent draining,
sequences moved, SLO attainment and p99 ITL of both.

    python -m loadtests.bench_sim migration [--duration 1800] [--json]
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from cluster.cluster_sim import ClusterSimConfig, ClusterSimResult, ClusterSimulator
from cluster.kv_transfer import KVTransfer
from cluster.simulator import capacity
from cluster.workload import CHAT_OUTPUT, LengthDist, make_workload
from loadtests.bench_autoscale import SETTINGS, study_replica, study_trace

OUTPUTS = {"chat": CHAT_OUTPUT, "long-output": LengthDist("uniform", 1000, 2000)}


def draining_seconds(result: ClusterSimResult) -> float:
    """Replica-seconds spent draining (no new requests, streams still running)."""
    s = result.replica_series
    return sum((b[0] - a[0]) * a[3] for a, b in zip(s, s[1:], strict=False))


def run_migration(duration_s: float = 1800.0) -> dict[str, Any]:
    _, rule, initial = next(s for s in SETTINGS if s[0] == "rule: default")
    replica = study_replica()
    rows = []
    for workload, output in OUTPUTS.items():
        # One replica's capacity on it (requests/s within the SLO), as the study measures it.
        cap = capacity(
            replica,
            lambda r, out=output: make_workload(int(r * 120), rate=r, output=out, seed=1),
            start=1.0,
            iters=3,
        )
        trace, _ = study_trace(cap, duration_s, seed=1)
        rng = random.Random(2)  # the study's arrivals and prompts, these answers' lengths
        trace = [replace(r, output_len=output.sample(rng)) for r in trace]
        results = {}
        for name, migration in (("drain", None), ("migrate", KVTransfer())):
            setup = ClusterSimConfig(
                replica, rule, initial, startup_delay_s=60.0, migration=migration
            )
            result = ClusterSimulator(setup).run(trace)
            summary = result.summary()
            results[name] = {
                "replica_hours": summary["replica_hours"],
                "draining_replica_s": draining_seconds(result),
                "scale_downs": summary["scale_downs"],
                "moved": summary.get("moved", 0),
                "move_ms_mean": summary.get("move_ms_mean", 0.0),
                "sla_attainment": summary["sla_attainment"],
                "itl_p99_ms": 1e3 * summary["itl_p99_s"],
            }
        rows.append(
            {"workload": workload, "replica_capacity_rps": cap, "requests": len(trace), **results}
        )
    return {"model": "Llama-2-7B", "gpu": "A100-80GB", "duration_s": duration_s, "rows": rows}


def describe(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']} on {result['gpu']}, a {result['duration_s']:.0f} s day, the default "
        "rule: replicas removed finish their streams (drain) or move them with their KV (migrate)",
        "| workload | removal | replica-hours | draining (replica-s) | scale-downs | moved "
        "| move (ms) | SLO met | ITL p99 (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        for name in ("drain", "migrate"):
            x = r[name]
            lines.append(
                f"| {r['workload']} | {name} | {x['replica_hours']:.3f} | "
                f"{x['draining_replica_s']:.0f} | {x['scale_downs']} | {x['moved']} | "
                f"{x['move_ms_mean']:.1f} | {x['sla_attainment']:.1%} | {x['itl_p99_ms']:.1f} |"
            )
    return "\n".join(lines)
