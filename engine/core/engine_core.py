"""One engine iteration without text: policy -> schedule -> execute -> update (pure Python).

LLMEngine adds detokenization and stop strings on top; the simulator drives it directly with
a cost-model runner on a virtual clock, so both run exactly the same scheduling code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine.core.clock import Clock
from engine.core.outputs import EngineCoreOutput, TokenLogprob
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


class EngineCore:
    def __init__(
        self, scheduler: Scheduler, runner, clock: Clock, policy: BatchingPolicy | None = None
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner  # engine.runner.base.ModelRunner
        self.clock = clock
        self.policy = policy

    def step(self) -> StepResult:
        if self.policy is not None:
            self.scheduler.set_limits(self.policy.limits(self.scheduler.stats()))
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty and not sched_out.finished_request_ids and not sched_out.has_swaps:
            return StepResult()
        started = self.clock.now()
        try:
            runner_out = self.runner.execute(sched_out)
        except Exception as exc:  # a failed step fails its requests, not the engine
            logger.exception("model step failed; failing its %d requests", len(sched_out.scheduled))
            return StepResult(self.scheduler.fail_step(sched_out), repr(exc))
        self.scheduler.steps.executed(self.clock.now() - started)
        outputs = self.scheduler.update_from_output(sched_out, runner_out)
        return StepResult(
            outputs,
            num_scheduled=len(sched_out.scheduled),
            logprobs=runner_out.logprobs,
            prompt_logprobs=runner_out.prompt_logprobs,
        )
