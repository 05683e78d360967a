"""Batch-size policies: pure functions of scheduler stats -> SchedulerLimits (no torch, no ray).

The engine calls `policy.limits(stats)` before every step (the simulator too); the cluster
controller calls `policy.limits_from_window(stats, window)` once per replica report, where a
DecodeWindow of the period stands in for the per-step samples. Both share the arithmetic.
Policies only move `max_num_seqs`; the token budget stays as configured.

- StaticPolicy:      a fixed max_num_seqs (the baseline).
- MemoryAwarePolicy: Algorithm 1 of arXiv 2503.05248 (as the authors' public patch shows it).
- SlaPolicy:         Algorithm 2, reconstructed (see ../shared/PAPER_NOTES.md and the class).
- CombinedPolicy:    the minimum of the two.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from engine.core.config import SchedulerLimits
from engine.core.outputs import SchedulerStats


@dataclass(frozen=True)
class Bounds:
    """Hard bounds on max_num_seqs that every dynamic policy respects."""

    lower: int = 1
    upper: int = 256

    def __post_init__(self) -> None:
        if not 1 <= self.lower <= self.upper:
            raise ValueError(f"batch size bounds need 1 <= lower <= upper, got {self}")

    def clamp(self, b: int) -> int:
        return min(max(b, self.lower), self.upper)


@dataclass(frozen=True)
class DecodeWindow:
    """Decode-only steps of one replica over a period: how many, mean latency, mean batch."""

    num_steps: int
    mean_step_s: float
    mean_batch: float

    @classmethod
    def between(cls, before: SchedulerStats | None, after: SchedulerStats) -> DecodeWindow | None:
        """The decode-only steps between two stats snapshots (None: there were none)."""
        n = after.decode_steps_total - (before.decode_steps_total if before else 0)
        if n <= 0:
            return None
        seconds = after.decode_step_seconds_total - (
            before.decode_step_seconds_total if before else 0.0
        )
        seqs = after.decode_step_seqs_total - (before.decode_step_seqs_total if before else 0)
        return cls(n, seconds / n, seqs / n)


class StaticPolicy:
    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs

    def limits(self, stats: SchedulerStats) -> SchedulerLimits:
        return SchedulerLimits(self.max_num_seqs, stats.max_num_batched_tokens)

    def limits_from_window(
        self, stats: SchedulerStats, window: DecodeWindow | None
    ) -> SchedulerLimits:
        return self.limits(stats)

    def resume(self, max_num_seqs: int) -> None:
        """A fixed limit does not move to the replica's current one."""


# ----------------------------------------------------------------------- memory-aware
@dataclass(frozen=True)
class MemoryAwareConfig:
    eta: float = 0.95  # share of the KV cache the running batch may fill
    bounds: Bounds = Bounds()

    def __post_init__(self) -> None:
        if not 0.0 < self.eta <= 1.0:
            raise ValueError(f"eta must be in (0, 1], got {self.eta}")


class MemoryAwarePolicy:
    """Algorithm 1: as many sequences as fit in eta of the cache at the current blocks/seq.

    Only under pressure (requests both running and waiting) does it move; otherwise it keeps
    the last value. It never goes below the running count (no eviction by policy); the
    scheduler still preempts if the estimate was optimistic.
    """

    def __init__(self, config: MemoryAwareConfig, initial: int) -> None:
        self.config = config
        self.b = config.bounds.clamp(initial)

    def next_batch_size(self, stats: SchedulerStats) -> int:
        if stats.num_waiting and stats.num_running and stats.num_used_blocks:
            per_seq = stats.num_used_blocks / stats.num_running
            b = math.floor(self.config.eta * stats.num_total_blocks / per_seq)
            self.b = self.config.bounds.clamp(max(b, stats.num_running))
        return self.config.bounds.clamp(max(self.b, stats.num_running))

    def limits(self, stats: SchedulerStats) -> SchedulerLimits:
        return SchedulerLimits(self.next_batch_size(stats), stats.max_num_batched_tokens)

    def limits_from_window(
        self, stats: SchedulerStats, window: DecodeWindow | None
    ) -> SchedulerLimits:
        return self.limits(stats)  # reads only the snapshot

    def resume(self, max_num_seqs: int) -> None:
        """Start from a replica's current limit (a fresh controller, or one that lost it)."""
        self.b = self.config.bounds.clamp(max_num_seqs)


