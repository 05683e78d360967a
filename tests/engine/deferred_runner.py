"""The real runner with a GPU's timing: a launched step computes only when the engine
collects it, so the engine's host work runs while the step is in flight, as on a GPU. The
CPU tests of `engine.overlap_steps` run on it."""

from __future__ import annotations

from dataclasses import replace

from engine.core.outputs import ModelRunnerOutput, SchedulerOutput
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


class DeferredRunner(TorchModelRunner):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_launched = 0

    def launch(self, scheduler_output: SchedulerOutput) -> DeferredStep:
        self.num_launched += 1
        return DeferredStep(self, scheduler_output)
