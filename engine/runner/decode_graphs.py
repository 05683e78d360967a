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

import torch

from engine.core.config import EngineConfig
from engine.core.outputs import ScheduledRequest
from engine.runner.decode_inputs import DecodeInputs, capture_sizes, decode_forward
from engine.runner.device_model import DeviceModel, KVCaches

logger = logging.getLogger(__name__)

# One capture stream per device for the process: each stream that runs a GEMM keeps a cuBLAS
# workspace of its own for good.
_capture_streams: dict[torch.device, torch.cuda.Stream] = {}


def graph_query_rows(dm: DeviceModel, config: EngineConfig) -> list[int]:
    """The query tokens per row of each set of decode graphs a runner of `dm` captures (1:
    plain decodes; k + 1: speculative rows); none where steps run eagerly."""
    # A mixture of experts groups its tokens by expert on the host: its steps run eagerly.
    graphable = dm.backend.supports_graphs and config.tensor_parallel_size == 1
    graphable = graphable and dm.spec.moe is None
    if dm.device.type != "cuda" or not graphable or config.enforce_eager:
        return []
    spec = config.speculative
    return [1, spec.num_speculative_tokens + 1] if spec.enabled else [1]


def measure_graph_bytes(
    dm: DeviceModel, max_num_seqs: int, max_model_len: int, query_rows: list[int]
) -> int:
    """Device bytes the decode graphs hold once captured (their pool, buffers and the capture
    stream's workspace): captured over a one-block cache before the real one exists, then
    freed. The KV cache's budget leaves them room."""
    device, spec = dm.device, dm.spec
    shape = (1, dm.block_size, spec.num_kv_heads, spec.head_dim)
    block = torch.zeros(shape, dtype=dm.kv_dtype, device=device)
    caches = [(block, block)] * spec.num_layers
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    graphs = [DecodeGraphs(dm, caches, 0, max_num_seqs, max_model_len, q) for q in query_rows]
    held = torch.cuda.memory_allocated(device) - before
    del graphs, caches, block
    torch.cuda.empty_cache()
    return max(held, 0)


class DecodeGraphs:
    def __init__(
        self,
        dm: DeviceModel,
        kv_caches: KVCaches,
        scratch_block: int,
        max_num_seqs: int,
        max_model_len: int,
        tokens_per_row: int = 1,
    ) -> None:
        """Captured over `kv_caches`, padding rows writing `scratch_block`."""
        self.dm = dm
        self.kv_caches = kv_caches
        self.scratch_block = scratch_block
        self.sizes = capture_sizes(max_num_seqs)
        self.tokens_per_row = tokens_per_row
        # A row's padding positions may reach past max_model_len: their table columns exist.
        blocks_per_row = -(-(max_model_len + tokens_per_row) // dm.block_size)
        self.inputs = DecodeInputs.allocate(
            self.sizes[-1], blocks_per_row, dm.device, tokens_per_row
        )
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.capture()

    def capture(self) -> None:
        device = self.dm.device
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        if device not in _capture_streams:  # (setdefault would make a stream every call)
            _capture_streams[device] = torch.cuda.Stream(device)
        stream = _capture_streams[device]
        # Largest first: the smaller graphs then fit in the memory the first one reserved.
        for size in reversed(self.sizes):
            self.inputs.fill([], size, self.dm.block_size, self.scratch_block)
            rows = self.inputs.rows(size)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up: lazy init and autotuning off-graph
                self._forward(rows)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
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
        model, q = self.dm.model, self.tokens_per_row
        self.inputs.fill(order, size, self.dm.block_size, self.scratch_block)
        if known is not None:
            self.inputs.input_ids[known[0]] = known[1]
        self._graphs[size].replay()
        hidden = self._outputs[size]
        if positions is not None:
            return model.logits(hidden[torch.tensor(positions, device=hidden.device)])
        return model.logits(hidden[: len(order) * q : q])

    def replay_hidden(self, order: list[ScheduledRequest]) -> torch.Tensor:
        """The final hidden states of a decode step of `order`, by replaying the graph of
        exactly their count; the buffers keep the step for an eager run to compare with (the
        GPU self-check)."""
        size = len(order)
        self.inputs.fill(order, size, self.dm.block_size, self.scratch_block)
        self._graphs[size].replay()
        return self._outputs[size].clone()

    def _forward(self, rows: DecodeInputs) -> torch.Tensor:
        dm = self.dm
        return decode_forward(dm.model, dm.backend, rows, self.kv_caches, dm.spec.sliding_window)
