"""The queue-depth autoscaling rule: bounds, delays, hysteresis, no flapping; and its Serve
adapter fed a real ray.serve AutoscalingContext."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from cluster.autoscale import (
    AutoscaleConfig,
    QueueDepthAutoscaler,
    QueueDepthRule,
    ReplicaLoad,
)

CFG = AutoscaleConfig(
    min_replicas=1,
    max_replicas=6,
    target_waiting=4.0,
    downscale_waiting=0.5,
    downscale_utilization=0.5,
    upscale_delay_s=10.0,
    downscale_delay_s=30.0,
)


def loads(n: int, waiting: float, running: float = 32, kv: float = 0.3) -> list[ReplicaLoad]:
    return [ReplicaLoad(waiting, running, kv, 64) for _ in range(n)]


def run(rule: QueueDepthRule, n: int, load_fn, t0: float, t1: float, dt: float = 1.0):
    """Drive the rule from t0 to t1; the count changes at once (start-up is not modelled)."""
    t, history = t0, []
    while t <= t1:
        n = rule.desired(t, n, load_fn(n))
        history.append((t, n))
        t += dt
    return n, history


def test_upscale_needs_the_condition_for_the_whole_delay():
    rule = QueueDepthRule(CFG)
    for t in range(10):  # 0..9 s above target: not yet
        assert rule.desired(float(t), 1, loads(1, waiting=40)) == 1
    # At 10 s: demand over what runs, 1 * (32 + 40) / 32 = 2.25 -> 3.
    assert rule.desired(10.0, 1, loads(1, waiting=40)) == 3
    # A queue just over the target asks for one more, not queue / target more.
    rule = QueueDepthRule(replace(CFG, upscale_delay_s=0))
    assert rule.desired(0.0, 2, loads(2, waiting=5, running=64)) == 3
    # A break in the condition restarts the delay.
    rule = QueueDepthRule(CFG)
    assert rule.desired(0.0, 1, loads(1, waiting=40)) == 1
    assert rule.desired(5.0, 1, loads(1, waiting=2)) == 1  # inside the band: reset
    assert rule.desired(12.0, 1, loads(1, waiting=40)) == 1
    assert rule.desired(22.0, 1, loads(1, waiting=40)) == 3


def test_kv_pressure_alone_scales_up_and_bounds_hold():
    rule = QueueDepthRule(CFG)
    rule.desired(0.0, 5, loads(5, waiting=0, kv=0.95))
    assert rule.desired(10.0, 5, loads(5, waiting=0, kv=0.95)) == 6
    # At max: no up, whatever the queue.
    rule = QueueDepthRule(CFG)
    assert all(rule.desired(float(t), 6, loads(6, waiting=100)) == 6 for t in range(60))
    # Out-of-bounds current counts are pulled back in.
    assert QueueDepthRule(CFG).desired(0.0, 9, []) == 6


def test_downscale_one_at_a_time_only_when_the_load_fits():
    rule = QueueDepthRule(CFG)
    # 4 replicas, 40 running in all: fits in 3 * 64 * 0.5 = 96 -> down after 30 s.
    n, history = run(rule, 4, lambda n: loads(n, 0, running=40 / n), 0.0, 30.0)
    assert n == 3 and [h for h in history if h[1] == 3] == [(30.0, 3)]
    # 100 running over 3 replicas: 2 * 64 * 0.5 = 64 < 100 -> stays.
    n, _ = run(QueueDepthRule(CFG), 3, lambda n: loads(n, 0, running=100 / n), 0.0, 300.0)
    assert n == 3
    # Never below min_replicas.
    n, _ = run(QueueDepthRule(CFG), 1, lambda n: loads(n, 0, running=0), 0.0, 300.0)
    assert n == 1


def test_no_flapping_under_noisy_constant_load():
    """A steady load with +-50% noise in the queue that sits in the hysteresis band: the count
    does not move at all, over an hour of decisions every second."""
    rng = random.Random(7)

    def noisy(n: int) -> list[ReplicaLoad]:
        total_waiting = 3 * 2.0 * rng.uniform(0.5, 1.5)  # mean 2/replica on 3 replicas
        total_running = 3 * 48 * rng.uniform(0.8, 1.2)
        return loads(n, total_waiting / n, total_running / n)

    n, history = run(QueueDepthRule(CFG), 3, noisy, 0.0, 3600.0)
    assert {count for _, count in history} == {3}


def test_burst_then_quiet_goes_up_then_back_down_without_oscillating():
    def load_at(t: float):
        """Demand of 160 requests in the burst, 10 outside; each replica runs up to 64."""
        demand = 160.0 if 100.0 <= t < 400.0 else 10.0

        def per_replica(n: int) -> list[ReplicaLoad]:
            running = min(demand, 64.0 * n)
            return loads(n, (demand - running) / n, running / n)

        return per_replica

    rule, n, counts = QueueDepthRule(CFG), 1, []
    for t in range(0, 800):
        n = rule.desired(float(t), n, load_at(float(t))(n))
        counts.append(n)
    assert max(counts) >= 3 and counts[-1] == 1
    changes = sum(1 for a, b in zip(counts, counts[1:], strict=False) if a != b)
    ups = sum(1 for a, b in zip(counts, counts[1:], strict=False) if b > a)
    assert ups <= 2  # proportional up-scaling reaches the need in one or two moves
    assert max(counts) == 3  # 160 / 64 -> 3, no overshoot to max_replicas
    assert changes <= ups + 6  # then one-at-a-time downs, never up again in between


def test_config_validation_names_the_problem():
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscaleConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="hysteresis"):
        AutoscaleConfig(target_waiting=1.0, downscale_waiting=1.0)


def test_serve_adapter_reads_aggregated_metrics_from_a_real_context():
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    dep = DeploymentID(name="EngineServer", app_name="llm")
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(2)]
    policy = QueueDepthAutoscaler(**{**CFG.__dict__, "upscale_delay_s": 0.0})

    def ctx(waiting: float, now: float) -> AutoscalingContext:
        metrics = {
            "waiting": {r: waiting for r in replicas},
            "running": {r: 8.0 for r in replicas},
            "kv_usage": {r: 0.2 for r in replicas},
            "max_num_seqs": {r: 8.0 for r in replicas},
        }
        return AutoscalingContext(
            deployment_id=dep,
            deployment_name="EngineServer",
            app_name="llm",
            current_num_replicas=2,
            target_num_replicas=2,
            running_replicas=replicas,
            total_num_requests=2 * (8 + waiting),
            total_queued_requests=0,
            aggregated_metrics=metrics,
            raw_metrics=None,
            capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=6,
            policy_state={},
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=now,
            config=AutoscalingConfig(min_replicas=1, max_replicas=6),
            total_pending_async_requests=0,
        )

    desired, state = policy(ctx(waiting=12.0, now=100.0))
    assert desired == 5  # 2 * (16 running + 24 waiting) / 16
    assert state["queue_depth_rule"]["last_reason"].startswith("up:")
    desired, _ = policy(ctx(waiting=2.0, now=101.0))  # inside the band
    assert desired == 2
