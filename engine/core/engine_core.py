"""One engine iteration without text: policy -> schedule -> launch -> collect (pure Python).

LLMEngine adds detokenization and stop strings on top; the simulator drives it directly with
a cost-model runner on a virtual clock, so both run exactly the same scheduling code.

A step is launched (scheduled and handed to the runner) and later collected (its sampled
tokens applied to the scheduler). `step()` does both at once; LLMEngine may instead leave a
step in flight on a GPU and process the previous step's outputs meanwhile, and launch the
step after it before collecting it where the scheduler can tell that step already
(engine/core/sched/continuation.py). Steps are collected in launch order.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from engine.core.clock import Clock
from engine.core.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    PendingStep,
    ReadyStep,
    SchedulerOutput,
    TokenLogprob,
)
from engine.core.policy import BatchingPolicy
from engine.core.request import RequestStatus
from engine.core.sched.continuation import schedule_continuation
from engine.core.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    error: str | None = None  # the runner raised: `outputs` are that step's failed requests
    num_scheduled: int = 0  # requests in the step's batch
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # of requests that ask
    # Of requests that ask: (prompt position of the first entry, entries).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


@dataclass
class InFlight:
    """A launched step not yet collected."""

    scheduled: SchedulerOutput
    pending: PendingStep
    started: float  # the engine clock at launch

    @property
    def may_overlap(self) -> bool:
        """Whether the host may go on while it runs (it is not done yet)."""
        return not self.pending.ready


class EngineCore:
    def __init__(
        self, scheduler: Scheduler, runner, clock: Clock, policy: BatchingPolicy | None = None
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner  # engine.runner.base.ModelRunner
        self.clock = clock
        self.policy = policy
        self.in_flight: deque[InFlight] = deque()  # launched, not collected, oldest first
        self._last_collected = float("-inf")  # the clock when a step was last collected
        self.num_continuations = 0  # steps launched before the step before was collected

    def step(self) -> StepResult:
        """Launch the next step and collect it."""
        failed_or_idle = self.launch()
        return failed_or_idle if failed_or_idle is not None else self.collect()

    def launch(self) -> StepResult | None:
        """Schedule the next step and hand it to the runner: None when it is in flight, else
        the result of a step that failed at launch or that had nothing to do."""
        assert not self.in_flight, "collect the steps in flight first"
        if self.policy is not None:
            self.scheduler.set_limits(self.policy.limits(self.scheduler.stats()))
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty and not sched_out.finished_request_ids and not sched_out.has_swaps:
            return StepResult()
        started = self.clock.now()
        try:
            launch = getattr(self.runner, "launch", None)
            pending = launch(sched_out) if launch else ReadyStep(self.runner.execute(sched_out))
        except Exception as exc:  # a failed step fails its requests, not the engine
            return self._failed(sched_out, exc)
        self.in_flight.append(InFlight(sched_out, pending, started))
        return None

    def launch_continuation(self) -> bool:
        """Launch the step after the one step in flight, before collecting it, where the
        scheduler can tell that step already. True if it did."""
        if len(self.in_flight) != 1 or not self.in_flight[0].may_overlap:
            return False
        if self.policy is not None:
            self.scheduler.set_limits(self.policy.limits(self.scheduler.stats()))
        sched_out = schedule_continuation(self.scheduler, self.in_flight[0].scheduled)
        if sched_out is None:
            return False
        started = self.clock.now()
        try:
            pending = self.runner.launch(sched_out)
        except Exception as exc:  # failed when collected, after the step before it
            pending = _FailedLaunch(exc)
        self.in_flight.append(InFlight(sched_out, pending, started))
        self.num_continuations += 1
        return True

    def collect(self) -> StepResult:
        """Wait for the oldest step in flight and advance its requests by what it sampled."""
        assert self.in_flight, "no step in flight"
        flight = self.in_flight.popleft()
        sched_out, pending, started = flight.scheduled, flight.pending, flight.started
        try:
            runner_out = pending.result()
        except Exception as exc:
            return self._failed(sched_out, exc)
        # From its launch, or from the step before's end where it ran behind that step.
        now = self.clock.now()
        self.scheduler.executed(sched_out, now - max(started, self._last_collected))
        self._last_collected = now
        outputs = self.scheduler.update_from_output(sched_out, runner_out)
        return StepResult(
            outputs,
            num_scheduled=len(sched_out.scheduled),
            logprobs=runner_out.logprobs,
            prompt_logprobs=runner_out.prompt_logprobs,
        )

    def _failed(self, sched_out: SchedulerOutput, exc: Exception) -> StepResult:
        logger.error(
            "model step failed; failing its %d requests",
            len(sched_out.scheduled),
            exc_info=exc,
        )
        # The runner raised on this step: its requests end with an error, the rest go on.
        scheduler = self.scheduler
        ids = [s.request_id for s in sched_out.scheduled if s.request_id in scheduler.requests]
        scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        reason = RequestStatus.FINISHED_ERROR.finish_reason
        return StepResult([EngineCoreOutput(rid, [], reason) for rid in ids], repr(exc))


@dataclass
class _FailedLaunch:
    error: Exception
    ready: bool = False

    def result(self) -> ModelRunnerOutput:
        raise self.error
