"""The contract of a batching policy (implementations live in cluster/batching.py)."""

from __future__ import annotations

from typing import Protocol

from engine.core.config import SchedulerLimits
from engine.core.outputs import SchedulerStats


class BatchingPolicy(Protocol):
    """Anything that turns scheduler stats into the next step's limits. Called before every
    step with the stats as they stand (including the last step's duration)."""

    def limits(self, stats: SchedulerStats) -> SchedulerLimits: ...
