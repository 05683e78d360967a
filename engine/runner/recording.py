"""A ModelRunner wrapper that keeps every SchedulerOutput it executes (calibration, tests)."""

from __future__ import annotations

from engine.core.outputs import ModelRunnerOutput, PendingStep, ReadyStep, SchedulerOutput


class RecordingRunner:
    """Delegates to `inner`; `outputs` holds the executed steps in order. NOTE: a step's
    `block_ids` lists are live; read ids, positions and token counts, not block tables."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.outputs: list[SchedulerOutput] = []

    def num_kv_blocks(self) -> int:
        return self.inner.num_kv_blocks()

    def max_model_len(self) -> int:
        return self.inner.max_model_len()

    def num_host_blocks(self) -> int:
        return self.inner.num_host_blocks()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.outputs.append(out)
        return self.inner.execute(out)

    def launch(self, out: SchedulerOutput) -> PendingStep:
        self.outputs.append(out)
        launch = getattr(self.inner, "launch", None)
        return launch(out) if launch else ReadyStep(self.inner.execute(out))
