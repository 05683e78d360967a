"""ClusterController: one per application, the home of ClusterControl (cluster/control.py).

Design: engine replicas push a ReplicaStats every `report_interval_s` and get their
ControlDecision (SchedulerLimits, throttle, routing weight) in the reply of that same call.
One call per period, started by the replica, so:
- the controller needs no list of replicas and no handles to them: replicas that Serve adds
  or removes (autoscaling, crashes) appear with their first report and drop out when their
  reports stop (`stale_after_s`);
- a controller that dies costs nothing but the decisions: replicas keep their last limits,
  their calls time out, and the restarted controller rebuilds its view from the next reports.

It is a Serve deployment with one replica rather than a bare named actor: Serve gives it a
name inside the app, restarts it when it dies (health-checked, like `max_restarts` plus
liveness), and removes it with the app. A detached actor would outlive `serve shutdown`; a
non-detached one made by a replica would die with that replica on scale-down.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ray import serve

from cluster.batching import AnyPolicy
from cluster.control import ClusterControl, ControlDecision, ReplicaStats

DEPLOYMENT_NAME = "ClusterController"


@serve.deployment(name=DEPLOYMENT_NAME, num_replicas=1, max_ongoing_requests=1000)
class ClusterController:
    def __init__(self, make_policy: Callable[[], AnyPolicy], stale_after_s: float) -> None:
        self.control = ClusterControl(make_policy, stale_after_s=stale_after_s)
        self.started_at = time.time()

    async def report(self, stats: ReplicaStats) -> ControlDecision:
        return self.control.report(stats, time.monotonic())

    async def status(self) -> dict[str, Any]:
        view = self.control.view(time.monotonic())
        view["controller_uptime_s"] = round(time.time() - self.started_at, 3)
        return view
