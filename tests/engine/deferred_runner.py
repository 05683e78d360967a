"""The real runner with a GPU's timing, for the CPU tests of `engine.overlap_steps`. A GPU's
launch does the host's share of a step at once (inputs, sampling arguments, grammar masks)
and the device's later; the engine reads the tokens when it collects the step. Two runners
emulate each half: DeferredRunner computes a launched step only when it is collected (what
the device has not done yet cannot be read), InFlightRunner computes it at launch but has
the engine treat it as in flight until collected (the host's order of a GPU launch)."""

from __future__ import annotations

from dataclasses import replace

from engine.core.outputs import ModelRunnerOutput, PendingStep, SchedulerOutput
from engine.runner.torch_runner import TorchModelRunner


class DeferredStep:
    ready = False

    def __init__(self, runner: TorchModelRunner, scheduled: SchedulerOutput) -> None:
        self._runner = runner
        # The step as launched: block tables are live lists (a GPU step has copied them).
        self._scheduled = replace(
            scheduled,
            scheduled=[replace(s, block_ids=list(s.block_ids)) for s in scheduled.scheduled],
        )

    def result(self) -> ModelRunnerOutput:
        return TorchModelRunner.launch(self._runner, self._scheduled).result()


class InFlightStep:
    ready = False

    def __init__(self, step: PendingStep) -> None:
        self._step = step

    def result(self) -> ModelRunnerOutput:
        return self._step.result()


class DeferredRunner(TorchModelRunner):
    """Steps computed when collected; `launch_now` computes them at launch instead (the
    InFlightRunner below). Either way a step stays in flight until collected."""

    launch_now = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_launched = 0

    def launch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        self.num_launched += 1
        if self.launch_now:
            return InFlightStep(super().launch(scheduler_output))
        return DeferredStep(self, scheduler_output)


class InFlightRunner(DeferredRunner):
    launch_now = True
