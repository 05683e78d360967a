"""What every trial of a search shares (the trace, the replica's model and GPU, the SLO) and
one trial: a Setting simulated on the trace, or on the trace's day played faster."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from cluster.cluster_sim import ClusterSimulator
from cluster.request_records import Slo
from cluster.tune.space import Setting
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


# A setting and the share of the trace it runs on (1/k: the day k times faster).
Job = tuple[Setting, float]