# ------------------------------------------------------------------------ SLA feedback
@dataclass(frozen=True)
class SlaConfig:
    """Decode-step latency target D_sla within +-eps, searched over an interval of batch sizes.

    alpha: least width of the search interval; delta: how far a bound moves per correction;
    window: decode-only steps averaged into the latency and batch-size estimates; max_step:
    most the batch size may move per update (the production refinement against oscillation;
    0 disables it).
    """

    target_s: float = 0.05
    eps_s: float = 0.005
    alpha: int = 4
    delta: int = 4
    window: int = 16
    max_step: int = 8
    bounds: Bounds = Bounds()

    def __post_init__(self) -> None:
        if self.target_s <= 0 or self.eps_s < 0 or self.eps_s >= self.target_s:
            raise ValueError(f"need target_s > eps_s >= 0, got {self.target_s}, {self.eps_s}")
        if self.alpha < 1 or self.delta < 1 or self.window < 1 or self.max_step < 0:
            raise ValueError("alpha, delta and window must be >= 1, max_step >= 0")


class SlaPolicy:
    """Algorithm 2 (reconstructed): keep the mean decode-step latency in D_sla +- eps.

    Departures from the paper's pseudo-code, and why:
    - Latency and batch size are means over the last `window` *decode-only* steps: a step that
      carries prefill chunks says nothing about decode latency at that batch size.
    - The new b moves at most `max_step` from the last one, against oscillation.
    - b never drops below the requests now decoding (the policy never evicts); it is capped by
      bounds.upper. Before any decode-only step is seen, the initial value stands.
    """

    def __init__(self, config: SlaConfig, initial: int) -> None:
        self.config = config
        bounds = config.bounds
        self.b = bounds.clamp(initial)
        self.b_low = bounds.lower
        self.b_high = bounds.upper
        self._latency: deque[float] = deque(maxlen=config.window)
        self._batch: deque[int] = deque(maxlen=config.window)
        self._last_step_seen = -1

    def observe(self, stats: SchedulerStats) -> None:
        step = stats.num_steps_total
        if step == self._last_step_seen:
            return
        self._last_step_seen = step
        if stats.last_step_decode_only and stats.last_step_duration_s is not None:
            self._latency.append(stats.last_step_duration_s)
            self._batch.append(stats.last_step_num_seqs)

    def next_batch_size(self, stats: SchedulerStats) -> int:
        self.observe(stats)
        if not self._latency:
            return max(self.b, min(stats.num_decoding, self.config.bounds.upper))
        tau = sum(self._latency) / len(self._latency)
        b_bar = sum(self._batch) / len(self._batch)
        return self.decide(tau, b_bar, stats.num_decoding)

    def batch_size_from_window(self, stats: SchedulerStats, window: DecodeWindow | None) -> int:
        """The periodic form (the controller): the window replaces the per-step samples."""
        if window is None:
            return max(self.b, min(stats.num_decoding, self.config.bounds.upper))
        return self.decide(window.mean_step_s, window.mean_batch, stats.num_decoding)

    def decide(self, tau: float, mean_batch: float, num_decoding: int) -> int:
        """One correction of the search interval from mean decode-step latency `tau` at mean
        batch `mean_batch`; returns the new batch size."""
        c = self.config
        lo, hi = c.bounds.lower, c.bounds.upper
        b_bar = round(mean_batch)
        if tau > c.target_s + c.eps_s:  # too slow: pull the interval down
            self.b_high = max(b_bar, self.b_low + c.alpha)
            self.b_low = max(self.b_low - c.delta, lo)
        elif tau < c.target_s - c.eps_s:  # headroom: push it up
            self.b_low = min(b_bar, self.b_high - c.alpha)
            self.b_high = min(self.b_high + c.delta, hi)
        else:  # in band: tighten around the observed batch
            self.b_high = min(b_bar + c.alpha // 2, hi)
            self.b_low = max(b_bar - c.alpha // 2, lo)
        self.b_low, self.b_high = max(self.b_low, lo), min(max(self.b_high, self.b_low), hi)
        b = (self.b_low + self.b_high) // 2
        if c.max_step:
            b = min(max(b, self.b - c.max_step), self.b + c.max_step)
        self.b = min(max(b, num_decoding, lo), hi)
        return self.b

    def over_target(self, window: DecodeWindow | None) -> bool:
        c = self.config
        return window is not None and window.mean_step_s > c.target_s + c.eps_s

    def limits(self, stats: SchedulerStats) -> SchedulerLimits:
        return SchedulerLimits(self.next_batch_size(stats), stats.max_num_batched_tokens)

    def limits_from_window(
        self, stats: SchedulerStats, window: DecodeWindow | None
    ) -> SchedulerLimits:
        b = self.batch_size_from_window(stats, window)
        return SchedulerLimits(b, stats.max_num_batched_tokens)

    def resume(self, max_num_seqs: int) -> None:
        """Start from a replica's current limit (a fresh controller, or one that lost it); the
        search interval starts wide again."""
        self.b = self.config.bounds.clamp(max_num_seqs)


class CombinedPolicy:
    """min(memory-aware, SLA): fill the cache, but not past the latency target."""

    def __init__(self, memory: MemoryAwarePolicy, sla: SlaPolicy) -> None:
        self.memory, self.sla = memory, sla

    def limits(self, stats: SchedulerStats) -> SchedulerLimits:
        b = min(self.memory.next_batch_size(stats), self.sla.next_batch_size(stats))
        return SchedulerLimits(max(b, 1), stats.max_num_batched_tokens)

    def limits_from_window(
        self, stats: SchedulerStats, window: DecodeWindow | None
    ) -> SchedulerLimits:
        b = min(self.memory.next_batch_size(stats), self.sla.batch_size_from_window(stats, window))
        return SchedulerLimits(max(b, 1), stats.max_num_batched_tokens)

    def resume(self, max_num_seqs: int) -> None:
        self.memory.resume(max_num_seqs)
        self.sla.resume(max_num_seqs)


PolicyName = Literal["static", "memory_aware", "sla", "combined"]
AnyPolicy = StaticPolicy | MemoryAwarePolicy | SlaPolicy | CombinedPolicy


def sla_part(policy: AnyPolicy) -> SlaPolicy | None:
    """The SLA-feedback part of a policy, if it has one (the controller's throttle rule)."""
    if isinstance(policy, SlaPolicy):
        return policy
    if isinstance(policy, CombinedPolicy):
        return policy.sla
    return None


def make_policy(
    name: PolicyName,
    max_num_seqs: int,
    memory: MemoryAwareConfig | None = None,
    sla: SlaConfig | None = None,
) -> AnyPolicy:
    """A fresh policy (they hold state: one per engine). `max_num_seqs` is the start value."""
    if name == "static":
        return StaticPolicy(max_num_seqs)
    if name == "memory_aware":
        return MemoryAwarePolicy(memory or MemoryAwareConfig(), max_num_seqs)
    if name == "sla":
        return SlaPolicy(sla or SlaConfig(), max_num_seqs)
    if name == "combined":
        return CombinedPolicy(
            MemoryAwarePolicy(memory or MemoryAwareConfig(), max_num_seqs),
            SlaPolicy(sla or SlaConfig(), max_num_seqs),
        )
    raise ValueError(f"batching policy must be static, memory_aware, sla or combined: {name!r}")


def policy_factory(batching: dict[str, Any], max_num_seqs: int) -> Callable[[], AnyPolicy]:
    """A picklable no-argument callable that makes a fresh policy (one per replica) from
    deploy.yaml's `batching:` fields (serve_app.config.BatchingArgs, as plain data)."""
    bounds = Bounds(batching["batch_size_lower"], batching["batch_size_upper"])
    sla = SlaConfig(
        target_s=batching["sla_target_ms"] / 1e3,
        eps_s=batching["sla_eps_ms"] / 1e3,
        alpha=batching["sla_alpha"],
        delta=batching["sla_delta"],
        window=batching["sla_window"],
        max_step=batching["sla_max_step"],
        bounds=bounds,
    )
    memory = MemoryAwareConfig(batching["eta"], bounds)
    return partial(make_policy, batching["policy"], max_num_seqs, memory, sla)
