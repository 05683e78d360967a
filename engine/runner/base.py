"""The contract between the engine and whatever executes a step."""

from __future__ import annotations

from typing import Protocol

from engine.core.outputs import ModelRunnerOutput, SchedulerOutput


class ModelRunner(Protocol):
    """Executes scheduled steps. The real one runs the model; the simulator's prices them.

    A runner may also offer `launch(scheduler_output) -> PendingStep` (engine.core.outputs):
    `execute`'s work, whose result may still be on its way (a GPU's); EngineCore uses it where
    present. One that can move sequences to other replicas with their KV offers
    `export_kv(block_ids, token_ids, swapped) -> SequenceKV | None` (`swapped`: the blocks
    are the host pool's) and `kv_refusal(kv) -> str | None`
    (engine.core.sequence_kv), and writes a step's `kv_imports` before computing it. Rows
    whose input token is UNKNOWN_TOKEN take the token the step launched just before samples
    for that request."""

    def num_kv_blocks(self) -> int:
        """How many KV blocks of the configured block size the cache holds."""
        ...

    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) the model supports."""
        ...

    def num_host_blocks(self) -> int:
        """Blocks of the host-memory pool for swap preemption (0: none)."""
        ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Carry out the step's swaps (every swap-out, then every swap-in) and KV imports,
        compute the KV of every scheduled token and sample one token for each request whose
        `sample` flag is set. Drops per-request state of `finished_request_ids`. Raises on a
        failure of the step; the engine then fails that step's requests."""
        ...
