"""Autoscaling on queue depth: a pure rule (replica loads -> desired replica count), and its
adapter to Ray Serve's custom autoscaling policy hook.

The rule, per decision (Serve calls it about every 0.1 s; the simulator on its own period):
- Up: the mean waiting queue per replica is above `target_waiting`, or mean KV usage above
  `upscale_kv_usage`, without a break for `upscale_delay_s`. The count needed is the serving
  replicas scaled by demand over what they run, n_serving * (running + waiting) / running
  (at least one more than serve now): a replica that runs 128 requests with 30 queued needs a
  quarter more capacity, not 30 / target_waiting times more. Replicas still starting count:
  if the target already covers the need, nothing is added while they start.
- Down: the mean queue is at most `downscale_waiting`, KV usage below the upscale mark, and the
  running requests would fit in n - 1 replicas at `downscale_utilization` of their batch
  limit, without a break for `downscale_delay_s`. One replica at a time.
- Between the two marks nothing happens (hysteresis), and each move restarts its delay, so a
  noisy but steady load does not flap and a scale-up is not repeated while new replicas start.
- Always within [min_replicas, max_replicas].

The mean divides by the target count, not the reporting replicas: replicas still starting
count as capacity on the way, which stops repeated scale-ups during their start-up.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from cluster import live_settings

# Names of the per-replica metrics EngineServer.record_autoscaling_stats() reports.
METRIC_WAITING = "waiting"
METRIC_RUNNING = "running"
METRIC_KV_USAGE = "kv_usage"
METRIC_MAX_NUM_SEQS = "max_num_seqs"


@dataclass(frozen=True)
class AutoscaleConfig:
    min_replicas: int = 1
    max_replicas: int = 4
    target_waiting: float = 4.0
    upscale_kv_usage: float = 0.9
    downscale_waiting: float = 0.5
    downscale_utilization: float = 0.5
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas}, "
                f"{self.max_replicas}"
            )
        if not 0 <= self.downscale_waiting < self.target_waiting:
            raise ValueError("need 0 <= downscale_waiting < target_waiting (the hysteresis band)")
        if not 0 < self.downscale_utilization <= 1 or not 0 < self.upscale_kv_usage <= 1:
            raise ValueError("downscale_utilization and upscale_kv_usage must be in (0, 1]")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("delays must be >= 0")

    def clamp(self, n: int) -> int:
        return min(max(n, self.min_replicas), self.max_replicas)


@dataclass(frozen=True)
class ReplicaLoad:
    waiting: float
    running: float
    kv_usage: float
    max_num_seqs: float


@dataclass
class QueueDepthRule:
    config: AutoscaleConfig
    up_since: float | None = None
    down_since: float | None = None
    last_reason: str = ""

    def desired(self, now: float, current: int, loads: list[ReplicaLoad]) -> int:
        """The replica count to aim for, given the current target count and replica loads."""
        c = self.config
        n = max(current, 1)
        if not loads:  # no metrics yet: only enforce the bounds
            self.up_since = self.down_since = None
            return c.clamp(current)
        mean_waiting = sum(x.waiting for x in loads) / n
        mean_kv = sum(x.kv_usage for x in loads) / len(loads)
        running = sum(x.running for x in loads)
        batch = sum(x.max_num_seqs for x in loads) / len(loads)
        up = current < c.max_replicas and (
            mean_waiting > c.target_waiting or mean_kv > c.upscale_kv_usage
        )
        down = (
            current > c.min_replicas
            and mean_waiting <= c.downscale_waiting
            and mean_kv <= c.upscale_kv_usage
            and running <= c.downscale_utilization * (n - 1) * batch
        )
        if up:
            self.down_since = None
            self.up_since = now if self.up_since is None else self.up_since
            # What the serving replicas run now, scaled to the demand (running + waiting).
            needed = len(loads) + 1
            if running > 0:
                demand = running + mean_waiting * n
                needed = max(needed, math.ceil(len(loads) * demand / running))
            if now - self.up_since >= c.upscale_delay_s and needed > current:
                self.up_since = None
                self.last_reason = (
                    f"up: waiting/replica {mean_waiting:.1f} > {c.target_waiting} "
                    f"or kv {mean_kv:.2f} > {c.upscale_kv_usage}; {needed} needed"
                )
                return c.clamp(needed)
        elif down:
            self.up_since = None
            self.down_since = now if self.down_since is None else self.down_since
            if now - self.down_since >= c.downscale_delay_s:
                self.down_since = None
                self.last_reason = (
                    f"down: waiting/replica {mean_waiting:.1f}, {running:.0f} running fit in "
                    f"{n - 1} replicas"
                )
                return c.clamp(n - 1)
        else:
            self.up_since = self.down_since = None
        return c.clamp(current)


class QueueDepthAutoscaler:
    """Ray Serve's `autoscaling_config.policy.policy_function` (a class: Serve builds it once
    with `policy_kwargs`, then calls it with an AutoscalingContext about every 0.1 s).

    Serve applies its own upscale/downscale delays after this returns; the app sets them to 0
    because the rule keeps its own (so the simulator, which runs the rule alone, matches).

    Settings applied to the running app (cluster/live_settings.py) replace the rule's config
    within SETTINGS_CHECK_S of their apply, keeping its timers; Serve still holds the count
    within the deployed min_replicas and max_replicas.
    """

    SETTINGS_CHECK_S = 1.0

    def __init__(self, deployed: str = "", **config: Any) -> None:
        self.rule = QueueDepthRule(AutoscaleConfig(**config))
        self.deployed = deployed  # the fingerprint of the model's args as deployed
        self.settings_version = 0
        self.checked_at = -math.inf

    def _take_settings(self, ctx: Any, now: float) -> None:
        if now - self.checked_at < self.SETTINGS_CHECK_S or not ctx.app_name:
            return
        self.checked_at = now
        record_key = live_settings.key(ctx.app_name, ctx.deployment_name)
        applied = live_settings.read(record_key, self.deployed)
        if applied is None or applied.version == self.settings_version:
            return
        if applied.autoscaling is not None:
            self.rule.config = AutoscaleConfig(**applied.autoscaling)
        self.settings_version = applied.version

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = ctx.current_time if ctx.current_time is not None else time.time()
        self._take_settings(ctx, now)
        metrics = ctx.aggregated_metrics or {}
        loads = loads_from_metrics(metrics)
        desired = self.rule.desired(now, ctx.target_num_replicas, loads)
        state = dict(ctx.policy_state or {})
        state["queue_depth_rule"] = {
            "up_since": self.rule.up_since,
            "down_since": self.rule.down_since,
            "last_reason": self.rule.last_reason,
            "config": asdict(self.rule.config),
            "settings_version": self.settings_version,
        }
        return desired, state


def loads_from_metrics(metrics: dict[str, dict[Any, float]]) -> list[ReplicaLoad]:
    """Per-replica loads from Serve's aggregated custom metrics (replicas that sent them all)."""
    waiting = metrics.get(METRIC_WAITING, {})
    running = metrics.get(METRIC_RUNNING, {})
    kv = metrics.get(METRIC_KV_USAGE, {})
    seqs = metrics.get(METRIC_MAX_NUM_SEQS, {})
    return [
        ReplicaLoad(waiting[r], running[r], kv[r], seqs[r])
        for r in waiting
        if r in running and r in kv and r in seqs
    ]
