"""The cluster controller's logic, without Ray: replica reports in, per-replica limits out.

Every engine replica reports a ReplicaStats on a short period and gets a ControlDecision back
in the reply. ClusterControl keeps one batching policy per replica (the same classes the
engine and the simulator run), and the cluster-wide SLA rule: a replica whose decode-step
latency is over the deployment's target is throttled, and its routing weight drops below 1
so the request router sends it a smaller share. State is soft: a fresh ClusterControl rebuilds
its view from the next round of reports, and a replica that stops reporting drops out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from cluster.batching import AnyPolicy, DecodeWindow, sla_part
from cluster.engine_metrics import EngineMetricsSnapshot
from cluster.metrics import percentile
from engine.core.config import SchedulerLimits
from engine.core.outputs import SchedulerStats

# A throttled replica still gets some traffic, so its latency keeps being measured.
MIN_ROUTING_WEIGHT = 0.1


def weighted_load(outstanding: int, weight: float) -> float:
    """A replica's load as routers rank it: outstanding requests over its routing weight.
    +1: a throttled replica with nothing outstanding still ranks behind an idle full one."""
    return (outstanding + 1) / max(weight, 1e-3)


@dataclass(frozen=True)
class LatencySummary:
    """p50 / p99 of a latency over the report period (None: no samples)."""

    p50_s: float | None = None
    p99_s: float | None = None
    count: int = 0


# Latency samples kept between two reports; beyond it the oldest go (controller unreachable).
_MAX_SAMPLES = 4096


class PeriodLatencies:
    """TTFT and inter-token gaps of a replica's requests since its last report (a chunk of
    k tokens after a gap g is one sample of g / k)."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []

    def add(self, samples: list[float], value: float) -> None:
        if len(samples) >= _MAX_SAMPLES:
            del samples[: _MAX_SAMPLES // 2]
        samples.append(value)

    def take(self) -> tuple[LatencySummary, LatencySummary]:
        """This period's summaries; the next period starts empty."""
        ttft, itl = (
            LatencySummary(percentile(x, 50), percentile(x, 99), len(x)) if x else LatencySummary()
            for x in (self.ttft, self.itl)
        )
        self.ttft, self.itl = [], []
        return ttft, itl


@dataclass(frozen=True)
class ReplicaStats:
    """One engine replica's report to the controller."""

    replica_id: str
    scheduler: SchedulerStats
    num_streams: int  # requests accepted and not ended (queued + running)
    capacity: int  # most requests the replica accepts at once
    num_rejected_total: int = 0
    decode: DecodeWindow | None = None  # decode-only steps since the last report
    ttft: LatencySummary = LatencySummary()  # requests that got their first token this period
    itl: LatencySummary = LatencySummary()  # inter-token gaps of the streamed chunks
    metrics: EngineMetricsSnapshot | None = None  # cumulative request metrics (/metrics)
    attention_kernels: str = ""  # the attention backend the engine runs (its registry's pick)
    attention_kernels_reason: str = ""  # why that one
    cache_dtype: str = ""  # what the KV cache holds: the model's dtype, or fp8_e4m3
    kv_block_size: int = 0  # tokens per KV block
    # The GPU self-check's verdicts at start: (part, "pass" or "fallback", reason).
    self_check_verdicts: tuple[tuple[str, str, str], ...] = ()

    @property
    def num_waiting(self) -> int:
        """Accepted but not running (scheduler queue plus requests not yet handed to it)."""
        return max(self.num_streams - self.scheduler.num_running, 0)


@dataclass(frozen=True)
class ControlDecision:
    """The controller's answer to one report."""

    limits: SchedulerLimits
    throttled: bool = False
    routing_weight: float = 1.0  # the router divides the replica's load by this
    reason: str = ""


@dataclass
class _Replica:
    policy: AnyPolicy
    last: ReplicaStats
    last_seen: float
    decision: ControlDecision
    num_reports: int = 0


@dataclass
class ClusterControl:
    """The cluster view and the rules. `now` is passed in (wall clock, or the simulator's)."""

    make_policy: Callable[[], AnyPolicy]
    stale_after_s: float = 5.0
    # Set: every decision's token budget (settings applied live); None: the replica's own.
    max_num_batched_tokens: int | None = None
    replicas: dict[str, _Replica] = field(default_factory=dict)
    num_reports_total: int = 0
    num_expired_total: int = 0

    def report(self, stats: ReplicaStats, now: float) -> ControlDecision:
        self.expire(now)
        entry = self.replicas.get(stats.replica_id)
        if entry is None:
            current = SchedulerLimits(
                stats.scheduler.max_num_seqs, stats.scheduler.max_num_batched_tokens
            )
            # The replica's current limit may be a past controller's decision: go on from it.
            policy = self.make_policy()
            policy.resume(current.max_num_seqs)
            entry = self.replicas[stats.replica_id] = _Replica(
                policy, stats, now, ControlDecision(current)
            )
        entry.last, entry.last_seen = stats, now
        entry.num_reports += 1
        self.num_reports_total += 1
        limits = entry.policy.limits_from_window(stats.scheduler, stats.decode)
        if self.max_num_batched_tokens is not None:
            limits = SchedulerLimits(limits.max_num_seqs, self.max_num_batched_tokens)
        entry.decision = ControlDecision(limits)
        self._apply_sla_rule()
        return entry.decision

    def retune(
        self, make_policy: Callable[[], AnyPolicy], max_num_batched_tokens: int | None
    ) -> None:
        """Run every replica under a new policy (each a fresh one, from its start value) and
        token budget, from its next report on."""
        self.make_policy, self.max_num_batched_tokens = make_policy, max_num_batched_tokens
        for entry in self.replicas.values():
            entry.policy = make_policy()

    def _apply_sla_rule(self) -> None:
        """Throttled replicas get a routing weight in proportion to their batch limit against
        the largest limit in the deployment; the others keep weight 1."""
        if not self.replicas:
            return
        top = max(e.decision.limits.max_num_seqs for e in self.replicas.values())
        for entry in self.replicas.values():
            sla = sla_part(entry.policy)
            window = entry.last.decode
            if sla is None or not sla.over_target(window):
                if entry.decision.throttled:
                    entry.decision = ControlDecision(entry.decision.limits)
                continue
            assert window is not None
            weight = max(entry.decision.limits.max_num_seqs / top, MIN_ROUTING_WEIGHT)
            reason = (
                f"decode step {window.mean_step_s * 1e3:.3g} ms over the "
                f"{sla.config.target_s * 1e3:.3g} ms target"
            )
            entry.decision = ControlDecision(entry.decision.limits, True, weight, reason)

    def expire(self, now: float) -> list[str]:
        """Drop replicas that have not reported for stale_after_s (they died or were removed)."""
        gone = [rid for rid, e in self.replicas.items() if now - e.last_seen > self.stale_after_s]
        for rid in gone:
            del self.replicas[rid]
        self.num_expired_total += len(gone)
        return gone

    def view(self, now: float) -> dict[str, Any]:
        """The cluster as JSON-ready data: GET /v1/cluster and `python -m cluster.status`."""
        self.expire(now)
        rows = []
        for rid, e in sorted(self.replicas.items()):
            s, sched = e.last, e.last.scheduler
            rows.append(
                {
                    "replica_id": rid,
                    "age_s": round(now - e.last_seen, 3),
                    "reports": e.num_reports,
                    "running": sched.num_running,
                    "waiting": s.num_waiting,
                    "capacity": s.capacity,
                    "kv_blocks_used": sched.num_used_blocks,
                    "kv_blocks_total": sched.num_total_blocks,
                    "kv_usage": round(sched.kv_usage, 4),
                    "preemptions_total": sched.num_preemptions_total,
                    # Speculative decoding: the share of drafted tokens accepted (null: off).
                    "spec_acceptance": sched.spec.acceptance_rate if sched.spec else None,
                    "rejected_total": s.num_rejected_total,
                    "decode": asdict(s.decode) if s.decode else None,
                    "ttft": asdict(s.ttft),
                    "itl": asdict(s.itl),
                    "limits": asdict(e.decision.limits),
                    "throttled": e.decision.throttled,
                    "routing_weight": round(e.decision.routing_weight, 3),
                    "reason": e.decision.reason,
                }
            )
        return {
            "num_replicas": len(rows),
            "reports_total": self.num_reports_total,
            "expired_total": self.num_expired_total,
            "replicas": rows,
        }
