"""The simulator: the real Scheduler and KV manager, a CostModelRunner, a VirtualClock.

Nothing of the scheduler is re-implemented here: requests go through `Scheduler.add_request`
and each step through `EngineCore.step` (policy -> schedule -> execute -> update), exactly as
in the engine, or, where most of the batch only decodes, through the decode cohort
(engine/core/sched/decode_cohort.py: the scheduler's own admission and ends, equal results). Only
the runner is priced instead of run.
"""

from __future__ import annotations

import gc
import math
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cluster.request_records import RequestRecord, summarize_records
from cluster.sim_config import SimConfig
from cluster.sim_replica import SimReplica
from cluster.workload import SimRequest


def after(t: float) -> float:
    """The first time later than `t`: a step starting at `t` still runs, one after not."""
    return math.nextafter(t, math.inf)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic GC off for a simulation run. A run allocates millions of short-lived
    acyclic objects (refcounting frees them) next to a growing heap of records, and every
    full collection walks that heap."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass
class SimResult:
    config: SimConfig
    records: dict[str, RequestRecord]
    duration_s: float
    num_steps: int
    num_preemptions: int
    num_kv_blocks: int
    batch_size_sum: int
    kv_usage_series: list[tuple[float, float]]
    max_num_seqs_series: list[tuple[float, int]]
    free_blocks_at_end: int
    num_cohort_steps: int = (
        0  # of num_steps, those the decode cohort took (engine/core/sched/decode_cohort.py)
    )

    def summary(self) -> dict[str, float]:
        return summarize_records(self.records, self.config.slo, self.duration_s) | {
            "preemptions": self.num_preemptions,
            "mean_batch_size": self.batch_size_sum / max(self.num_steps, 1),
            "mean_kv_usage": (
                sum(u for _, u in self.kv_usage_series) / len(self.kv_usage_series)
                if self.kv_usage_series
                else 0.0
            ),
            "num_kv_blocks": self.num_kv_blocks,
            "steps": self.num_steps,
            "cohort_steps": self.num_cohort_steps,
        }


class Simulator:
    """One engine replica under a trace; `run` is deterministic for a given trace and config."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config

    def run(self, trace: list[SimRequest], max_sim_s: float = math.inf) -> SimResult:
        records: dict[str, RequestRecord] = {}
        replica = SimReplica(self.config, records)
        clock = replica.clock
        pending = deque(sorted(trace, key=lambda r: r.arrival_s))
        with gc_paused():
            while pending or replica.busy:
                now = clock.now()
                if now > max_sim_s:
                    break
                while pending and pending[0].arrival_s <= now:
                    replica.add(pending.popleft())
                if not replica.busy:
                    clock.advance(pending[0].arrival_s - now)
                    continue
                until = min(pending[0].arrival_s if pending else math.inf, after(max_sim_s))
                replica.advance(until)
        stats = replica.scheduler.stats()
        return SimResult(
            config=self.config,
            records=records,
            duration_s=clock.now(),
            num_steps=replica.steps,
            num_preemptions=stats.num_preemptions_total,
            num_kv_blocks=replica.runner.num_kv_blocks(),
            batch_size_sum=replica.batch_sum,
            kv_usage_series=replica.kv_series,
            max_num_seqs_series=replica.seqs_series,
            free_blocks_at_end=stats.num_free_blocks,
            num_cohort_steps=replica.cohort_steps,
        )


def capacity(
    config: SimConfig,
    make_trace,
    start: float = 0.5,
    target: float = 0.9,
    iters: int = 6,
) -> float:
    """The highest arrival rate (requests/s) at which >= `target` of requests meet the SLO
    on one replica (`highest_rate`). `make_trace(rate)` builds the trace for a rate."""
    sim = Simulator(config)
    return highest_rate(
        lambda rate: sim.run(make_trace(rate)).summary()["sla_attainment"] >= target,
        start,
        iters,
    )


def highest_rate(meets: Callable[[float], bool], start: float = 0.5, iters: int = 6) -> float:
    """The highest rate at which `meets(rate)` holds, on any simulator: doubling from
    `start` to bracket it in [r, 2r], then `iters` bisections (resolution r / 2**iters)."""
    lo = start
    while not meets(lo):
        lo /= 2
        if lo < 1e-3:
            return 0.0
    hi = lo * 2
    while meets(hi):
        lo, hi = hi, hi * 2
        if hi > 1e5:
            return lo
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo
