"""One engine iteration without text: policy -> schedule -> launch -> collect (pure Python).

LLMEngine adds detokenization and stop strings on top; the simulator drives it directly with
a cost-model runner on a virtual clock, so both run exactly the same scheduling code.

A step is launched (scheduled and handed to the runner) and later collected (its sampled
tokens applied to the scheduler). `step()` does both at once; LLMEngine may instead leave a
step in flight on a GPU and process the previous step's outputs meanwhile. The scheduler
never schedules while a step is in flight: the next step is launched only after the one in
flight is collected, so it sees every token sampled so far.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine.core.clock import Clock
from engine.core.outputs import (
    EngineCoreOutput,
    PendingStep,
    ReadyStep,
    SchedulerOutput,
    TokenLogprob,
)
from engine.core.policy import BatchingPolicy
from engine.core.scheduler import Scheduler

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
        """Whether the host may go on while it runs: not for grammar rows, whose matchers
        took the step's tokens at launch (the previous step's outputs must not see them)."""
        return not self.pending.ready and not any(
            s.sampling_params.structured is not None for s in self.scheduled.scheduled
        )


class EngineCore:
    def __init__(
        self, scheduler: Scheduler, runner, clock: Clock, policy: BatchingPolicy | None = None
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner  # engine.runner.base.ModelRunner
        self.clock = clock
        self.policy = policy
        self.in_flight: InFlight | None = None

    def step(self) -> StepResult:
        """Launch the next step and collect it."""
        failed_or_idle = self.launch()
        return failed_or_idle if failed_or_idle is not None else self.collect()

    def launch(self) -> StepResult | None:
        """Schedule the next step and hand it to the runner: None when it is in flight, else
        the result of a step that failed at launch or that had nothing to do."""
        assert self.in_flight is None, "collect the step in flight first"
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
        self.in_flight = InFlight(sched_out, pending, started)
        return None

    def collect(self) -> StepResult:
        """Wait for the step in flight and advance its requests by what it sampled."""
        assert self.in_flight is not None, "no step in flight"
        sched_out, pending, started = (
            self.in_flight.scheduled,
            self.in_flight.pending,
            self.in_flight.started,
        )
        self.in_flight = None
        try:
            runner_out = pending.result()
        except Exception as exc:
            return self._failed(sched_out, exc)
        self.scheduler.steps.executed(self.clock.now() - started)
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
        return StepResult(self.scheduler.fail_step(sched_out), repr(exc))
