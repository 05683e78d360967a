"""EngineMetricsBoard: the latest metrics of every engine replica of an app (of each model
it serves), for the ingress's `/metrics`; a table of the app's AppTables (cluster/app_tables.py).
Engine replicas push to it on their own period whether a cluster controller runs or not, so
engine metrics do not depend on the controller (disabled, or restarting)."""

from __future__ import annotations

import time

from cluster.control import ControlDecision, ReplicaStats
from serve_app.observability.telemetry import render_engine_metrics


class EngineMetricsBoard:
    def __init__(self, stale_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        self._latest: dict[str, tuple[float, str, ReplicaStats, ControlDecision]] = {}

    async def push(self, model_name: str, stats: ReplicaStats, decision: ControlDecision) -> None:
        self._latest[stats.replica_id] = (time.monotonic(), model_name, stats, decision)

    async def render(self) -> bytes:
        """Prometheus text of the replicas heard from within stale_after_s (a replica that
        went away drops out)."""
        now = time.monotonic()
        for replica_id, (at, *_) in list(self._latest.items()):
            if now - at > self.stale_after_s:
                del self._latest[replica_id]
        return render_engine_metrics([row[1:] for row in self._latest.values()])
