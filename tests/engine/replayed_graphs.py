"""CUDA graphs' replay semantics on the CPU, for the tests of the graph-replayed decode path:
each padded batch size is "captured" once over views of the persistent input buffers, and a
replay runs that forward again over those same views into the output tensor kept at capture.
So a step must reach the graph through the buffers alone, as on a GPU, where a replay reads
the addresses it was captured with and nothing the host computes after capture."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.runner.decode_graphs import DecodeGraphs
from engine.runner.decode_inputs import DecodeInputs


class ReplayedGraph:
    def __init__(self, forward: Callable[[DecodeInputs], torch.Tensor], rows: DecodeInputs):
        self._forward, self._rows = forward, rows
        self.output = forward(rows)
        self.num_replays = 0

    def replay(self) -> None:
        self.output.copy_(self._forward(self._rows))
        self.num_replays += 1


class ReplayedDecodeGraphs(DecodeGraphs):
    def capture(self) -> None:
        for size in self.sizes:
            self.inputs.fill([], size, self.dm.block_size, self.scratch_block)
            graph = ReplayedGraph(self._forward, self.inputs.rows(size))
            self._graphs[size], self._outputs[size] = graph, graph.output

    def replays(self) -> dict[int, int]:
        """Replays per captured batch size, of the sizes replayed at least once."""
        return {s: g.num_replays for s, g in self._graphs.items() if g.num_replays}


def replay_decodes(engine, largest: int) -> ReplayedDecodeGraphs:
    """Give the engine's runner (on the CPU, attention backend `triton` under Triton's
    interpreter) decode graphs with CUDA's replay semantics, for batches of up to `largest`
    (larger decode steps run eagerly); returns them."""
    runner = engine.runner
    assert runner.backend.supports_graphs and runner.graphs is None
    with torch.inference_mode():
        runner.graphs = ReplayedDecodeGraphs(*_parts(runner), largest, runner.max_model_len())
    return runner.graphs


def replay_spec_decodes(engine, largest: int) -> ReplayedDecodeGraphs:
    """`replay_decodes` for the speculative graphs: rows of k + 1 query tokens, where k is
    the engine's num_speculative_tokens."""
    runner = engine.runner
    assert runner.backend.supports_graphs and runner.spec_graphs is None
    q = engine.config.speculative.num_speculative_tokens + 1
    with torch.inference_mode():
        max_len = runner.max_model_len()
        runner.spec_graphs = ReplayedDecodeGraphs(*_parts(runner), largest, max_len, q)
    return runner.spec_graphs


def _parts(runner) -> tuple:
    """What decode graphs are captured over: the runner's model and its KV cache."""
    return runner.device_model(), runner.kv_caches, runner.scratch_block
