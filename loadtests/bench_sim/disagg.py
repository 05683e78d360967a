"""Disaggregated prefill/decode against colocated replicas in the simulator (issue 59, item 5):
goodput (requests/s of which >= 90% meet a TTFT and an ITL SLO) of N colocated replicas with
chunked prefill against every split of the same N GPUs into prefill and decode pools, on a
long-prompt workload and on chat, under a loose and a tight ITL SLO; then, at the colocated
fleet's capacity, the tail ITL (p99 of each request's mean gap) of both.

    python -m loadtests.bench_sim disagg [--json] [--quick]
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from cluster.cluster_sim import ClusterSimConfig, ClusterSimulator
from cluster.disaggregated_sim import DisaggregatedConfig, DisaggregatedSimulator
from cluster.kv_transfer import KVTransfer
from cluster.request_records import Slo
from cluster.sim_config import SimConfig
from cluster.simulator import highest_rate
from cluster.workload import LengthDist, SimRequest, make_workload
from engine.runner.cost_model import GPUS, MODELS

TARGET = 0.9  # of requests meeting the SLO
WORKLOADS = {  # name: (prompt lengths, output lengths); None: ShareGPT-like lognormals
    "long-prompt": (LengthDist("uniform", 2000, 6000), LengthDist("uniform", 100, 300)),
    "chat": (None, None),
}
# Colocated replicas' token budgets tried (smaller chunks: shorter steps beside a prefill,
# slower prefills), and the prefill pool's.
COLOCATED_TOKENS = (512, 2048)
PREFILL_TOKENS = 8192
SLOS = {"itl-50ms": Slo(ttft_s=2.0, itl_s=0.05), "itl-20ms": Slo(ttft_s=2.0, itl_s=0.02)}


def _trace(workload: str, rate: float, duration_s: float) -> list[SimRequest]:
    """`duration_s` of Poisson arrivals at `rate` (a count of its own at each rate: a fixed
    count at a high rate is one burst, which a fleet drains within any SLO)."""
    prompt, output = WORKLOADS[workload]
    lengths = {} if prompt is None else {"prompt": prompt, "output": output}
    return make_workload(max(int(rate * duration_s), 20), rate, seed=1, **lengths)


def _colocated(config: SimConfig, replicas: int):
    sim = ClusterSimulator(ClusterSimConfig(config, initial_replicas=replicas))
    return lambda trace: sim.run(trace).summary()


def _disaggregated(config: SimConfig, prefill: int, decode: int, transfer: KVTransfer):
    # A prefill replica takes whole long prompts in a step: no decode shares it.
    prefill_config = config.with_scheduler(max_num_batched_tokens=PREFILL_TOKENS)
    setup = DisaggregatedConfig(prefill_config, config, prefill, decode, transfer)
    sim = DisaggregatedSimulator(setup)
    return lambda trace: sim.run(trace).summary()


def run_disagg(
    gpus: int = 4,
    model: str = "Llama-3.1-8B",
    gpu: str = "H100-80GB",
    transfer: KVTransfer | None = None,
    quick: bool = False,
    workloads: tuple[str, ...] = tuple(WORKLOADS),
    slos: tuple[str, ...] = tuple(SLOS),
) -> dict[str, Any]:
    transfer = transfer or KVTransfer()
    duration_s, iters = (20.0, 3) if quick else (60.0, 5)
    base = SimConfig(MODELS[model], GPUS[gpu]).with_scheduler(max_model_len=8192)
    rows = []
    for workload in workloads:
        for slo_name in slos:
            config = replace(base, slo=SLOS[slo_name])
            fleets = {
                f"colocated-{n}": _colocated(config.with_scheduler(max_num_batched_tokens=n), gpus)
                for n in COLOCATED_TOKENS
            }
            for p in range(1, gpus):
                fleets[f"{p}P+{gpus - p}D"] = _disaggregated(config, p, gpus - p, transfer)

            def capacity_of(run, workload: str = workload) -> float:
                def meets(rate: float) -> bool:
                    return run(_trace(workload, rate, duration_s))["sla_attainment"] >= TARGET

                return highest_rate(meets, start=4.0, iters=iters)

            capacities = {name: capacity_of(run) for name, run in fleets.items()}
            colocated = max((n for n in fleets if n.startswith("colocated")), key=capacities.get)
            best = max((n for n in fleets if "P+" in n), key=capacities.__getitem__)
            at = capacities[colocated]  # both fleets' tails at the colocated capacity
            tails = {
                name: fleets[name](_trace(workload, at, duration_s)) for name in (colocated, best)
            }
            rows.append(
                {
                    "workload": workload,
                    "slo": slo_name,
                    "capacity_rps": capacities,
                    "best_colocated": colocated,
                    "best_split": best,
                    "disaggregated_over_colocated": capacities[best] / max(at, 1e-9),
                    "at_rps": at,
                    "itl_p99_ms": [1e3 * s["itl_p99_s"] for s in tails.values()],
                    "ttft_p99_ms": [1e3 * s["ttft_p99_s"] for s in tails.values()],
                    "transfer_ms_mean": tails[best]["transfer_ms_mean"],
                }
            )
    return {
        "model": model,
        "gpu": gpu,
        "gpus": gpus,
        "target": TARGET,
        "transfer_gb_s": transfer.bandwidth_bytes_s / 1e9,
        "transfer_latency_ms": 1e3 * transfer.latency_s,
        "rows": rows,
    }


def describe(result: dict[str, Any]) -> str:
    lines = [
        f"{result['gpus']}x {result['gpu']}, {result['model']}: goodput (req/s, >= "
        f"{result['target']:.0%} within the SLO), the best colocated fleet (token budget) vs "
        "the best prefill/decode split; p99 ITL and TTFT of both at the colocated goodput",
        "| workload | SLO | colocated | its goodput | split | its goodput | ratio "
        "| ITL p99 (ms) | TTFT p99 (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        caps, best, colocated = r["capacity_rps"], r["best_split"], r["best_colocated"]
        itl, ttft = r["itl_p99_ms"], r["ttft_p99_ms"]
        lines.append(
            f"| {r['workload']} | {r['slo']} | {colocated} | {caps[colocated]:.1f} | {best} | "
            f"{caps[best]:.1f} | {r['disaggregated_over_colocated']:.2f}x | "
            f"{itl[0]:.1f} / {itl[1]:.1f} | {ttft[0]:.0f} / {ttft[1]:.0f} |"
        )
    return "\n".join(lines)
