"""Autoscaling policies compared in the cluster simulator (`bench_sim autoscale`).

A diurnal trace (trough at the start and end, peak in the middle, a burst on the rising
edge) is served by fixed fleets sized for the trough and for the peak, and by the
queue-depth rule at several settings; each run reports replica-hours spent and SLA
attainment, which is how a user picks the rule's knobs before deploying it. Rates are set
in units of one replica's capacity (measured first by the simulator), so the scenario keeps
its shape on any model and GPU.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cluster.autoscale import AutoscaleConfig
from cluster.cluster_sim import ClusterSimConfig, ClusterSimulator
from cluster.request_records import Slo
from cluster.sim_config import SimConfig
from cluster.simulator import capacity
from cluster.workload import Burst, SimRequest, diurnal_rate, make_diurnal_workload, make_workload
from engine.runner.cost_model import GPUS, MODELS
from loadtests.plotting import pyplot

# (name, autoscale config or None for a fixed fleet, initial replicas)
SETTINGS: list[tuple[str, AutoscaleConfig | None, int]] = [
    ("fixed 1 (trough)", None, 1),
    ("fixed 4 (peak)", None, 4),
    (
        "rule: aggressive",
        AutoscaleConfig(1, 6, target_waiting=2, upscale_delay_s=5, downscale_delay_s=30),
        1,
    ),
    (
        "rule: default",
        AutoscaleConfig(1, 6, target_waiting=4, upscale_delay_s=10, downscale_delay_s=60),
        1,
    ),
    (
        "rule: conservative",
        AutoscaleConfig(1, 6, target_waiting=16, upscale_delay_s=30, downscale_delay_s=180),
        1,
    ),
]


def study_replica(model: str = "Llama-2-7B", gpu: str = "A100-80GB") -> SimConfig:
    return SimConfig(MODELS[model], GPUS[gpu], slo=Slo(2.0, 0.1)).with_scheduler(max_num_seqs=128)


def study_trace(
    capacity_rps: float, duration_s: float, seed: int = 0
) -> tuple[list[SimRequest], tuple[Burst, ...]]:
    """The diurnal trace in units of one replica's capacity: 0.3x at the trough, 2.5x at the
    peak, a burst of +2x for a thirtieth of it a third of the way in."""
    cap = capacity_rps
    bursts = (Burst(start_s=duration_s / 3, duration_s=duration_s / 30, rate=2.0 * cap),)
    trace = make_diurnal_workload(duration_s, 0.3 * cap, 2.5 * cap, duration_s, bursts, seed=seed)
    return trace, bursts


def run_autoscale(
    duration_s: float = 1800.0,
    startup_delay_s: float = 60.0,
    model: str = "Llama-2-7B",
    gpu: str = "A100-80GB",
    seed: int = 0,
    quick: bool = False,
) -> dict[str, Any]:
    """`quick`: a coarser capacity search (smoke runs)."""
    replica = study_replica(model, gpu)
    started = time.perf_counter()
    seconds, iters = (20, 1) if quick else (120, 4)
    cap = capacity(
        replica, lambda r: make_workload(int(r * seconds), rate=r, seed=1), 2.0, iters=iters
    )
    base, peak = 0.3 * cap, 2.5 * cap
    trace, bursts = study_trace(cap, duration_s, seed)
    rows, series = [], {}
    for name, rule, initial in SETTINGS:
        config = ClusterSimConfig(replica, rule, initial, startup_delay_s=startup_delay_s)
        t0 = time.perf_counter()
        res = ClusterSimulator(config).run(trace)
        s = res.summary()
        rows.append(
            {
                "setting": name,
                "rule": asdict(rule) if rule else None,
                "replica_hours": s["replica_hours"],
                "mean_replicas": s["mean_replicas"],
                "max_replicas": s["max_replicas"],
                "sla_attainment": s["sla_attainment"],
                "ttft_p50_s": s["ttft_p50_s"],
                "ttft_p99_s": s["ttft_p99_s"],
                "itl_p99_s": s["itl_p99_s"],
                "scale_ups": s["scale_ups"],
                "scale_downs": s["scale_downs"],
                "wall_s": time.perf_counter() - t0,
            }
        )
        series[name] = res.replica_series
    return {
        "model": model,
        "gpu": gpu,
        "replica_capacity_rps": cap,
        "trace": {
            "requests": len(trace),
            "duration_s": duration_s,
            "base_rps": base,
            "peak_rps": peak,
            "bursts": [asdict(b) for b in bursts],
            "startup_delay_s": startup_delay_s,
        },
        "rows": rows,
        "series": series,
        "wall_s": time.perf_counter() - started,
    }


def write_report(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tr = result["trace"]
    lines = [
        "# Autoscaling policies (cluster simulator)",
        "",
        f"{result['model']} on {result['gpu']}; one replica's capacity "
        f"{result['replica_capacity_rps']:.1f} req/s (>= 90% within TTFT 2 s, ITL 100 ms). "
        f"Diurnal trace: {tr['requests']} requests over {tr['duration_s']:.0f} s, "
        f"{tr['base_rps']:.1f} -> {tr['peak_rps']:.1f} req/s, a burst of "
        f"+{tr['bursts'][0]['rate']:.1f} req/s for {tr['bursts'][0]['duration_s']:.0f} s at "
        f"{tr['bursts'][0]['start_s']:.0f} s; replica start-up {tr['startup_delay_s']:.0f} s.",
        "",
        "| setting | replica-hours | mean replicas | max | SLA attainment | TTFT p50 s "
        "| TTFT p99 s | ITL p99 ms | ups | downs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['setting']} | {r['replica_hours']:.2f} | {r['mean_replicas']:.2f} "
            f"| {r['max_replicas']} | {100 * r['sla_attainment']:.1f}% | {r['ttft_p50_s']:.2f} "
            f"| {r['ttft_p99_s']:.2f} | {1e3 * r['itl_p99_s']:.0f} | {r['scale_ups']} "
            f"| {r['scale_downs']} |"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, points) in enumerate(result["series"].items()):
        times = [p[0] for p in points] + [tr["duration_s"]]
        counts = [p[1] + p[2] + p[3] for p in points]
        ax.step(times, counts + counts[-1:], where="post", label=name, color=f"C{i}")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("replicas (serving + starting + draining)")
    rate_ax = ax.twinx()
    ts = [tr["duration_s"] * k / 200 for k in range(201)]
    rate = [diurnal_rate(t, tr["base_rps"], tr["peak_rps"], tr["duration_s"]) for t in ts]
    burst = tr["bursts"][0]
    rate = [
        r + (burst["rate"] if burst["start_s"] <= t < burst["start_s"] + burst["duration_s"] else 0)
        for t, r in zip(ts, rate, strict=True)
    ]
    rate_ax.plot(ts, rate, color="grey", linestyle=":", label="arrival rate")
    rate_ax.set_ylabel("arrival rate (req/s)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "replicas_over_time.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, r in enumerate(result["rows"]):
        ax.scatter(r["replica_hours"], 100 * r["sla_attainment"], color=f"C{i}", label=r["setting"])
    ax.set_xlabel("replica-hours")
    ax.set_ylabel("SLA attainment (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "cost_vs_sla.png", dpi=100)
    plt.close(fig)
