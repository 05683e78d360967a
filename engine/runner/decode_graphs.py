"""CUDA graphs of decode-only steps: captured at start, one per padded batch size, sharing one
memory pool; a decode step then costs one graph replay instead of a launch per kernel.

A step of B decodes copies its inputs into the persistent buffers (engine/runner/
decode_inputs.py), replays the graph of the smallest captured size >= B, and finishes the
first B rows' logits eagerly. Mixed steps, larger batches and backends that cannot be
captured run eagerly; `enforce_eager` turns graphs off. With speculative decoding a second
set is captured whose rows hold k + 1 query tokens (a last token and up to k drafts, padded):
steps of decodes and drafted rows replay those.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from engine.core.outputs import ScheduledRequest
from engine.runner.decode_inputs import DecodeInputs, capture_sizes, decode_forward

if TYPE_CHECKING:
    from engine.runner.torch_runner import TorchModelRunner

logger = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(
        self,
        runner: TorchModelRunner,
        max_num_seqs: int,
        max_model_len: int,
        tokens_per_row: int = 1,
    ) -> None:
        self.runner = runner
        self.sizes = capture_sizes(max_num_seqs)
        self.tokens_per_row = tokens_per_row
        # A row's padding positions may reach past max_model_len: their table columns exist.
        blocks_per_row = -(-(max_model_len + tokens_per_row) // runner.block_size)
        self.inputs = DecodeInputs.allocate(
            self.sizes[-1], blocks_per_row, runner.device, tokens_per_row
        )
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.capture()

    def capture(self) -> None:
        runner, device = self.runner, self.runner.device
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller graphs then fit in the memory the first one reserved.
        for size in reversed(self.sizes):
            self.inputs.fill([], size, runner.block_size, runner.scratch_block)
            rows = self.inputs.rows(size)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up: lazy init and autotuning off-graph
                self._forward(rows)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._forward(rows)
            self._graphs[size] = graph
        torch.cuda.synchronize(device)
        logger.info(
            "captured %d decode graphs (batch sizes %s) in %.1f s, %.0f MiB",
            len(self.sizes),
            self.sizes,
            time.perf_counter() - start,
            (free_before - torch.cuda.mem_get_info(device)[0]) / (1 << 20),
        )

    def run(
        self,
        order: list[ScheduledRequest],
        known: tuple[torch.Tensor, torch.Tensor] | None,
        positions: list[int] | None = None,
    ) -> torch.Tensor | None:
        """Logits of a decode-only step by graph replay, or None where no graph fits it.
        `known`: rows whose input token is already on the device, and those tokens.
        `positions`: the query tokens to take logits of (row i's j-th is i x Q + j); every
        row's first where not given."""
        if len(order) > self.sizes[-1]:
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, len(order))]
        runner, q = self.runner, self.tokens_per_row
        self.inputs.fill(order, size, runner.block_size, runner.scratch_block)
        if known is not None:
            self.inputs.input_ids[known[0]] = known[1]
        self._graphs[size].replay()
        hidden = self._outputs[size]
        if positions is not None:
            return runner.model.logits(hidden[torch.tensor(positions, device=hidden.device)])
        return runner.model.logits(hidden[: len(order) * q : q])

    def replay_padding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final hidden states of a step of padding rows (position 0, K/V to the scratch
        block) with these input ids, by replaying the graph of exactly their count; the
        buffers keep the step for an eager run to compare with (the GPU self-check)."""
        size = len(input_ids)
        self.inputs.fill([], size, self.runner.block_size, self.runner.scratch_block)
        self.inputs.input_ids[:size].copy_(input_ids)
        self._graphs[size].replay()
        return self._outputs[size].clone()

    def _forward(self, rows: DecodeInputs) -> torch.Tensor:
        r = self.runner
        return decode_forward(r.model, r.backend, rows, r.kv_caches, r.spec.sliding_window)
