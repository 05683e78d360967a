"""ClusterController: one per application, the home of ClusterControl (cluster/control.py).

Design: engine replicas push a ReplicaStats every `report_interval_s` and get their
ControlDecision (SchedulerLimits, throttle, routing weight) in the reply of that same call.
One call per period, started by the replica, so:
- the controller needs no list of replicas and no handles to them: replicas that Serve adds
  or removes (autoscaling, crashes) appear with their first report and drop out when their
  reports stop (`stale_after_s`);
- a controller that dies costs nothing but the decisions: replicas keep their last limits,
  their calls time out, and the restarted controller rebuilds its view from the next reports.

Settings applied to the running app (POST /v1/cluster/settings: its policy, limits and
token budget) it reads from the model's record (cluster/live_settings.py) when it starts and
about every SETTINGS_CHECK_S after, so a restart keeps them. With deploy.yaml `tuning.auto`
it also runs the model's self-tuning (cluster/tuning_loop.py), which writes that record.

It is a Serve deployment with one replica rather than a bare named actor: Serve gives it a
name inside the app, restarts it when it dies (health-checked, like `max_restarts` plus
liveness), and removes it with the app. A detached actor would outlive `serve shutdown`; a
non-detached one made by a replica would die with that replica on scale-down.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ray import serve

from cluster import live_settings
from cluster.app_tables import Table
from cluster.batching import policy_factory
from cluster.control import ClusterControl, ControlDecision, ReplicaStats
from cluster.tuning_loop import TuningLoop

DEPLOYMENT_NAME = "ClusterController"
SETTINGS_CHECK_S = 1.0  # how often it looks for settings applied to the running app


@serve.deployment(name=DEPLOYMENT_NAME, num_replicas=1, max_ongoing_requests=1000)
class ClusterController:
    def __init__(
        self,
        batching: dict[str, Any],
        max_num_seqs: int,
        stale_after_s: float,
        engine_deployment: str,
        deployed: str,
        tuning: dict[str, Any] | None = None,
        traffic_trace: Table | None = None,
    ) -> None:
        """`batching`: deploy.yaml's `batching:` as deployed; `engine_deployment`: the name
        of the deployment whose replicas report here; `deployed`: the fingerprint of the
        model's args (cluster/live_settings.py); `tuning`: self-tuning's plan
        (serve_app.tuning_args.tuning_plan; None: off), run on `traffic_trace`'s rows."""
        self.control = ClusterControl(
            policy_factory(batching, max_num_seqs), stale_after_s=stale_after_s
        )
        self.started_at = time.time()
        self.policy, self.version = batching["policy"], 0
        context = serve.get_replica_context()
        self.record_key = live_settings.key(context.app_name, engine_deployment)
        self.deployed = deployed
        self.checked_at = time.monotonic()
        self._apply(live_settings.read(self.record_key, self.deployed))
        self.tuning = None
        if tuning is not None and traffic_trace is not None:
            self.tuning = TuningLoop(tuning, traffic_trace, self.record_key)
            self._tuning_task = asyncio.get_running_loop().create_task(self.tuning.run())

    async def _take_settings(self, now: float) -> None:
        """Look for settings applied to the running app, at most every SETTINGS_CHECK_S. The
        record is read off the event loop: a GCS call that waits while the GCS is slow
        would hold every replica's report."""
        if now - self.checked_at < SETTINGS_CHECK_S:
            return
        self.checked_at = now
        self._apply(await asyncio.to_thread(live_settings.read, self.record_key, self.deployed))

    def _apply(self, applied: live_settings.LiveSettings | None) -> None:
        """Run every replica under the model's applied settings, if newer than those in
        force, from its next report on."""
        if applied is None or applied.version == self.version:
            return
        factory = policy_factory(applied.batching, applied.max_num_seqs)
        self.control.retune(factory, applied.max_num_batched_tokens)
        self.policy, self.version = applied.batching["policy"], applied.version

    async def report(self, stats: ReplicaStats) -> ControlDecision:
        now = time.monotonic()
        await self._take_settings(now)
        return self.control.report(stats, now)

    async def status(self) -> dict[str, Any]:
        now = time.monotonic()
        await self._take_settings(now)
        view = self.control.view(now)
        view["controller_uptime_s"] = round(time.time() - self.started_at, 3)
        view["policy"], view["settings_version"] = self.policy, self.version
        if self.tuning is not None:
            view["tuning"] = self.tuning.view()
        return view

    async def tuning_view(self) -> dict[str, Any] | None:
        """Self-tuning's counts and setting (None: off)."""
        return self.tuning.view() if self.tuning is not None else None
