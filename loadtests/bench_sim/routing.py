"""KV-aware routing against the hash of the first 64 prompt tokens and plain least-loaded
routing in the simulator (issue 59, item 5): multi-turn conversations sharing a 512-token
system prompt (cluster/conversations.py) over N replicas with prefix caching, the routing
rules the app's router applies (cluster/prefix_routing.py). For each rule: goodput (the
highest rate of new conversations at which >= 90% of requests meet a TTFT and an ITL SLO), and
at the least-loaded rule's goodput the share of prompt tokens found cached, TTFT p50 and p99.

    python -m loadtests.bench_sim routing [--gpus 4] [--json] [--quick]
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from cluster.cluster_sim import ClusterSimConfig, ClusterSimulator
from cluster.conversations import make_conversations
from cluster.prefix_routing import PrefixRouting
from cluster.request_records import Slo
from cluster.sim_config import SimConfig
from cluster.simulator import highest_rate
from cluster.workload import SimRequest
from engine.runner.cost_model import GPUS, MODELS

TARGET = 0.9  # of requests meeting the SLO
RULES: dict[str, PrefixRouting | None] = {
    "least-loaded": None,
    "hash-64": PrefixRouting(),
    "kv-aware": PrefixRouting(kv_aware=True),
}
SLOS = {"ttft-1s": Slo(ttft_s=1.0, itl_s=0.05)}


def _trace(rate: float, duration_s: float) -> list[SimRequest]:
    """Conversations starting over `duration_s` at `rate` per second (20 at least)."""
    return make_conversations(max(int(rate * duration_s), 20), rate, seed=1)


def run_routing(
    gpus: int = 4,
    model: str = "Llama-3.1-8B",
    gpu: str = "H100-80GB",
    quick: bool = False,
    slos: tuple[str, ...] = tuple(SLOS),
) -> dict[str, Any]:
    duration_s, iters = (15.0, 3) if quick else (30.0, 4)
    base = SimConfig(MODELS[model], GPUS[gpu]).with_cache(enable_prefix_caching=True)
    rows = []
    for slo_name in slos:
        config = replace(base, slo=SLOS[slo_name])

        def run(rule: PrefixRouting | None, rate: float, config: SimConfig = config) -> dict:
            setup = ClusterSimConfig(config, initial_replicas=gpus, prefix_routing=rule)
            return ClusterSimulator(setup).run(_trace(rate, duration_s)).summary()

        def goodput(rule: PrefixRouting | None) -> float:
            def meets(rate: float) -> bool:
                return run(rule, rate)["sla_attainment"] >= TARGET

            return highest_rate(meets, start=4.0, iters=iters)

        capacities = {name: goodput(rule) for name, rule in RULES.items()}
        at = capacities["least-loaded"]
        at_rate = {name: run(rule, at) for name, rule in RULES.items()}
        rows.append(
            {
                "slo": slo_name,
                "goodput_conversations_s": capacities,
                "kv_aware_over_hash": capacities["kv-aware"] / max(capacities["hash-64"], 1e-9),
                "at_conversations_s": at,
                "prefix_hit_rate": {n: s.get("prefix_hit_rate", 0.0) for n, s in at_rate.items()},
                "ttft_p50_ms": {n: 1e3 * s["ttft_p50_s"] for n, s in at_rate.items()},
                "ttft_p99_ms": {n: 1e3 * s["ttft_p99_s"] for n, s in at_rate.items()},
            }
        )
    return {"model": model, "gpu": gpu, "gpus": gpus, "target": TARGET, "rows": rows}


def describe(result: dict[str, Any]) -> str:
    lines = [
        f"{result['gpus']}x {result['gpu']}, {result['model']}, conversations sharing a "
        f"system prompt: goodput (new conversations/s, >= {result['target']:.0%} of requests "
        "within the SLO) by routing rule; at the least-loaded rule's goodput, prompt tokens "
        "found cached and TTFT p50 / p99",
        "| SLO | rule | goodput | prompt tokens cached | TTFT p50 (ms) | TTFT p99 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        for name, capacity in r["goodput_conversations_s"].items():
            lines.append(
                f"| {r['slo']} | {name} | {capacity:.1f} | {r['prefix_hit_rate'][name]:.1%} | "
                f"{r['ttft_p50_ms'][name]:.0f} | {r['ttft_p99_ms'][name]:.0f} |"
            )
    return "\n".join(lines)
