"""EngineMetricsBoard: the latest metrics of every engine replica, for the ingress's
`/metrics`. Engine replicas push to it on their own period whether a cluster controller runs
or not, so engine metrics do not depend on the controller (disabled, or restarting)."""

from __future__ import annotations

import time

from ray import serve

from cluster.control import ControlDecision, ReplicaStats
from serve_app.observability.telemetry import render_engine_metrics


@serve.deployment(name="EngineMetricsBoard", num_replicas=1, max_ongoing_requests=1024)
class EngineMetricsBoard:
    def __init__(self, model_name: str, stale_after_s: float) -> None:
        self.model_name = model_name
        self.stale_after_s = stale_after_s
        self._latest: dict[str, tuple[float, ReplicaStats, ControlDecision]] = {}

    async def push(self, stats: ReplicaStats, decision: ControlDecision) -> None:
        self._latest[stats.replica_id] = (time.monotonic(), stats, decision)

    async def render(self) -> bytes:
        """Prometheus text of the replicas heard from within stale_after_s (a replica that
        went away drops out)."""
        now = time.monotonic()
        for replica_id, (at, _, _) in list(self._latest.items()):
            if now - at > self.stale_after_s:
                del self._latest[replica_id]
        rows = [(stats, decision) for _, stats, decision in self._latest.values()]
        return render_engine_metrics(self.model_name, rows)
