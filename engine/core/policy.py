"""The contract of a batching policy (implementations live in cluster/batching.py)."""

from __future__ import annotations

from typing import Protocol

from engine.core.config import SchedulerLimits
from engine.core.outputs import SchedulerStats


class BatchingPolicy(Protocol):
    """Anything that turns scheduler stats into the next step's limits. Called before every
    step with the stats as they stand (including the last step's duration)."""

    def limits(self, stats: SchedulerStats) -> SchedulerLimits: ...


class ExternalLimits:
    """Limits set from outside the engine (the cluster controller), between any two steps.

    `set` swaps one immutable object, so the event-loop thread may call it while the step
    thread reads; the next step sees the new limits. Until the first `set`, `initial` holds.
    """

    def __init__(self, initial: SchedulerLimits) -> None:
        self.current = initial

    def set(self, limits: SchedulerLimits) -> None:
        self.current = limits

    def limits(self, stats: SchedulerStats) -> SchedulerLimits:
        return self.current
